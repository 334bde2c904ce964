"""Shared pieces of the launcher tests: a plan for the example GPT, running ``varuna launch`` with a hard
timeout, waiting for training progress, and finding every process of a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARUNA = Path(sys.executable).parent / "varuna"
TRAIN = ["examples/gpt/train.py", "--batch-size", "32", "--log-every", "10"]


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory) -> Path:
    """A profile of the example GPT (few repeats: the tests need its structure, not precise times)."""
    out = tmp_path_factory.mktemp("gpt") / "profile.json"
    done = subprocess.run([str(VARUNA), "profile", "examples/gpt/spec.py:spec", "--repeats", "2", "--warmup", "1",
                           "--microbatch-sizes", "2,4,8", "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    return out


def make_plan(profile: Path, out: Path, *, pp: int, dp: int, mbs: int = 4, schedule: str = "varuna") -> Path:
    """A plan of the given shape for 32 examples, recording its profile (so a morph can plan again)."""
    from varuna_core.artifacts import load_profile, save_plan
    from varuna_core.plan import PlanRequest, plan_for

    plan = plan_for(load_profile(profile), PlanRequest(gpus=pp * dp, batch_size=32, gpus_per_node=2), pp=pp, dp=dp,
                    microbatch_size=mbs, schedule=schedule)
    plan.profile_path = str(profile)
    save_plan(plan, out)
    return out


@pytest.fixture(scope="session")
def plan4(gpt_profile) -> Path:
    return make_plan(gpt_profile, gpt_profile.parent / "plan4.yaml", pp=2, dp=2)


class Launch:
    """``varuna launch`` running in the background, in its own session (so a test can kill all of it)."""

    def __init__(self, args: list[str], run_dir: Path, timeout: float) -> None:
        self.run_dir = run_dir
        self.deadline = time.monotonic() + timeout
        self.log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "w")
        self.proc = subprocess.Popen([str(VARUNA), "launch", *args], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", VARUNA_TIMEOUT="60"))

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def steps(self) -> dict[int, float]:
        """step -> loss, as the launcher recorded them (first report of each step)."""
        path = self.run_dir / "metrics.jsonl"
        out: dict[int, float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    out.setdefault(r["step"], r["loss"])
        return out

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def job(self) -> str:
        return json.loads((self.run_dir / "manager.json").read_text())["job"]

    def wait_for(self, what, timeout: float = 120, poll: float = 0.2):
        """Poll ``what()`` until it is truthy (returns it); fail if the launcher exits or time runs out."""
        end = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < end:
            value = what()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher exited with {self.proc.returncode} while waiting:\n{self.output()[-3000:]}")
            time.sleep(poll)
        self.kill()
        pytest.fail(f"timed out waiting:\n{self.output()[-3000:]}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the launcher did not finish in time:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()


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


def job_processes(job: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose environment carries ``VARUNA_JOB_ID=job`` (agents and
    workers, on every test host: the hosts' namespaces share this machine's process table)."""
    needle = f"VARUNA_JOB_ID={job}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie holds nothing
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found


def interrupt_and_expect_nothing_left(launch: Launch, processes: int) -> None:
    """With the job running as ``processes`` processes (agents and workers), Ctrl-C the launcher: it exits with
    130 and no process of the job is left on any host."""
    job = launch.job()
    assert len(job_processes(job)) == processes, job_processes(job)
    os.kill(launch.proc.pid, signal.SIGINT)
    assert launch.wait() == 130, launch.output()[-2000:]
    deadline = time.monotonic() + 5  # the launcher waited for its agents; the kernel may still be reaping
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == []


def run_reference(plan: Path, steps: int, tmp_path: Path, launches) -> dict[int, float]:
    """The example GPT trained by ``plan`` on local workers without interruption: step -> loss, at full
    precision (the launcher's metrics)."""
    launch = launches([str(plan), "--", *TRAIN, "--steps", str(steps)], tmp_path / "reference", timeout=300)
    assert launch.wait() == 0, launch.output()[-3000:]
    return launch.steps()
