"""Assignment of model segments (the pieces between CutPoints) to pipeline stages.

A stage always owns a contiguous, non-empty run of segments, so a partition is just one half-open
``[start, stop)`` range per stage. The original gave each stage ``(N+1)//S`` segments and silently lost the
remainder's parameters and checkpoints when ``S`` did not divide ``N+1``; here every segment is always
assigned, and :func:`balance` sizes the stages by weight instead of by count.

Pure Python: imported by planning code and the CLI, which must start fast (no torch).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence
from fractions import Fraction

from varuna_core.errors import PartitionError

__all__ = ["Partition", "PartitionSpec", "balance", "coerce_partition"]

_FORMAT_HINT = "write inclusive segment ranges per stage, e.g. '0-2,3-4,5-7' for 8 segments on 3 stages"


@dataclasses.dataclass(frozen=True)
class Partition:
    """Per-stage half-open segment ranges, contiguous from segment 0.

    Attributes:
        ranges: ``ranges[stage] = (start, stop)``; stage ``s`` runs segments ``start..stop-1``.
    """

    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        ranges = tuple(self.ranges)
        if not ranges:
            raise PartitionError("a partition needs at least one stage", hint=_FORMAT_HINT)
        clean: list[tuple[int, int]] = []
        expected_start = 0
        for s, item in enumerate(ranges):
            try:
                start, stop = item
            except (TypeError, ValueError):
                raise PartitionError(
                    f"stage {s} range {item!r} is not a (start, stop) pair", hint=_FORMAT_HINT
                ) from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
                raise PartitionError(f"stage {s} range {item!r} has non-integer bounds", hint=_FORMAT_HINT)
            if start != expected_start:
                raise PartitionError(
                    f"stage {s} starts at segment {start} but the previous stage ends before segment {expected_start}"
                    " (stages must be contiguous, starting at segment 0)",
                    hint=_FORMAT_HINT,
                )
            if stop <= start:
                raise PartitionError(f"stage {s} range [{start}, {stop}) is empty", hint="every stage needs a segment")
            clean.append((start, stop))
            expected_start = stop
        object.__setattr__(self, "ranges", tuple(clean))

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.ranges)

    @property
    def num_segments(self) -> int:
        """Number of segments covered (``CutPoints + 1``)."""
        return self.ranges[-1][1]

    def segments(self, stage: int) -> range:
        """Segment indices owned by ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise PartitionError(f"stage {stage} out of range: partition has {self.num_stages} stages",
                                 hint=f"use a stage in 0..{self.num_stages - 1}")
        return range(*self.ranges[stage])

    def stage_of_segment(self, segment: int) -> int:
        """Stage that owns ``segment`` (used to place parameters and checkpoint shards)."""
        if not 0 <= segment < self.num_segments:
            raise PartitionError(f"segment {segment} out of range: partition covers {self.num_segments} segments",
                                 hint=f"use a segment in 0..{self.num_segments - 1}")
        return bisect.bisect_right([start for start, _ in self.ranges], segment) - 1

    def to_string(self) -> str:
        """Inclusive ranges per stage, e.g. ``"0-2,3-4,5-7"``; read back by :func:`coerce_partition`."""
        return ",".join(f"{start}-{stop - 1}" for start, stop in self.ranges)

    @classmethod
    def from_ranges(cls, ranges: Sequence[tuple[int, int]], num_segments: int) -> Partition:
        """Build from half-open ranges and check they cover exactly ``num_segments`` segments.

        Raises:
            PartitionError: ranges not contiguous from 0, an empty stage, or segments left uncovered/overrun.
        """
        partition = cls(tuple(ranges))  # __post_init__ checks and normalises each pair
        if partition.num_segments != num_segments:
            raise PartitionError(
                f"partition {partition.to_string()!r} covers {partition.num_segments} segments, "
                f"but the model has {num_segments}",
                hint=f"the last stage must end at segment {num_segments - 1}",
            )
        return partition


def _exact_weights(weights: Sequence[float]) -> list[int]:
    """Scale the weights to exact integers (floats are dyadic rationals), so ties compare exactly."""
    fracs = []
    for i, w in enumerate(weights):
        try:
            value = Fraction(w)
        except (TypeError, ValueError, OverflowError):
            raise PartitionError(f"segment {i} has weight {w!r}, which is not a finite number",
                                 hint="weights are e.g. parameter bytes per segment") from None
        if value < 0:
            raise PartitionError(f"segment {i} has negative weight {w!r}", hint="weights must be >= 0")
        fracs.append(value)
    scale = math.lcm(*(f.denominator for f in fracs)) if fracs else 1
    return [int(f * scale) for f in fracs]


