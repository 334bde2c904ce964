"""Tests of the stage-to-rank map (parsing, placement arithmetic, error messages)."""

from __future__ import annotations

import pytest

from varuna_core.errors import TopologyError
from varuna_core.ir.topology import Topology


@pytest.mark.parametrize("text", ["0,2;1,3;", "0,2;1,3", " 0, 2 ;\n1 ,3 ; "])
def test_parse(text: str) -> None:
    topo = Topology.parse(text)
    assert (topo.pp, topo.dp, topo.world_size) == (2, 2, 4)
    assert topo.stage_ranks == ((0, 2), (1, 3))
    assert topo.coords(3) == (1, 1)
    assert topo.coords(2) == (0, 1)
    assert topo.rank(1, 0) == 1
    assert topo.replica_ranks(1) == (2, 3)
    assert topo.to_string() == "0,2;1,3;"


def test_parse_with_world_size() -> None:
    assert Topology.parse("0,2;1,3;", world_size=4).world_size == 4


def test_by_stage_puts_a_stage_s_replicas_on_consecutive_ranks() -> None:
    assert Topology.by_stage(2, 2).to_string() == "0,1;2,3;"
    assert Topology.by_stage(3, 2).to_string() == "0,1;2,3;4,5;"
    for pp, dp in [(1, 1), (1, 4), (4, 1), (3, 5)]:
        topo = Topology.by_stage(pp, dp)
        topo.validate(pp * dp)
        assert [topo.coords(r) for r in range(pp * dp)] == [(r // dp, r % dp) for r in range(pp * dp)]
    assert Topology.placed("stage", 2, 3) == Topology.by_stage(2, 3)
    assert Topology.placed("pipeline", 2, 3) == Topology.clustered(2, 3)
    for bad in [(0, 2), (2, 0), (True, 2)]:
        with pytest.raises(TopologyError):
            Topology.by_stage(*bad)
    with pytest.raises(TopologyError, match="unknown placement"):
        Topology.placed("rack", 2, 2)


def test_clustered() -> None:
    assert Topology.clustered(2, 2).to_string() == "0,2;1,3;"
    topo = Topology.clustered(4, 2)
    assert topo.to_string() == "0,4;1,5;2,6;3,7;"  # the original's 2 nodes x 4 GPUs example
    assert topo.coords(5) == (1, 1)
    assert topo.replica_ranks(0) == (0, 1, 2, 3)
    assert Topology.clustered(3, 2).to_string() == "0,3;1,4;2,5;"
    for pp, dp in ((1, 1), (1, 4), (4, 1), (3, 5)):
        topo = Topology.clustered(pp, dp)
        assert Topology.parse(topo.to_string(), world_size=pp * dp) == topo
        for rank in range(pp * dp):
            stage, replica = topo.coords(rank)
            assert rank == replica * pp + stage == topo.rank(stage, replica)


def test_non_clustered_placement() -> None:
    topo = Topology.parse("0,1;2,3")  # "scattered": replicas are neighbours
    assert topo.coords(1) == (0, 1)
    assert topo.replica_ranks(0) == (0, 2)


@pytest.mark.parametrize(
    ("text", "world", "match"),
    [
        ("", None, "empty stage-to-rank map"),
        ("   ", None, "empty stage-to-rank map"),
        ("0,2;;1,3", None, "stage 1 of stage-to-rank map .* is empty"),
        (";", None, "stage 0 .* is empty"),
        ("0,2;;", None, "stage 1 .* is empty"),
        ("0,x;1,3", None, "non-integer rank 'x'"),
        ("0,2.5;1,3", None, "non-integer rank '2.5'"),
        ("0,,2;1,3", None, "non-integer rank ''"),
        ("0,-2;1,3", None, "negative rank -2"),
        ("0,2;1,2", None, "rank 2 is listed twice: stage 0 replica 1 and stage 1 replica 1"),
        ("0,2;1", None, r"different replica counts \(stage 0: 2, stage 1: 1\)"),
        ("0,2;1,4", None, r"2 stages × 2 replicas = 4 ranks must be 0..3, but rank\(s\) \[3\] are missing"),
        ("0,2;1,3", 3, "2 stages × 2 replicas = 4 ranks, but WORLD_SIZE=3"),
        ("0;1", 4, "2 stages × 1 replica = 2 ranks, but WORLD_SIZE=4"),
    ],
)
def test_parse_errors(text: str, world: int | None, match: str) -> None:
    with pytest.raises(TopologyError, match=match) as info:
        Topology.parse(text, world_size=world)
    assert info.value.hint


def test_hints_show_a_valid_map() -> None:
    with pytest.raises(TopologyError) as info:
        Topology.parse("0,2;1,3", world_size=6)
    assert "'0,2,4;1,3,5'" in info.value.hint and "6 ranks" in info.value.hint
    with pytest.raises(TopologyError) as info:
        Topology.parse("0,2;1,3", world_size=3)
    assert "'0,1,2'" in info.value.hint
    with pytest.raises(TopologyError) as info:
        Topology.parse("")
    assert "'0,2;1,3'" in info.value.hint


def test_lookup_errors() -> None:
    topo = Topology.clustered(2, 2)
    with pytest.raises(TopologyError, match="rank 4 is not in stage-to-rank map '0,2;1,3;'"):
        topo.coords(4)
    with pytest.raises(TopologyError, match=r"\(stage 2, replica 0\) is outside 2 stages × 2 replicas"):
        topo.rank(2, 0)
    with pytest.raises(TopologyError, match="replica 2 out of range"):
        topo.replica_ranks(2)
    with pytest.raises(TopologyError, match="WORLD_SIZE=8"):
        topo.validate(8)
    topo.validate(4)


def test_constructor_and_clustered_errors() -> None:
    with pytest.raises(TopologyError, match="no stages"):
        Topology(())
    with pytest.raises(TopologyError, match=r"stage 0 .* has no ranks"):
        Topology(((),))
    with pytest.raises(TopologyError, match="not an integer rank"):
        Topology((("0",),))
    with pytest.raises(TopologyError, match="0 stages × 2 replicas"):
        Topology.clustered(0, 2)
    with pytest.raises(TopologyError, match="must be integers"):
        Topology.clustered(2.0, 2)  # type: ignore[arg-type]


def test_frozen_and_comparable() -> None:
    assert Topology.parse("0;1;") == Topology.clustered(2, 1)
    assert hash(Topology.clustered(2, 1)) == hash(Topology.parse("0;1"))
