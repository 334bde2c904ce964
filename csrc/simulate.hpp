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

// What an action pays for starting right after its stage idled ([Note: idle penalty] in simulate.py):
// fraction(gap) * min(duration, action_s), fraction linear from 0 at no gap through (gaps[i], fractions[i]) and
// fractions.back() after the last gap. Empty gaps: nothing. The caller checks the lists (equal sizes, gaps > 0
// strictly increasing, fractions >= 0, action_s > 0).
struct IdleCost {
    std::vector<double> gaps;
    std::vector<double> fractions;
    double action_s = 1.0;

    double penalty(double gap, double duration) const {
        if (gaps.empty() || gap <= 0.0) return 0.0;
        double previous_gap = 0.0, previous = 0.0, fraction = fractions.back();
        for (size_t i = 0; i < gaps.size(); ++i) {
            if (gap <= gaps[i]) {
                fraction = previous + (fractions[i] - previous) * (gap - previous_gap) / (gaps[i] - previous_gap);
                break;
            }
            previous_gap = gaps[i];
            previous = fractions[i];
        }
        return fraction * (duration < action_s ? duration : action_s);
    }
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
// ``timeline`` may be nullptr; ``idle`` adds its penalty to an action after its stage idled.
void simulate(Actions& actions, const KeySpace& keys, const std::vector<StageCostRow>& costs, int max_sends,
              bool opportunistic, std::vector<TimelineEntry>* timeline, SimResult& result, const IdleCost& idle);

}  // namespace varuna
