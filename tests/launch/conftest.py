"""Shared pieces of the launcher tests: a plan for the example GPT, running ``varuna launch`` with a hard
timeout, waiting for training progress, and finding every process of a job."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from devtools.launching import ROOT, VARUNA, Launch, job_processes, make_plan, profile_example_gpt  # noqa: F401

TRAIN = ["examples/gpt/train.py", "--batch-size", "32", "--log-every", "10"]
# the same, each rank pausing 0.1 s after every step (devtools/paced_train.py): for the scenarios that train while they
# wait for what they test, whose steps are then replayed unpaced (TRAIN) and must equal them to the bit
PACED = ["devtools/paced_train.py", "--pace", "0.1", *TRAIN[1:]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two SSH test hosts for one test module (a module that needs private disks on them defines its own)."""
    from devtools.testhosts import start_cluster

    cl = start_cluster(2, tmp_path_factory.mktemp("hosts"))
    yield cl
    cl.close()


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory) -> Path:
    """A profile of the example GPT (few repeats: the tests need its structure, not precise times)."""
    return profile_example_gpt(tmp_path_factory.mktemp("gpt") / "profile.json")


@pytest.fixture(scope="session")
def plan4(gpt_profile) -> Path:
    return make_plan(gpt_profile, gpt_profile.parent / "plan4.yaml", pp=2, dp=2)


@pytest.fixture(scope="session")
def plan2(gpt_profile) -> Path:
    """Two stages, one replica: two workers (what tests of the launcher's mechanics need, at half the cost)."""
    return make_plan(gpt_profile, gpt_profile.parent / "plan2.yaml", pp=2, dp=1, per_node=1)


@pytest.fixture
def launches():
    """Start launchers with ``launches(args, run_dir, timeout)``; every one is killed at the end of the test."""
    started: list[Launch] = []

    def start(args: list[str], run_dir: Path, timeout: float = 240) -> Launch:
        launch = Launch([*args[:1], "--run-dir", str(run_dir), *args[1:]], run_dir, timeout)
        started.append(launch)
        return launch

    yield start
    for launch in started:
        launch.close()


def interrupt_and_expect_nothing_left(launch: Launch, processes: int) -> None:
    """With the job running as ``processes`` processes (agents and workers), Ctrl-C the launcher: it exits with
    130 and no process of the job is left on any host."""
    job = launch.job()
    assert len(job_processes(job)) == processes, job_processes(job)
    before = _signal_state(launch.proc.pid)
    os.kill(launch.proc.pid, signal.SIGINT)
    try:
        code = launch.wait()
    except Exception as exc:  # say how the launcher stood towards SIGINT, then and now
        raise AssertionError(
            f"{exc}\nlauncher before SIGINT: {before}\nafter: {_signal_state(launch.proc.pid)}") from exc
    assert code == 130, launch.output()[-2000:]
    deadline = time.monotonic() + 5  # the launcher waited for its agents; the kernel may still be reaping
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == []


def _signal_state(pid: int) -> str:
    """The signal lines of ``/proc/PID/status`` (blocked, ignored, caught, pending masks)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return str(exc)
    return "; ".join(line for line in lines if line.startswith(("Sig", "ShdPnd")))


def run_reference(plan: Path, steps: int, tmp_path: Path, launches) -> dict[int, float]:
    """The example GPT trained by ``plan`` on local workers without interruption: step -> loss, at full
    precision (the launcher's metrics)."""
    launch = launches([str(plan), "--", *TRAIN, "--steps", str(steps)], tmp_path / "reference", timeout=300)
    assert launch.wait() == 0, launch.output()[-3000:]
    return launch.steps()

