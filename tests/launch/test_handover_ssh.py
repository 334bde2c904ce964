"""A morph by handover between SSH hosts that share no file system: each host has a private tmpfs at the
checkpoint store's path and at /dev/shm (``start_cluster(..., private=...)``), so the state can only move from host
to host through the shelves' wire. The job shrinks (a host leaves: the pipeline's depth changes too), grows back
(another data-parallel layout) and shrinks again, each time warming the new configuration up beside the running
one and handing the state over from memory (the last shrink from the remaining host's copy of its replica's files,
nothing over the wire, and stopped by a SIGTERM as it begins: the new configuration takes the state and writes the
checkpoint); every step's loss and the final parameters equal the same layouts replayed through a store."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from devtools.chaos import _params_diff
from devtools.launching import Launch
from devtools.same_layouts import mismatches, replay, surviving_chain
from devtools.testhosts import start_cluster
from tests.launch.conftest import PACED, TRAIN, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

STORE = Path("/var/tmp/varuna-private-store")  # the same path on every host, a different disk on each


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(2, tmp_path_factory.mktemp("hosts"), private=(STORE, "/dev/shm"), private_size="1g")
    yield cl
    cl.close()


def _write(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)


def _trained(launch: Launch, hosts: list[str], after: int, steps: int = 3) -> dict | None:
    """The newest attempt if it runs on ``hosts``, began after attempt ``after``, and has trained ``steps``
    steps past where it took over."""
    starts = [e for e in launch.events() if e["event"] == "starting"]
    new = starts[-1] if starts and starts[-1]["attempt"] > after and starts[-1]["hosts"] == hosts else None
    if new is None:
        return None
    mine = [r["step"] for r in launch.reports() if r["attempt"] == new["attempt"]]
    return new if len(mine) >= steps else None


def _morph_through(launch: Launch, hosts: Path, steps: list[list[str]], *, term_in_last: bool = False) -> list[dict]:
    """Once the job trains, write each of ``steps`` (hosts-file lines) in turn, each once the previous change has
    trained a few steps; then SIGTERM (exit 143): after the last change has trained too, or (``term_in_last``) as
    soon as the last change's old workers are asked to hand over. Returns the ``starting`` event of each change's
    attempt."""
    try:
        launch.wait_for(lambda: max((r["step"] for r in launch.reports()), default=-1) >= 8)
        shapes = []
        for i, lines in enumerate(steps):
            before = max(e["attempt"] for e in launch.events() if e["event"] == "starting")
            _write(hosts, lines)
            names = [x.split()[0] for x in lines]
            if term_in_last and i == len(steps) - 1:
                launch.wait_for(lambda before=before: [e for e in launch.events() if e["event"] == "handover_asked"
                                                       and e["attempt"] == before], 150)
                os.kill(launch.proc.pid, signal.SIGTERM)
                assert launch.wait() == 143, launch.output()[-3000:]
                shapes.append(next(e for e in launch.events() if e["event"] == "starting" and e["attempt"] > before))
                return shapes
            shapes.append(launch.wait_for(lambda names=names, before=before: _trained(launch, names, before), 150))
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        launch.close()
    return shapes


def test_a_job_on_hosts_that_share_no_file_system_morphs_by_handover(cluster, plan2, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    _write(hosts, cluster.hosts_file_lines(1))
    run = tmp_path / "run"
    marker = tmp_path / "took-then-died"
    launch = Launch([str(plan2), "--run-dir", str(run), "--ckpt-dir", str(STORE), "--hosts", str(hosts), "--morph",
                     "--grace", "2", *cluster.launcher_args(), "--", "tests/launch/take_crash_worker.py", str(marker),
                     *PACED[1:], "--steps", "100000"], run, timeout=360)
    lines = cluster.hosts_file_lines(1)
    # the last change is stopped by a SIGTERM as soon as its handover begins: the new configuration takes the state,
    # then writes the SIGTERM's checkpoint (the old one has nothing left to write it from)
    shapes = _morph_through(launch, hosts, [lines[:1], lines, lines[:1]], term_in_last=True)

    events = launch.events()
    assert [(s["pp"], s["dp"], len(s["hosts"])) for s in shapes] == [(1, 1, 1), (1, 2, 2), (1, 1, 1)], shapes
    # the shrink's new worker died right after taking its state (no store to fall back on): the old attempt kept
    # serving it, and a new configuration took the same step again
    assert marker.exists()
    goes = [e for e in events if e["event"] == "go"]
    assert [g["source"] for g in goes] == ["shelf"] * 4 and goes[0]["step"] == goes[1]["step"], goes
    again = [e for e in events if e["event"] == "handover_again"]
    assert len(again) == 1 and again[0]["attempt"] == 1 and again[0]["step"] == goes[0]["step"], again
    assert "exited with code 3" in again[0]["reason"]
    assert not [e for e in events if e["event"] in ("signal", "warm_failed", "handover_lost")
                and e.get("reason") != "SIGTERM"], events
    firsts = {e["attempt"]: e for e in events if e["event"] == "first_step"}
    # the shrink took host 2's stage over the wire, the growth all of it onto host 2
    assert firsts[shapes[0]["attempt"]]["taken_remote"] > 0 and firsts[shapes[0]["attempt"]]["taken_local"] > 0
    assert firsts[shapes[1]["attempt"]]["taken_remote"] > 0
    # each shrink's old workers were told that host 2 leaves, the growth's that no host does
    names = [line.split()[0] for line in lines]
    asked = [e["leaving"] for e in events if e["event"] == "handover_asked"]
    assert asked[0] == asked[-1] == [names[1]] and [] in asked, asked
    # and each shrink's, that the next configuration runs on host 1 alone: its files were linked there, unhashed
    alone = [e["alone"] for e in events if e["event"] == "handover_asked"]
    assert alone[0] == alone[-1] == names[0] and None in alone, alone
    # the last shrink (dp=2 -> 1 on host 1): host 2 leaves, so its replica on host 1 wrote the whole stage, taken
    # from host 1's own shelf: nothing over the wire, and no copy needed
    last = firsts[shapes[2]["attempt"]]
    assert last["taken_remote"] == 0 and last["taken_copies"] == 0 and last["taken_local"] > 0, last
    assert last["taken_replica"] == 0, last
    assert not [e for e in events if e["event"] == "handover_replica"], events
    # nothing went through the launcher's own copy of the store's path, and no shelf is left on any host
    assert not STORE.exists() or list(STORE.iterdir()) == []
    for host in cluster.hosts:
        left = cluster.run(host, "ls -A /dev/shm").stdout.split()
        assert not [f for f in left if f.startswith("varuna-")], (host.name, left)
    assert job_processes(launch.job()) == []

    # the SIGTERM's on-demand checkpoint is on host 1's private store (the one host left)
    held = cluster.run(cluster.hosts[0], f"ls {STORE}").stdout.split()
    steps = sorted(int(d.removeprefix("step_")) for d in held if d.startswith("step_"))
    assert steps and cluster.run(cluster.hosts[1], f"ls -A {STORE}").stdout.split() == [], held
    final = cluster.copy_from(cluster.hosts[0], STORE / f"step_{steps[-1]}", tmp_path / "got")

    # The same layouts over the same steps, restarted through a store between them on local processes: every loss
    # and every final parameter to the bit (devtools/same_layouts.py says why not an uninterrupted run).
    reports = launch.reports()
    assert {r["step"] for r in reports} >= set(range(steps[-1]))
    chain = surviving_chain(events, reports, run, steps[-1])
    assert [link.attempt for link in chain] == [1, *(s["attempt"] for s in shapes)], chain
    expected, replayed = replay(chain, tmp_path / "replay", TRAIN)
    assert mismatches(chain, reports, expected) == []
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(final, replayed, problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    cl = start_cluster(2, tmp_path_factory.mktemp("shared-hosts"))
    yield cl
    cl.close()


def test_a_handover_that_cannot_happen_goes_through_the_store(shared, plan2, tmp_path) -> None:
    """Two morphs whose handover fails, on hosts that share the store: the shrink's new worker dies while warming
    up (the old configuration keeps training meanwhile, then checkpoints to the store and restarts as before the
    handover existed); the growth's publish does not fit the shelves (``--shelf-budget``): the old workers write
    the store instead, and the warm workers load it. Each is reported once, and every loss equals an
    uninterrupted run's as the chaos test bounds it."""
    hosts = tmp_path / "hosts"
    _write(hosts, shared.hosts_file_lines(1))
    run = tmp_path / "run"
    marker = tmp_path / "warm-crash"
    launch = Launch([str(plan2), "--run-dir", str(run), "--hosts", str(hosts), "--morph", "--grace", "2",
                     "--shelf-budget", "4096", *shared.launcher_args(), "--", "tests/launch/warm_crash_worker.py",
                     str(marker), *PACED[1:], "--steps", "100000"], run, timeout=360)
    lines = shared.hosts_file_lines(1)
    shapes = _morph_through(launch, hosts, [lines[:1], lines])
    events = launch.events()
    assert marker.exists()
    failed = [e for e in events if e["event"] == "warm_failed"]
    assert len(failed) == 1 and "exited with code 3 while warming up" in failed[0]["reason"], failed
    assert "this worker dies while warming up" in failed[0]["reason"]
    signals = [e for e in events if e["event"] == "signal"]
    assert [s["attempt"] for s in signals][:1] == [1], signals  # the store's checkpoint, after the failed warm-up
    starts = [e for e in events if e["event"] == "starting"]
    assert [(s["attempt"], s["warm"]) for s in starts][:3] == [(1, False), (2, True), (3, False)], starts
    assert shapes[0]["attempt"] == 3 and shapes[0]["resume"] is not None
    goes = [e for e in events if e["event"] == "go"]
    assert [(g["attempt"], g["source"]) for g in goes] == [(shapes[1]["attempt"], "store")], goes
    reported = [e for e in events if e["event"] == "handover_failed"]
    assert len(reported) == 1 and "does not fit on its host's shelf" in reported[0]["reason"], reported
    log = (run / "logs" / "rank0.log").read_text()
    assert "for a handover failed (" in log and "do not fit on the shelf of job" in log, log[-2000:]
    assert "writing it to the store instead" in log
    assert job_processes(launch.job()) == []
