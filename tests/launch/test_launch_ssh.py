"""`varuna launch` over real SSH to several hosts (network namespaces with their own sshd, or loopback aliases
where namespaces are not permitted): host checks before anything starts, a pipeline across hosts that morphs
when hosts leave and come back (the chaos test of every kind of fault: test_chaos_ssh.py), Ctrl-C and a
partial start leaving no process behind on any host."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.chaos import _params_diff
from devtools.launching import Launch, worker_pid
from devtools.same_layouts import mismatches, replay, surviving_chain
from tests.launch.conftest import PACED, ROOT, TRAIN, VARUNA, interrupt_and_expect_nothing_left, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


def hosts_file(path: Path, lines: list[str]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)  # an atomic swap, as an operator's tooling would do it
    return path


def test_an_unreachable_host_is_named_and_nothing_starts(cluster, plan4, tmp_path) -> None:
    dead = cluster.hosts[0].address.rsplit(".", 1)[0] + ".250"  # an address in the hosts' subnet nobody has
    hosts = hosts_file(tmp_path / "hosts", [cluster.hosts_file_lines(2)[0], f"root@{dead}:22 slots=2"])
    done = subprocess.run([str(VARUNA), "launch", str(plan4), "--hosts", str(hosts), *cluster.launcher_args(),
                           "--run-dir", str(tmp_path / "run"), "--", *TRAIN], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot use root@{dead}:22" in done.stderr and "nothing was started" in done.stderr
    assert f"root@{cluster.hosts[0].address}:22:" not in done.stderr  # the good host is not blamed
    assert cluster.processes("varuna_core.launch.agent") == [] and not (tmp_path / "run").exists()



def test_a_host_without_torch_is_named_by_the_check_and_one_with_it_passes(cluster, tmp_path) -> None:
    """The pre-flight check finds torch without importing it (seconds of CPU on every host at every check): an
    interpreter that imports varuna but has no torch (the venv's without its site-packages) is named with the
    import's own words; the job's interpreter passes."""
    from varuna_core.launch.hosts import Host
    from varuna_core.launch.options import HostRuntime, SSHConfig
    from varuna_core.launch.ssh import check_hosts

    bare = tmp_path / "python-without-torch"
    bare.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT / 'src'} exec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    good = cluster.hosts[0]
    host = Host(good.address, 1, user=cluster.user, port=good.port)
    opts = cluster.ssh_options()
    ssh = SSHConfig(identity=str(cluster.identity),
                    options=tuple(v for f, v in zip(opts[::2], opts[1::2], strict=True) if f == "-o"))
    problems = check_hosts([host], ssh, HostRuntime(python=str(bare), code_dir=str(ROOT)))
    assert [p.message for p in problems] == ["ModuleNotFoundError: No module named 'torch'"], problems
    assert check_hosts([host], ssh, HostRuntime(python=sys.executable, code_dir=str(ROOT))) == []

def _progress(launch: Launch) -> int:
    return max((r["step"] for r in launch.reports()), default=-1)


def _starts(launch: Launch) -> list[dict]:
    return [e for e in launch.events() if e["event"] == "starting"]


def _resumed(launch: Launch, start: dict) -> int:
    """The step the attempt of ``start`` continued from: its checkpoint's, or the step a handover gave it."""
    if start["resume"] is not None:
        return start["resume"]
    goes = [e["step"] for e in launch.events() if e["event"] == "go" and e["attempt"] == start["attempt"]]
    return goes[0] if goes and goes[0] is not None else 10**9  # not taken over yet: not trained past it either


def _carry_on(pid: int | None) -> None:
    """SIGCONT to a worker the test stopped (if it is still there)."""
    try:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _lose_a_host_and_take_it_back(cluster, plan2, tmp_path, lose, mend, relapse=None) -> list[dict]:
    """A `--morph` job pipelined over the two hosts loses the second one (``lose(host)``), which stays in the
    hosts file: the job goes on training on the first without restarting again and again (before: a new attempt
    every second or so, each seeing the listed host as "added" and morphing before its first step, none
    training), checks the lost host again in the background, and grows back onto it once ``mend(host)`` has
    made it usable. Every loss of the run's surviving history and the final checkpoint equal the same layouts
    replayed through a store, to the bit (devtools/same_layouts.py). ``relapse(host)``, if given, runs once a
    check of the lost host has failed; the host must then fail a check again, naming its agent's start, before
    ``mend``. Returns the launcher's events."""
    names = [line.split()[0] for line in cluster.hosts_file_lines(1)]
    hosts = hosts_file(tmp_path / "hosts", cluster.hosts_file_lines(1))
    launch = Launch([str(plan2), "--run-dir", str(tmp_path / "run"), "--hosts", str(hosts), "--morph",
                     "--ckpt-every", "5", "--grace", "2", "--recheck-max", "2", *cluster.launcher_args(), "--",
                     *PACED, "--steps", "100000"], tmp_path / "run", timeout=360)
    paused = None
    try:
        launch.wait_for(lambda: _progress(launch) >= 8)
        assert [s["hosts"] for s in _starts(launch)] == [names]
        try:
            lose(cluster.hosts[1])
            lost_at = _progress(launch)
            # training goes on without it, or the launcher keeps starting attempts that do not train
            launch.wait_for(lambda: _progress(launch) >= lost_at + 3 or len(_starts(launch)) > 4)
            starts = _starts(launch)
            assert len(starts) <= 3 and starts[-1]["hosts"] == names[:1], [(s["attempt"], s["hosts"]) for s in starts]
            paused = worker_pid(launch.job(), 0)  # the steps on one host, paused while the test looks
            assert paused is not None
            os.kill(paused, signal.SIGSTOP)
            launch.wait_for(lambda: any(e["event"] == "host_recheck_failed" for e in launch.events()))
            if relapse is not None:
                relapse(cluster.hosts[1])
                launch.wait_for(lambda: any(e["event"] == "host_recheck_failed" and "agent" in e["message"]
                                            and "start" in e["message"] for e in launch.events()))
            assert len(_starts(launch)) == len(starts)  # the checks are no attempts
            out = " ".join(launch.output().split())  # as printed, wrapped at the terminal's width
            assert out.count(f"leaving out {names[1]}") == 1, out[-3000:]
            assert "checking it again in 2s" in out and f"{names[1]} still fails its check" in out
        finally:
            mend(cluster.hosts[1])
        launch.wait_for(lambda: any(e["event"] == "host_back" for e in launch.events()))
        _carry_on(paused)
        grown_from = len(starts)  # (the new configuration may start warm before the paused worker goes on)
        launch.wait_for(lambda: len(_starts(launch)) > grown_from and _starts(launch)[-1]["hosts"] == names)
        grown = _starts(launch)[-1]
        launch.wait_for(lambda: any(r["attempt"] == grown["attempt"] and r["step"] >= _resumed(launch, grown) + 3
                                    for r in launch.reports()))
        os.kill(launch.proc.pid, signal.SIGTERM)
        assert launch.wait() == 143, launch.output()[-3000:]
    finally:
        _carry_on(paused)
        launch.close()
    events = launch.events()
    assert len(_starts(launch)) <= 4, [(s["attempt"], s["hosts"]) for s in _starts(launch)]
    assert [e["host"] for e in events if e["event"] == "host_unreachable"] == [names[1]]
    assert [e["host"] for e in events if e["event"] == "host_back"] == [names[1]]
    assert "answers again (added" in next(e["message"] for e in events if e["event"] == "ending" and
                                          e["attempt"] == grown_from)
    assert job_processes(launch.job()) == []
    # every loss of the surviving history and the SIGTERM's checkpoint equal the same layouts replayed, to the bit
    reports = launch.reports()
    last = next(e["checkpoint"] for e in events if e["event"] == "terminated")
    chain = surviving_chain(events, reports, tmp_path / "run", last)
    assert chain[0].attempt == 1 and chain[-1].attempt == grown["attempt"], chain
    expected, replayed = replay(chain, tmp_path / "replay", TRAIN)
    assert mismatches(chain, reports, expected) == []
    problems: list[str] = []
    rel, absolute, tensor = _params_diff(tmp_path / "run" / "checkpoints" / f"step_{last}", replayed, problems)
    assert not problems and rel == 0.0 and absolute == 0.0, (problems, rel, tensor)
    return events


def test_a_host_that_dies_is_left_out_while_it_cannot_be_used_and_taken_back_once_it_can(cluster, plan2,
                                                                                         tmp_path) -> None:
    """The machine dies at once (every process of it killed, sshd included) and stays in the hosts file; SSH to
    it is refused until it boots again. It then comes back with a broken copy of the launcher's node agent (a
    deployment cut short): SSH answers and the interpreter imports varuna and finds torch there, but the agent does not
    start. It is taken back once it is redeployed."""
    if cluster.mode != "netns":
        pytest.skip("needs a network namespace per test host")
    real = Path(importlib.util.find_spec("varuna_core.launch.agent").origin)
    broken = tmp_path / "agent.py"
    text = real.read_text()
    broken.write_text(text[: len(text) // 2])  # cut off halfway

    def mend(host) -> None:
        cluster.crash(host)
        cluster.boot(host)

    events = _lose_a_host_and_take_it_back(cluster, plan2, tmp_path, cluster.crash, mend,
                                           relapse=lambda host: cluster.boot(host, replaced={real: broken}))
    unreachable = next(e for e in events if e["event"] == "host_unreachable")
    assert "Connection refused" in unreachable["message"], unreachable
    # while it is down, the checks in the background find SSH refused; once it is up with the broken agent, they
    # start an agent there, which fails until mended
    failures = [e["message"] for e in events if e["event"] == "host_recheck_failed"]
    assert any("Connection refused" in m for m in failures), failures
    assert any("agent" in m and "start" in m for m in failures), failures


def test_ctrl_c_stops_every_worker_on_every_host(cluster, plan2, tmp_path, launches) -> None:
    hosts = hosts_file(tmp_path / "hosts", cluster.hosts_file_lines(1))
    launch = launches([str(plan2), "--hosts", str(hosts), *cluster.launcher_args(), "--", *TRAIN, "--steps", "100000"],
                      tmp_path / "run", timeout=240)
    launch.wait_for(lambda: len(launch.steps()) >= 3)
    assert len(cluster.processes("varuna_core.launch.agent")) == 2  # what the unreachable-host test counts
    interrupt_and_expect_nothing_left(launch, processes=4)  # an agent and a worker on each host


def test_a_partial_start_is_rolled_back(cluster, plan4, tmp_path) -> None:
    """The first host's agent is up (it hosts the job's store) when the second cannot be reached: the first is
    stopped again and nothing of the job is left."""
    from varuna_core.launch.attempt import LaunchError
    from varuna_core.launch.hosts import Host
    from varuna_core.launch.manager import Manager
    from varuna_core.launch.options import HostRuntime, LaunchOptions, SSHConfig
    from varuna_core.planning.artifacts import load_plan

    good = cluster.hosts[0]
    hosts = [Host(good.address, 2, user=cluster.user, port=good.port), Host(good.address, 2, user=cluster.user, port=1)]
    opts = cluster.ssh_options()
    ssh = SSHConfig(identity=str(cluster.identity),
                    options=tuple(v for f, v in zip(opts[::2], opts[1::2], strict=True) if f == "-o"))
    run = tmp_path / "run"
    run.mkdir()
    options = LaunchOptions(script=TRAIN, run_dir=run, ckpt_dir=run / "ckpt", runtime=HostRuntime(code_dir=str(ROOT)),
                            ssh=ssh)
    events = []

    class Quiet:
        def event(self, message: str) -> None:
            events.append(message)

        def status(self, status) -> None:
            pass

    manager = Manager(options, load_plan(plan4), hosts, None, 2, Quiet())
    job = manager.job
    with pytest.raises(LaunchError, match=r"the agent on root@.*:1 failed to start"):
        manager.run()
    time.sleep(0.5)
    assert job_processes(job) == []
