"""Run a scenario on N local processes over gloo, with a hard timeout, and collect each rank's results.

The processes are started by :func:`varuna_core.util.procs.run_workers`, the library's one local spawner.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch

from varuna_core.env import CACHE_DIR
from varuna_core.util.procs import run_workers

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    returncode: int | None
    output: str
    result: dict | None
    error: str | None


def train_plain(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, loss_at: Callable[[int], torch.Tensor],
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference of every parity test: ``steps`` plain steps of one process (``loss_at(step)`` runs the
    forward). Returns the losses (float64) and the final parameters under every slot name, tied ones included."""
    losses = []
    for step in range(steps):
        loss = loss_at(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return torch.tensor(losses, dtype=torch.float64), params


def run_ranks(spec: dict, world: int, tmp_path: Path, *, timeout: float = 240.0, worker: str = "tests.dist.worker",
              env: dict | None = None) -> list[RankResult]:
    """Start ``world`` workers running ``worker`` on ``spec``; kill them all if any runs past ``timeout``.

    As under torchrun, the job's TCPStore is hosted here (the "agent"), not by rank 0, so it outlives any
    worker: the tests kill workers and check what the survivors report (a failing rank does not stop the others).
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    outcome = run_workers(
        [sys.executable, "-m", worker, str(spec_path), str(tmp_path)], world, log_dir=tmp_path, timeout=timeout,
        env={CACHE_DIR: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT,
        stop_on_failure=False)
    out = []
    for rank, code in enumerate(outcome.returncodes):
        result_path = tmp_path / f"rank{rank}.pt"
        err_path = tmp_path / f"rank{rank}.err"
        out.append(RankResult(
            returncode=None if rank in outcome.killed else code,
            output=(tmp_path / f"rank{rank}.log").read_text(),
            result=torch.load(result_path, weights_only=True) if result_path.exists() else None,
            error=err_path.read_text() if err_path.exists() else None,
        ))
    if outcome.killed:
        raise AssertionError(f"ranks {outcome.killed} hung past {timeout}s:\n"
                             + "\n".join(r.output[-2000:] for r in out))
    return out
