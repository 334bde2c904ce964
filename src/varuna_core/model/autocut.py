"""``cutpoints="auto"``: cut points between the blocks of a model that has none, without editing its code.

Most large models keep their repeated blocks in an ``nn.ModuleList`` (Hugging Face ``transformer.h``,
``encoder.layer``, ``model.layers``; torchtitan's ``layers``; nanoGPT's ``h``), some in an ``nn.Sequential``
of repeated blocks (vision models, hand-written stacks), and encoder–decoders in two of them. Every such stack
(:func:`block_stacks`: the longest ``ModuleList``, and any other stack holding a tenth of the parameters) gets a
``CutPoint`` in front of every block but its first, through a forward *pre-hook*: parameter names,
``state_dict`` keys and the model's own ``forward`` do not change. In a stack other than the one holding the
most parameters, a block that carries nothing from the block before it (heads run side by side) gets no cut.

What crosses such a cut is what the loop carries from one block to the next: the arguments of the block that
are not the very objects an earlier block was called with in the same place (the hidden state; see [Note:
loop-carried]). The loop-invariant ones
(attention mask, rotary tables, position ids, a key/value cache object) were computed once before the loop
from the model's inputs, which every stage has: each stage computes its own. For that, a stage runs the code
before its incoming cut on real NaN-filled placeholders rather than ``meta`` ones (the prologue of these
models inspects values: a mask builder asks whether any position is padded, and leaves the mask out when
none is), and the pipeline is compared with the unsliced model at start-up (``validate``), which names the
cut if an invariant depended on another stage's values after all.

Tied weights (the embedding and the output head sharing one ``Parameter``) need no declaration: discovery
sees one object used in two segments.

A model without a stack may reuse one module's weights across depth (ALBERT calls its one layer group once per
layer; a Universal Transformer its block): :func:`repeated_module` watches one dry forward (discovery's
:func:`~varuna_core.model.discovery.dry_forward`: no gradients, forked RNG, buffers and train/eval flags left as
they were) for the outermost module holding parameters that it calls the most times, at least twice, one call
after another. A cut goes in front of every call but the first, through a pre-hook on the module that counts its
calls within one forward (a pre-hook on the model starts the count) and decides what crosses as between the
blocks of a stack (:func:`_crossing`). The module's parameters are then read in every segment: discovery makes
them one weight tied over the stages that call it, each stage runs its own calls and stands in for the others'
(:class:`~varuna_core.model.stage.StageSlice` stubs per call), and the copies' gradients are summed after the
pipeline. A forward that calls the module more often than there are cuts is a :class:`CutPointError`.

On one stage no cut is needed: a model with neither (``stages=1``) gets none and trains as one segment.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import CutPointError
from .cutpoint import CutPoint

__all__ = ["apply_auto_cutpoints", "block_stacks", "longest_module_list", "repeated_module",
           "survey_auto_cuts", "follow_auto_cuts", "AUTO_ATTRIBUTE"]

log = logging.getLogger(__name__)

AUTO_ATTRIBUTE = "_varuna_auto_cuts"
_AUTO_BLOCKS = "_varuna_auto_blocks"  # the names of the blocks a cut precedes
_AUTO_LOOPS = "_varuna_auto_loops"  # per stack: its _LoopState and the names of its cuts, in call order

Stack = nn.ModuleList | nn.Sequential


def longest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """``(name, list)`` of the model's ``nn.ModuleList`` with the most entries (ties: the most parameters)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not name.endswith(AUTO_ATTRIBUTE) and len(module) > 0:
            key = (len(module), sum(p.numel() for p in module.parameters()))
            if best is None or key > best[0]:
                best = (key, name, module)
    return None if best is None else (best[1], best[2])


MIN_STACK_SHARE = 0.1  # of the model's parameters: smaller lists (heads, adapters) are not block stacks


