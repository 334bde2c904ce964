// Python bindings of varuna_core._native (pybind11). Converts arguments, checks them, and releases the GIL
// around the C++ work. The algorithms are in schedule.cpp and simulate.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "schedule.hpp"
#include "simulate.hpp"
#ifdef VARUNA_WITH_CUDA
#include "fused.hpp"
#endif

namespace py = pybind11;

namespace {

using varuna::Action;
using varuna::Actions;
using varuna::StageCostRow;

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// A list or tuple (or other sequence) as a fast sequence; TypeError naming ``what`` otherwise.
py::object as_sequence(py::handle obj, const char* what) {
    PyObject* seq = PySequence_Fast(obj.ptr(), "");
    if (seq == nullptr) {
        PyErr_Clear();
        throw py::type_error(std::string(what) + " must be a sequence, got " + type_name(obj));
    }
    return py::reinterpret_steal<py::object>(seq);
}

int64_t as_int(PyObject* item, const char* what) {
    if (!PyLong_Check(item))
        throw py::type_error(std::string(what) + " must be an int, got " + type_name(item));
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0) throw py::value_error(std::string(what) + " out of range");
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int64_t>(v);
}

std::vector<StageCostRow> parse_costs(py::handle obj, size_t num_stages) {
    py::object seq = as_sequence(obj, "costs");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    if (static_cast<size_t>(n) != num_stages)
        throw py::value_error(std::to_string(n) + " stage costs for " + std::to_string(num_stages) + " stages");
    std::vector<StageCostRow> costs(static_cast<size_t>(n));
    PyObject** rows = PySequence_Fast_ITEMS(seq.ptr());
    for (Py_ssize_t s = 0; s < n; ++s) {
        py::object row = as_sequence(rows[s], "each stage's costs");
        if (PySequence_Fast_GET_SIZE(row.ptr()) != varuna::kNumCosts)
            throw py::value_error("stage " + std::to_string(s) + " has " +
                                  std::to_string(PySequence_Fast_GET_SIZE(row.ptr())) +
                                  " cost numbers, expected " + std::to_string(varuna::kNumCosts) +
                                  " (StageCosts.as_tuple())");
        PyObject** items = PySequence_Fast_ITEMS(row.ptr());
        for (int k = 0; k < varuna::kNumCosts; ++k) {
            const double v = PyFloat_AsDouble(items[k]);
            if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
            costs[s][k] = v;
        }
    }
    return costs;
}

// Per-stage [(op, mb), ...] -> dense actions. Micro-batch numbers in [0, m) are used as keys directly;
// otherwise (hand-written schedules) they are renumbered densely so arbitrary ints behave like the
// reference's dict keys.
struct ParsedActions {
    Actions actions;
    std::vector<int64_t> key_to_mb;  // empty: identity
    varuna::KeySpace keys;
};

