"""What the GPU tests share: the device they run on, the example GPT, a run of ``Varuna`` and its comparison with
the plain reference of ``tests/reference.py`` on the same device.

``VARUNA_GPU_TESTS_ON_CPU=1`` is a developer aid, read only here: the tests then run on the CPU (with CPU autocast)
so that their logic can be checked on a machine without a GPU. What only a GPU can show (CUDA memory accounting,
NCCL's refusal of two ranks on one GPU) is skipped under it, and only under it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models import SHARED, ToyLM, batch
from tests.reference import Layout, train_reference

ROOT = Path(__file__).resolve().parents[2]
GPT_DIR = ROOT / "examples" / "gpt"
if str(GPT_DIR) not in sys.path:
    sys.path.insert(0, str(GPT_DIR))

ON_CPU = os.environ.get("VARUNA_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
NO_CUDA = "no CUDA device: make test-gpu needs a GPU"
BATCH, STEPS = 8, 3


def needs_real_gpu(why: str) -> None:
    """Skip under the CPU aid (only there): ``why`` is what only a GPU can show."""
    if ON_CPU:
        pytest.skip(f"VARUNA_GPU_TESTS_ON_CPU=1: {why} needs a real GPU")


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Case:
    """A model to train: how to build it (seeded), its batches, its tied weights, the micro-batch size."""

    def __init__(self, name: str, build: Callable[[], torch.nn.Module], batch_at: Callable[[int, int], dict],
                 ties, chunk: int) -> None:
        self.name, self.build, self.batch_at, self.ties, self.chunk = name, build, batch_at, ties, chunk

    def __repr__(self) -> str:
        return self.name


def _toy() -> torch.nn.Module:
    torch.manual_seed(0)
    return ToyLM()


def _gpt() -> torch.nn.Module:
    from model import GPT
    from spec import CONFIG

    torch.manual_seed(0)
    return GPT(CONFIG)


def gpt_batch(n: int, seed: int) -> dict:
    from spec import BLOCK_SIZE, _data

    return _data.get_batch("train", n, BLOCK_SIZE, torch.Generator().manual_seed(1000 + seed))


def _gpt_ties():
    from model import SHARED_WEIGHTS

    return SHARED_WEIGHTS


TOY = Case("ToyLM", _toy, batch, SHARED, 3)


def gpt_case() -> Case:
    return Case("GPT", _gpt, gpt_batch, _gpt_ties(), 2)


def train(vm, opt, steps: int, batch_at: Callable[[int, int], dict]) -> tuple[list[float], list[bool]]:
    """``steps`` steps of ``vm`` on CPU batches (the library moves them); the optimizer steps unless the step
    overflowed. Every batch is still on the CPU afterwards."""
    losses, overflows = [], []
    for step in range(steps):
        inputs = batch_at(BATCH, step)
        loss, overflow = vm.step(inputs)
        assert all(v.device.type == "cpu" for v in inputs.values() if isinstance(v, torch.Tensor))
        if not overflow:
            opt.step()
        opt.zero_grad()
        losses.append(loss)
        overflows.append(overflow)
    return losses, overflows


def reference(model: torch.nn.Module, steps: int, batch_at: Callable[[int, int], dict], layout: Layout, ties,
              device, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain process on ``device``: parameters and buffers under every name, losses as float64."""
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_reference(model.to(device), sgd, steps, lambda step: batch_at(BATCH, step), layout,
                                     ties=ties, buffers=buffers, device=device, **kw)
    return losses, {**params, **buffers}


def assert_equal_to_reference(losses, named_tensors, ref_losses, ref_tensors) -> None:
    """Every loss, parameter and buffer ``torch.equal`` to the reference's (compared on the CPU)."""
    got = torch.tensor(losses, dtype=torch.float64)
    assert torch.equal(got, ref_losses), f"losses {got.tolist()} != reference {ref_losses.tolist()}"
    assert named_tensors, "nothing to compare"
    unequal = [name for name, t in named_tensors.items() if not torch.equal(t.detach().cpu(), ref_tensors[name].cpu())]
    assert unequal == [], f"{len(unequal)}/{len(named_tensors)} tensors differ from the reference: {unequal[:8]}"


def state_of(vm) -> dict[str, torch.Tensor]:
    """``vm``'s parameters and buffers by name."""
    return {**{n: p.detach().clone() for n, p in vm.named_parameters()},
            **{n: b.detach().clone() for n, b in vm.named_buffers()}}