def block_stacks(model: nn.Module) -> list[tuple[str, Stack]]:
    """The model's stacks of blocks, in registration order: the longest ``nn.ModuleList`` (see
    :func:`longest_module_list`), and every other ``nn.ModuleList`` of at least 2 entries or ``nn.Sequential``
    of at least 2 children of one class (each holding parameters) that holds at least
    :data:`MIN_STACK_SHARE` of the parameters and does not sit inside a block of another stack (an encoder's
    and a decoder's layers; a vision model's stages)."""
    total = sum(p.numel() for p in model.parameters()) or 1
    primary = longest_module_list(model)
    found: list[tuple[str, Stack]] = []
    for name, module in model.named_modules():
        if name.endswith(AUTO_ATTRIBUTE) or any(name.startswith(f"{outer}.") if outer else True
                                                for outer, _ in found):
            continue
        if primary is not None and module is primary[1]:
            found.append((name, primary[1]))
        elif _is_stack(module) and sum(p.numel() for p in module.parameters()) >= MIN_STACK_SHARE * total:
            found.append((name, module))
    if primary is not None and all(m is not primary[1] for _, m in found):  # nested in a Sequential stack
        found = [(n, m) for n, m in found if not primary[0].startswith(f"{n}.")] + [primary]
    return found


def _is_stack(module: nn.Module) -> TypeGuard[Stack]:
    if isinstance(module, nn.ModuleList):
        children = list(module)
    elif type(module) is nn.Sequential:
        children = list(module)
        if len({type(c) for c in children}) != 1:
            return False
    else:
        return False
    return len(children) >= 2 and all(any(True for _ in c.parameters()) for c in children)


class _LoopState:
    """Which arguments of each block the loop carries from the block before it, for one stack.

    ``strict``: a block that carries nothing from the one before is an error (the stack with the most
    parameters); otherwise its cut is left out (entries that do not run one after another, heads side by side).

    [Note: loop-carried] A tensor argument is *loop-invariant* when another block of the same forward is given
    the very same object in the same place: a mask, rotary table or position ids computed once before the loop,
    which every stage computes for itself. Anything else is *carried*: what the previous block produced (the
    hidden state). Comparing with the previous block only is not enough: layers of several types (full and
    sliding attention, as Gemma's and ModernBERT's) take one of several masks by type, so a sliding layer after a
    full one would count its mask (``[b, 1, s, s]``) as carried, and send it, and the next sliding layer would
    not. And comparing with the earlier blocks only still sends a mask where it is first used. So the decision
    is made once, over a whole forward (:func:`survey_auto_cuts`, from discovery): per block call, the places
    whose object no other call gets. Until then (a forward before discovery), an argument counts as invariant
    when an earlier call got it in the same place. Both compare the arguments as the blocks were called, before
    a cut replaced them with received values, and hold weak references only (a no-grad forward must not keep
    every hidden state alive)."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.frozen: dict[int, tuple[int, ...]] | None = None  # per call index: the carried places
        self.count: int | None = None  # leaves per call (None before the first block of a forward)
        self.index = 0  # the call index of the current block within this forward
        self._seen: list[dict[int, tuple[weakref.ref, list[int]]]] = []  # per place: tensor -> (ref, its calls)
        self._history: list[list[list[int] | None]] = []  # per call, per place: the calls that got its tensor

    def start(self, leaves: list[Any]) -> None:
        """The stack's first block is called: a new forward."""
        self.count, self.index = len(leaves), 0
        self._seen = [{} for _ in leaves]
        self._history = []
        self._record(leaves)

    def carried(self, leaves: list[Any]) -> list[int] | None:
        """The places of ``leaves`` that the current block's cut carries (see [Note: loop-carried]); ``None`` if
        this call's arguments do not line up with the other calls' (another number of leaves, no first call)."""
        if self.count is None or len(leaves) != self.count:
            return None
        self.index += 1
        if self.frozen is not None:
            places = self.frozen.get(self.index)
            return None if places is None else list(places)
        carried = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and self._first_time(i, x)]
        self._record(leaves)
        return carried

    def decide(self) -> dict[int, tuple[int, ...]]:
        """After a whole forward: per call index ≥ 1, the tensor places whose object no other call got."""
        return {k: tuple(place for place, calls in enumerate(row) if calls is not None and len(calls) == 1)
                for k, row in enumerate(self._history) if k >= 1}

    def _first_time(self, i: int, x: torch.Tensor) -> bool:
        """Whether no earlier call got ``x`` at place ``i``."""
        entry = self._seen[i].get(id(x))
        return entry is None or entry[0]() is not x  # an id may be reused by a new tensor once the old one is freed

    def _record(self, leaves: list[Any]) -> None:
        row: list[list[int] | None] = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                row.append(None)
                continue
            entry = self._seen[i].get(id(x))
            if entry is None or entry[0]() is not x:
                entry = (weakref.ref(x), [])
                self._seen[i][id(x)] = entry
            entry[1].append(self.index)
            row.append(entry[1])
        self._history.append(row)


