"""Run a scenario on N local processes over gloo, with a hard timeout, and collect each rank's results.

The processes are forked from a *forkserver* that has imported torch and the worker modules once
(:func:`run_forked`): a fresh ``python -m worker`` spends 1.8 s importing them, which over the ~300 worker
processes of the suite was a quarter of its time. Each child is made to look like a fresh process: its own
environment, working directory and log file, a new random seed (``torch.initial_seed()`` differs per process,
as the unseeded-start tests need), and the worker module run as ``__main__``. Everything else is what
:func:`varuna_core.util.procs.run_workers` does (torchrun's environment, the TCPStore hosted here, a hard
timeout, every straggler killed), so what a test sees does not depend on the spawner.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from varuna_core.env import CACHE_DIR
from varuna_core.util.procs import JobOutcome, free_port, torchrun_env

WORKER_MODULES = ("tests.dist.worker", "tests.dist.receives_worker", "tests.dist.wire_worker")
_CONTEXT = None


def _context():
    """The forkserver context, started once per test session with torch and the workers imported."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        # transformers and its modeling base cost an HF model's worker ~2 s more than torch (tests/hf_models.py
        # builds them in the workers); a missing [hf] extra is skipped (the server ignores an ImportError);
        # tests.dist.frozen, last, freezes all of it out of the workers' garbage collections
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tests.dist.harness", *WORKER_MODULES,
                                         "transformers", "transformers.modeling_utils", "tests.dist.frozen"])
    return _CONTEXT


def _child(module: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In a forked worker: become a fresh ``python -m module argv`` with ``env``, in ``cwd``, output to ``log``."""
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.seed()  # a fresh process draws its own seed; a fork would share the server's
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # preloaded: runpy would warn that it runs a module already imported
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_forked(module: str, argv: list[str], world: int, *, log_dir: Path, timeout: float, env: dict[str, str],
               cwd: Path) -> JobOutcome:
    """``python -m module argv`` as ``world`` local ranks, forked from the preloaded server (see the module's
    docstring); the job's TCPStore is hosted here, and every rank still running after ``timeout`` is killed."""
    import torch.distributed as dist

    ctx = _context()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    procs = []
    outcome = JobOutcome(returncodes=[], timeout=timeout)
    try:
        for rank in range(world):
            penv = {**os.environ, **torchrun_env(rank, world, port), "OMP_NUM_THREADS": "1", **env}
            proc = ctx.Process(target=_child, args=(module, argv, penv, str(cwd), str(log_dir / f"rank{rank}.log")))
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for rank, proc in enumerate(procs):
            if proc.exitcode is None:
                proc.kill()
                outcome.killed.append(rank)
            proc.join()
        del store
    outcome.timed_out = bool(outcome.killed)
    outcome.returncodes = [p.exitcode for p in procs]
    return outcome

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    returncode: int | None
    output: str
    result: dict | None
    error: str | None


def train_plain(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, loss_at: Callable[[int], torch.Tensor],
                buffers: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference of every parity test: ``steps`` plain steps of one process (``loss_at(step)`` runs the
    forward). Returns the losses (float64) and the final parameters under every slot name, tied ones included;
    ``buffers``, if given, receives the final buffers."""
    losses = []
    for step in range(steps):
        loss = loss_at(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    if buffers is not None:
        buffers.update({n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)})
    return torch.tensor(losses, dtype=torch.float64), params


def run_module_ranks(module: str, world: int, tmp_path: Path, *, timeout: float) -> tuple[JobOutcome, str]:
    """``python -m module TMP_PATH`` as ``world`` ranks (forked, see :func:`run_forked`): the outcome, and the
    tail of every rank's log for assertion messages."""
    outcome = run_forked(module, [str(tmp_path)], world, log_dir=tmp_path, timeout=timeout,
                         env={CACHE_DIR: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(world))
    return outcome, logs


def run_ranks(spec: dict, world: int, tmp_path: Path, *, timeout: float = 240.0, worker: str = "tests.dist.worker",
              env: dict | None = None) -> list[RankResult]:
    """Start ``world`` workers running ``worker`` on ``spec``; kill them all if any runs past ``timeout``.

    As under torchrun, the job's TCPStore is hosted here (the "agent"), not by rank 0, so it outlives any
    worker: the tests kill workers and check what the survivors report (a failing rank does not stop the others).
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    outcome = run_forked(worker, [str(spec_path), str(tmp_path)], world, log_dir=tmp_path, timeout=timeout,
                         env={CACHE_DIR: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT)
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