void parse_actions(py::handle obj, int64_t m, ParsedActions& out) {
    py::object stages = as_sequence(obj, "actions");
    const Py_ssize_t p = PySequence_Fast_GET_SIZE(stages.ptr());
    if (p < 1) throw py::value_error("actions must hold at least one stage");
    std::vector<std::vector<int64_t>> mbs(static_cast<size_t>(p));
    out.actions.assign(static_cast<size_t>(p), {});
    bool dense = true;
    PyObject** stage_items = PySequence_Fast_ITEMS(stages.ptr());
    for (Py_ssize_t s = 0; s < p; ++s) {
        py::object stage = as_sequence(stage_items[s], "each stage's actions");
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(stage.ptr());
        PyObject** items = PySequence_Fast_ITEMS(stage.ptr());
        out.actions[s].resize(static_cast<size_t>(n));
        mbs[s].resize(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
            py::object pair = as_sequence(items[i], "an action");
            if (PySequence_Fast_GET_SIZE(pair.ptr()) != 2)
                throw py::value_error("an action must be an (op, micro-batch) pair");
            PyObject** fields = PySequence_Fast_ITEMS(pair.ptr());
            const int64_t op = as_int(fields[0], "op");
            if (op < varuna::kF || op > varuna::kW)
                throw py::value_error("op must be 0 (F), 1 (R), 2 (B) or 3 (W), got " + std::to_string(op));
            const int64_t mb = as_int(fields[1], "micro-batch");
            out.actions[s][i].op = static_cast<int32_t>(op);
            mbs[s][i] = mb;
            if (mb < 0 || mb >= m) dense = false;
        }
    }
    out.key_to_mb.clear();
    // Dense keys need p * m arrival slots: fine unless m is absurdly large for the number of actions.
    size_t total = 0;
    for (const auto& v : mbs) total += v.size();
    if (m > 4 * static_cast<int64_t>(total) + 1024) dense = false;
    if (dense) {
        for (Py_ssize_t s = 0; s < p; ++s)
            for (size_t i = 0; i < mbs[s].size(); ++i) out.actions[s][i].mb = static_cast<int32_t>(mbs[s][i]);
        out.keys.num_keys = static_cast<int>(m);
        out.keys.last_key = static_cast<int>(m - 1);
        out.keys.key_to_mb = nullptr;
        return;
    }
    for (const auto& v : mbs) out.key_to_mb.insert(out.key_to_mb.end(), v.begin(), v.end());
    std::sort(out.key_to_mb.begin(), out.key_to_mb.end());
    out.key_to_mb.erase(std::unique(out.key_to_mb.begin(), out.key_to_mb.end()), out.key_to_mb.end());
    auto key_of = [&](int64_t mb) {
        return static_cast<int32_t>(std::lower_bound(out.key_to_mb.begin(), out.key_to_mb.end(), mb) -
                                    out.key_to_mb.begin());
    };
    for (Py_ssize_t s = 0; s < p; ++s)
        for (size_t i = 0; i < mbs[s].size(); ++i) out.actions[s][i].mb = key_of(mbs[s][i]);
    out.keys.num_keys = static_cast<int>(out.key_to_mb.size());
    auto it = std::lower_bound(out.key_to_mb.begin(), out.key_to_mb.end(), m - 1);
    out.keys.last_key = (it != out.key_to_mb.end() && *it == m - 1) ? static_cast<int>(it - out.key_to_mb.begin()) : -1;
    out.keys.key_to_mb = out.key_to_mb.data();
}

py::list busy_list(const std::vector<double>& busy) {
    py::list out(busy.size());
    for (size_t s = 0; s < busy.size(); ++s) PyList_SET_ITEM(out.ptr(), s, PyFloat_FromDouble(busy[s]));
    return out;
}

py::list actions_to_python(const Actions& actions) {
    py::list out(actions.size());
    for (size_t s = 0; s < actions.size(); ++s) {
        py::list stage(actions[s].size());
        for (size_t i = 0; i < actions[s].size(); ++i)
            PyList_SET_ITEM(stage.ptr(), i, py::make_tuple(actions[s][i].op, actions[s][i].mb).release().ptr());
        PyList_SET_ITEM(out.ptr(), s, stage.release().ptr());
    }
    return out;
}

// simulate_generated: the planner calls it thousands of times, mostly for a few (name, p, m), so generated
// schedules are cached (per thread, bounded) and copied into a reused working buffer, which the simulator
// may reorder.
struct GeneratedCache {
    std::map<std::tuple<std::string, int, int>, Actions> schedules;
    size_t total_actions = 0;
    Actions work;

    const Actions& get(const std::string& name, int p, int m) {
        auto key = std::make_tuple(name, p, m);
        auto it = schedules.find(key);
        if (it != schedules.end()) return it->second;
        Actions actions;
        varuna::generate(name, p, m, actions);
        size_t n = 0;
        for (const auto& stage : actions) n += stage.size();
        if (total_actions + n > (size_t{1} << 22)) {  // ~32 MB of actions: start over
            schedules.clear();
            total_actions = 0;
        }
        total_actions += n;
        return schedules.emplace(std::move(key), std::move(actions)).first->second;
    }
};

thread_local GeneratedCache generated;

py::list generate(const std::string& name, int p, int m) {
    Actions actions;
    varuna::generate(name, p, m, actions);
    return actions_to_python(actions);
}