def apply_auto_cutpoints(model: nn.Module, dry_run: Callable[[], Any] | None = None, *,
                         stages: int | None = None) -> list[str]:
    """Put a cut in front of every block but the first of each block stack (see :func:`block_stacks`), or, in a
    model without one, in front of every call but the first of the module its forward calls repeatedly (see
    :func:`repeated_module`; found by watching ``dry_run``). Idempotent.

    Args:
        model: a model without CutPoints.
        dry_run: runs the model's forward once on example inputs, leaving it as it was (discovery's
            :func:`~varuna_core.model.discovery.dry_forward`); needed only for a model without a block stack.
        stages: the pipeline depth, if known. A single stage needs no cut: a model with nothing to cut then gets
            none (one segment) instead of an error.

    Returns the names of the blocks a cut precedes (``name#k`` for the ``k``-th call, from 0, of a module called
    repeatedly); empty when a single stage got no cut.

    Raises:
        CutPointError: the model already has CutPoints of its own, or (with more than one stage, or ``stages``
            unknown) neither a stack of at least two blocks nor a module called at least twice.
    """
    if isinstance(getattr(model, AUTO_ATTRIBUTE, None), nn.ModuleList):
        return list(getattr(model, _AUTO_BLOCKS))
    own = [n for n, m in model.named_modules() if isinstance(m, CutPoint)]
    if own:
        raise CutPointError(f"{type(model).__name__} already has CutPoints ({own[0]}, ...): cutpoints='auto' would "
                            f"add more", hint="use cutpoints='auto' only for models without CutPoints")
    stacks = [(name, blocks) for name, blocks in block_stacks(model) if len(blocks) >= 2]
    if not stacks:
        repeated = repeated_module(model, dry_run) if dry_run is not None else None
        if repeated is not None:
            return _cut_calls(model, *repeated)
        if stages == 1:
            log.info("cutpoints='auto': %s has no block stack and no module called repeatedly; one stage needs no "
                     "cut", type(model).__name__)
            return []
        repeats = " nor a module with parameters that its forward calls at least twice" if dry_run is not None else ""
        raise CutPointError(f"cutpoints='auto' found no block stack (an nn.ModuleList, or an nn.Sequential of "
                            f"repeated blocks) of at least 2 blocks{repeats} in {type(model).__name__}",
                            hint="insert CutPoint() calls between the model's blocks by hand, or train it on one "
                                 "stage")
    main = max((blocks for _, blocks in stacks), key=lambda b: sum(p.numel() for p in b.parameters()))
    cut_points = [CutPoint() for _, blocks in stacks for _ in range(len(blocks) - 1)]
    model.add_module(AUTO_ATTRIBUTE, nn.ModuleList(cut_points))
    names: list[str] = []
    loops: list[tuple[_LoopState, list[str]]] = []
    first_cut = 0
    called: set[int] = set()  # the stacks' blocks called in the current forward of the model
    model.register_forward_pre_hook(lambda root, args: called.clear())
    for name, blocks in stacks:
        state = _LoopState(strict=blocks is main)
        cut_indices = range(first_cut, first_cut + len(blocks) - 1)
        first_cut += len(blocks) - 1
        loops.append((state, [f"{AUTO_ATTRIBUTE}.{j}" for j in cut_indices]))
        prefix = f"{name}." if name else ""
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(_once_per_forward(f"{prefix}{i}", len(blocks), called))
        blocks[0].register_forward_pre_hook(_entering(state), with_kwargs=True)
        for block, j in zip(list(blocks)[1:], cut_indices, strict=True):
            block.register_forward_pre_hook(_crossing(cut_points[j], state), with_kwargs=True)
        names += [f"{prefix}{i}" for i in range(1, len(blocks))]
    object.__setattr__(model, _AUTO_BLOCKS, tuple(names))
    object.__setattr__(model, _AUTO_LOOPS, tuple(loops))
    log.info("cutpoints='auto': %d cuts in front of the blocks of %s", len(cut_points),
             ", ".join(f"{name or 'the model'} ({len(blocks)} blocks)" for name, blocks in stacks))
    return names


