"""`varuna launch` over real SSH to several hosts (network namespaces with their own sshd, or loopback aliases
where namespaces are not permitted): a run across hosts, host checks before anything starts, morphing when
hosts leave and come back, and restarts after a worker is killed, leaving no process behind on any host."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.conftest import interrupt_and_expect_nothing_left, ROOT, TRAIN, VARUNA, job_processes, make_plan, run_reference
from devtools.testhosts import start_cluster

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(2, tmp_path_factory.mktemp("hosts"))
    yield cl
    cl.close()


def hosts_file(path: Path, lines: list[str]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)  # an atomic swap, as an operator's tooling would do it
    return path


def test_two_hosts_two_workers_each(cluster, plan4, tmp_path, launches) -> None:
    hosts = hosts_file(tmp_path / "hosts", cluster.hosts_file_lines(2))
    launch = launches([str(plan4), "--hosts", str(hosts), *cluster.launcher_args(), "--", *TRAIN, "--steps", "20"],
                      tmp_path / "run", timeout=240)
    assert launch.wait() == 0, launch.output()[-3000:]
    addresses = [h.address for h in cluster.hosts]
    for rank in range(4):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} on root@{addresses[rank // 2]}" in log, log[:300]
    assert "final loss" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert sorted(launch.steps()) == list(range(20))
    assert job_processes(launch.job()) == []


def test_an_unreachable_host_is_named_and_nothing_starts(cluster, plan4, tmp_path) -> None:
    dead = cluster.hosts[0].address.rsplit(".", 1)[0] + ".250"  # an address in the hosts' subnet nobody has
    hosts = hosts_file(tmp_path / "hosts", [cluster.hosts_file_lines(2)[0], f"root@{dead}:22 slots=2"])
    before = subprocess.run(["pgrep", "-f", "varuna_core.agent"], capture_output=True, text=True).stdout
    done = subprocess.run([str(VARUNA), "launch", str(plan4), "--hosts", str(hosts), *cluster.launcher_args(),
                           "--run-dir", str(tmp_path / "run"), "--", *TRAIN], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot use root@{dead}:22" in done.stderr and "nothing was started" in done.stderr
    assert f"root@{cluster.hosts[0].address}:22:" not in done.stderr  # the good host is not blamed
    after = subprocess.run(["pgrep", "-f", "varuna_core.agent"], capture_output=True, text=True).stdout
    assert after == before and not (tmp_path / "run").exists()


def test_morph_shrinks_grows_and_follows_a_preemption_notice(cluster, gpt_profile, tmp_path, launches) -> None:
    """Remove a host from the hosts file, add it back, then announce its preemption: each time the job
    checkpoints on demand, plans again and continues; its losses equal those of the same job run without
    interruption, to fp32 rounding.

    (Not those of a run that used another layout from step 0: Adam's first updates are ±lr wherever a gradient
    is near zero, so rounding differences of 1e-8 in the first steps change the trajectory visibly, as another
    machine would. After the first steps the same differences stay at 1e-8: that is what a morph meets.)"""
    plan = make_plan(gpt_profile, tmp_path / "plan.yaml", pp=2, dp=2)
    both = cluster.hosts_file_lines(2)
    hosts = hosts_file(tmp_path / "hosts", both)
    steps = 100
    launch = launches([str(plan), "--hosts", str(hosts), "--morph", *cluster.launcher_args(), "--", *TRAIN,
                       "--steps", str(steps)], tmp_path / "run", timeout=400)

    def attempts_started(n: int):
        return lambda: sum(e["event"] == "first_step" for e in launch.events()) >= n

    launch.wait_for(lambda: len(launch.steps()) >= 30)
    hosts_file(hosts, both[:1])  # a machine goes away
    launch.wait_for(attempts_started(2))
    at = len(launch.steps())
    launch.wait_for(lambda: len(launch.steps()) >= at + 15)
    hosts_file(hosts, both)  # and comes back
    launch.wait_for(attempts_started(3))
    at = len(launch.steps())
    launch.wait_for(lambda: len(launch.steps()) >= at + 15)
    second = cluster.hosts[1].address
    notify = subprocess.run([str(VARUNA), "notify-preempt", f"root@{second}:22", "--in", "0", "--run-dir",
                             str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert notify.returncode == 0, notify.stderr
    assert launch.wait() == 0, launch.output()[-4000:]

    starts = [e for e in launch.events() if e["event"] == "starting"]
    assert [(e["pp"] * e["dp"], len(e["hosts"])) for e in starts] == [(4, 2), (2, 1), (4, 2), (2, 1)]
    assert [e["resume"] for e in starts][0] is None and all(e["resume"] for e in starts[1:])
    signals = [e["reason"] for e in launch.events() if e["event"] == "signal"]
    assert "removed" in signals[0] and "added" in signals[1] and "will be preempted" in signals[2]
    assert {e["microbatch"] for e in starts} == {4}  # kept, so that the numerics do not change
    got = launch.steps()
    assert sorted(got) == list(range(steps))
    want = run_reference(plan, steps, tmp_path, launches)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in range(steps))
    assert worst <= 1e-5, worst
    assert job_processes(launch.job()) == []


def test_chaos_faults_are_survived_and_change_no_number(cluster, plan4, tmp_path) -> None:
    """A short chaos run (benchmarks/chaos.py runs every kind of fault): a killed agent (a lost machine), a
    frozen worker (only its missing heartbeats tell) and a killed worker whose restart meets a corrupt newest
    checkpoint, at seeded random steps of one `--morph` run over SSH. Every fault is survived, the corrupt
    checkpoint is set aside for the one before it, and every loss (each time a step was computed) and every
    final parameter equal an uninterrupted run's: on one layout, restarts reproduce it to the last bit."""
    from devtools.chaos import run_chaos
    from devtools.launching import read_events

    result = run_chaos(cluster, plan4, tmp_path, seed=13, kinds=["kill_agent", "stop_worker", "corrupt_checkpoint"],
                       gap=8, first=8, heartbeat_timeout=5, timeout=360)
    assert not result.problems, result.problems
    assert result.exit_code == 0 and result.injected == result.survived == 3, result.faults
    assert result.restarts >= 3 and result.refused_checkpoints >= 1, result
    assert result.loss_max_rel_diff == 0 and result.params_max_rel_diff == 0, result
    crashes = " | ".join(e["message"] for e in read_events(tmp_path / "run") if e.get("kind") == "crash")
    for why in ("lost the agent on root@", "missed its heartbeats", "exited with signal SIGKILL",
                "could not load checkpoint", "sha256 mismatch"):
        assert why in crashes, crashes


