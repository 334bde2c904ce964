"""Worker for ``tests/dist/test_small_sums.py``: the step's small sums and the tied weights' swaps
([Note: hops of small sums] in ``varuna_core.pipeline.grads``) on three ranks, against gloo's all-reduce."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tests.dist.worker import main
from varuna_core.pipeline.grads import PairSum, _SMALL_SUM, post_tie_sum, sum_small, tie_tag
from varuna_core.pipeline.p2p import wait_all


def values(rank: int) -> torch.Tensor:
    """Float64 numbers whose sum depends on the order of addition (large magnitudes cancelling)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, generator=g, dtype=torch.float64) * torch.tensor([1e16, 1, 1e8, 1e-8, 3, 1e16],
                                                                           dtype=torch.float64)


def run_one(run: dict, spec: dict) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 2])  # collective: every rank makes it
    out: dict = {"rank": rank}

    small = values(rank)
    sum_small(small, None, timeout=30, describe=lambda: "small sum")
    out["small"] = small
    want = values(0).clone()
    for r in range(1, world):
        want += values(r)
    out["small_want"] = want  # rank order, as every rank adds them

    large = torch.full((_SMALL_SUM + 1,), float(rank + 1), dtype=torch.float32)
    sum_small(large, None, timeout=30, describe=lambda: "large sum")  # an all-reduce
    out["large"] = large

    if rank in (0, 2):
        g = torch.Generator().manual_seed(10 + rank)
        grad = torch.randn(4160, generator=g) * 1e3
        flat = torch.zeros(5000)
        view = flat[100:100 + grad.numel()]  # a view of a flat buffer, as a tied weight's gradient is
        view.copy_(grad)
        work = post_tie_sum(view, pair, tie_tag("wte.weight"))
        out["pair_kind"] = torch.tensor(isinstance(work, PairSum))
        out["pair_done_before_wait"] = torch.tensor(work.is_completed())
        wait_all([work], timeout=30, describe=lambda: "tie swap", peer=None)
        out["pair_done"] = torch.tensor(work.is_completed())
        out["pair"] = view.clone()
        out["pair_same_storage"] = torch.tensor(flat[100:100 + grad.numel()].data_ptr() == view.data_ptr()
                                                and torch.equal(flat[100:100 + grad.numel()], view))
        reference = grad.clone()
        dist.all_reduce(reference, group=pair)
        out["pair_ring"] = reference
    whole = post_tie_sum(torch.ones(3), None, 7)  # three ranks: an all-reduce
    out["three_kind"] = torch.tensor(isinstance(whole, PairSum))
    wait_all([whole], timeout=30, describe=lambda: "three", peer=None)
    dist.barrier()
    return out


if __name__ == "__main__":
    main(run_one)