def survey_auto_cuts(model: nn.Module, run: Callable[[], object]) -> dict[str, tuple[int, ...]]:
    """Decide, over one whole forward (``run()``, a dry run), what each automatic cut carries (see [Note:
    loop-carried]), and keep to it from now on. Returns per cut name the places of its block's arguments it
    carries (flattened as ``pytree.tree_leaves((args, kwargs))``), for :func:`follow_auto_cuts` to apply to the
    same model elsewhere (discovery keeps it in its cached structure). ``{}`` for a model without auto cuts."""
    loops = getattr(model, _AUTO_LOOPS, ())
    if not loops:
        return {}
    for state, _ in loops:
        state.frozen, state.count = None, None
    run()
    carried: dict[str, tuple[int, ...]] = {}
    for state, cut_names in loops:
        for k, places in state.decide().items():
            if k - 1 < len(cut_names):
                carried[cut_names[k - 1]] = places
    follow_auto_cuts(model, carried)
    return carried


def follow_auto_cuts(model: nn.Module, carried: Mapping[str, Sequence[int]]) -> None:
    """Make the automatic cuts carry the places ``carried`` gives (from :func:`survey_auto_cuts`)."""
    for state, cut_names in getattr(model, _AUTO_LOOPS, ()):
        state.frozen = {k: tuple(carried[name]) for k, name in enumerate(cut_names, start=1) if name in carried}


def _once_per_forward(name: str, blocks: int, called: set[int]):
    """The pre-hook that refuses a block of a stack called twice in one forward: its weights are reused across
    depth (ALBERT with several layer groups), and a cut in front of each block would be crossed several times."""
    def pre_hook(module, args):
        if id(module) in called:
            raise CutPointError(f"cutpoints='auto': block {name!r} of a stack of {blocks} is called more than once "
                                f"in one forward (its weights are reused across depth)",
                                hint="a model that reuses one module at every depth is cut between its calls "
                                     "(keep one block in the list); otherwise insert CutPoint() calls by hand")
        called.add(id(module))

    return pre_hook


def _entering(state: _LoopState):
    """The pre-hook of the first block of a chain: what it is called with is what the next one is compared to."""
    def pre_hook(module, args, kwargs):
        state.start(pytree.tree_leaves((args, kwargs)))

    return pre_hook


