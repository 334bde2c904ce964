"""The goodput benchmark's trace and arithmetic (the runs themselves need the SSH test hosts: see
benchmarks/goodput.py)."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.goodput import REAL_GAP, PathResult, make_trace, position, summarize


def test_the_trace_is_seeded_spaced_and_inside_the_window() -> None:
    kw = {"window": 600.0, "compress": 10.0, "lead": 15.0, "tail": 45.0, "hosts": 2}
    trace = make_trace(3, **kw)
    assert trace == make_trace(3, **kw) and trace != make_trace(4, **kw)
    assert trace and all(15.0 < e.at <= 600.0 - 45.0 for e in trace)
    for a, b in itertools.pairwise(trace):  # one host down at a time: the next comes after the return
        assert b.at >= a.at + a.notice + a.down
    assert {e.kind for e in make_trace(1, **{**kw, "window": 20_000.0})} == {"loss", "notice"}
    assert all(e.notice == (0.0 if e.kind == "loss" else 6.0) and e.down >= 3.0 and e.host in (0, 1)
               for e in make_trace(1, **{**kw, "window": 20_000.0, "compress": 5.0}))
    assert make_trace(1, **{**kw, "window": 60.0}) == []  # lead + tail leave no room


def test_the_position_is_the_newest_attempts_progress() -> None:
    reports = [{"attempt": 1, "step": s} for s in range(1, 41)] + [{"attempt": 2, "step": s} for s in (31, 32)]
    assert position(reports) == 32  # steps 33..40 of attempt 1 are redone, not counted
    assert position([]) == 0


def test_goodput_cost_and_projection() -> None:
    clean = PathResult("uninterrupted", 1000, 0, 1, 0, 0, True)
    slow = PathResult("restart", 700, 3, 7, 3, 3, True)
    summarize([clean, slow], 1000, 0.15)
    assert clean.goodput == 1.0 and clean.cost_per_event is None
    assert slow.goodput == pytest.approx(0.7)
    assert slow.cost_per_event == pytest.approx(300 * 0.15 / 3)
    assert slow.projected == pytest.approx(1 - 15.0 / REAL_GAP)
