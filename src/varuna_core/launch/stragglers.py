"""Finding slow machines from the workers' heartbeats.

Step times cannot show a straggler: a pipeline is synchronous, so every rank's step takes as long as the
slowest rank's. What differs is each rank's *compute time* (its own forward and backward work, without the
time it waits for its neighbours), which the runtime measures. Ranks of the same stage do the same work, so a
rank is compared with the other replicas of its stage; a stage with one replica is compared with every other
rank through the plan's predicted busy time per stage (less exact: the predictions carry the planner's error).
A rank whose compute time exceeds the median of those others by more than ``threshold`` in ``patience``
consecutive reports is a straggler; its host goes to ``slow_machines`` in the run directory (the original
Varuna's file name) and on the live view.

Each new report of a rank is judged against the latest reports of the others, whichever steps those were: the
heartbeats arrive on their own clocks, so a rank's replica is often not heard from between two of its reports.
Judged only against the ranks heard from at the same time, such a rank was compared through the plan with the
other stages in those reports, the plan's error broke its streak, and a rank 7x slower than its replica went
unnamed over 15 steps.
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
    _latest: dict[int, float] = field(default_factory=dict)  # rank -> its latest compute time

    def observe(self, reports: dict[int, tuple[str, int, float]]) -> list[Straggler]:
        """``reports``: rank -> (host, step, compute seconds) of its latest heartbeat."""
        fresh = {r: v for r, v in reports.items() if v[2] is not None and v[2] > 0 and r in self.stage_of
                 and v[1] > self._seen_step.get(r, -1)}
        for r, (_, step, seconds) in fresh.items():
            self._seen_step[r], self._latest[r] = step, seconds
        found = []
        for r in fresh:
            judged = self._judge(r)
            if judged is None:
                continue  # no one to compare with yet: the streak stands
            if judged > 1.0 + self.threshold:
                self._streak[r] = self._streak.get(r, 0) + 1
                if self._streak[r] == self.patience and r not in self.slow:
                    self.slow[r] = Straggler(rank=r, host=fresh[r][0], stage=self.stage_of[r], ratio=judged)
                    found.append(self.slow[r])
            else:
                self._streak[r] = 0
        return found

    def _judge(self, r: int) -> float | None:
        """Rank ``r``'s latest compute time over the median of the others' latest (of the other ranks: with two,
        the one over the other): like with like, its own stage's replicas when it has some; else every rank
        through the plan's predictions; None when there is nothing to compare with (a replica not heard from yet,
        or a lone stage without a plan)."""
        stage = self.stage_of[r]
        if any(p != r and s == stage for p, s in self.stage_of.items()):
            peers, value = [t for p, t in self._latest.items() if p != r and self.stage_of[p] == stage], self._latest[r]
        elif self.expected:
            peers = [t / self._scale(self.stage_of[p]) for p, t in self._latest.items() if p != r]
            value = self._latest[r] / self._scale(stage)
        else:
            return None
        if not peers:
            return None
        median = statistics.median(peers)
        return value / median if median > 0 else 1.0

    def _scale(self, stage: int) -> float:
        if self.expected and stage < len(self.expected) and self.expected[stage] > 0:
            return self.expected[stage]
        return 1.0