def _min_max_weight(prefix: list[int], num_stages: int) -> int:
    """Smallest achievable maximum stage weight: binary search over all contiguous-run sums."""
    n = len(prefix) - 1
    largest = max(prefix[i + 1] - prefix[i] for i in range(n))
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)} | {largest})
    candidates = candidates[bisect.bisect_left(candidates, largest):]

    def feasible(cap: int) -> bool:
        # Greedy packing gives the fewest stages with weight <= cap; more stages are always possible (S <= n).
        stages, start = 1, 0
        for j in range(1, n + 1):
            if prefix[j] - prefix[start] > cap:
                stages, start = stages + 1, j - 1
        return stages <= num_stages

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def balance(weights: Sequence[float], num_stages: int) -> Partition:
    """Split segments into ``num_stages`` contiguous non-empty stages with the smallest maximum stage weight.

    Among optimal partitions the choice is deterministic, by these keys in order:

    1. minimal maximum stage weight;
    2. minimal sum of squared stage weights (spreads the slack instead of piling it on one stage);
    3. minimal sum of squared stage segment counts (balances counts, e.g. when weights are all zero);
    4. lexicographically smallest tuple of segment counts, i.e. earlier stages hold fewer segments
       (stage 0 also holds the input pipeline and the last stage the loss).

    Weights are compared exactly (floats are scaled to integers), so the result never depends on rounding.
    Runs in O(S·n²) time: an exact dynamic programme, meant for up to a few hundred segments.

    Args:
        weights: per-segment cost, e.g. parameter bytes; must be finite and non-negative.
        num_stages: number of pipeline stages, 1..len(weights).

    Raises:
        PartitionError: if ``num_stages`` is out of range or a weight is negative or not finite.
    """
    n = len(weights)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise PartitionError(
            f"cannot split {n} segments into {num_stages!r} stages",
            hint="use 1..number-of-segments stages (at most one stage per segment); add CutPoints for more stages",
        )
    exact = _exact_weights(weights)
    prefix = [0]
    for w in exact:
        prefix.append(prefix[-1] + w)
    cap = _min_max_weight(prefix, num_stages)
    # Combined additive cost per stage: (weight², count²) compared lexicographically, packed into one int.
    count_scale = n * n + 1
    inf = None
    # best[k][i]: minimal cost of splitting segments i..n-1 into k stages each within cap (None = impossible).
    best: list[list[int | None]] = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0
    for k in range(1, num_stages + 1):
        for i in range(num_stages - k, n - k + 1):
            top = None
            for j in range(i + 1, n - k + 2):
                w = prefix[j] - prefix[i]
                if w > cap:
                    break
                rest = best[k - 1][j]
                if rest is not None:
                    cost = (w * w) * count_scale + (j - i) ** 2 + rest
                    if top is None or cost < top:
                        top = cost
            best[k][i] = top
    ranges: list[tuple[int, int]] = []
    start = 0
    for k in range(num_stages, 0, -1):
        # Smallest stop that stays optimal gives earlier stages fewer segments (key 4).
        for j in range(start + 1, n - k + 2):
            w = prefix[j] - prefix[start]
            rest = best[k - 1][j]
            if w <= cap and rest is not None and w * w * count_scale + (j - start) ** 2 + rest == best[k][start]:
                ranges.append((start, j))
                start = j
                break
    return Partition(tuple(ranges))


def _parse_string(text: str) -> list[tuple[int, int]]:
    ranges = []
    for part in text.replace(" ", "").split(","):
        bounds = part.split("-")
        try:
            if len(bounds) == 1:
                first = last = int(bounds[0])
            elif len(bounds) == 2:
                first, last = int(bounds[0]), int(bounds[1])
            else:
                raise ValueError(part)
        except ValueError:
            raise PartitionError(
                f"cannot parse stage range {part!r} in partition {text!r}", hint=_FORMAT_HINT
            ) from None
        ranges.append((first, last + 1))
    return ranges


PartitionSpec = Partition | str | Sequence[tuple[int, int]] | Sequence[int]
"""A partition as a user gives it (see :func:`coerce_partition`), before the model's segments are known."""


def coerce_partition(value: object, *, num_segments: int, num_stages: int) -> Partition:
    """Turn a user-supplied partition into a :class:`Partition` for this model and pipeline.

    ``value`` is meant to be a :data:`PartitionSpec`; anything else is refused. Accepted forms: a
    :class:`Partition`; a string of inclusive ranges ``"0-2,3-4,5-7"`` (a lone ``"5"`` means
    ``"5-5"``); a sequence of half-open ``(start, stop)`` pairs; a sequence of per-stage segment counts
    ``[3, 2, 3]``.

    Raises:
        PartitionError: unrecognised form, malformed ranges, or a stage/segment count that does not match.
    """
    if isinstance(value, Partition):
        partition = value
    elif isinstance(value, str):
        partition = Partition(tuple(_parse_string(value)))
    elif isinstance(value, Sequence) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if any(v < 1 for v in value):
            raise PartitionError(f"segment counts {list(value)} contain a stage with fewer than 1 segment",
                                 hint="every stage needs at least one segment")
        stops = [sum(value[: i + 1]) for i in range(len(value))]
        partition = Partition(tuple(itertools.pairwise([0] + stops)))
    elif isinstance(value, Sequence) and value and all(
        isinstance(v, Sequence) and not isinstance(v, str) and len(v) == 2 for v in value
    ):
        partition = Partition(tuple((v[0], v[1]) for v in value))
    else:
        raise PartitionError(
            f"cannot interpret {value!r} as a partition",
            hint="give a Partition, '0-2,3-4,5-7', [(0, 3), (3, 5), (5, 8)] or segment counts [3, 2, 3]",
        )
    if partition.num_stages != num_stages or partition.num_segments != num_segments:
        raise PartitionError(
            f"partition {partition.to_string()!r} has {partition.num_stages} stages over {partition.num_segments} "
            f"segments, but the run has {num_stages} stages over {num_segments} segments",
            hint=f"give {num_stages} contiguous ranges covering segments 0..{num_segments - 1}",
        )
    return partition
