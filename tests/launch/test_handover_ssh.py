"""A morph by handover between SSH hosts that share no file system: each host has a private tmpfs at the
checkpoint store's path and at /dev/shm (``start_cluster(..., private=...)``), so the state can only move from host
to host through the shelves' wire. The job shrinks (a host leaves: the pipeline's depth changes too), grows back
(another data-parallel layout) and shrinks again, each time warming the new configuration up beside the running
one and handing the state over from memory; every step's loss and the final parameters equal an uninterrupted
run's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from devtools.chaos import _params_diff
from devtools.launching import Launch, read_steps
from devtools.testhosts import start_cluster
from tests.launch.conftest import TRAIN, job_processes

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


def test_a_job_on_hosts_that_share_no_file_system_morphs_by_handover(cluster, plan2, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    _write(hosts, cluster.hosts_file_lines(1))
    run = tmp_path / "run"
    launch = Launch([str(plan2), "--run-dir", str(run), "--ckpt-dir", str(STORE), "--hosts", str(hosts), "--morph",
                     "--grace", "2", *cluster.launcher_args(), "--", *TRAIN, "--steps", "100000"], run, timeout=360)
    try:
        launch.wait_for(lambda: max((r["step"] for r in launch.reports()), default=-1) >= 8)
        shapes = []
        for lines in (cluster.hosts_file_lines(1)[:1], cluster.hosts_file_lines(1), cluster.hosts_file_lines(1)[:1]):
            before = max(e["attempt"] for e in launch.events() if e["event"] == "starting")
            _write(hosts, lines)
            names = [x.split()[0] for x in lines]
            shapes.append(launch.wait_for(lambda names=names, before=before: _trained(launch, names, before), 150))
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        launch.close()

    events = launch.events()
    assert [(s["pp"], s["dp"], len(s["hosts"])) for s in shapes] == [(1, 1, 1), (1, 2, 2), (1, 1, 1)], shapes
    goes = [e for e in events if e["event"] == "go"]
    assert [g["source"] for g in goes] == ["shelf"] * 3, goes
    assert not [e for e in events if e["event"] in ("signal", "warm_failed", "handover_lost")
                and e.get("reason") != "SIGTERM"], events
    firsts = {e["attempt"]: e for e in events if e["event"] == "first_step"}
    # the shrink took host 2's stage over the wire, the growth all of it onto host 2
    assert firsts[shapes[0]["attempt"]]["taken_remote"] > 0 and firsts[shapes[0]["attempt"]]["taken_local"] > 0
    assert firsts[shapes[1]["attempt"]]["taken_remote"] > 0
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
    # and every final parameter to the bit. (An uninterrupted run on one layout differs by the rounding of the
    # others, which training amplifies step after step: the chaos test bounds that.)
    segments = _segments(events, run, steps[-1])
    assert [plan.name for plan, _, _ in segments] == [f"attempt{a}.yaml" for a in
                                                       (1, *(s["attempt"] for s in shapes))], segments
    expected = _through_the_store(segments, tmp_path / "reference")
    got = {(r["step"], r["loss"]) for r in launch.reports()}
    assert {step for step, _ in got} >= set(range(steps[-1]))
    assert got <= set(expected.items()), sorted(got - set(expected.items()))[:5]
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(final, tmp_path / "reference" / "store" / f"step_{steps[-1]}", problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)


def _segments(events: list[dict], run: Path, last: int) -> list[tuple[Path, int, int]]:
    """``(plan, first step, end step)`` of each attempt that trained, in order: from the step it took over (its
    go) to the step its successor took over (or ``last``)."""
    goes = {e["attempt"]: e["step"] for e in events if e["event"] == "go"}
    trained = sorted({1, *goes})
    bounds = [goes.get(a, 0) for a in trained] + [last]
    return [(run / "plans" / f"attempt{a}.yaml", bounds[i], bounds[i + 1]) for i, a in enumerate(trained)]


def _through_the_store(segments: list[tuple[Path, int, int]], where: Path) -> dict[int, float]:
    """Run each segment's plan on local processes up to its end step (its final checkpoint in one store), each
    resuming from the previous one's; the losses of every step."""
    losses: dict[int, float] = {}
    where.mkdir(parents=True, exist_ok=True)
    for i, (plan, first, end) in enumerate(segments):
        run = where / f"run{i}"
        launch = Launch([str(plan), "--run-dir", str(run), "--ckpt-dir", str(where / "store"),
                         *(["--resume"] if i else []), "--", *TRAIN, "--steps", str(end)], run, timeout=240)
        try:
            assert launch.wait() == 0, launch.output()[-3000:]
        finally:
            launch.close()
        steps = read_steps(run)
        assert set(steps) == set(range(first, end)), (plan, first, end, sorted(steps))
        losses.update(steps)
    return losses


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
                     str(marker), *TRAIN[1:], "--steps", "100000"], run, timeout=360)
    try:
        launch.wait_for(lambda: max((r["step"] for r in launch.reports()), default=-1) >= 8)
        shapes = []
        for lines in (shared.hosts_file_lines(1)[:1], shared.hosts_file_lines(1)):
            before = max(e["attempt"] for e in launch.events() if e["event"] == "starting")
            _write(hosts, lines)
            names = [x.split()[0] for x in lines]
            shapes.append(launch.wait_for(lambda names=names, before=before: _trained(launch, names, before), 150))
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        launch.close()
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
    assert len(reported) == 1 and "does not fit on the shelf" in reported[0]["reason"], reported
    log = (run / "logs" / "rank0.log").read_text()
    assert "for a handover failed (blob step_" in log and "does not fit on the shelf of job" in log, log[-2000:]
    assert "writing it to the store instead" in log
    assert job_processes(launch.job()) == []
