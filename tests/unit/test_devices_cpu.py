"""The device paths that a CPU machine can check: a batch goes to the stage's device, the backend and the
collectives' tensors follow the device the stage computes on. (Run on a GPU by the GPU checks.)"""

from __future__ import annotations

import torch

from varuna_core.pipeline.groups import collective_device, ensure_process_group
from varuna_core.pipeline.microbatch import to_device


def test_a_batch_goes_to_the_stage_device_nested_values_too_and_other_values_stay() -> None:
    batch = {"ids": torch.ones(2, 3, dtype=torch.long), "pair": (torch.zeros(2), [torch.ones(1)]), "n": 7,
             "name": "x", "none": None}
    moved = to_device(batch, torch.device("meta"))  # any device other than the batch's shows the move
    assert moved["ids"].device.type == "meta" and moved["ids"].dtype == torch.long
    assert moved["pair"][0].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert moved["n"] == 7 and moved["name"] == "x" and moved["none"] is None
    assert batch["ids"].device.type == "cpu"  # the caller's batch is left alone
    same = to_device(batch, torch.device("cpu"))
    assert same["ids"] is batch["ids"]  # already there: not copied


def test_a_single_process_and_gloo_use_cpu_tensors_for_collectives(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert ensure_process_group(10, torch.device("cpu")) == (1, 0)
    assert collective_device() == torch.device("cpu")


def test_two_ranks_on_one_gpu_are_named() -> None:
    from varuna_core.pipeline.groups import shared_gpu

    assert shared_gpu([("a", "u0", "cuda:0"), ("a", "u1", "cuda:1"), ("b", "u0", "cuda:0")]) is None  # other host
    problem = shared_gpu([("a", "u0", "cuda:0"), ("a", "u1", "cuda:1"), ("a", "u0", "cuda:0")])
    assert problem == "ranks 0 and 2 would both compute on cuda:0 of host a, and NCCL needs one GPU per rank"
    assert "\x1b" not in shared_gpu([("h\x1b[2J", "u", "cuda:0")] * 2)


def test_messages_go_through_host_memory_only_for_a_gpu_under_gloo(monkeypatch) -> None:
    """gloo cannot send or receive CUDA tensors point to point: a GPU stage under gloo receives into host buffers
    and hands the value on on its device; a CPU stage, or NCCL, does not copy."""
    import torch.distributed as dist

    from varuna_core.pipeline import p2p

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert not p2p.staged_through_host(torch.device("cpu"))
    assert p2p.staged_through_host(torch.device("meta"))  # stands for a GPU: any device but the host's
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert not p2p.staged_through_host(torch.device("meta"))
    host = [torch.ones(2, 3)]
    assert p2p.Pending(host, [], 1, "activation").arrived() is host
    moved = p2p.Pending(host, [], 1, "activation", device=torch.device("meta")).arrived()
    assert moved[0].device.type == "meta" and moved[0].shape == (2, 3)