// The idle penalty's lists, checked as simulate.IdleCost checks them (empty gaps: no penalty).
varuna::IdleCost parse_idle(const std::vector<double>& gaps, const std::vector<double>& fractions, double action_s) {
    if (gaps.size() != fractions.size())
        throw py::value_error(std::to_string(gaps.size()) + " idle gaps but " + std::to_string(fractions.size()) +
                              " fractions (one per gap)");
    for (size_t i = 0; i < gaps.size(); ++i) {
        if (!(gaps[i] > 0.0) || (i > 0 && !(gaps[i] > gaps[i - 1])) || !std::isfinite(gaps[i]))
            throw py::value_error("idle gaps must be positive, finite and strictly increasing");
        if (!(fractions[i] >= 0.0) || !std::isfinite(fractions[i]))
            throw py::value_error("idle fractions must be finite and not negative");
    }
    if (!(action_s > 0.0) || !std::isfinite(action_s)) throw py::value_error("idle action_s must be positive");
    return varuna::IdleCost{gaps, fractions, action_s};
}

py::tuple simulate_actions(py::handle actions, int64_t m, py::handle costs, int max_sends, bool opportunistic,
                           bool timeline, const std::vector<double>& idle_gaps,
                           const std::vector<double>& idle_fractions, double idle_action) {
    if (m < 1) throw py::value_error("m (micro-batches) must be at least 1, got " + std::to_string(m));
    const varuna::IdleCost idle = parse_idle(idle_gaps, idle_fractions, idle_action);
    ParsedActions parsed;
    parse_actions(actions, m, parsed);
    const std::vector<StageCostRow> rows = parse_costs(costs, parsed.actions.size());
    varuna::SimResult result;
    std::vector<varuna::TimelineEntry> line;
    {
        py::gil_scoped_release release;
        varuna::simulate(parsed.actions, parsed.keys, rows, max_sends, opportunistic, timeline ? &line : nullptr,
                         result, idle);
    }
    py::object line_obj = py::none();
    if (timeline) {
        py::list out(line.size());
        for (size_t i = 0; i < line.size(); ++i) {
            const auto& e = line[i];
            PyList_SET_ITEM(out.ptr(), i, py::make_tuple(e.stage, e.op, e.mb, e.start, e.end).release().ptr());
        }
        line_obj = std::move(out);
    }
    return py::make_tuple(result.step_time, result.pipeline_time, busy_list(result.busy), line_obj);
}

py::tuple simulate_generated(const std::string& name, int p, int m, py::handle costs, int max_sends,
                             bool opportunistic, const std::vector<double>& idle_gaps,
                             const std::vector<double>& idle_fractions, double idle_action) {
    const varuna::IdleCost idle = parse_idle(idle_gaps, idle_fractions, idle_action);
    if (!varuna::is_schedule_name(name) || p < 1 || m < 1) {
        Actions unused;
        varuna::generate(name, p, m, unused);  // throws the generator's error
    }
    const std::vector<StageCostRow> rows = parse_costs(costs, static_cast<size_t>(p));
    varuna::SimResult result;
    {
        py::gil_scoped_release release;
        generated.work = generated.get(name, p, m);
        varuna::KeySpace keys;
        keys.num_keys = m;
        keys.last_key = m - 1;
        varuna::simulate(generated.work, keys, rows, max_sends, opportunistic, nullptr, result, idle);
    }
    return py::make_tuple(result.step_time, result.pipeline_time, busy_list(result.busy));
}

py::list inflight(const std::string& name, int p, int m) {
    Actions actions;
    {
        py::gil_scoped_release release;
        varuna::generate(name, p, m, actions);
    }
    const auto counts = varuna::inflight(actions);
    py::list out(counts.size());
    for (size_t s = 0; s < counts.size(); ++s)
        PyList_SET_ITEM(out.ptr(), s, py::make_tuple(counts[s].first, counts[s].second).release().ptr());
    return out;
}

#ifdef VARUNA_WITH_CUDA
// The CUDA kernel takes device addresses as ints (fused.hpp); what they point to is the caller's to get right
// (src/varuna_core/pipeline/fused.py checks every tensor first). Checked here: the counts and the type codes.
varuna::fused::DType dtype_of(int code, const char* what) {
    if (code < 0 || code > 2)
        throw py::value_error(std::string(what) + " must be 0, 1 or 2, got " + std::to_string(code));
    return static_cast<varuna::fused::DType>(code);
}

