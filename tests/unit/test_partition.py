"""Tests of segment-to-stage partitions: the Partition type, `balance` (against brute force) and coercion."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from varuna_core.errors import PartitionError
from varuna_core.ir.partition import Partition, balance, coerce_partition


def _all_partitions(n: int, stages: int):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield tuple(itertools.pairwise(bounds))


def _key(weights, ranges):
    """The documented tie-break order of `balance`, computed exactly."""
    sums = [sum(Fraction(w) for w in weights[a:b]) for a, b in ranges]
    counts = tuple(b - a for a, b in ranges)
    return (max(sums), sum(s * s for s in sums), sum(c * c for c in counts), counts)


# ---------------------------------------------------------------------------------------------- Partition


def test_partition_basics() -> None:
    p = Partition(((0, 3), (3, 5), (5, 8)))
    assert (p.num_stages, p.num_segments) == (3, 8)
    assert p.segments(1) == range(3, 5)
    assert [p.stage_of_segment(i) for i in range(8)] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert p.to_string() == "0-2,3-4,5-7"
    assert Partition.from_ranges([(0, 3), (3, 5), (5, 8)], 8) == p
    assert Partition(((0, 1),)).to_string() == "0-0"


@pytest.mark.parametrize(
    ("ranges", "segments", "match"),
    [
        ([], 3, "at least one stage"),
        ([(1, 3)], 3, "stage 0 starts at segment 1"),
        ([(0, 2), (3, 4)], 4, "stage 1 starts at segment 3"),
        ([(0, 2), (1, 4)], 4, "stage 1 starts at segment 1"),
        ([(0, 2), (2, 2), (2, 4)], 4, r"stage 1 range \[2, 2\) is empty"),
        ([(0, 2), (2, 3)], 4, "covers 3 segments, but the model has 4"),
        ([(0, 2), (2, 5)], 4, "covers 5 segments, but the model has 4"),
        ([(0, 1, 2)], 2, "not a \\(start, stop\\) pair"),
        ([(0, 1.5)], 2, "non-integer bounds"),
    ],
)
def test_from_ranges_errors(ranges, segments: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match) as info:
        Partition.from_ranges(ranges, segments)
    assert info.value.hint


def test_lookup_errors() -> None:
    p = Partition(((0, 2), (2, 4)))
    with pytest.raises(PartitionError, match="stage 2 out of range"):
        p.segments(2)
    with pytest.raises(PartitionError, match="segment 4 out of range"):
        p.stage_of_segment(4)
    with pytest.raises(PartitionError, match="segment -1 out of range"):
        p.stage_of_segment(-1)


# ---------------------------------------------------------------------------------------------- balance


def test_balance_known() -> None:
    assert balance([1, 1, 1, 1, 4], 2).ranges == ((0, 4), (4, 5))
    assert balance([4, 1, 1, 1, 1], 2).ranges == ((0, 1), (1, 5))
    assert balance([5, 5, 5, 5], 4).ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert balance([3, 1, 2], 1).ranges == ((0, 3),)
    assert balance([1, 2, 3, 4, 5, 6, 7, 8, 9], 3).to_string() == "0-4,5-6,7-8"


def test_balance_uneven_counts_cover_everything() -> None:
    p = balance([1.0] * 7, 3)
    assert p.num_segments == 7 and p.num_stages == 3
    assert [len(p.segments(s)) for s in range(3)] == [2, 2, 3]  # ties: earlier stages hold fewer segments


def test_balance_zero_weights_deterministic() -> None:
    p = balance([0] * 7, 3)
    assert p.ranges == ((0, 2), (2, 4), (4, 7))
    assert balance([0.0] * 7, 3) == p
    assert balance([0, 0, 5, 0, 0], 2).ranges == ((0, 2), (2, 5))
    assert balance([0] * 3, 3).ranges == ((0, 1), (1, 2), (2, 3))


def test_balance_float_weights_exact() -> None:
    # 0.1 + 0.2 != 0.3 in floats; the split must not depend on that rounding.
    assert balance([0.1, 0.2, 0.3], 2).ranges == ((0, 2), (2, 3))
    assert balance([1e-300, 1e300, 1e-300], 2).num_stages == 2
    assert balance([Fraction(1, 3), Fraction(2, 3), 1], 2).ranges == ((0, 2), (2, 3))


def test_balance_matches_brute_force() -> None:
    rng = random.Random(1234)
    for trial in range(400):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        kind = trial % 4
        if kind == 0:
            weights = [rng.randint(0, 5) for _ in range(n)]
        elif kind == 1:
            weights = [rng.choice([0, 0, 1, 2]) for _ in range(n)]
        elif kind == 2:
            weights = [round(rng.uniform(0, 3), 1) for _ in range(n)]
        else:
            weights = [rng.random() for _ in range(n)]
        got = balance(weights, stages)
        assert got.num_segments == n and got.num_stages == stages
        best = min(_all_partitions(n, stages), key=lambda r: _key(weights, r))
        assert _key(weights, got.ranges)[0] == _key(weights, best)[0], (weights, stages)  # max weight optimal
        assert got.ranges == best, (weights, stages)  # and the documented tie-break


def test_balance_speed_few_hundred_segments() -> None:
    rng = random.Random(7)
    weights = [rng.randint(1, 10**9) for _ in range(300)]
    p = balance(weights, 64)
    assert p.num_segments == 300 and p.num_stages == 64
    assert balance([0] * 200, 100).num_stages == 100


@pytest.mark.parametrize(
    ("weights", "stages", "match"),
    [
        ([1, 2], 3, "cannot split 2 segments into 3 stages"),
        ([1, 2], 0, "cannot split 2 segments into 0 stages"),
        ([], 1, "cannot split 0 segments into 1 stages"),
        ([1, -2], 1, "segment 1 has negative weight -2"),
        ([1, float("nan")], 1, "segment 1 has weight nan"),
        ([float("inf")], 1, "segment 0 has weight inf"),
        ([1, None], 1, "segment 1 has weight None"),
    ],
)
def test_balance_errors(weights, stages: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match) as info:
        balance(weights, stages)
    assert info.value.hint


def test_balance_error_hint_mentions_cutpoints() -> None:
    with pytest.raises(PartitionError) as info:
        balance([1, 2], 3)
    assert "CutPoints" in info.value.hint


# ---------------------------------------------------------------------------------------------- coerce


@pytest.mark.parametrize(
    "value",
    [
        Partition(((0, 3), (3, 5), (5, 8))),
        "0-2,3-4,5-7",
        " 0-2, 3-4 ,5-7 ",
        [(0, 3), (3, 5), (5, 8)],
        ((0, 3), [3, 5], (5, 8)),
        [3, 2, 3],
        (3, 2, 3),
    ],
)
def test_coerce_forms(value) -> None:
    p = coerce_partition(value, num_segments=8, num_stages=3)
    assert p.ranges == ((0, 3), (3, 5), (5, 8))


def test_coerce_single_segment_stage() -> None:
    assert coerce_partition("0-1,2,3-4", num_segments=5, num_stages=3).ranges == ((0, 2), (2, 3), (3, 5))
    p = balance([1] * 5, 3)
    assert coerce_partition(p.to_string(), num_segments=5, num_stages=3) == p


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("0-2,3-4", "2 stages over 5 segments, but the run has 3 stages over 8 segments"),
        ([3, 2, 2], "3 stages over 7 segments, but the run has 3 stages over 8 segments"),
        ([3, 0, 5], "fewer than 1 segment"),
        ("0-2,x,5-7", "cannot parse stage range 'x'"),
        ("0-2,3-4-5,6-7", "cannot parse stage range '3-4-5'"),
        ("0-2,4-4,5-7", "stage 1 starts at segment 4"),
        ("", "cannot parse stage range ''"),
        ([], "cannot interpret"),
        (3, "cannot interpret"),
        ([1, (2, 3)], "cannot interpret"),
        ([True, 2, 5], "cannot interpret"),
        (None, "cannot interpret"),
    ],
)
def test_coerce_errors(value, match: str) -> None:
    with pytest.raises(PartitionError, match=match) as info:
        coerce_partition(value, num_segments=8, num_stages=3)
    assert info.value.hint
