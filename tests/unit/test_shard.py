"""The layout of a sharded optimizer (``varuna_core.pipeline.shard``): every element of every parameter owned by
exactly one replica, each replica's piece a box of the parameter, ranges even up to a row; which optimizers can
be sharded; and ``shard_optimizer`` in one process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna, register_elementwise_optimizer
from varuna_core.errors import ConfigError
from varuna_core.pipeline.shard import ELEMENTWISE, ShardLayout, check_shardable

SHAPES = [(), (1,), (7,), (5, 3), (1, 9), (1, 1, 4), (3, 1, 2), (0, 4), (64, 16), (2, 3, 4, 5)]


def _params(shapes) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(s)) for s in shapes]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_every_element_is_owned_by_exactly_one_replica_as_a_box(dp, order) -> None:
    shapes = list(itertools.islice(itertools.cycle(SHAPES), order, order + len(SHAPES)))
    params = _params(shapes)
    owners = [torch.zeros(p.shape, dtype=torch.int64) for p in params]
    total = sum(p.numel() for p in params)
    for replica in range(dp):
        layout = ShardLayout([params], dp, replica)
        bounds = layout.bounds[0]
        assert bounds[0] == 0 and bounds[-1] == total and bounds == sorted(bounds)
        for p, piece in layout.owned():
            box = piece.of(p.detach())
            assert box.is_contiguous() and box.data_ptr() == p.data_ptr() + (piece.flat_start - _offset(params, p)) * 4
            assert box.numel() == piece.numel > 0
            piece.of(owners[_index(params, p)]).add_(1)
            start = piece.offsets(p.dim())
            assert len(start) == p.dim()
    for p, owned in zip(params, owners, strict=True):
        assert bool((owned == 1).all()), (list(p.shape), owned)


def _index(params, p) -> int:
    return next(i for i, q in enumerate(params) if q is p)


def _offset(params, p) -> int:
    return sum(q.numel() for q in params[: _index(params, p)])


def test_ranges_are_even_up_to_a_row_at_each_boundary() -> None:
    params = _params([(100, 32), (32,), (50, 32)])
    total = sum(p.numel() for p in params)
    for dp in (2, 3, 4, 8):
        bounds = ShardLayout([params], dp, 0).bounds[0]
        for r in range(1, dp):
            assert abs(bounds[r] - r * total / dp) <= 32 / 2 + 1, (dp, bounds)


def test_a_replica_may_own_nothing_of_a_small_stage() -> None:
    params = _params([(2, 3)])
    layouts = [ShardLayout([params], 4, r) for r in range(4)]
    assert sum(len(layout.pieces) for layout in layouts) == 2  # two rows, four replicas
    assert sorted(layout.pieces[0].length for layout in layouts if layout.pieces) == [1, 1]


def test_each_flat_buffer_is_split_on_its_own() -> None:
    f32, f64 = _params([(8, 2)]), [nn.Parameter(torch.zeros(6, 2, dtype=torch.float64))]
    layout = ShardLayout([f32, f64], 2, 1)
    assert layout.bounds == [[0, 8, 16], [0, 6, 12]]
    assert [(p.dtype, piece.start, piece.length) for p, piece in layout.owned()] == \
        [(torch.float32, 4, 4), (torch.float64, 3, 3)]


def test_only_element_wise_optimizers_are_sharded() -> None:
    ps = _params([(3,)])
    for cls in ELEMENTWISE:
        check_shardable(cls(ps, lr=0.1) if cls is not torch.optim.SGD else cls(ps, lr=0.1, momentum=0.9))
    with pytest.raises(ConfigError, match=r"LBFGS.*not known to be element-wise") as info:
        check_shardable(torch.optim.LBFGS(ps))
    assert "shard_optimizer=False" in info.value.hint

    class Mine(torch.optim.AdamW):  # a subclass may change the update: refused until declared
        pass

    with pytest.raises(ConfigError, match="Mine"):
        check_shardable(Mine(ps))
    register_elementwise_optimizer(Mine)
    check_shardable(Mine(ps))
    with pytest.raises(ConfigError, match="Optimizer subclass"):
        register_elementwise_optimizer(dict)


def test_shard_optimizer_in_one_process_changes_nothing_but_refuses_what_it_cannot_shard() -> None:
    """With one replica there is nothing to shard: the run is the unsharded run, bit for bit. An optimizer that
    could not be sharded is refused all the same (the script may run with replicas next)."""
    runs = []
    for shard in (True, False):
        torch.manual_seed(0)
        vm = Varuna(ToyLM(), "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED,
                    shard_optimizer=shard)
        opt = torch.optim.AdamW(vm.parameters(), lr=1e-2)
        vm.set_optimizer(opt)
        for step in range(2):
            vm.step(batch(8, seed=step))
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in vm.parameters()])
        if shard:
            with pytest.raises(ConfigError, match="LBFGS"):
                vm.set_optimizer(torch.optim.LBFGS(vm.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_shard_optimizer_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="shard_optimizer must be True, False or None"):
        Varuna(ToyLM(), "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED, shard_optimizer="yes")


def test_a_box_is_never_taken_for_a_whole_tensor_a_replica_could_copy() -> None:
    """A replica keeps copies of its mates' handover files written from its own tensors; a sharded optimizer's box
    of the same size and dtype as a mate's box at offset 0 must not pass for it (it holds other elements)."""
    from varuna_core.checkpoint.chunks import chunk
    from varuna_core.checkpoint.handover import _whole

    mine = chunk(torch.zeros(2, 3), (2, 0), (4, 3))  # rows 2-3 of a 4x3 state; a mate holds rows 0-1
    assert not _whole(mine, [0, 0], 2 * 3 * 4)
    assert _whole(torch.zeros(4, 3), [0, 0], 4 * 3 * 4)
