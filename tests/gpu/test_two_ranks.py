"""Two processes on the one GPU. Under NCCL (the library's default on CUDA) every rank refuses with one clear
error instead of NCCL's "Duplicate GPU detected" or a hang; under a gloo group the script joins itself the two
stages share the GPU (cut values cross through host memory) and train bit for bit as the reference."""

from __future__ import annotations

import sys

import torch

from tests.gpu.common import DEVICE, ROOT, assert_equal_to_reference, needs_real_gpu, reference
from tests.gpu.pp2_worker import BATCH, CHUNK, STEPS
from tests.models import SHARED, ToyLM, batch
from tests.reference import Layout
from varuna_core.env import CACHE_DIR
from varuna_core.util.procs import run_workers

TIMEOUT = 120.0


def _run(backend: str, tmp_path, **env) -> list[int]:
    device = "cuda:0" if DEVICE == "cuda" else DEVICE  # the one GPU, for both ranks
    outcome = run_workers([sys.executable, "-m", "tests.gpu.pp2_worker", backend, device, str(tmp_path)], 2,
                          log_dir=tmp_path, timeout=TIMEOUT, cwd=ROOT, stop_on_failure=False,
                          env={CACHE_DIR: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env})
    assert not outcome.timed_out, f"killed after {TIMEOUT:g}s: " + _logs(tmp_path)
    return outcome.returncodes


def _logs(tmp_path) -> str:
    return "".join(f"\n--- rank {r} ---\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))


def test_nccl_refuses_two_ranks_on_one_gpu(tmp_path) -> None:
    """Both ranks given ``LOCAL_RANK=0`` (what one GPU's worth of ``LOCAL_RANK`` gives two processes): each exits
    with the ``ConfigError``'s code (2, bad input) and its one line, the script having let it propagate."""
    needs_real_gpu("NCCL")
    codes = _run("nccl", tmp_path, LOCAL_RANK="0")
    assert codes == [2, 2], _logs(tmp_path)
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith(f"[rank {rank}] error: ")]
        assert len(errors) == 1, log[-3000:]
        assert errors[0].startswith(f"[rank {rank}] error: ranks 0 and 1 would both compute on cuda:0 "), errors
        assert "Traceback" not in log, log[-3000:]


def test_gloo_pipeline_on_one_gpu_equals_the_reference(tmp_path) -> None:
    codes = _run("gloo", tmp_path)
    assert codes == [0, 0], _logs(tmp_path)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    assert {torch.device(r["device"]).type for r in results} == {DEVICE}
    assert results[0]["losses"] == results[1]["losses"]
    torch.manual_seed(0)
    ref_losses, ref_state = reference(ToyLM(), STEPS, batch, Layout(BATCH, CHUNK, pp=2), SHARED, DEVICE)
    state = {**results[0]["state"], **results[1]["state"]}
    assert_equal_to_reference(results[0]["losses"], state, ref_losses, ref_state)
