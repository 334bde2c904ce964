"""Run a scenario on N local processes over gloo, with a hard timeout, and collect each rank's results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    returncode: int | None
    output: str
    result: dict | None
    error: str | None


def run_ranks(spec: dict, world: int, tmp_path: Path, *, timeout: float = 240.0, worker: str = "tests.dist.worker",
              env: dict | None = None) -> list[RankResult]:
    """Start ``world`` workers running ``worker`` on ``spec``; kill them all if any runs past ``timeout``.

    As under torchrun, the job's TCPStore is hosted here (the "agent"), not by rank 0, so it outlives any
    worker: the tests kill workers and check what the survivors report.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(world):
        penv = dict(os.environ)
        penv.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            VARUNA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), TORCHELASTIC_USE_AGENT_STORE="True",
        )
        penv.update(env or {})
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", worker, str(spec_path), str(tmp_path)],
                                       cwd=ROOT, env=penv, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    hung = [p for p, _ in procs if p.poll() is None]
    for proc in hung:
        proc.kill()
        proc.wait()
    del store
    out = []
    for rank, (proc, log) in enumerate(procs):
        log.close()
        result_path = tmp_path / f"rank{rank}.pt"
        err_path = tmp_path / f"rank{rank}.err"
        out.append(RankResult(
            returncode=None if proc in hung else proc.returncode,
            output=(tmp_path / f"rank{rank}.log").read_text(),
            result=torch.load(result_path, weights_only=True) if result_path.exists() else None,
            error=err_path.read_text() if err_path.exists() else None,
        ))
    if hung:
        raise AssertionError(f"ranks {[r for r, (p, _) in enumerate(procs) if p in hung]} hung past {timeout}s:\n"
                             + "\n".join(r.output[-2000:] for r in out))
    return out
