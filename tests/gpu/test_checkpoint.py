"""A checkpoint crosses devices: saved on the GPU, loaded by a CPU ``Varuna`` and saved again, loaded back on the
GPU, the parameters and the optimizer state are bit for bit those saved, and the next step is the step the
original run takes."""

from __future__ import annotations

import torch

from tests.gpu.common import BATCH, DEVICE, sgd, train
from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna


def _varuna(seed: int, device: str):
    torch.manual_seed(seed)  # another seed per run: what a load does not restore would show
    vm = Varuna(ToyLM(), "0", batch(2, 99), batch_size=BATCH, chunk_size=3, shared_weights=SHARED, device=device)
    opt = sgd(list(vm.parameters()))
    vm.set_optimizer(opt)
    return vm, opt


def _state(vm, opt) -> dict[str, torch.Tensor]:
    """Parameters and momentum buffers by name, on the CPU."""
    out = {}
    for name, p in vm.named_parameters():
        out[name] = p.detach().cpu().clone()
        out[f"{name} momentum"] = opt.state[p]["momentum_buffer"].detach().cpu().clone()
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


def test_checkpoint_from_the_gpu_through_the_cpu_and_back(tmp_path) -> None:
    first, first_opt = _varuna(0, DEVICE)
    train(first, first_opt, 2, batch)
    first.checkpoint(tmp_path / "gpu")
    saved = _state(first, first_opt)

    on_cpu, cpu_opt = _varuna(7, "cpu")
    assert on_cpu.load_checkpoint(tmp_path / "gpu") == 2
    _assert_equal(_state(on_cpu, cpu_opt), saved)
    on_cpu.checkpoint(tmp_path / "cpu")

    back, back_opt = _varuna(9, DEVICE)
    assert back.load_checkpoint(tmp_path / "cpu") == 2
    assert {p.device.type for p in back.parameters()} == {DEVICE}
    assert {back_opt.state[p]["momentum_buffer"].device.type for p in back.parameters()} == {DEVICE}
    _assert_equal(_state(back, back_opt), saved)

    want, _ = first.step(batch(BATCH, 2))
    first_opt.step()
    got, _ = back.step(batch(BATCH, 2))
    back_opt.step()
    assert got == want
    _assert_equal(_state(back, back_opt), _state(first, first_opt))