def repeated_module(model: nn.Module, dry_run: Callable[[], Any]) -> tuple[str, nn.Module, int] | None:
    """``(name, module, calls)``: the module holding parameters that one forward (``dry_run``) calls the most
    times, at least twice, each call returning before the next starts (ties: the one holding the most parameters,
    then the outermost); None if there is none. ALBERT's one layer group, called at every depth; a Universal
    Transformer's block."""
    watched: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        if module is not model and not isinstance(module, CutPoint) and any(True for _ in module.parameters()):
            watched.setdefault(id(module), (name, module))
    calls: dict[int, int] = {}
    running: dict[int, int] = {}
    nested: set[int] = set()

    def enter(module, args):
        key = id(module)
        if running.get(key, 0):
            nested.add(key)  # called again inside its own call: not one call after another
        running[key] = running.get(key, 0) + 1
        calls[key] = calls.get(key, 0) + 1

    def leave(module, args, output):
        running[id(module)] -= 1

    handles = []
    try:
        for _, module in watched.values():
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
        dry_run()
    finally:
        for handle in handles:
            handle.remove()
    candidates = [(count, sum(p.numel() for p in watched[key][1].parameters()), -watched[key][0].count("."), key)
                  for key, count in calls.items() if count >= 2 and key not in nested]
    if not candidates:
        return None
    count, _, _, key = max(candidates, key=lambda c: c[:3])
    name, module = watched[key]
    return name, module, count


def _cut_calls(model: nn.Module, name: str, module: nn.Module, count: int) -> list[str]:
    """A cut in front of every call but the first of ``module`` within one forward of ``model``: a pre-hook on the
    model starts the count of each forward, and the module's pre-hook takes the cut of its call. What crosses is
    decided as between the blocks of a stack (:func:`_crossing`). Its parameters are one weight used by every
    stage that calls it: discovery sees them read in every segment, so they are tied over those stages."""
    cut_points = [CutPoint() for _ in range(count - 1)]
    model.add_module(AUTO_ATTRIBUTE, nn.ModuleList(cut_points))
    state = _LoopState(strict=True)
    first = _entering(state)
    crossings = [_crossing(cut, state) for cut in cut_points]
    seen = [0]  # calls of the module in the current forward of the model

    def start(root, args):
        seen[0] = 0
        state.count = None

    def call(called, args, kwargs):
        index, seen[0] = seen[0], seen[0] + 1
        if index == 0:
            return first(called, args, kwargs)
        if index > len(crossings):
            raise CutPointError(f"cutpoints='auto': {type(model).__name__}'s forward calls {name or 'the model'} "
                                f"more than the {count} times it did when the cuts were placed",
                                hint="the number of calls must not depend on the inputs; insert CutPoint() calls "
                                     "by hand")
        return crossings[index - 1](called, args, kwargs)

    model.register_forward_pre_hook(start)
    module.register_forward_pre_hook(call, with_kwargs=True)
    names = [f"{name}#{k}" for k in range(1, count)]
    object.__setattr__(model, _AUTO_BLOCKS, tuple(names))
    object.__setattr__(model, _AUTO_LOOPS, ((state, [f"{AUTO_ATTRIBUTE}.{j}" for j in range(count - 1)]),))
    log.info("cutpoints='auto': no block stack; %d cuts in front of the calls of %s (called %d times per forward, "
             "its weights tied over the stages that call it)", len(cut_points), name, count)
    return names


def _crossing(cut: CutPoint, state: _LoopState):
    def pre_hook(module, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        carried = state.carried(leaves)
        if not carried and not state.strict:
            return None  # not a chain of blocks: no cut here (discovery lists the cut as never called)
        if carried is None:
            raise CutPointError(f"cutpoints='auto': block {type(module).__name__} is called with other arguments "
                                f"than the block before it", hint="insert CutPoint() calls by hand")
        if not carried:
            raise CutPointError(f"cutpoints='auto': block {type(module).__name__} receives nothing from the block "
                                f"before it", hint="insert CutPoint() calls by hand")
        out = cut([leaves[i] for i in carried])
        if out is not None:
            # a stage's incoming cut returns the value discovery recorded crossing it, which may hold fewer
            # tensors than the arguments that changed since the previous block here (T5's position bias, which
            # the stage computes itself): those first ones are replaced, the rest stay this stage's own
            for i, value in zip(carried, out, strict=False):
                leaves[i] = value
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), new_kwargs

    return pre_hook
