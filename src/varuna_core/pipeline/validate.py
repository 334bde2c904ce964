"""Start-up validation: does the sliced pipeline compute what the unsliced model computes?

:func:`reference_run` records the unsliced model's value at every cut and its loss on the dummy inputs (before
slicing); :func:`check_slicing` runs the sliced pipeline on the same inputs, compares each stage's output and
names, on every rank, the first cut where they differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ConfigError, CutPointError
from ..ir.partition import Partition
from ..model.discovery import Structure
from .executor import PipelineExecutor
from .groups import agree_started, collective_device
from .microbatch import batch_size_of

__all__ = ["reference_run", "check_slicing"]


def reference_run(model: nn.Module, dummy_inputs: Any, batch_fn: Callable[[int], dict],
                  chunk_size: int, values: Any = None, *, rng: tuple[int, int] | None = None,
                  device: torch.device | None = None) -> tuple[dict, list, torch.Tensor]:
    """The unsliced model's value at each cut and its loss on the dummy inputs (no grad, in the model's mode: the
    one discovery saw). A model built on meta runs with ``values``
    (:class:`~varuna_core.model.lazy_values.ValueSource`), made as each op reads them. ``rng`` ``(seed, step)``
    seeds each segment as a stage seeds micro-batch 0's (so dropout in training mode draws the pipeline's masks);
    the random stream and every buffer are as before afterwards."""
    from ..model.buffer_writes import WriteWatch
    from ..model.cutpoint import CutPoint, find_cutpoints
    from ..model.discovery import _quiet_run, extract_loss
    from ..model.lazy_values import on_touch
    from ..model.rng import seed_segment, segment_seed

    inputs = dict(dummy_inputs) if isinstance(dummy_inputs, Mapping) else batch_fn(chunk_size)
    at_cuts: list[Any] = []
    cuts = find_cutpoints(model)

    where = device if device is not None else torch.device("cpu")

    def seed(segment: int) -> None:
        if rng is not None:
            seed_segment(where, segment_seed(rng[0], rng[1], 0, segment))

    def record(cut: CutPoint, value: Any) -> Any:
        at_cuts.append(torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value))
        seed(len(at_cuts))
        return value

    for cut in cuts.values():
        cut.set_hook(record)
    try:
        with WriteWatch(model), _quiet_run(model), on_touch(model, values):
            seed(0)
            output = extract_loss(model(**inputs))
            if output is None:  # discovery refused such a model already
                raise ConfigError("the model's forward must return the loss as a scalar tensor")
            loss = output.detach().clone()
    finally:
        for cut in cuts.values():
            cut.set_hook(None)
    return inputs, at_cuts, loss


def check_slicing(executor: PipelineExecutor, module: nn.Module, structure: Structure, partition: Partition,
                  stage: int, *, is_last: bool, input_batch_dims: Mapping[str, Any], world_size: int,
                  reference: tuple[dict, list, torch.Tensor], rng: tuple[int, int] | None = None) -> None:
    """Run the sliced pipeline on the reference's inputs and compare each stage's output with the unsliced
    model's (collective); raise :class:`~varuna_core.errors.CutPointError` naming the first differing cut. Runs
    in the model's mode with the reference's ``rng``; leaves the buffers and the random stream as they were."""
    inputs, cut_values, loss = reference
    captured: list = []
    n = batch_size_of(inputs, input_batch_dims)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), executor.stage.buffer_writes.kept():
            executor.run([inputs], [n], [1.0], train=False, capture=captured, rng=rng)
    except Exception as exc:  # the next stage waits for this one's value, the others at the agreement below
        executor.release_next(n)
        agree_started(exc, rank=dist.get_rank() if world_size > 1 else 0, world_size=world_size, first_wins=True)
        raise
    agree_started(None, rank=dist.get_rank() if world_size > 1 else 0, world_size=world_size, first_wins=True)
    if is_last:
        want = [loss]
        index = len(structure.cut_names)
    else:
        index = partition.segments(stage).stop - 1
        want = [t for t in torch.utils._pytree.tree_leaves(cut_values[index]) if isinstance(t, torch.Tensor)]
    got = captured[0]
    if not is_last:  # the skipped tensors crossing with the cut's value follow it
        carried = len(structure.skips_across(index))
        got = got[:len(got) - carried] if carried and len(got) == len(want) + carried else got
    ok = len(got) == len(want) and all(
        torch.allclose(g.to(w.device).float(), w.float(), rtol=1e-4, atol=1e-5) for g, w in zip(got, want, strict=True)
    )
    flag = torch.tensor([index if not ok else 10**9], dtype=torch.int64, device=collective_device())
    if world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    bad = int(flag.item())
    if bad < 10**9:
        name = "the loss" if bad == len(structure.cut_names) else f"CutPoint {structure.cut_names[bad]!r}"
        raise CutPointError(
            f"validation failed: the sliced pipeline's value at {name} differs from the unsliced model's",
            hint="the stage ending there depends on state not passed through its incoming CutPoint "
            "(e.g. a value computed on an earlier stage); route it through the CutPoint",
        )
