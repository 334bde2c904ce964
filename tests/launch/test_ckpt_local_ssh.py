"""Periodic checkpoints on each host's own disk (``--ckpt-local``), on SSH hosts that share no file system (a
private tmpfs at the store's path and at /dev/shm on each): every third step each host writes its workers' files
and a copy of the other host's into its own store; a worker killed mid-run, after each host's directory was cut
down to its own worker's files, makes the job restart from the newest such checkpoint (no snapshot is newer:
``--snapshot-every 0``), each new rank taking the other host's files over the wire; every step's loss and the
final parameters equal the same layouts replayed through a store, and the hosts' directories assemble into one
checkpoint that ``varuna ckpt verify`` accepts. (``--resume`` reads the same way; it finds the checkpoints in the
run directory's events: tests/unit/test_launch_parts.py.)"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from devtools.chaos import _params_diff, _signal_worker
from devtools.launching import VARUNA, Launch
from devtools.same_layouts import mismatches, replay, surviving_chain
from devtools.testhosts import start_cluster
from tests.launch.conftest import TRAIN, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(360)]

STORE = Path("/var/tmp/varuna-local-store")  # the same path on every host, a different disk on each
EVERY = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(2, tmp_path_factory.mktemp("hosts"), private=(STORE, "/dev/shm"), private_size="1g")
    yield cl
    cl.close()


def _steps(cluster, host) -> list[int]:
    held = cluster.run(host, f"ls {STORE}").stdout.split()
    return sorted(int(d.removeprefix("step_")) for d in held if d.startswith("step_"))


def _launch(cluster, plan2, tmp_path: Path, *extra: str) -> Launch:
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(line + "\n" for line in cluster.hosts_file_lines(1)))
    run = tmp_path / "run"
    return Launch([str(plan2), "--run-dir", str(run), "--ckpt-dir", str(STORE), "--hosts", str(hosts), "--morph",
                   "--ckpt-local", "--ckpt-every", str(EVERY), "--ckpt-keep", "2", "--snapshot-every", "0",
                   "--grace", "2", *extra, *cluster.launcher_args(), "--", *TRAIN, "--steps", "100000"], run,
                  timeout=300)


def _stop(launch: Launch) -> None:
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 143, launch.output()[-3000:]


def _keep_own_files_only(cluster, step: int, run_id: str) -> None:
    """Make each host's directory of ``step`` a part: only the files its own worker wrote (rank i on host i)."""
    for i, host in enumerate(cluster.hosts):
        directory = STORE / f"step_{step}"
        listed = cluster.run(host, f"ls {directory}").stdout.split()
        drop = [f for f in listed if f.endswith(".distcp") and not f.startswith(f"__{i}_")]
        own = sorted(f for f in listed if f.endswith(".distcp") and f.startswith(f"__{i}_"))
        marker = json.dumps({"schema_version": 1, "step": step, "run_id": run_id, "host": host.name, "files": own})
        cluster.run(host, f"cd {directory} && rm -f COMPLETE {' '.join(drop)} && "
                          f"printf '%s' {shlex.quote(marker)} > PART")


def test_checkpoints_on_the_hosts_own_disks_restart_a_job_exactly(cluster, plan2, tmp_path) -> None:
    run = tmp_path / "run"
    launch = _launch(cluster, plan2, tmp_path)
    try:
        launch.wait_for(lambda: any(e["event"] == "checkpoint_local" and e["step"] == 2 * EVERY
                                    for e in launch.events()), 200)
        for rank in (0, 1):  # held still: no newer checkpoint while the test changes the hosts' directories
            _signal_worker(launch.job(), rank, signal.SIGSTOP)
        kept = [_steps(cluster, host) for host in cluster.hosts]
        # each host holds its own worker's files and a copy of the other's: a whole checkpoint on each disk, the
        # newest two of the run (--ckpt-keep 2)
        assert all(len(k) == 2 and k[-1] >= 2 * EVERY for k in kept), kept
        # now each host holds only its own worker's files, of every checkpoint it has (whichever the launcher
        # heard of last): the restart takes the other's from the other host
        run_id = cluster.run(cluster.hosts[0], f"cat {STORE}/step_{kept[0][-1]}/RUN").stdout.strip()
        for step in sorted(set(kept[0]) & set(kept[1])):
            _keep_own_files_only(cluster, step, run_id)
        _signal_worker(launch.job(), 1, signal.SIGKILL)
        _signal_worker(launch.job(), 0, signal.SIGCONT)
        new = launch.wait_for(lambda: next((e for e in launch.events() if e["event"] == "starting"
                                            and e["attempt"] > 1
                                            and len([r for r in launch.reports() if r["attempt"] == e["attempt"]])
                                            >= EVERY + 1), None), 200)
        _stop(launch)
    finally:
        launch.close()

    events = launch.events()
    written = sorted({e["step"] for e in events if e["event"] == "checkpoint_local"})
    newest = new["resume"]
    assert newest in kept[0] and newest in kept[1] and written[:2] == [EVERY, 2 * EVERY], (new, kept, written)
    first = next(e for e in events if e["event"] == "first_step" and e["attempt"] == new["attempt"])
    assert first["taken_remote"] > 0 and first["taken_local"] > 0, first
    assert not [e for e in events if e["event"] in ("checkpoint_refused", "recovering")], events
    assert job_processes(launch.job()) == []
    final = _steps(cluster, cluster.hosts[0])[-1]  # the SIGTERM's, on both hosts
    assert final > newest and final in written and _steps(cluster, cluster.hosts[1])[-1] == final

    # host 1's directory, copied here without its copy of host 0's files, and host 0's, read over SSH, assemble
    # into one whole checkpoint
    part = cluster.copy_from(cluster.hosts[1], STORE, tmp_path / "host1") / f"step_{final}"
    assert (part / "COMPLETE").is_file()
    (part / "COMPLETE").unlink()
    for name in [p.name for p in part.glob("__0_*.distcp")]:
        (part / name).unlink()
    host0 = cluster.hosts[0]
    ssh = ["--ssh-port", str(host0.port), "--ssh-identity", str(cluster.identity)]
    for flag, value in zip(cluster.ssh_options()[::2], cluster.ssh_options()[1::2], strict=True):
        ssh += ["--ssh-option", value] if flag == "-o" else []
    out = tmp_path / "assembled"
    done = subprocess.run([str(VARUNA), "ckpt", "assemble", str(part.parent), f"{cluster.user}@{host0.address}:{STORE}",
                           "-o", str(out), *ssh, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["step"] == final and all(s["reachable"] and s["files"] for s in report["sources"]), report
    verified = subprocess.run([str(VARUNA), "ckpt", "verify", str(out)], capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # the steps after the checkpoint were trained again; the surviving history replayed through a store equals
    # every loss and the final parameters to the bit (devtools/same_layouts.py)
    events, reports = launch.events(), launch.reports()
    chain = surviving_chain(events, reports, run, final)
    assert [(link.attempt, link.first) for link in chain] == [(1, 0), (new["attempt"], newest)], chain
    expected, replayed = replay(chain, tmp_path / "replay", TRAIN)
    assert mismatches(chain, reports, expected) == []
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(out / f"step_{final}", replayed, problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)
