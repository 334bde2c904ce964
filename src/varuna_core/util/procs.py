"""Starting local worker processes (free ports, torchrun-style env, a job store that outlives the workers)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_port", "run_local_workers"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_workers(argv: list[str], world: int, *, log_dir: Path, timeout: float, env: dict | None = None,
                      cwd: str | Path | None = None) -> str | None:
    """Run ``argv`` as ``world`` local ranks with torchrun-style env and wait for them.

    As torchrun does, the job's TCPStore is hosted here, not by rank 0, so it outlives any worker. Each rank's
    output goes to ``log_dir/rank<R>.log``. All ranks are killed as soon as one fails or ``timeout`` passes.

    Returns:
        ``None`` on success, else what went wrong first (``"rank 1 exited with -9"``, ``"timed out after 60s"``).
    """
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(world):
        penv = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True", **(env or {}))
        out = open(Path(log_dir) / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(argv, cwd=cwd, env=penv, stdout=out, stderr=subprocess.STDOUT), out))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while any(p.poll() is None for p, _ in procs):
            bad = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failure = f"rank {bad[0][0]} exited with {bad[0][1]}"
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout:g}s"
                break
            time.sleep(0.1)
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
        del store
    if failure is None:
        bad = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
        if bad:
            failure = f"rank {bad[0][0]} exited with {bad[0][1]}"
    return failure
