"""A host lost without notice, on SSH hosts that share no file system (a private tmpfs at the store's path and at
/dev/shm on each): the job snapshots its state into host memory every few steps, each host keeping a copy of the
other's; when the second host dies at once (every process of it, its sshd and its memory with it), the first
goes on alone from the newest snapshot — its own part from its own shelf, the lost host's part from its copy —
with no checkpoint in any store, and every step's loss and the final parameters equal the same layouts replayed
through a store. The new worker is forked by the survivor's fork server (started once the job trained)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from devtools.chaos import _params_diff
from devtools.launching import Launch
from devtools.same_layouts import mismatches, replay, surviving_chain
from devtools.testhosts import start_cluster
from tests.launch.conftest import TRAIN, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(360)]

STORE = Path("/var/tmp/varuna-private-store")  # the same path on every host, a different disk on each
EVERY = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(2, tmp_path_factory.mktemp("hosts"), private=(STORE, "/dev/shm"), private_size="1g")
    yield cl
    cl.close()


def test_a_host_lost_without_notice_costs_the_steps_since_the_snapshot_and_no_store(cluster, plan2, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    lines = cluster.hosts_file_lines(1)
    hosts.write_text("".join(line + "\n" for line in lines))
    run = tmp_path / "run"
    launch = Launch([str(plan2), "--run-dir", str(run), "--ckpt-dir", str(STORE), "--hosts", str(hosts), "--morph",
                     "--snapshot-every", str(EVERY), "--grace", "2", *cluster.launcher_args(), "--", *TRAIN,
                     "--steps", "100000"], run, timeout=300)
    survivor = lines[0].split()[0]
    try:
        # once both hosts' fork servers serve (the new configuration's workers are then forked, not started)
        launch.wait_for(lambda: max((r["step"] for r in launch.reports()), default=-1) >= 2 * EVERY + 1
                        and len({e["host"] for e in launch.events() if e["event"] == "fork_server" and e["pid"]}) == 2)
        cluster.crash(cluster.hosts[1])
        new = launch.wait_for(lambda: next((e for e in launch.events() if e["event"] == "starting"
                                            and e["attempt"] > 1 and e["hosts"] == [survivor]
                                            and len([r for r in launch.reports() if r["attempt"] == e["attempt"]])
                                            >= 3), None), 200)
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        launch.close()

    events = launch.events()
    recovering = [e for e in events if e["event"] == "recovering"]
    assert len(recovering) == 1, [e for e in events if e["event"] not in ("first_step",)]
    step = recovering[0]["step"]
    assert step >= 2 * EVERY and step % EVERY == 0 and recovering[0]["lost"] == [lines[1].split()[0]]
    taken = [e for e in events if e["event"] == "snapshot" and e["attempt"] == 1]
    assert [e["step"] for e in taken] == list(range(EVERY, step + 1, EVERY)), taken
    # each host holds its own files and a copy of the other's: the same bytes on both
    assert all(e["peer"] and e["every"] == EVERY and len(e["host_bytes"]) == 2 for e in taken), taken
    assert len(set(taken[-1]["host_bytes"].values())) == 1 and min(taken[-1]["host_bytes"].values()) > 0, taken
    go = next(e for e in events if e["event"] == "go" and e["attempt"] == new["attempt"])
    assert go["source"] == "shelf" and go["step"] == step and go["copies"], go
    assert (new["pp"], new["dp"]) == (1, 1)
    first = next(e for e in events if e["event"] == "first_step" and e["attempt"] == new["attempt"])
    # the lost host's part came from the survivor's copy of it, linked in place: nothing over the wire
    assert first["taken_remote"] == 0 and first["taken_local"] > 0 and first["taken_copies"] > 0, first
    assert first["forked"] == 1, first  # the new worker was forked by the survivor's fork server
    assert not [e for e in events if e["event"] in ("handover_lost", "snapshot_lost", "checkpoint_refused")], events
    assert job_processes(launch.job()) == []
    left = cluster.run(cluster.hosts[0], "ls -A /dev/shm").stdout.split()
    assert not [f for f in left if f.startswith("varuna-")], left

    # the SIGTERM's on-demand checkpoint is the only one, on the survivor's private store
    held = cluster.run(cluster.hosts[0], f"ls {STORE}").stdout.split()
    steps = sorted(int(d.removeprefix("step_")) for d in held if d.startswith("step_"))
    assert len(steps) == 1 and steps[0] > step, held
    final = cluster.copy_from(cluster.hosts[0], STORE / f"step_{steps[-1]}", tmp_path / "got")

    # the steps after the snapshot were trained again; the surviving history replayed through a store equals
    # every loss and the final parameters to the bit (devtools/same_layouts.py)
    reports = launch.reports()
    chain = surviving_chain(events, reports, run, steps[-1])
    assert [(link.attempt, link.first) for link in chain] == [(1, 0), (new["attempt"], step)], chain
    expected, replayed = replay(chain, tmp_path / "replay", TRAIN)
    assert mismatches(chain, reports, expected) == []
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(final, replayed, problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)
