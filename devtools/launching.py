"""Running ``varuna launch`` in the background and reading what it recorded: the run directory's events and
metrics, the job's processes on every test host, the addresses they listen on.

Used by the launcher tests and by the benchmarks that drive whole jobs (morph latency, chaos); they run the
real command, as a user would.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from devtools.procs import Proc, live_processes

__all__ = ["ROOT", "VARUNA", "Launch", "LaunchFailed", "profile_example_gpt", "make_plan", "end_bench",
           "read_reports", "read_steps", "read_events", "job_processes", "worker_pid", "agent_pids", "process_environ",
           "listening_addresses"]

ROOT = Path(__file__).resolve().parents[1]
VARUNA = Path(sys.executable).parent / "varuna"


class LaunchFailed(AssertionError):
    """The launcher exited or ran out of time while a caller waited for something (carries its output)."""


def _as_in_a_terminal() -> None:
    """In the launcher's process, before it starts: SIGINT and SIGQUIT as a command typed in a terminal has them.
    A suite started as a background job of a script (``bash .ci/run &``) inherits them ignored, as POSIX shells
    do for asynchronous commands, and so would every launcher it starts: a Ctrl-C test would then fail for a
    reason that is not the launcher's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class Launch:
    """``varuna launch ARGS`` running in the background, in its own session (so that all of it can be killed).

    ``run_dir`` must be the ``--run-dir`` among ``args``; the launcher's own output goes to
    ``<run_dir>.launcher.log`` beside it."""

    def __init__(self, args: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.deadline = time.monotonic() + timeout
        self.log = open(self.run_dir.parent / f"{self.run_dir.name}.launcher.log", "w")  # noqa: SIM115 - see close()
        self.proc = subprocess.Popen([str(VARUNA), "launch", *args], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_as_in_a_terminal,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", VARUNA_TIMEOUT="60", **(env or {})))

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def reports(self) -> list[dict]:
        return read_reports(self.run_dir)

    def steps(self) -> dict[int, float]:
        return read_steps(self.run_dir)

    def events(self) -> list[dict]:
        return read_events(self.run_dir)

    def job(self) -> str:
        return json.loads((self.run_dir / "manager.json").read_text())["job"]

    def wait_for(self, what, timeout: float = 120, poll: float = 0.2):
        """Poll ``what()`` until it is truthy (returns it); LaunchFailed if the launcher exits or time runs out."""
        end = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < end:
            value = what()
            if value:
                return value
            if self.proc.poll() is not None:
                raise LaunchFailed(f"the launcher exited with {self.proc.returncode} while waiting:\n"
                                   f"{self.output()[-3000:]}")
            time.sleep(poll)
        self.kill()
        raise LaunchFailed(f"timed out waiting:\n{self.output()[-3000:]}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise LaunchFailed(f"the launcher did not finish in time:\n{self.output()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()


def profile_example_gpt(out: Path, *, quick: bool = True) -> Path:
    """A profile of the example GPT at ``out`` (``quick``: few repeats, for tests that need its structure, not
    precise times)."""
    args = ["--repeats", "2", "--warmup", "1", "--microbatch-sizes", "2,4,8"] if quick else ["--nproc", "2"]
    done = subprocess.run([str(VARUNA), "profile", "examples/gpt/spec.py:spec", *args, "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise LaunchFailed(f"profiling the example GPT failed:\n{done.stderr[-3000:]}")
    return out


def make_plan(profile: Path, out: Path, *, pp: int | None = None, dp: int | None = None, mbs: int = 4,
              schedule: str = "varuna", batch_size: int = 32, per_node: int = 2, gpus: int = 4) -> Path:
    """A plan of the given shape (``pp`` and ``dp``: the search with every choice pinned, as `varuna plan --pp
    --dp --microbatch-size --schedule --no-shard-optimizer` makes it), or the planner's own choice for ``gpus``
    devices with micro-batch ``mbs`` (what `varuna launch --morph` plans again when the devices come back),
    recording its profile (so that a morph can plan again)."""
    from varuna_core.planning.artifacts import load_profile, save_plan
    from varuna_core.planning.planner import PlanRequest
    from varuna_core.planning.planner import make_plan as search

    if pp is None or dp is None:
        plan = search(load_profile(profile), PlanRequest(gpus=gpus, batch_size=batch_size, gpus_per_node=per_node,
                                                         microbatch_sizes=(mbs,)))
    else:
        plan = search(load_profile(profile), PlanRequest(
            gpus=pp * dp, batch_size=batch_size, gpus_per_node=per_node, pp=pp, dp=dp, microbatch_sizes=(mbs,),
            schedules=(schedule,), shard_optimizer=False))
    plan.profile_path = str(profile)
    save_plan(plan, out)
    return out


def end_bench(cluster, work: Path, keep: str | None) -> None:
    """A benchmark's end, whatever happened: its test hosts closed, its work directory copied to ``keep`` (if
    given) and removed."""
    import shutil

    if cluster is not None:
        cluster.close()
    if keep:
        shutil.copytree(work, keep, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def read_reports(run_dir: Path) -> list[dict]:
    """Every step report a launcher recorded in ``run_dir`` (``step``, ``loss``, ``step_time``, ``attempt``), in
    order: a step recomputed after a restart appears once per computation."""
    return _jsonl(Path(run_dir) / "metrics.jsonl")


def read_steps(run_dir: Path) -> dict[int, float]:
    """step -> loss, as the launcher recorded them in ``run_dir`` (first report of each step)."""
    out: dict[int, float] = {}
    for r in read_reports(run_dir):
        out.setdefault(r["step"], r["loss"])
    return out


def read_events(run_dir: Path) -> list[dict]:
    """What the launcher did (``RUN_DIR/events.jsonl``), in order."""
    return _jsonl(Path(run_dir) / "events.jsonl")


def job_processes(job: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose environment carries ``VARUNA_JOB_ID=job`` (agents and
    workers, on every test host: the hosts' namespaces share this machine's process table)."""
    needle = f"VARUNA_JOB_ID={job}".encode()
    return [(p.pid, p.cmdline()) for p in live_processes() if needle in p.environ()]


def process_environ(pid: int) -> list[bytes]:
    """The ``KEY=VALUE`` entries of a process's environment ([] if it is gone)."""
    return Proc(pid, 0).environ()


def worker_pid(job: str, rank: int, script: str = "train.py") -> int | None:
    """The pid of rank ``rank``'s worker (a process running ``script``) of ``job``, if it is alive: started as
    an interpreter (``RANK`` in its environment) or forked by the host's fork server (named after its rank; its
    environment as the kernel shows it is the server's)."""
    needle = f"VARUNA_JOB_ID={job}".encode()
    for p in live_processes():
        if needle not in p.environ():
            continue
        cmd = p.cmdline()
        if script in cmd and (f"RANK={rank}".encode() in p.environ() or p.comm() == f"varuna-r{rank}"):
            return p.pid
    return None


def agent_pids(job: str) -> list[int]:
    """The pids of ``job``'s node agents (``python -m varuna_core.launch.agent``), on every host."""
    return [pid for pid, cmd in job_processes(job) if "varuna_core.launch.agent" in cmd and "sh -c" not in cmd]


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses on which the processes ``pids`` listen (TCP, IPv4 and IPv6), from ``/proc``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # each 32-bit word is little-endian
            found.add(str(ipaddress.ip_address(packed)))
    return found
