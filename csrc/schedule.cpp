// C++ port of the generators in src/varuna_core/ir/schedule.py. Must produce exactly the same action lists
// (tests/unit/test_native.py checks every name for 1..10 stages x 1..40 micro-batches).
#include "schedule.hpp"

#include <algorithm>
#include <array>
#include <stdexcept>

namespace varuna {

namespace {

void gpipe(int p, int m, Actions& out) {
    for (int s = 0; s < p; ++s) {
        StageActions& acts = out[s];
        acts.reserve(2 * static_cast<size_t>(m));
        for (int mb = 0; mb < m; ++mb) acts.push_back({kF, mb});
        for (int mb = 0; mb < m; ++mb) acts.push_back({kB, mb});
    }
}

void one_f_one_b(int p, int m, Actions& out) {
    for (int s = 0; s < p; ++s) {
        StageActions& acts = out[s];
        acts.reserve(2 * static_cast<size_t>(m));
        const int warmup = std::min(p - 1 - s, m);
        for (int mb = 0; mb < warmup; ++mb) acts.push_back({kF, mb});
        for (int i = 0; i < m - warmup; ++i) {
            acts.push_back({kF, warmup + i});
            acts.push_back({kB, i});
        }
        for (int mb = m - warmup; mb < m; ++mb) acts.push_back({kB, mb});
    }
}

// _split_one_f_one_b (the generator "zb"): per stage s, min(p-1-s, m) warm-up F; then F, B for each further
// micro-batch, each followed by the oldest pending W once i >= s; then B, W for the rest; then the W still
// pending.
void split_one_f_one_b(int p, int m, Actions& out) {
    for (int s = 0; s < p; ++s) {
        StageActions& acts = out[s];
        acts.reserve(3 * static_cast<size_t>(m));
        const int warmup = std::min(p - 1 - s, m);
        for (int mb = 0; mb < warmup; ++mb) acts.push_back({kF, mb});
        int weights = 0;  // W actions placed so far (in micro-batch order)
        auto backward = [&](int mb) { acts.push_back({kB, mb}); };
        for (int i = 0; i < m - warmup; ++i) {
            acts.push_back({kF, warmup + i});
            backward(i);
            if (i >= s) acts.push_back({kW, weights++});
        }
        for (int mb = m - warmup; mb < m; ++mb) {
            backward(mb);
            acts.push_back({kW, weights++});
        }
        for (int mb = weights; mb < m; ++mb) acts.push_back({kW, mb});
    }
}

// FIFO of micro-batches. Every micro-batch enters each queue of each stage at most once, so a vector with a
// read index is enough (no wrap-around, capacity m).
struct Fifo {
    std::vector<int32_t> items;
    size_t head = 0;
    bool empty() const { return head == items.size(); }
    int32_t pop() { return items[head++]; }
};

// Queue names of _varuna in priority order: "bw", "bi", "rc", "fwd".
enum Queue { kBw = 0, kBi = 1, kRc = 2, kFwd = 3, kNumQueues = 4 };

struct Push {
    int stage;
    int queue;
    int32_t mb;
};

// _varuna: unit-time quanta; pushes made in a quantum become visible in the next one.
void varuna_schedule(int p, int m, Actions& out) {
    const int last = p - 1;
    std::vector<std::array<Fifo, kNumQueues>> queues(p);
    for (auto& qs : queues)
        for (auto& q : qs) q.items.reserve(m);
    for (int mb = 0; mb < m; ++mb) queues[0][kFwd].items.push_back(mb);
    for (int s = 0; s < p; ++s) out[s].reserve((s < last ? 3 : 2) * static_cast<size_t>(m));
    std::vector<Push> pushes;
    pushes.reserve(2 * static_cast<size_t>(p));
    while (true) {
        pushes.clear();
        bool busy = false;
        for (int i = 0; i < p; ++i) {
            int task = -1;
            for (int q = 0; q < kNumQueues; ++q) {
                if (!queues[i][q].empty()) {
                    task = q;
                    break;
                }
            }
            if (task < 0) continue;
            busy = true;
            const int32_t mb = queues[i][task].pop();
            switch (task) {
                case kFwd:
                    out[i].push_back({kF, mb});
                    if (i < last)
                        pushes.push_back({i + 1, kFwd, mb});
                    else
                        pushes.push_back({i, kBi, mb});
                    break;
                case kRc:
                    out[i].push_back({kR, mb});
                    pushes.push_back({i, kBi, mb});
                    break;
                case kBi:
                    out[i].push_back({kB, mb});
                    pushes.push_back({i, kBw, mb});
                    if (i > 0) pushes.push_back({i - 1, kRc, mb});
                    break;
                default:  // kBw: the second time unit of a backward, no action of its own
                    break;
            }
        }
        if (!busy) return;
        for (const Push& push : pushes) queues[push.stage][push.queue].items.push_back(push.mb);
    }
}

// _varuna_zero_bubble: varuna's order, each B followed by the oldest pending W once more than s are pending;
// the W still pending after the last B.
void varuna_zero_bubble(int p, int m, Actions& out) {
    Actions plain(p);
    varuna_schedule(p, m, plain);
    for (int s = 0; s < p; ++s) {
        StageActions& acts = out[s];
        acts.reserve(plain[s].size() + static_cast<size_t>(m));
        std::vector<int32_t> pending;
        size_t head = 0;
        for (const Action& a : plain[s]) {
            acts.push_back(a);
            if (a.op == kB) {
                pending.push_back(a.mb);
                if (static_cast<int>(pending.size() - head) > s) acts.push_back({kW, pending[head++]});
            }
        }
        for (; head < pending.size(); ++head) acts.push_back({kW, pending[head]});
    }
}

}  // namespace

bool is_schedule_name(const std::string& name) {
    return name == "varuna" || name == "1f1b" || name == "gpipe" || name == "zb" || name == "varuna-zb";
}

void generate(const std::string& name, int num_stages, int num_mb, Actions& out) {
    if (!is_schedule_name(name))
        throw std::invalid_argument("unknown schedule '" + name +
                                    "' (choose one of varuna, 1f1b, gpipe, zb, varuna-zb)");
    if (num_stages < 1 || num_mb < 1)
        throw std::invalid_argument("cannot build a " + name + " schedule with " + std::to_string(num_stages) +
                                    " stages and " + std::to_string(num_mb) +
                                    " micro-batches (both must be at least 1)");
    out.resize(num_stages);
    for (auto& stage : out) stage.clear();
    if (name == "varuna")
        varuna_schedule(num_stages, num_mb, out);
    else if (name == "1f1b")
        one_f_one_b(num_stages, num_mb, out);
    else if (name == "gpipe")
        gpipe(num_stages, num_mb, out);
    else if (name == "varuna-zb")
        varuna_zero_bubble(num_stages, num_mb, out);
    else
        split_one_f_one_b(num_stages, num_mb, out);
}

std::vector<std::pair<int, int>> inflight(const Actions& actions) {
    std::vector<std::pair<int, int>> out;
    out.reserve(actions.size());
    for (const StageActions& stage : actions) {
        int live = 0, rebuilt = 0, held = 0, graphs = 0;
        bool has_r = false;
        for (const Action& a : stage) {
            if (a.op == kF) {
                ++live;
            } else if (a.op == kR) {
                ++rebuilt;
                has_r = true;
            } else if (a.op == kB) {
                --live;
                --rebuilt;
            }  // kW: counts in neither
            held = std::max(held, live);
            graphs = std::max(graphs, rebuilt);
        }
        out.emplace_back(held, has_r ? graphs : held);
    }
    return out;
}

}  // namespace varuna
