// Event simulation of one training step: the C++ twin of varuna_core.planning.simulate.simulate_python.
// Pure C++17, no Python headers.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "schedule.hpp"

namespace varuna {

// Order of StageCosts.as_tuple().
enum CostIndex : int {
    kForward = 0,
    kRecompute,
    kBackward,
    kSendActivation,
    kSendGradient,
    kAllreduce,
    kForwardLast,
    kRecomputeLast,
    kBackwardLast,
    kSendActivationLast,
    kSendGradientLast,
    kWeight,      // W: the weights' gradient of a split backward
    kWeightLast,
    kOptimizer,   // after the compute and the all-reduce (which starts with the last B or W)
    kNumCosts  // 14
};

using StageCostRow = std::array<double, kNumCosts>;

struct TimelineEntry {
    int stage;
    int op;
    int64_t mb;  // the caller's micro-batch number (not the dense key)
    double start;
    double end;
};

struct SimResult {
    double step_time = 0.0;
    double pipeline_time = 0.0;
    std::vector<double> busy;
};

// Describes how the dense keys in Action::mb relate to the caller's micro-batch numbers.
struct KeySpace {
    int num_keys = 0;                  // every Action::mb is in [0, num_keys)
    int last_key = -1;                 // key of micro-batch m - 1 (-1: absent); selects the *_last costs
    const int64_t* key_to_mb = nullptr;  // key -> micro-batch; nullptr means identity
};

// Simulates ``actions`` (one ordered list per stage; ops must be 0..3, keys in range: the caller checks).
// ``actions`` is modified: the opportunistic rule moves forwards within a stage's list, as the reference
// does with its ``pending`` lists. ``costs.size()`` must equal ``actions.size()`` (caller checks).
// Throws std::invalid_argument naming the stuck actions if some stage never finishes.
// ``timeline`` may be nullptr.
void simulate(Actions& actions, const KeySpace& keys, const std::vector<StageCostRow>& costs, int max_sends,
              bool opportunistic, std::vector<TimelineEntry>* timeline, SimResult& result);

}  // namespace varuna