varuna::fused::TensorList tensor_list(uintptr_t table, int64_t n, int64_t chunks) {
    if (n < 0 || chunks < 0 || chunks > 0x7fffffff || n > 0x7fffffff)
        throw py::value_error("tensor list of " + std::to_string(n) + " tensors in " + std::to_string(chunks) +
                              " chunks is out of range");
    if (n > 0 && table == 0) throw py::value_error("the chunk table of a non-empty tensor list is null");
    return {table, n, chunks};
}

void raise_if(const std::string& error, const char* what) {
    if (!error.empty()) throw std::runtime_error(std::string(what) + " failed: " + error);
}
#endif

}  // namespace

PYBIND11_MODULE(_native, mod) {
    mod.doc() =
        "C++ twins of varuna_core.ir.schedule.generate, varuna_core.planning.simulate.simulate_python and "
        "varuna_core.ir.inflight.inflight (see csrc/README.md). Ops are coded F=0, R=1, B=2, W=3; a stage's costs "
        "are the 14 numbers of StageCosts.as_tuple().";
    mod.def("generate", &generate, py::arg("name"), py::arg("p"), py::arg("m"),
            "Per-stage [(op, mb), ...] of the named schedule; equals varuna_core.ir.schedule.generate.\n"
            "ValueError on an unknown name or a size below 1.");
    mod.def("simulate_actions", &simulate_actions, py::arg("actions"), py::arg("m"), py::arg("costs"),
            py::arg("max_sends"), py::arg("opportunistic"), py::arg("timeline"), py::arg("idle_gaps") = std::vector<double>(),
            py::arg("idle_fractions") = std::vector<double>(), py::arg("idle_action") = 1.0,
            "Simulate per-stage [(op, mb), ...] (op F=0, R=1, B=2, W=3) with per-stage StageCosts.as_tuple()\n"
            "costs (14 numbers each) and IdleCost.as_args() (([], [], 1.0): no idle penalty).\n"
            "Returns (step_time, pipeline_time, busy, timeline or None); timeline entries are\n"
            "(stage, op, mb, start, end). ValueError on deadlock, an op outside 0..3, or when len(costs) != stages\n"
            "or a row does not hold 14 numbers.");
    mod.def("simulate_generated", &simulate_generated, py::arg("name"), py::arg("p"), py::arg("m"),
            py::arg("costs"), py::arg("max_sends"), py::arg("opportunistic"), py::arg("idle_gaps") = std::vector<double>(),
            py::arg("idle_fractions") = std::vector<double>(), py::arg("idle_action") = 1.0,
            "simulate_actions(generate(name, p, m), m, costs, max_sends, opportunistic, False, idle...)[:3] without\n"
            "building Python lists.");
    mod.def("inflight", &inflight, py::arg("name"), py::arg("p"), py::arg("m"),
            "Per stage (held, graphs) from the static order of generate(name, p, m); equals\n"
            "varuna_core.ir.inflight.inflight.");
#ifdef VARUNA_WITH_CUDA
    mod.attr("CUDA") = true;
    mod.attr("FUSED_CHUNK") = varuna::fused::kChunk;
    mod.def(
        "unscale_sq_norms",
        [](uintptr_t table, int64_t n, int64_t chunks, int dtype, uintptr_t inv_scale, uintptr_t found_inf,
           uintptr_t partials, uintptr_t sq_out, uintptr_t stream) {
            const auto list = tensor_list(table, n, chunks);
            const auto dt = dtype_of(dtype, "dtype");
            std::string error;
            {
                py::gil_scoped_release release;
                error = varuna::fused::unscale_sq_norms(list, dt, inv_scale, found_inf, partials, sq_out, stream);
            }
            raise_if(error, "unscale_sq_norms");
        },
        py::arg("table"), py::arg("n"), py::arg("chunks"), py::arg("dtype"), py::arg("inv_scale"),
        py::arg("found_inf"), py::arg("partials"), py::arg("sq_out"), py::arg("stream"),
        "CUDA: unscale in place (inv_scale 0: no unscale), flag non-finite values, per-tensor squared norms\n"
        "(csrc/fused.hpp). Twin: varuna_core.pipeline.fused.unscale_sq_norms_torch.");
#else
    mod.attr("CUDA") = false;
#endif
}
