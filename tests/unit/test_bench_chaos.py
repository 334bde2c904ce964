"""The chaos benchmark's account of a sudden fault, read from the launcher's events: how long the launcher took to
notice, to train again, the steps lost and where the state came from."""

from __future__ import annotations

from devtools.chaos import KINDS, SUDDEN, Fault, _timings, schedule


def _events(*items: tuple[float, str, dict]) -> list[dict]:
    return [{"t": t, "event": name, **fields} for t, name, fields in items]


def test_a_host_lost_and_recovered_from_a_snapshot() -> None:
    fault = Fault("lose_host", step=40, target=1, at=100.0, progress=47)
    _timings(fault, _events(
        (90.0, "snapshot", {"attempt": 1, "step": 44}),
        (101.5, "ending", {"attempt": 1, "kind": "crash"}),
        (103.0, "recovering", {"attempt": 1, "step": 44}),
        (103.1, "starting", {"attempt": 2, "resume": None}),
        (104.0, "go", {"attempt": 2, "source": "shelf", "step": 44}),
        (106.0, "first_step", {"attempt": 2}),
    ), [])
    assert (fault.detected_s, fault.recovered_s, fault.steps_lost, fault.source) == (1.5, 4.5, 4, "snapshot step 44")


def test_a_restart_from_the_store_and_a_fault_nobody_noticed() -> None:
    fault = Fault("kill_worker", step=20, target=0, at=50.0, progress=23)
    _timings(fault, _events(
        (49.0, "ending", {"attempt": 1, "kind": "crash"}),  # before the fault: another one's
        (50.4, "ending", {"attempt": 2, "kind": "crash"}),
        (53.0, "starting", {"attempt": 3, "resume": 20}),
        (55.0, "first_step", {"attempt": 3}),
    ), [])
    assert (fault.detected_s, fault.recovered_s, fault.steps_lost, fault.source) == (0.4, 4.6, 4, "store step 20")
    quiet = Fault("lose_host", step=5, target=0, at=10.0, progress=6)
    _timings(quiet, _events((9.0, "first_step", {"attempt": 1})), [])
    assert quiet.detected_s is None and quiet.source is None
    asked = Fault("preempt", step=5, target=0, at=1.0, progress=6)  # a planned morph: not a sudden fault
    _timings(asked, _events((2.0, "ending", {"attempt": 1, "kind": "crash"})), [])
    assert asked.detected_s is None


def test_a_host_lost_whose_replicas_survivors_regrouped() -> None:
    """No attempt ends: the launcher noticed the lost agent at the decision's time less its wait, and the
    survivors redid the step in flight."""
    fault = Fault("lose_host", step=40, target=1, at=100.0, progress=47)
    _timings(fault, _events(
        (100.5, "regroup", {"attempt": 1, "number": 1, "step": 47, "dp": 1, "waited": 0.3}),
        (130.0, "ending", {"attempt": 1, "kind": "crash"}),  # a later fault's
    ), [{"step": 46, "t": 100.1}, {"step": 47, "t": 100.6}, {"step": 48, "t": 100.7}])
    assert (fault.detected_s, fault.recovered_s, fault.steps_lost) == (0.2, 0.4, 1)
    assert fault.source == "regroup at step 47 (dp=1, no process started)"


def test_every_kind_is_scheduled_once_and_the_sudden_ones_are_known() -> None:
    faults = schedule(3, list(KINDS), first=10, gap=8, ranks=2, hosts=2)
    assert sorted(f.kind for f in faults) == sorted(KINDS) and set(SUDDEN) < set(KINDS)
    assert all(0 <= f.target < 2 for f in faults) and [f.step for f in faults] == sorted(f.step for f in faults)