def test_ctrl_c_stops_every_worker_on_every_host(cluster, plan4, tmp_path, launches) -> None:
    hosts = hosts_file(tmp_path / "hosts", cluster.hosts_file_lines(2))
    launch = launches([str(plan4), "--hosts", str(hosts), *cluster.launcher_args(), "--", *TRAIN, "--steps", "100000"],
                      tmp_path / "run", timeout=240)
    launch.wait_for(lambda: len(launch.steps()) >= 3)
    interrupt_and_expect_nothing_left(launch, processes=6)  # an agent on each host and 4 workers


def test_a_partial_start_is_rolled_back(cluster, plan4, tmp_path) -> None:
    """The first host's agent is up (it hosts the job's store) when the second cannot be reached: the first is
    stopped again and nothing of the job is left."""
    from varuna_core.artifacts import load_plan
    from varuna_core.hosts import Host
    from varuna_core.launch import LaunchError, LaunchOptions
    from varuna_core.morph import Manager
    from varuna_core.remote import Runtime, SSHConfig

    good = cluster.hosts[0]
    hosts = [Host(good.address, 2, user=cluster.user, port=good.port), Host(good.address, 2, user=cluster.user, port=1)]
    opts = cluster.ssh_options()
    ssh = SSHConfig(identity=str(cluster.identity),
                    options=tuple(v for f, v in zip(opts[::2], opts[1::2]) if f == "-o"))
    run = tmp_path / "run"
    run.mkdir()
    options = LaunchOptions(script=TRAIN, run_dir=run, ckpt_dir=run / "ckpt", runtime=Runtime(code_dir=str(ROOT)),
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
