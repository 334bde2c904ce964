// Schedule generators of varuna_core.ir.schedule (``_varuna``, ``_one_f_one_b``, ``_gpipe``, ``_zero_bubble``,
// ``_varuna_zero_bubble``) and the static in-flight counts of varuna_core.ir.inflight, in C++. Pure C++17, no
// Python headers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace varuna {

// Same codes as varuna_core.planning.simulate._OP_CODE. kW is the weights' gradient of a split backward
// (schedules "zb" and "varuna-zb"), where kB computes only the input gradient.
enum OpCode : int32_t { kF = 0, kR = 1, kB = 2, kW = 3 };

// One action of a stage. ``mb`` is the micro-batch; inside the simulator it is a dense key in [0, num_keys)
// (identical to the micro-batch for generated schedules).
struct Action {
    int32_t op;
    int32_t mb;
};

using StageActions = std::vector<Action>;
using Actions = std::vector<StageActions>;

// True for "varuna", "1f1b", "gpipe", "zb", "varuna-zb" (varuna_core.ir.schedule.SCHEDULE_NAMES).
bool is_schedule_name(const std::string& name);

// Fills ``out`` (resized to ``num_stages``; inner vectors are cleared, their capacity is kept) with the
// schedule ``name`` builds. Throws std::invalid_argument on an unknown name or a size below 1, checked in
// that order, as varuna_core.ir.schedule.generate does.
void generate(const std::string& name, int num_stages, int num_mb, Actions& out);

// Per stage (held, graphs): held = max over prefixes of (#F - #B); graphs = max over prefixes of (#R - #B)
// for stages that have an R, else held. The empty prefix counts, so both are >= 0. W actions count in
// neither (what a W still needs is not a held micro-batch: varuna_core.ir.inflight.pending_weights).
std::vector<std::pair<int, int>> inflight(const Actions& actions);

}  // namespace varuna
