"""Hosts that do not answer are left out of a `--morph` job and checked again with a back-off, without a loop of
attempts: the bookkeeping (:mod:`varuna_core.launch.exclusion`) and the manager's decisions with scripted attempts
and host checks (no processes, no SSH; a clock the test moves)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.profiles import make_profile
from varuna_core.launch.attempt import Ending, LaunchError, Outcome
from varuna_core.launch.exclusion import Exclusions
from varuna_core.launch.hosts import Host
from varuna_core.launch.manager import Manager
from varuna_core.launch.options import LaunchOptions, SlurmConfig, SSHConfig
from varuna_core.launch.ssh import HostProblem
from varuna_core.planning.planner import PlanRequest, plan_for

A, B = Host("10.0.0.1", 1), Host("10.0.0.2", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_back_off_doubles_up_to_the_longest_and_a_check_is_handed_out_once() -> None:
    clock = Clock()
    out = Exclusions(first=5, longest=60, clock=clock)
    assert [out.delay(n) for n in range(1, 8)] == [5, 10, 20, 40, 60, 60, 60]
    record = out.leave_out(B, "refused")
    assert B.name in out and record.due == 1005 and not record.held and out.due() == []
    checks = []
    for _ in range(400):  # 400 s: checks at 5, 15, 35, 75, 135, 195, ...
        clock.now += 1
        for host in out.due():
            checks.append(clock.now - 1000)
            assert out.due() == []  # handed out once until it answers
            out.failed(host, "refused")
    assert checks == [5, 15, 35, 75, 135, 195, 255, 315, 375]
    assert Exclusions(first=5, longest=2).delay(1) == 2  # the first wait is never longer than the longest


def test_a_host_taken_back_whose_agent_does_not_start_is_held_until_the_hosts_file_changes() -> None:
    clock = Clock()
    out = Exclusions(first=5, longest=60, clock=clock)
    out.leave_out(B, "the agent on b failed to start", at_start=True)  # first time: checked again, as any
    clock.now += 5
    assert out.due() == [B]
    out.answered(B)
    assert B.name not in out
    held = out.leave_out(B, "the agent on b failed to start", at_start=True)  # the check passed, the start did not
    assert held.held and held.failures == 2
    clock.now += 10**6
    assert out.due() == []  # never, by itself
    out.listed([A, Host(B.address, 2)])  # the operator edits (or touches) the hosts file
    assert out.due() == [Host(B.address, 2)]
    out.listed([A])  # no longer listed: forgotten
    assert B.name not in out and len(out) == 0
    # an agent that started clears the past: a later failure starts the back-off afresh, and is not held
    out.leave_out(B, "refused")
    clock.now += 5
    out.due()
    out.answered(B)
    out.started([B.name])
    again = out.leave_out(B, "the agent on b failed to start", at_start=True)
    assert not again.held and again.failures == 1


# ------------------------------------------------------------------------------------------------------------
# The manager, with scripted attempts and checks


class Quiet:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def event(self, message: str) -> None:
        self.lines.append(message)

    def status(self, status) -> None:
        pass


class Job:
    """A Manager whose attempts and host checks are scripted: ``down`` is the set of hosts whose check fails;
    every attempt is recorded with the hosts it ran on and played by ``script(job, number)``."""

    def __init__(self, tmp_path, hosts: list[Host], script, *, slurm: bool = False, hosts_file: bool = True,
                 **options) -> None:
        plan = plan_for(make_profile([1e-3] * 4, sizes=(1, 2, 4)), PlanRequest(gpus=2, batch_size=8, gpus_per_node=1),
                        pp=1, dp=2, microbatch_size=2, schedule="1f1b")
        run = tmp_path / "run"
        run.mkdir()
        path = None
        if hosts_file:
            path = tmp_path / "hosts"
            path.write_text("".join(f"{h.name} slots={h.slots}\n" for h in hosts))
        opts = LaunchOptions(script=["train.py"], run_dir=run, ckpt_dir=run / "ckpt", morph=True, backoff=0.0,
                             ssh=None if slurm else SSHConfig(), slurm=SlurmConfig("42") if slurm else None,
                             **options)
        self.reporter = Quiet()
        self.manager = Manager(opts, plan, hosts, path, 1, self.reporter)
        self.clock = Clock()
        self.manager.exclusions = Exclusions(5, 60, clock=self.clock)
        self.down: set[str] = set()
        self.checks: list[tuple[float, str, bool]] = []  # (time, host, with a node agent)
        self.attempts: list[list[str]] = []
        self.manager._check = self.check
        self.manager._start_check = self.manager._check_in_background  # at once, not in a thread
        self.manager._attempt = self.attempt
        self.script = script

    def check(self, hosts: list[Host], agents: bool = False) -> list[HostProblem]:
        self.checks += [(self.clock.now, h.name, agents) for h in hosts]
        return [HostProblem(h, "connection refused") for h in hosts if h.name in self.down]

    def attempt(self, number: int, resume, restarts: int, handover=None, retiring=None) -> Outcome:
        self.attempts.append([h.name for h in self.manager.hosts])
        if len(self.attempts) > 12:
            raise AssertionError(f"attempt after attempt: {self.attempts}")
        return self.script(self, len(self.attempts))

    def train(self, seconds: int, at: dict[int, Callable[[], object]] | None = None) -> Outcome:
        """An attempt that trains for ``seconds`` (the manager's ``changes()`` asked every second, as
        Attempt.run does): the morph it is asked for, else done. ``at``: things that happen at a second."""
        for second in range(seconds):
            (at or {}).get(second, lambda: None)()
            self.clock.now += 1
            change = self.manager._changes()
            if change is not None:
                return Outcome(Ending.MORPH, change[1], hosts=change[0])
        return Outcome(Ending.DONE, "every worker finished")

    def events(self, name: str) -> list[dict]:
        lines = (self.manager.opts.run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_host_lost_for_good_is_checked_with_a_back_off_not_an_attempt_each_time(tmp_path) -> None:
    """Before: every attempt on the hosts left saw the listed host as "added", morphed before its first step and
    checked it again: a new attempt every second or so, none training."""

    def script(job: Job, n: int) -> Outcome:
        if n == 1:
            job.down.add(B.name)
            return Outcome(Ending.CRASH, f"lost the agent on {B.name} (host down or SSH dropped)", suspects=[B.name])
        if n == 2:  # trains on A alone while B stays down for 100 s, then B answers
            return job.train(300, at={100: lambda: job.down.discard(B.name)})
        return Outcome(Ending.DONE, "every worker finished")

    job = Job(tmp_path, [A, B], script)
    assert job.manager.run() == 0
    assert job.attempts == [[A.name, B.name], [A.name], [A.name, B.name]]
    rechecks = [t - 1000 for t, name, agents in job.checks if name == B.name and agents]
    assert rechecks == [5, 15, 35, 75, 135], rechecks  # left out at 0; back at 100, found at the check of 135
    assert [e["retry_in"] for e in job.events("host_recheck_failed")] == [10, 20, 40, 60]
    assert [e["host"] for e in job.events("host_unreachable")] == [B.name]
    assert [e["host"] for e in job.events("host_back")] == [B.name]
    assert job.manager.status.restarts == 1 and job.manager.status.morphs == 1  # the crash; the growth
    said = "\n".join(job.reporter.lines)
    assert said.count(f"leaving out {B.name}: connection refused; checking it again in 5s") == 1
    assert f"{B.name} answers again after 135s left out: taking it back" in said


def test_a_host_whose_agent_does_not_start_is_left_out_without_a_restart(tmp_path) -> None:
    """The attempt's start names the host whose agent did not come up: the job goes on at once on the others
    (before: a crash, restarted on the same hosts until --max-restarts gave up); a host taken back whose agent
    then fails again is held out, not taken back at every check."""

    def script(job: Job, n: int) -> Outcome:
        if n in (1, 3):
            return Outcome(Ending.CRASH, f"the agent on {B.name} failed to start: SyntaxError", unstarted=B)
        if n == 2:
            return job.train(20)  # its check (with a node agent) passes at 5 s: taken back
        return job.train(600)

    job = Job(tmp_path, [A, B], script, max_restarts=0)
    assert job.manager.run() == 0
    assert job.attempts == [[A.name, B.name], [A.name], [A.name, B.name], [A.name]]
    assert [(t - 1000, agents) for t, name, agents in job.checks] == [(5, True)]  # once; not after the relapse
    assert job.manager.status.restarts == 0
    assert [e["retry_in"] for e in job.events("host_unreachable")] == [5, None]
    assert "it is not checked again until the hosts file changes" in "\n".join(job.reporter.lines)


def test_a_failed_slurm_node_is_left_out_and_checked_by_starting_an_agent(tmp_path) -> None:
    """A node of the allocation whose agent (a job step) does not start is left out; it is checked again by
    starting a node agent there (no SSH under Slurm), with the back-off, and the job grows back onto it."""

    def script(job: Job, n: int) -> Outcome:
        if n == 1:
            job.down.add(B.name)
            return Outcome(Ending.CRASH, f"the agent on {B.name} did not report 'ready' within 60s", unstarted=B)
        if n == 2:
            return job.train(300, at={30: lambda: job.down.discard(B.name)})
        return Outcome(Ending.DONE, "every worker finished")

    job = Job(tmp_path, [A, B], script, slurm=True, hosts_file=False)
    assert job.manager.run() == 0
    assert job.attempts == [[A.name, B.name], [A.name], [A.name, B.name]]
    assert [(t - 1000, name, agents) for t, name, agents in job.checks] == [
        (5, B.name, True), (15, B.name, True), (35, B.name, True)]
    assert job.manager.status.restarts == 0


def test_a_host_named_in_a_preemption_notice_is_not_taken_back_by_a_restart(tmp_path) -> None:
    """After the morph without the preempted host, neither the attempts' polling nor a crash's restart puts it
    back (before: the restart checked it as a new host and started on it, and the attempt then morphed it out
    again before its first step)."""

    def script(job: Job, n: int) -> Outcome:
        if n == 1:  # a spot notice: the host goes away now
            return job.train(5, at={2: lambda: job.manager.listener.add_notice(B.address, 0.0, "gcp")})
        if n == 2:
            outcome = job.train(50)
            assert outcome.kind is Ending.DONE  # polled 50 times: no change
            return Outcome(Ending.CRASH, f"rank 0 on {A.name} exited with code 1", suspects=[])
        if n == 3:
            return job.train(50)
        return Outcome(Ending.DONE, "every worker finished")

    job = Job(tmp_path, [A, B], script)
    assert job.manager.run() == 0
    assert job.attempts == [[A.name, B.name], [A.name], [A.name]]
    assert job.checks == []  # the preempted host is never checked, let alone added
    assert [e["host"] for e in job.events("preempt_notice")] == [B.name]


def test_a_job_whose_every_host_is_left_out_fails(tmp_path) -> None:
    """No host answers: the job waits for one (checking them with the back-off) and ends with a LaunchError
    (exit 1) that names them, rather than starting attempts without end."""

    def script(job: Job, n: int) -> Outcome:
        job.down.update({A.name, B.name})
        return Outcome(Ending.CRASH, "lost every agent", suspects=None)

    job = Job(tmp_path, [A, B], script, start_timeout=1.5)
    with pytest.raises(LaunchError, match=r"no usable configuration on the hosts left: no host is left \(left out, "
                                          r"as they do not answer: 10.0.0.1 \(connection refused\), 10.0.0.2"):
        job.manager.run()
    assert job.attempts == [[A.name, B.name]]
