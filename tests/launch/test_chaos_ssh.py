"""The chaos test over real SSH: one `--morph` run pipelined across two hosts meets every kind of fault (a frozen
worker, a host leaving the hosts file and coming back, a lost machine, a preemption notice, a corrupt checkpoint)
and ends with the same numbers as its layouts replayed (its own file, so that the suite's workers share the SSH
tests evenly)."""

from __future__ import annotations

import json

import pytest

from tests.launch.conftest import job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


def test_a_pipeline_across_two_hosts_survives_every_fault_with_the_same_numbers(cluster, plan2, tmp_path) -> None:
    """One `--morph` run of the example GPT pipelined across the two hosts (a stage on each), hit at seeded
    random steps by a frozen worker (only its missing heartbeats tell), a host leaving the hosts file and coming
    back, a lost machine (its agent killed), a preemption notice, and a killed worker whose restart meets a
    corrupt newest checkpoint (benchmarks/chaos.py throws every fault, twice). Every fault is survived; with
    `--max-restarts 1` the restarts are forgiven by the checkpoints written between them (progress is counted in
    checkpoints); the corrupt checkpoint is set aside for the one before it; the job shrinks to one host and grows
    back with the micro-batch kept, by handover where every host is alive; and every loss of the run's surviving
    history and every final parameter equal, to the bit, the same layouts over the same steps restarted through a
    store on local processes (devtools/same_layouts.py; against a run that never changed its layout only a
    tolerance could be asserted: benchmarks/chaos.py measures that drift). Without in-memory snapshots, so that
    every crash restarts through the store, where the corrupt checkpoint waits (tests/launch/test_snapshot_ssh.py
    recovers from a snapshot). Once the last fault is survived and five more steps trained, SIGTERM ends the run
    with a checkpoint (exit code 143), the end its layouts are replayed to. Each rank pauses 0.1 s after every step
    (devtools/paced_train.py): the run trains fewer steps while it waits for what a fault brings."""
    from devtools.chaos import run_chaos
    from devtools.launching import read_events

    result = run_chaos(cluster, plan2, tmp_path, seed=3, slots=1, gap=8, first=10, heartbeat_timeout=5,
                       max_restarts=1, timeout=400, uninterrupted=False, replay_layouts=True, snapshot_every="0",
                       steady=False, stop_after=5, pace=0.1,
                       kinds=["stop_worker", "remove_host", "kill_agent", "preempt", "corrupt_checkpoint"])
    assert not result.problems, result.problems
    assert result.exit_code == 143 and result.injected == result.survived == 5, result.faults
    assert result.same_as_its_layouts, (result.chain, result.layout_loss_mismatches[:5], result.layout_params_equal)

    events = read_events(tmp_path / "run")
    endings = [(e["kind"], e["message"]) for e in events if e["event"] == "ending"]
    assert result.refused_checkpoints >= 1 and result.morphs >= 4, endings
    starts = [e for e in events if e["event"] == "starting"]
    shapes = [(e["pp"] * e["dp"], len(e["hosts"])) for e in starts]
    shrunk = shapes.index((1, 1)) if (1, 1) in shapes else None
    assert shapes[0] == (2, 2) and shrunk is not None and (2, 2) in shapes[shrunk:], shapes  # shrank, grew back
    assert {e["microbatch"] for e in starts} == {4} and starts[0]["resume"] is None
    reasons = " | ".join(e["reason"] for e in events if e["event"] in ("signal", "handover_asked"))
    for why in ("removed", "added", "will be preempted"):
        assert why in reasons, reasons
    assert [e["source"] for e in events if e["event"] == "go"].count("shelf") >= 2, events  # handovers happened
    crashes = " | ".join(e["message"] for e in events if e.get("kind") == "crash")
    for why in ("missed its heartbeats", "lost the agent on root@", "exited with signal SIGKILL",
                "could not load checkpoint", "digest mismatch"):
        assert why in crashes, crashes
    for rank, host in enumerate(cluster.hosts):  # attempt 1 placed one stage on each host
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert f"===== attempt 1: rank {rank} on root@{host.address}" in log, log[:300]
    assert job_processes(json.loads((tmp_path / "run" / "manager.json").read_text())["job"]) == []
