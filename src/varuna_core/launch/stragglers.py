"""Finding slow machines from the workers' heartbeats.

Step times cannot show a straggler: a pipeline is synchronous, so every rank's step takes as long as the
slowest rank's. What differs is each rank's *compute time* (its own forward and backward work, without the
time it waits for its neighbours), which the runtime measures. Ranks of the same stage do the same work, so a
rank is compared with the other replicas of its stage; a stage with one replica is compared with every other
rank through the plan's predicted busy time per stage (less exact: the predictions carry the planner's error).
A rank whose compute time exceeds the median of those others by more than ``threshold`` in ``patience``
consecutive reports is a straggler; its host goes to ``slow_machines`` in the run directory (the original
Varuna's file name) and on the live view.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["StragglerDetector", "Straggler"]


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    stage: int
    ratio: float  # compute time over the median, both normalised by the stage's predicted work


@dataclass
class StragglerDetector:
    """Feed :meth:`observe` with each rank's latest ``(step, compute time)``; it returns new stragglers.

    Args:
        stage_of: rank -> stage.
        expected: per stage, the predicted busy time per step (the plan's), or None to compare raw times.
        threshold: how much slower than the median counts (0.2 = 20%).
        patience: consecutive slow reports before a rank is named.
    """

    stage_of: dict[int, int]
    expected: list[float] | None = None
    threshold: float = 0.3
    patience: int = 5
    slow: dict[int, Straggler] = field(default_factory=dict)
    _streak: dict[int, int] = field(default_factory=dict)
    _seen_step: dict[int, int] = field(default_factory=dict)

    def observe(self, reports: dict[int, tuple[str, int, float]]) -> list[Straggler]:
        """``reports``: rank -> (host, step, compute seconds) of its latest heartbeat."""
        fresh = {r: v for r, v in reports.items() if v[2] is not None and v[2] > 0 and r in self.stage_of
                 and v[1] > self._seen_step.get(r, -1)}
        if len(fresh) < 2:
            return []
        for r, (_, step, _) in fresh.items():
            self._seen_step[r] = step
        raw = {r: t for r, (_, _, t) in fresh.items()}
        norm = {r: t / self._scale(self.stage_of[r]) for r, t in raw.items()}
        found = []
        for r in raw:
            # like with like: the replicas of its own stage when it has some, else every rank through the
            # plan's predictions (without a plan, a lone stage is not judged)
            peers = [raw[p] for p in raw if p != r and self.stage_of[p] == self.stage_of[r]]
            value = raw[r]
            if not peers and self.expected:
                peers, value = [norm[p] for p in norm if p != r], norm[r]
            if not peers:
                continue
            median = statistics.median(peers)  # of the others: with two ranks, the one is compared with the other
            ratio = value / median if median > 0 else 1.0
            if ratio > 1.0 + self.threshold:
                self._streak[r] = self._streak.get(r, 0) + 1
                if self._streak[r] == self.patience and r not in self.slow:
                    self.slow[r] = Straggler(rank=r, host=fresh[r][0], stage=self.stage_of[r], ratio=ratio)
                    found.append(self.slow[r])
            else:
                self._streak[r] = 0
        return found

    def _scale(self, stage: int) -> float:
        if self.expected and stage < len(self.expected) and self.expected[stage] > 0:
            return self.expected[stage]
        return 1.0
