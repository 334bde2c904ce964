"""The step's small sums (an all-gather added in rank order) and a tied weight's swap between its two stages
([Note: hops of small sums]): the same bits on every rank; the swap gives the bits of gloo's all-reduce and keeps
the gradient a view of its buffer; large tensors and groups of three keep the all-reduce."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_small_sums_and_tie_swaps(tmp_path) -> None:
    results = run_ranks({"runs": [{}]}, 3, tmp_path, timeout=120.0, worker="tests.dist.sums_worker")
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    runs = [res.result["runs"][0] for res in results]
    for got in runs:
        assert torch.equal(got["small"], runs[0]["small"]), "the small sum differs between ranks"
        assert torch.equal(got["small"], got["small_want"]), "the small sum is not the rank-order sum"
        assert torch.equal(got["large"], torch.full_like(got["large"], 6.0))
        assert not bool(got["three_kind"])
    ends = [runs[0], runs[2]]
    for got in ends:
        assert bool(got["pair_kind"]) and not bool(got["pair_done_before_wait"]) and bool(got["pair_done"])
        assert bool(got["pair_same_storage"])
        assert torch.equal(got["pair"], got["pair_ring"]), "the swap's sum is not the all-reduce's, bit for bit"
    assert torch.equal(ends[0]["pair"], ends[1]["pair"])
    assert "pair" not in runs[1]
