"""``cutpoints="auto"``: cut points between the blocks of a model that has none, without editing its code.

Most large models keep their repeated blocks in one ``nn.ModuleList`` (Hugging Face ``transformer.h``,
``encoder.layer``, ``model.layers``; torchtitan's ``layers``; nanoGPT's ``h``). The longest one (most
blocks; the most parameters among equally long ones) gets a ``CutPoint`` in front of every block but the
first, through a forward *pre-hook*: parameter names, ``state_dict`` keys and the model's own ``forward`` do not
change.

What crosses such a cut is what the loop carries from one block to the next: the arguments of the block that
are not the very objects the previous block was called with (the hidden state). The loop-invariant ones
(attention mask, rotary tables, position ids, a key/value cache object) were computed once before the loop
from the model's inputs, which every stage has: each stage computes its own. For that, a stage runs the code
before its incoming cut on real NaN-filled placeholders rather than ``meta`` ones (the prologue of these
models inspects values: a mask builder asks whether any position is padded, and leaves the mask out when
none is), and the pipeline is compared with the unsliced model at start-up (``validate``), which names the
cut if an invariant depended on another stage's values after all.

Tied weights (the embedding and the output head sharing one ``Parameter``) need no declaration: discovery
sees one object used in two segments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import CutPointError
from .cutpoint import CutPoint

__all__ = ["apply_auto_cutpoints", "longest_module_list", "AUTO_ATTRIBUTE"]

log = logging.getLogger(__name__)

AUTO_ATTRIBUTE = "_varuna_auto_cuts"


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
    """The flattened arguments of the previous block call of this forward (to tell loop-carried values from
    loop-invariant ones)."""

    def __init__(self) -> None:
        self.previous: list[Any] | None = None


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

    def first_block(module, args, kwargs):
        state.previous = pytree.tree_leaves((args, kwargs))

    blocks[0].register_forward_pre_hook(first_block, with_kwargs=True)
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
        previous, state.previous = state.previous, leaves
        if previous is None or len(previous) != len(leaves):
            raise CutPointError(f"cutpoints='auto': block {type(module).__name__} is called with other arguments "
                                f"than the block before it", hint="insert CutPoint() calls by hand")
        carried = [i for i, (x, y) in enumerate(zip(leaves, previous)) if isinstance(x, torch.Tensor) and x is not y]
        if not carried:
            raise CutPointError(f"cutpoints='auto': block {type(module).__name__} receives nothing from the block "
                                f"before it", hint="insert CutPoint() calls by hand")
        out = cut([leaves[i] for i in carried])
        if out is not None:
            for i, value in zip(carried, out):
                leaves[i] = value
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), new_kwargs

    return pre_hook
