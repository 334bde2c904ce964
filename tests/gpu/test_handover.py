"""A handover from and to the GPU: the state published from CUDA tensors onto a host shelf (device -> host memory)
and taken back into a fresh CUDA ``Varuna`` (host -> device) is bit for bit what was published, and the next step
is the step the original run takes. Also from the GPU to a CPU worker and back, as a morph onto another kind of
machine would."""

from __future__ import annotations

import torch

from tests.gpu.common import BATCH, DEVICE, train
from tests.gpu.test_checkpoint import _state, _varuna
from tests.models import batch
from varuna_core.launch.shelf import Shelf
from varuna_core.worker.morph import holder_rank


def _take(vm, shelf: Shelf, step: int, staging) -> int:
    def fetch(holder, names, into, max_bytes) -> None:
        assert holder == 0
        for name in names:
            shelf.get_into(name, lambda e: into(e.name, e.size))

    return vm.take_state(step=step, locate=holder_rank, fetch=fetch, staging=staging)


def test_a_handover_from_the_gpu_through_host_memory_and_back(tmp_path) -> None:
    first, first_opt = _varuna(0, DEVICE)
    train(first, first_opt, 2, batch)
    shelf = Shelf("gpu-handover", root=tmp_path / "shm")
    owners = first.publish_state(shelf.reserve)
    assert set(owners.values()) == {0} and all(shelf.has(name) for name in owners)
    saved = _state(first, first_opt)

    on_cpu, cpu_opt = _varuna(7, "cpu")
    assert _take(on_cpu, shelf, 2, tmp_path / "shm") == 2
    assert _state(on_cpu, cpu_opt).keys() == saved.keys()
    assert [n for n, t in _state(on_cpu, cpu_opt).items() if not torch.equal(t, saved[n])] == []

    back, back_opt = _varuna(9, DEVICE)
    assert _take(back, shelf, 2, tmp_path / "shm") == 2
    assert {p.device.type for p in back.parameters()} == {DEVICE}
    assert [n for n, t in _state(back, back_opt).items() if not torch.equal(t, saved[n])] == []

    want, _ = first.step(batch(BATCH, 2))
    first_opt.step()
    got, _ = back.step(batch(BATCH, 2))
    back_opt.step()
    assert got == want
    after = _state(first, first_opt)
    assert [n for n, t in _state(back, back_opt).items() if not torch.equal(t, after[n])] == []
