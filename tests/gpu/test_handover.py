"""A handover from and to the GPU: the state published from CUDA tensors onto a host shelf (device -> host memory)
and taken back into a fresh CUDA ``Varuna`` (host -> device) is bit for bit what was published, and the next step
is the step the original run takes. Also from the GPU to a CPU worker and back, as a morph onto another kind of
machine would."""

from __future__ import annotations

import torch

from tests.gpu.common import BATCH, DEVICE, needs_real_gpu, train
from tests.gpu.test_checkpoint import _state, _varuna
from tests.models import batch
from varuna_core import Varuna
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


def test_a_warm_worker_takes_no_device_memory_for_its_stage_until_the_go(tmp_path, monkeypatch) -> None:
    """A worker started beside the one it replaces (``VARUNA_HANDOVER=wait``) builds its stage in host memory --
    each module initialised on the GPU, one at a time, then moved -- so the old worker keeps the device while the
    new one warms up. At the go the stage moves onto the GPU (parameters keep their identity: the optimizer built
    over them meanwhile still holds them) and takes the published state there: every tensor and the next step are
    the original run's."""
    from varuna_core.launch.protocol import Go, ShelfHolder
    from varuna_core.worker import morph as morph_mod

    first, first_opt = _varuna(0, DEVICE)
    train(first, first_opt, 2, batch)
    shelf_root = tmp_path / "shm"
    shelf = Shelf("job-w-a1", root=shelf_root)
    first.publish_state(shelf.reserve)
    saved = _state(first, first_opt)
    want, _ = first.step(batch(BATCH, 2))
    first_opt.step()
    after = _state(first, first_opt)

    for key, value in {"HANDOVER": "wait", "SHELF_DIR": str(shelf_root), "JOB_ID": "job-w", "JOB_TOKEN": "t" * 32,
                       "ATTEMPT": "2", "HOST": "here"}.items():
        monkeypatch.setenv(f"VARUNA_{key}", value)
    go = Go(attempt=2, source="shelf", step=2, shelf="job-w-a1", holders=[ShelfHolder(host="here", address="x",
                                                                                       port=1)])
    monkeypatch.setattr(morph_mod.Morph, "wait_for_go", lambda self, timeout=0: go)
    warm, warm_opt = _varuna(9, DEVICE)  # set_optimizer is the resume point: the go (patched) comes at once
    assert warm.stage_slice.park is None and {p.device.type for p in warm.parameters()} == {DEVICE}
    assert all(any(p is q for q in warm.parameters()) for group in warm_opt.param_groups for p in group["params"])
    assert [n for n, t in _state(warm, warm_opt).items() if not torch.equal(t, saved[n])] == []
    got, _ = warm.step(batch(BATCH, 2))
    warm_opt.step()
    assert got == want
    assert [n for n, t in _state(warm, warm_opt).items() if not torch.equal(t, after[n])] == []


def test_a_parked_stage_is_built_where_it_computes_and_held_in_host_memory(monkeypatch) -> None:
    """What the warm worker holds before its go: parameters in host memory with the values a cold start builds on
    the GPU (a model built on meta is initialised there, module by module), and no device memory for them; a
    script that evaluates before the go gets its stage moved onto the GPU first."""
    needs_real_gpu("device memory accounting and the GPU's own random streams")
    from model import GPT, GPTConfig

    from varuna_core import meta_init

    def build(**env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with meta_init():
            model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=256))
        x = torch.randint(0, 64, (4, 16))
        return Varuna(model, "0", {"idx": x, "targets": x}, batch_size=4, chunk_size=2, device=DEVICE, seed=5,
                      init=GPT.init_module)

    cold = {n: p.detach().cpu() for n, p in build().named_parameters()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    warm = build(VARUNA_HANDOVER="wait", VARUNA_SHELF_DIR="/dev/shm", VARUNA_JOB_ID="job-p",
                 VARUNA_JOB_TOKEN="t" * 32)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    size = sum(p.numel() * p.element_size() for p in warm.parameters())
    assert {p.device.type for p in warm.parameters()} == {"cpu"} and held < size / 4, (held, size)
    assert {n for n, p in warm.named_parameters() if not torch.equal(p.detach(), cold[n])} == set()
    params = list(warm.parameters())
    x = torch.randint(0, 64, (4, 16))
    loss = warm.evaluate({"idx": x, "targets": x})  # before any go: the stage moves where it computes first
    assert {p.device.type for p in warm.parameters()} == {"cuda"} and list(warm.parameters()) == params
    assert {n for n, p in warm.named_parameters() if not torch.equal(p.detach().cpu(), cold[n])} == set()
    assert loss > 0


def test_snapshots_of_gpu_state_are_whole_and_replace_each_other(tmp_path) -> None:
    """In-memory snapshots (``--snapshot-every``) of a CUDA run: each one publishes the state from the GPU through
    the pinned staging onto the host's shelf without stopping the run, the older one is dropped once the newer is
    whole, and a worker that takes the newest onto the GPU holds every tensor of that step and steps as the run
    does."""
    from varuna_core.worker.snapshots import Snapshots, step_of

    run, run_opt = _varuna(0, DEVICE)
    shelf = Shelf("gpu-snap", root=tmp_path / "shm")
    snaps = Snapshots(2, rank=0, host="here", shelf=shelf, server=None, job="j", token="t", attempt=1,
                      publish=lambda reserve, copies: run.publish_state(reserve, copies=copies),
                      all_gather=lambda obj: [obj])
    reports = []
    for step in range(4):
        if snaps.due(step):
            reports.append(snaps.take(step))
        train(run, run_opt, 1, lambda n, s, step=step: batch(n, step))
    assert snaps.due(4)
    reports.append(snaps.take(4))
    assert [r.step for r in reports if r is not None] == [2, 4] and all(r.held > 0 for r in reports if r)
    assert {step_of(n) for n in shelf.names()} - {None} == {4}  # step 2's blobs are gone
    saved = _state(run, run_opt)

    back, back_opt = _varuna(9, DEVICE)
    assert _take(back, shelf, 4, tmp_path / "shm") == 4
    assert {p.device.type for p in back.parameters()} == {DEVICE}
    assert [n for n, t in _state(back, back_opt).items() if not torch.equal(t, saved[n])] == []
    want, _ = run.step(batch(BATCH, 4))
    got, _ = back.step(batch(BATCH, 4))
    assert got == want
