"""Starting local worker processes: the one way to do it (floor L0; torch is imported only when a job starts).

:func:`run_workers` starts ``world`` processes with torchrun's environment (:data:`varuna_core.env.TORCHRUN`),
hosts the job's TCPStore itself, as torchrun's agent does, so that the store outlives any worker, sends each
rank's output to a log file, and kills every rank that still runs past a hard timeout (and, unless told
otherwise, as soon as one rank fails). It reports what happened (:class:`JobOutcome`); each caller words its
own errors. :func:`run_local_workers` is the short form that returns the first thing that went wrong.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..env import TORCHRUN

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["JobOutcome", "free_port", "run_local_workers", "run_workers", "torchrun_env"]

# a rename in env.TORCHRUN breaks this line at import, not a worker at start-up
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, USE_AGENT_STORE = TORCHRUN
LOCALHOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        port: int = s.getsockname()[1]
        return port


def torchrun_env(rank: int, world: int, port: int, *, agent_store: bool = True) -> dict[str, str]:
    """torchrun's variables for local ``rank`` of ``world`` (one node; the master on 127.0.0.1:``port``).

    ``agent_store``: the workers connect to a store hosted by the starting process instead of rank 0 hosting it.
    """
    out = {RANK: str(rank), LOCAL_RANK: str(rank), WORLD_SIZE: str(world), LOCAL_WORLD_SIZE: str(world),
           MASTER_ADDR: LOCALHOST, MASTER_PORT: str(port)}
    if agent_store:
        out[USE_AGENT_STORE] = "True"
    return out


@dataclass
class JobOutcome:
    """How a local job ended.

    Attributes:
        returncodes: each rank's exit code (a rank this function killed has the kill's code, e.g. ``-9``).
        killed: ranks still running when the job was stopped (timeout, or another rank's failure), then killed.
        timed_out: the job was stopped because ``timeout`` passed.
        failed: the first rank seen exiting non-zero on its own while others still ran, with its code
            (None when every rank ran to its end, or the job timed out first).
        timeout: the timeout the job had, in seconds.
    """

    returncodes: list[int]
    killed: list[int] = field(default_factory=list)
    timed_out: bool = False
    failed: tuple[int, int] | None = None
    timeout: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def first_error(self) -> str | None:
        """What went wrong first (``"rank 1 exited with -9"``, ``"timed out after 60s"``), None on success."""
        if self.failed is not None:
            return f"rank {self.failed[0]} exited with {self.failed[1]}"
        if self.timed_out:
            return f"timed out after {self.timeout:g}s"
        bad = [(r, code) for r, code in enumerate(self.returncodes) if code != 0]
        return f"rank {bad[0][0]} exited with {bad[0][1]}" if bad else None


def run_workers(
    argv: Sequence[str] | Callable[[int], Sequence[str]],
    world: int,
    *,
    log_dir: str | Path,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    log_name: str = "rank{rank}.log",
    stdout_to_log: bool = True,
    agent_store: bool = True,
    stop_on_failure: bool = True,
    die_with_parent: bool = False,
    poll: float = 0.1,
    on_poll: Callable[[Any], None] | None = None,
) -> JobOutcome:
    """Run ``argv`` as ``world`` local ranks with torchrun's environment and wait for them.

    Args:
        argv: the command, or a function of the rank returning it (e.g. to prefix a namespace per rank).
        log_dir, log_name: each rank's output goes to ``log_dir / log_name.format(rank=R)``.
        timeout: seconds the whole job may take; every rank still running then is killed.
        env: added to this process's environment and torchrun's variables (it may override them);
            ``OMP_NUM_THREADS`` is 1 unless this sets it.
        stdout_to_log: False: stdout is discarded, only stderr goes to the log.
        agent_store: host the job's TCPStore here, as torchrun's agent does, so that it outlives every worker.
        stop_on_failure: kill the other ranks as soon as one exits non-zero (False: let the others run on).
        die_with_parent: the workers get SIGKILL when this process dies, even by SIGKILL (Linux).
        poll: seconds between looks at the workers.
        on_poll: called with the store (None without ``agent_store``) at each look while workers run.
    """
    port = free_port()
    store = _host_store(port, world) if agent_store else None
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(world):
            penv = dict(os.environ, **torchrun_env(rank, world, port, agent_store=agent_store), OMP_NUM_THREADS="1")
            penv.update(env or {})
            out = open(Path(log_dir) / log_name.format(rank=rank), "w")  # noqa: SIM115 - closed below
            logs.append(out)
            command = list(argv(rank) if callable(argv) else argv)
            procs.append(subprocess.Popen(
                command, cwd=cwd, env=penv, stdout=out if stdout_to_log else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if stdout_to_log else out,
                preexec_fn=_die_with_parent if die_with_parent else None))  # opt-in (not thread-safe)
        outcome = _watch(procs, timeout, stop_on_failure, poll, on_poll, store)
    finally:
        killed = _kill_running(procs)
        for out in logs:
            out.close()
        del store
    outcome.killed = killed
    outcome.returncodes = [p.returncode for p in procs]
    return outcome


def run_local_workers(argv: list[str], world: int, *, log_dir: Path, timeout: float, env: dict[str, str] | None = None,
                      cwd: str | Path | None = None) -> str | None:
    """Run ``argv`` as ``world`` local ranks (see :func:`run_workers`); all are killed as soon as one fails.

    Returns:
        ``None`` on success, else what went wrong first (``"rank 1 exited with -9"``, ``"timed out after 60s"``).
    """
    return run_workers(argv, world, log_dir=log_dir, timeout=timeout, env=env, cwd=cwd).first_error()


def _host_store(port: int, world: int) -> dist.TCPStore:
    import torch.distributed as dist

    return dist.TCPStore(LOCALHOST, port, world, is_master=True, wait_for_workers=False)


def _watch(procs: list[subprocess.Popen[bytes]], timeout: float, stop_on_failure: bool, poll: float,
           on_poll: Callable[[Any], None] | None, store: Any) -> JobOutcome:
    """Wait until every process ended, the deadline passed, or (``stop_on_failure``) one exited non-zero."""
    deadline = time.monotonic() + timeout
    outcome = JobOutcome(returncodes=[], timeout=timeout)
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            return outcome
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad and stop_on_failure:
            outcome.failed = bad[0]
            return outcome
        if time.monotonic() > deadline:
            outcome.timed_out = True
            return outcome
        if on_poll is not None:
            on_poll(store)
        time.sleep(poll)


def _kill_running(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Kill and reap every process still running; their ranks."""
    killed = []
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            killed.append(rank)
        proc.wait()
    return killed


def _die_with_parent() -> None:
    """In a worker before exec: SIGKILL it when the starting process dies (Linux prctl; kept by exec).

    Safe as a ``preexec_fn`` only where the starting process runs no threads.
    """
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
