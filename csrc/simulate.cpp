// C++ port of varuna_core.planning.simulate.simulate_python. Every rule, tie-break and comparison mirrors the Python
// reference line by line (see the comments quoting it); tests/unit/test_native.py checks that results and
// timelines are identical.
#include "simulate.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

namespace varuna {

namespace {

using HeapEntry = std::pair<double, int>;  // (time, stage): same order as the reference's heap tuples

// Min-heap of (time, stage) whose storage survives between calls (clear() keeps the capacity).
struct EventQueue : std::priority_queue<HeapEntry, std::vector<HeapEntry>, std::greater<HeapEntry>> {
    void clear() { c.clear(); }
    void reserve(size_t n) { c.reserve(n); }
};

// Scratch buffers reused across calls (the planner simulates thousands of configurations); per thread so
// that calls made without the GIL stay independent.
struct Workspace {
    std::vector<size_t> pos;
    std::vector<double> free_at;
    std::vector<double> end;
    std::vector<double> sync_start;  // start of the stage's last B or W: its all-reduce starts with it
    std::vector<double> act_arrival;   // [stage * num_keys + key]: activation of key at stage
    std::vector<double> grad_arrival;  // [stage * num_keys + key]: gradient of key at stage
    std::vector<unsigned char> act_known;
    std::vector<unsigned char> grad_known;
    std::vector<double> channels;  // [(stage * 2 + gradient) * num_channels + k]: free time of channel k
    std::vector<unsigned char> waiting;
    std::vector<int> held;  // micro-batches between their F and B on each stage
    std::vector<int> cap;   // the static order's peak of held: the opportunistic swap never exceeds it
    EventQueue heap;
};

thread_local Workspace workspace;

// Python's max(a, b): a unless b > a.
inline double py_max(double a, double b) { return b > a ? b : a; }

const char kOpLetter[4] = {'F', 'R', 'B', 'W'};

}  // namespace

void simulate(Actions& actions, const KeySpace& keys, const std::vector<StageCostRow>& costs, int max_sends,
              bool opportunistic, std::vector<TimelineEntry>* timeline, SimResult& result, const IdleCost& idle) {
    const int p = static_cast<int>(actions.size());
    const size_t K = static_cast<size_t>(keys.num_keys);
    const int nc = std::max(1, max_sends);
    constexpr double kInf = std::numeric_limits<double>::infinity();

    Workspace& ws = workspace;
    ws.pos.assign(p, 0);
    ws.free_at.assign(p, 0.0);
    ws.end.assign(p, 0.0);
    ws.sync_start.assign(p, 0.0);
    ws.act_arrival.assign(p * K, 0.0);
    ws.grad_arrival.assign(p * K, 0.0);
    ws.act_known.assign(p * K, 0);
    ws.grad_known.assign(p * K, 0);
    ws.channels.assign(static_cast<size_t>(p) * 2 * nc, 0.0);
    ws.waiting.assign(p, 0);
    ws.held.assign(p, 0);
    ws.cap.assign(p, 0);
    for (int s = 0; s < p; ++s) {  // ir.inflight.inflight(): peak of (#F - #B) over the static order
        int count = 0, peak = 0;
        for (const Action& a : actions[s]) {
            if (a.op == kF) ++count;
            else if (a.op == kB) --count;
            if (count > peak) peak = count;
        }
        ws.cap[s] = peak;
    }
    ws.heap.clear();
    ws.heap.reserve(2 * static_cast<size_t>(p));
    result.busy.assign(p, 0.0);
    if (timeline != nullptr) {
        size_t total = 0;
        for (const auto& stage : actions) total += stage.size();
        timeline->clear();
        timeline->reserve(total);
    }

    std::vector<size_t>& pos = ws.pos;
    std::vector<double>& free_at = ws.free_at;
    std::vector<double>& busy = result.busy;
    std::vector<double>& end = ws.end;

    // ready_time: when stage s can start its next action; false when it waits on an unknown arrival.
    auto ready_time = [&](int s, double& t) -> bool {
        const Action& a = actions[s][pos[s]];
        if (a.op == kF && s > 0) {
            const size_t i = s * K + a.mb;
            if (!ws.act_known[i]) return false;
            t = py_max(free_at[s], ws.act_arrival[i]);
            return true;
        }
        if (a.op == kB && s < p - 1) {
            const size_t i = s * K + a.mb;
            if (!ws.grad_known[i]) return false;
            t = py_max(free_at[s], ws.grad_arrival[i]);
            return true;
        }
        t = free_at[s];  // R, W, and F/B at the pipeline's ends: only the stage's own order
        return true;
    };

    auto push = [&](int s) {
        if (pos[s] >= actions[s].size()) return;
        double t;
        if (!ready_time(s, t)) {
            ws.waiting[s] = 1;
        } else {
            ws.heap.emplace(t, s);
        }
    };

    auto send = [&](int s, int dst, int32_t key, bool gradient, double at, double duration) {
        double* chans = &ws.channels[(static_cast<size_t>(s) * 2 + (gradient ? 1 : 0)) * nc];
        int best = 0;  // min(range(n), key=lambda k: (chans[k], k)): the first smallest free time
        for (int k = 1; k < nc; ++k)
            if (chans[k] < chans[best]) best = k;
        const double start = py_max(at, chans[best]);
        const double done = start + duration;
        chans[best] = done;
        const size_t i = dst * K + key;
        if (gradient) {
            ws.grad_arrival[i] = done;
            ws.grad_known[i] = 1;
        } else {
            ws.act_arrival[i] = done;
            ws.act_known[i] = 1;
        }
        if (ws.waiting[dst]) {
            ws.waiting[dst] = 0;
            push(dst);
        }
    };

    for (int s = 0; s < p; ++s) push(s);
    while (!ws.heap.empty()) {
        const HeapEntry top = ws.heap.top();
        ws.heap.pop();
        const double t = top.first;
        const int s = top.second;
        StageActions& pending = actions[s];
        if (pos[s] >= pending.size()) continue;
        double current;
        if (!ready_time(s, current) || current != t) continue;  // stale entry
        Action a = pending[pos[s]];
        if (opportunistic && a.op == kR && s < p - 1 && ws.held[s] < ws.cap[s]) {
            const size_t gi = s * K + a.mb;
            if (!ws.grad_known[gi] || ws.grad_arrival[gi] > t) {
                for (size_t j = pos[s] + 1; j < pending.size(); ++j) {
                    const Action b = pending[j];
                    if (b.op == kF) {
                        // act_arrival[s].get(b.mb, float("inf")) <= t
                        const size_t ai = s * K + b.mb;
                        const bool arrived = s == 0 || (ws.act_known[ai] ? ws.act_arrival[ai] : kInf) <= t;
                        if (arrived) {
                            // pending[s].insert(pos[s], pending[s].pop(j))
                            std::rotate(pending.begin() + pos[s], pending.begin() + j, pending.begin() + j + 1);
                            a = b;
                        }
                        break;
                    }
                }
            }
        }
        const StageCostRow& c = costs[s];
        const bool last = a.mb == keys.last_key;
        double duration;
        if (a.op == kF)
            duration = last ? c[kForwardLast] : c[kForward];
        else if (a.op == kR)
            duration = last ? c[kRecomputeLast] : c[kRecompute];
        else if (a.op == kW)
            duration = last ? c[kWeightLast] : c[kWeight];
        else
            duration = last ? c[kBackwardLast] : c[kBackward];
        duration += idle.penalty(t - free_at[s], duration);  // the stage idled since its last action (or the start)
        const double finish = t + duration;
        busy[s] += duration;
        free_at[s] = finish;
        end[s] = finish;
        pos[s] += 1;
        if (a.op == kF) ws.held[s] += 1;
        else if (a.op == kB) ws.held[s] -= 1;  // R and W leave it
        if (a.op == kB || a.op == kW) ws.sync_start[s] = t;
        if (timeline != nullptr) {
            const int64_t mb = keys.key_to_mb != nullptr ? keys.key_to_mb[a.mb] : a.mb;
            timeline->push_back({s, a.op, mb, t, finish});
        }
        if (a.op == kF && s < p - 1)
            send(s, s + 1, a.mb, false, finish, last ? c[kSendActivationLast] : c[kSendActivation]);
        else if (a.op == kB && s > 0)
            send(s, s - 1, a.mb, true, finish, last ? c[kSendGradientLast] : c[kSendGradient]);
        // R and W send nothing
        push(s);
    }

    std::string stuck;
    for (int s = 0; s < p; ++s) {
        if (pos[s] < actions[s].size()) {
            const Action& a = actions[s][pos[s]];
            const int64_t mb = keys.key_to_mb != nullptr ? keys.key_to_mb[a.mb] : a.mb;
            if (!stuck.empty()) stuck += ", ";
            stuck += std::to_string(s) + kOpLetter[a.op] + std::to_string(mb);
        }
    }
    if (!stuck.empty()) throw std::invalid_argument("schedule deadlocks in simulation; stuck at " + stuck);

    double pipe = end[0];  // max(end)
    for (int s = 1; s < p; ++s)
        if (end[s] > pipe) pipe = end[s];
    // max(max(end[s], sync_start[s] + allreduce[s]) + optimizer[s])
    auto synced = [&](int s) { return py_max(end[s], ws.sync_start[s] + costs[s][kAllreduce]) + costs[s][kOptimizer]; };
    double step = synced(0);
    for (int s = 1; s < p; ++s) {
        const double v = synced(s);
        if (v > step) step = v;
    }
    result.pipeline_time = pipe;
    result.step_time = step;
}

}  // namespace varuna
