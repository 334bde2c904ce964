"""One process plays every stage of a pipeline: each stage's slice of its own copy of the model runs one
micro-batch, the values crossing each cut are handed on (detached, as a receive would give them), and the
gradients go back the same way. For checking slicing (skips, stand-ins, ties) without processes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from varuna_core.ir.partition import Partition
from varuna_core.model.discovery import discover, extract_loss, make_batch_fn
from varuna_core.model.split import WeightGrads, splitting
from varuna_core.model.stage import StageSlice, find_tie_sets, weight_groups


def reference(make_model: Callable[[], nn.Module], inputs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients (by parameter name) of the unsliced model."""
    model = make_model()
    loss = extract_loss(model(**inputs))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def pipelined(make_model: Callable[[], nn.Module], ranges: list[tuple[int, int]], inputs: dict,
              placeholders: str = "meta", shared=None,
              split: list[WeightGrads] | None = None) -> tuple[float, dict[str, torch.Tensor], list[StageSlice]]:
    """Loss and gradients of the model cut into stages of segment ranges ``ranges`` (tied copies summed). With
    ``split`` (a list), each stage's forward runs under ``splitting`` with a store appended to it, whose W runs
    right after the stage's backward."""
    probe = make_model()
    fn, dims = make_batch_fn(inputs, None)
    structure = discover(probe, fn, dims, use_cache=False)
    partition = Partition.from_ranges(ranges, structure.num_segments)
    n = next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor))
    stages, outs, ins = [], [], []
    value = None
    for s in range(partition.num_stages):
        model = make_model()
        ties = find_tie_sets(model, structure, partition, weight_groups(model, shared))
        stage = StageSlice(model, structure, partition, s, ties, torch.device("cpu"), placeholders=placeholders)
        received = None
        if value is not None:
            received = pytree.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point())
                                       if isinstance(t, torch.Tensor) else t, value)
        if split is None:
            out = stage.forward(inputs, received, n)
        else:
            split.append(WeightGrads())
            with splitting(split[-1]):
                out = stage.forward(inputs, received, n)
        stages.append(stage)
        ins.append(received)
        outs.append(out)
        value = out
    loss = outs[-1]
    loss.backward()
    if split is not None:
        split[-1].run()
    for s in range(len(stages) - 2, -1, -1):
        sent = [t for t in pytree.tree_leaves(outs[s]) if isinstance(t, torch.Tensor)]
        got = [t for t in pytree.tree_leaves(ins[s + 1]) if isinstance(t, torch.Tensor)]
        pairs = [(o, g.grad if g.grad is not None else torch.zeros_like(g)) for o, g in zip(sent, got, strict=True)
                 if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if split is not None:
            split[s].run()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        canonical = {name: tie.canonical for tie in stage.ties for name in tie.names}
        for name, param in stage.named_parameters():
            if param.grad is not None:
                tied = name in canonical
                name = canonical.get(name, name)
                assert tied or name not in grads, f"{name} is held by two stages but is no tie set"
                grads[name] = grads[name] + param.grad if name in grads else param.grad.clone()
    return loss.item(), grads, stages
