"""The original's import name: ``from varuna import ...`` gives this library's objects (no logic of its own)."""

from __future__ import annotations

import pytest

import varuna
import varuna_core
from varuna_core.errors import TopologyError


def test_original_names_are_this_librarys() -> None:
    from varuna import (  # noqa: F401
        AutoConfig,
        CutPoint,
        Profiler,
        Varuna,
        get_this_rank_config_varuna,
        get_varuna_config,
    )

    assert varuna.Varuna is varuna_core.Varuna and varuna.CutPoint is varuna_core.CutPoint
    assert varuna.AutoConfig is varuna_core.AutoConfig and varuna.Profiler is varuna_core.Profiler


@pytest.mark.parametrize(("stage_map", "shape", "places"), [
    ("0", (1, 1), {0: (0, 0)}),
    ("0,2;1,3", (2, 2), {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}),
    ("0;1;2;", (3, 1), {2: (2, 0)}),
    (" 0, 1 ; 2, 3 ", (2, 2), {1: (0, 1), 2: (1, 0)}),
])
def test_map_shape_and_rank_place(stage_map: str, shape: tuple[int, int], places: dict) -> None:
    assert varuna.get_varuna_config(stage_map) == shape
    for rank, place in places.items():
        assert varuna.get_this_rank_config_varuna(stage_map, rank) == place


@pytest.mark.parametrize(("stage_map", "rank", "match"), [
    ("0,2;1,3", 4, "rank 4 is not in stage-to-rank map"),
    ("0,2;1", 0, "different replica counts"),
    ("", 0, "empty stage-to-rank map"),
    ("0;x", 0, "non-integer rank 'x'"),
])
def test_bad_maps_are_named(stage_map: str, rank: int, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        varuna.get_this_rank_config_varuna(stage_map, rank)
