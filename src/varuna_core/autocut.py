"""``cutpoints="auto"``: cut points between the blocks of a model that has none, without editing its code.

Most large models keep their repeated blocks in one ``nn.ModuleList`` (Hugging Face ``transformer.h``,
``encoder.layer``, ``model.layers``; torchtitan's ``layers``; nanoGPT's ``h``). The longest one (most
blocks; the most parameters among equally long ones) gets a ``CutPoint`` in front of every block but the
first, through a forward *pre-hook*: parameter names, ``state_dict`` keys and the model's own ``forward`` do not
change.

What crosses such a cut is everything the block is called with, not only the hidden state: in these models
the loop over the blocks also passes values computed once before it (the attention mask, rotary tables,
position ids), and a stage that starts in the middle of the loop did not compute them (their inputs there are
placeholders). So the cut carries the block's positional and keyword arguments; the later blocks of the same
stage, which are called with the stage's own placeholder copies of those values, get the received ones
instead. Arguments that cannot cross a process boundary (a key/value cache object) stay local. Tensors that do
not scale with the batch (rotary tables, ``cache_position``) cross whole with every micro-batch.

Tied weights (the embedding and the output head sharing one ``Parameter``) need no declaration: discovery
sees one object used in two segments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .cutpoint import CutPoint
from .errors import CutPointError

__all__ = ["apply_auto_cutpoints", "longest_module_list", "AUTO_ATTRIBUTE"]

log = logging.getLogger(__name__)

AUTO_ATTRIBUTE = "_varuna_auto_cuts"
_CONST = (type(None), bool, int, float, str)


def longest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """``(name, list)`` of the model's ``nn.ModuleList`` with the most entries (ties: the most parameters)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not name.endswith(AUTO_ATTRIBUTE) and len(module) > 0:
            key = (len(module), sum(p.numel() for p in module.parameters()))
            if best is None or key > best[0]:
                best = (key, name, module)
    return None if best is None else (best[1], best[2])


class _LoopState:
    """Per forward, from this stage's incoming cut (None before it, and on stage 0): the block arguments the
    stage had locally there, and those it received instead."""

    def __init__(self) -> None:
        self.local: list[Any] | None = None
        self.received: list[Any] | None = None


def apply_auto_cutpoints(model: nn.Module) -> list[str]:
    """Put a cut in front of every block of the longest ``ModuleList`` but the first (idempotent).

    Returns the names of the blocks a cut precedes.

    Raises:
        CutPointError: the model already has CutPoints of its own, or no ``ModuleList`` with two blocks.
    """
    if isinstance(getattr(model, AUTO_ATTRIBUTE, None), nn.ModuleList):
        return list(getattr(model, "_varuna_auto_blocks"))
    own = [n for n, m in model.named_modules() if isinstance(m, CutPoint)]
    if own:
        raise CutPointError(f"{type(model).__name__} already has CutPoints ({own[0]}, ...): cutpoints='auto' would "
                            f"add more", hint="use cutpoints='auto' only for models without CutPoints")
    found = longest_module_list(model)
    if found is None or len(found[1]) < 2:
        raise CutPointError(f"cutpoints='auto' found no nn.ModuleList of at least 2 blocks in {type(model).__name__}",
                            hint="insert CutPoint() calls between the model's blocks by hand")
    name, blocks = found
    cuts = nn.ModuleList(CutPoint() for _ in range(len(blocks) - 1))
    model.add_module(AUTO_ATTRIBUTE, cuts)
    state = _LoopState()

    def reset(module, args, kwargs):
        state.local = state.received = None

    blocks[0].register_forward_pre_hook(reset, with_kwargs=True)
    for cut, block in zip(cuts, list(blocks)[1:]):
        block.register_forward_pre_hook(_crossing(cut, state), with_kwargs=True)
    names = [f"{name}.{i}" for i in range(1, len(blocks))]
    object.__setattr__(model, "_varuna_auto_blocks", tuple(names))
    log.info("cutpoints='auto': %d cuts in front of the blocks of %s (%d blocks)", len(cuts), name or "the model",
             len(blocks))
    return names


def _crossing(cut: CutPoint, state: _LoopState):
    def pre_hook(module, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        local = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, (torch.Tensor, *_CONST))}
        carried = pytree.tree_unflatten([None if i in local else x for i, x in enumerate(leaves)], spec)
        out = cut(carried)
        out_leaves, out_spec = pytree.tree_flatten(out)
        if out is not carried:  # this stage's incoming cut: the block's arguments as the previous stage had them
            state.local, state.received = leaves, out_leaves
        elif state.received is not None:
            # A later block of the same stage. An argument that is the very object the loop passed to the block
            # at the incoming cut is loop-invariant (a mask, rotary tables): take the received value, as this
            # stage's own was computed from placeholders. The others (the hidden state) are this stage's.
            out_leaves = [r if x is y and isinstance(x, torch.Tensor) else x
                          for x, y, r in zip(out_leaves, state.local, state.received)]
        for i, leaf in local.items():
            out_leaves[i] = leaf
        new_args, new_kwargs = pytree.tree_unflatten(out_leaves, out_spec)
        return tuple(new_args), new_kwargs

    return pre_hook
