"""A lost replica stops nobody, over SSH: pp=2 × dp=2 on two hosts, each holding one whole replica; the second
host dies at once (every process of it and its sshd). The workers of the first go on in their own processes as
pp=2 × dp=1 — no process started, no state moved, nothing in any store, the step in flight redone with the lost
replica's examples; when the host comes back the job grows onto it again by a handover; and every step's loss and
the final parameters equal the same layouts replayed through a store."""

from __future__ import annotations

import os
import signal

import pytest

from devtools.chaos import _params_diff
from devtools.launching import Launch
from devtools.same_layouts import mismatches, replay, surviving_chain
from tests.launch.conftest import PACED, TRAIN, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(360)]


def test_the_survivors_of_a_lost_host_go_on_in_their_processes(cluster, plan4, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(line + "\n" for line in cluster.hosts_file_lines(2)))
    run = tmp_path / "run"
    launch = Launch([str(plan4), "--run-dir", str(run), "--hosts", str(hosts), "--morph", "--snapshot-every", "0",
                     "--recheck-max", "2",
                     "--grace", "2", *cluster.launcher_args(), "--", *PACED, "--steps", "100000"], run, timeout=300)
    try:
        launch.wait_for(lambda: max((r["step"] for r in launch.reports()), default=-1) >= 4, 200)
        before = {pid for pid, _ in job_processes(launch.job())}
        cluster.crash(cluster.hosts[1])
        regroup = launch.wait_for(lambda: next((e for e in launch.events() if e["event"] == "regroup"), None), 60)
        launch.wait_for(lambda: max(r["step"] for r in launch.reports()) >= regroup["step"] + 3, 120)
        after = {pid for pid, _ in job_processes(launch.job())}
        assert not list((run / "checkpoints").glob("step_*"))  # nothing in the store: nothing could be read
        cluster.boot(cluster.hosts[1])  # back: the launcher's checks find it, and the job grows onto it again
        grown = launch.wait_for(lambda: next((e for e in launch.events() if e["event"] == "starting"
                                              and e["attempt"] > 1 and e["pp"] * e["dp"] == 4
                                              and len([r for r in launch.reports() if r["attempt"] == e["attempt"]])
                                              >= 2), None), 200)
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        launch.close()

    events = launch.events()
    # no new configuration until the host came back, and then by a handover
    assert [e["attempt"] for e in events if e["event"] == "starting"] == [1, grown["attempt"]], events
    assert not [e for e in events if e["event"] in ("recovering", "workers_ended")], events
    assert [e["source"] for e in events if e["event"] == "go"] == ["shelf"], events
    assert after <= before, "no process was started"
    assert (regroup["pp"], regroup["dp"], regroup["leaving"], regroup["lost"]) == (2, 1, [], [2, 3]), regroup
    assert regroup["waited"] < 10
    assert job_processes(launch.job()) == []

    reports = launch.reports()
    final = max(r["step"] for r in reports) + 1
    assert (run / "checkpoints" / f"step_{final}" / "COMPLETE").is_file()
    chain = surviving_chain(events, reports, run, final)
    handed = next(e["step"] for e in events if e["event"] == "go")
    assert [(link.attempt, link.first, link.end) for link in chain] == \
        [(1, 0, regroup["step"]), (1, regroup["step"], handed), (grown["attempt"], handed, final)], chain
    expected, replayed = replay(chain, tmp_path / "replay", TRAIN)
    assert mismatches(chain, reports, expected) == []
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(run / "checkpoints" / f"step_{final}", replayed, problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)
