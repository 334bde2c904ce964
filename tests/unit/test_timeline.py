"""Measured timelines (Chrome traces of ``Varuna(trace=...)``) against the simulated step: waits told apart from
compute, hostile traces refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.profiles import make_profile
from varuna_core.errors import ConfigError
from varuna_core.planning.planner import PlanRequest, plan_for
from varuna_core.planning.timeline import compare, draw_plan, load_measured, load_trace, simulated_timeline

pytestmark = pytest.mark.timeout(60)


def _event(name: str, ts: float, dur: float, **args) -> dict:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 0, "args": args}


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _plan():
    return plan_for(make_profile([0.001, 0.004, 0.004, 0.001]), PlanRequest(gpus=2, batch_size=8), pp=2, dp=1,
                    microbatch_size=2, schedule="1f1b")


def _trace(tmp_path: Path) -> Path:
    """Stage 1 waits 3 ms for its first activation; the rest of the actions compute for their whole length."""
    d = tmp_path / "trace"
    d.mkdir()
    _write(d / "trace_rank0.json", [_event(f"0{op}{mb}", 1000 + i * 2000, 1500, waited_us=0, compute_us=1400)
                                    for i, (op, mb) in enumerate((op, mb) for mb in range(4) for op in "FB")])
    _write(d / "trace_rank1.json", [_event("1F0", 1000, 4000, waited_us=3000, compute_us=900),
                                    *(_event(f"1{op}{mb}", 6000 + i * 2000, 1000, waited_us=0, compute_us=1000)
                                      for i, (op, mb) in enumerate((op, mb) for mb in range(4) for op in "FB")
                                      if (op, mb) != ("F", 0))])
    return d


def test_waits_are_read_and_compared_apart_from_compute(tmp_path) -> None:
    trace = _trace(tmp_path)
    line, waits = load_measured(trace)
    assert load_trace(trace) == line and line[0][:3] == (0, "F", 0) and line[0][3] == 0.0
    assert waits[(1, "F", 0)] == pytest.approx(3e-3) and waits[(0, "B", 2)] == 0.0
    rows = {(r["stage"], r["op"]): r for r in compare(_plan(), trace)}
    assert rows[(1, "F")]["waited_s"] == pytest.approx(3e-3) and rows[(1, "F")]["count"] == 4
    assert rows[(1, "F")]["measured_s"] == pytest.approx(1e-3)  # the median compute, the wait left out
    assert rows[(0, "B")]["measured_s"] == pytest.approx(1.5e-3) and rows[(0, "B")]["waited_s"] == 0.0
    step = rows[(-1, "step")]
    assert step["measured_s"] == pytest.approx((6000 + 7 * 2000 + 1000 - 1000) / 1e6)
    assert step["simulated_s"] == max(end for *_, end in simulated_timeline(_plan()))
    draw_plan(_plan(), tmp_path / "t.png", measured=trace)
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_a_trace_without_waits_reads_as_no_wait(tmp_path) -> None:
    path = _write(tmp_path / "t.json", [{"name": "0F0", "ph": "X", "ts": 0, "dur": 5, "pid": 0}])
    assert load_measured(path)[1] == {(0, "F", 0): 0.0}


@pytest.mark.parametrize("waited", [-1, 10, "3", None, float("nan"), True, [1]])
def test_a_hostile_wait_is_refused_in_one_line(tmp_path, waited) -> None:
    path = _write(tmp_path / "t.json", [_event("0F0", 0, 5, waited_us=waited)])  # NaN as JSON's NaN
    with pytest.raises(ConfigError) as info:
        load_measured(path)
    assert "waited" in info.value.message and "\n" not in info.value.message
