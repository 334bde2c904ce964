"""The memory model against the GPU's own accounting: a plan's predicted memory for a small GPT at pp=1, over
``torch.cuda.max_memory_allocated`` during training steps, lies in the band ``benchmarks/memory_model.py`` holds
the CPU measurements to."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from benchmarks import memory_model as mm
from tests.gpu.common import DEVICE, needs_real_gpu
from varuna_core import Varuna
from varuna_core.planning.artifacts import save_plan
from varuna_core.planning.planner import PlanRequest, plan_for
from varuna_core.profiling.run import profile

SIZE = mm.GptSize(n_layer=4, n_embd=512, n_head=8, block_size=64)
BATCH = 32


@functools.lru_cache(maxsize=1)
def _profile():
    """Measured once for both schedules (in the test, not a fixture: without CUDA a test fails, not errors)."""
    return profile(mm.gpt_spec(SIZE), microbatch_sizes=[4, 8], nproc=1, repeats=1, warmup=0, device=DEVICE)


@pytest.mark.parametrize("schedule, microbatch", [("varuna", 8), ("gpipe", 4)])
def test_predicted_memory_within_the_band_of_the_measured_peak(schedule, microbatch, tmp_path) -> None:
    needs_real_gpu("CUDA memory accounting")
    spec = mm.gpt_spec(SIZE)
    plan = plan_for(_profile(), PlanRequest(gpus=1, batch_size=BATCH), pp=1, dp=1,
                    microbatch_size=microbatch, schedule=schedule)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    vm = Varuna(spec.build(), None, spec.batch(2), batch_size=BATCH, chunk_size=microbatch, plan=str(path),
                shared_weights=spec.shared_weights, device=DEVICE)
    opt = spec.optimizer(list(vm.parameters()))
    vm.set_optimizer(opt)
    inputs = vm.replica_slice(spec.batch(BATCH))
    mm._train_step(vm, opt, inputs)  # the optimizer's state exists from the first step on
    peak, how = mm._measured_steps(vm, opt, inputs, 1, True)
    assert how == "cuda"
    ratio = plan.stages[0].memory_bytes / (peak - base)
    assert mm.LOW <= ratio <= mm.HIGH, (f"predicted {plan.stages[0].memory_bytes / 2**20:.1f} MiB, measured "
                                        f"{(peak - base) / 2**20:.1f} MiB: ratio {ratio:.3f}")
