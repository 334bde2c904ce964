"""Skip connections across cuts: finding the tensors that must be carried, and the values that then cross.

[Note: skip routing] A tensor computed in one segment and read in a later one that the cuts do not carry (the
encoder's output read by every decoder block, a U-Net's down-path features, a position bias computed by the
first block and shared by the others) would be a placeholder on the later stage. The dry run finds every such
tensor, and the stages in between carry it next to the cut's value (and its gradient back).

What can be carried is named by where a stage can put it back: an *origin*.

* The output leaves of a module call that runs within one segment (``module``, call index, leaf). A later
  stage stands a placeholder in for that call (see :mod:`varuna_core.model.stage`); with the skip routed, the
  placeholder's leaf is the received tensor instead.
* The tensor leaves leaving a cut (``cut``, cut index, leaf): a later stage counting that cut swaps them in.

Provenance follows every torch op of the first dry run (a ``TorchFunctionMode``): a tensor depends on the
origins of the tensors it was computed from; the output of a module call within one segment becomes a new
origin (if the module has parameters, or if it computed from other origins: a parameter-free module on the
model's inputs, such as a rotary table, runs on every stage and is never carried). Model inputs, parameters,
buffers and new tensors depend on nothing. An op in segment ``q`` that reads a tensor depending on an origin
of segment ``p < q`` makes the origin cross cuts ``p .. q - 1``. Code between the origin and the reader runs
again on the later stage (on the carried tensor), as the code before a stage's cut always does.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import CutPointError
from .payload import TensorSpec, ValueSpec, flatten, unflatten

__all__ = ["Skip", "Provenance", "crossing_spec", "split_crossing", "join_crossing"]

MODULE, CUT = "module", "cut"


@dataclasses.dataclass(frozen=True)
class Skip:
    """One tensor carried across cuts ``produced .. last - 1``.

    Attributes:
        source: ``"module"`` (a leaf of a module call's output) or ``"cut"`` (a leaf of a cut's value).
        name: the module's or the cutpoint's name.
        call: module: index of the call in the module's calls; cut: the cut's index.
        leaf: index of the tensor among the flattened leaves of the output or cut value.
        produced: the segment that computes it.
        reads: the later segments that read it (a stage holding one of them puts it back in place).
        spec: its shape and dtype per number of examples.
    """

    source: str
    name: str
    call: int
    leaf: int
    produced: int
    reads: tuple[int, ...]
    spec: TensorSpec

    @property
    def last(self) -> int:
        return self.reads[-1]

    def crosses(self, cut: int) -> bool:
        """Whether the tensor crosses cut ``cut`` (between segments ``cut`` and ``cut + 1``)."""
        return self.produced <= cut < self.last

    def read_in(self, first: int, stop: int) -> bool:
        """Whether a segment of ``first .. stop - 1`` reads it."""
        return any(first <= q < stop for q in self.reads)

    def describe(self) -> str:
        what = (f"output {self.leaf} of {self.name!r}" if self.source == MODULE
                else f"value {self.leaf} at {self.name!r}")
        per = "per example" if self.spec.batch_dims else "for any number of examples"
        return f"{what} ({self.spec.describe(1)} {per})"

    def to_json(self) -> list:
        return [self.source, self.name, self.call, self.leaf, self.produced, list(self.reads),
                dataclasses.asdict(self.spec)]

    @classmethod
    def from_json(cls, data: list) -> Skip:
        source, name, call, leaf, produced, reads, spec = data
        return cls(source, name, call, leaf, produced, tuple(reads),
                   TensorSpec(tuple(spec["shape"]), tuple(spec["batch_dims"]), spec["dtype"]))


# ----------------------------------------------------------------------------------------------------------
# What crosses a cut


def crossing_spec(cut: ValueSpec, skips: list[Skip]) -> ValueSpec:
    """The spec of ``(cut value, [skipped tensors])``, or ``cut`` itself when nothing skips (the wire format of
    a model without skips does not change)."""
    if not skips:
        return cut
    tree = unflatten(list(range(len(cut.leaves))), cut.treespec)
    _, treespec = flatten((tree, list(range(len(skips)))))
    return ValueSpec(treespec, tuple(cut.leaves) + tuple(s.spec for s in skips))


def split_crossing(value: Any, count: int) -> tuple[Any, list[Any]]:
    """``(cut value, skipped tensors)`` of a received value built by :func:`join_crossing`."""
    if not count:
        return value, []
    cut_value, carried = value
    return cut_value, list(carried)


def join_crossing(value: Any, carried: list[torch.Tensor]) -> Any:
    return (value, list(carried)) if carried else value


# ----------------------------------------------------------------------------------------------------------
# Finding them (first dry run)


@dataclasses.dataclass
class _Call:
    name: str
    call: int
    start: int
    end: int | None = None


@dataclasses.dataclass
class _Origin:
    source: str  # MODULE, CUT, or SLOT (a parameter or buffer: its reads through derived tensors are uses)
    name: str
    call: int
    leaf: int
    produced: int
    enclosing: tuple[_Call, ...] = ()  # open calls of modules with parameters around the producing call
    reads: set[int] = dataclasses.field(default_factory=set)
    mutated: int | None = None  # the segment of an in-place op on the tensor after it was produced
    tensor: Any = None  # a weak reference to the tensor (to recognise in-place ops on it)

    def nested_in(self) -> str | None:
        """A call around this one that a later stage stands in for as a whole (it never runs there)."""
        return next((f"{c.name!r} (call {c.call})" for c in self.enclosing if c.start == c.end), None)

    def describe(self) -> str:
        return (f"output {self.leaf} of module {self.name!r}" if self.source == MODULE
                else f"value {self.leaf} at CutPoint {self.name!r}")


SLOT = "slot"


class Provenance:
    """Follows which origins each tensor of one forward depends on; see [Note: skip routing].

    The recorder calls :meth:`module_enter` and :meth:`module_output` around each module call and
    :meth:`cut_value` at each cut; the dry run's ``TorchFunctionMode`` calls :meth:`after_op` for every op.

    A parameter or buffer read by root code (``x + self.pos``) passes on to what is computed from it too: a
    stage that computes that code again on a carried tensor reads the parameter, so :meth:`slot_reads` gives
    those segments as uses of the parameter (it is then held by both stages as a tied weight, and the
    gradients of both uses add up).
    """

    def __init__(self, slots: set[int]) -> None:
        self._slots = slots  # ids of the model's parameters and buffers: never an origin (ties are not skips)
        self._slot_origin: dict[int, int] = {}
        self._of: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.origins: list[_Origin] = []
        self._open: list[tuple[_Call, bool]] = []  # module calls in progress, and whether they own parameters

    # -- events --------------------------------------------------------------------------------------------

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any, segment: int, reads: bool) -> None:
        sources: set[int] = set()
        leaves = pytree.tree_leaves((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                found = self._of.get(leaf)
                if found:
                    sources |= found
                elif id(leaf) in self._slots:
                    sources.add(self._slot(leaf))
        if not sources:
            return
        if reads:
            for index in sources:
                self.origins[index].reads.add(segment)
        if _in_place(func) and leaves and isinstance(leaves[0], torch.Tensor):
            for index in self._of.get(leaves[0], ()):
                origin = self.origins[index]
                if origin.tensor is not None and origin.tensor() is leaves[0] and origin.mutated is None:
                    origin.mutated = segment
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self._slots:
                self._of[leaf] = self._of.get(leaf, frozenset()) | sources

    def module_enter(self, name: str, call: int, segment: int, has_params: bool) -> None:
        self._open.append((_Call(name, call, segment), has_params))

    def module_output(self, segment: int, output: Any) -> None:
        current, has_params = self._open.pop()
        current.end = segment
        name, call, start = current.name, current.call, current.start
        if start != segment:  # spans cuts: it runs on every stage that needs it, its children decide
            return
        leaves = pytree.tree_leaves(output)
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and id(t) not in self._slots]
        if not has_params and not any(self._of.get(t) for _, t in tensors):
            return  # computed from the model's inputs alone: every stage computes it
        enclosing = tuple(c for c, params in self._open if params and c.start == segment)
        seen: set[int] = set()
        for i, tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                self._of[tensor] = frozenset({self._new(MODULE, name, call, i, segment, enclosing, tensor)})

    def cut_value(self, name: str, index: int, value: Any) -> Any:
        """Fresh aliases of the tensors leaving cut ``index``, each its own origin (so a read of the value
        before the cut is told apart from a read of the one after it)."""
        leaves, spec = pytree.tree_flatten(value)
        out = []
        with torch._C.DisableTorchFunction():
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    leaf = leaf.view_as(leaf)
                    self._of[leaf] = frozenset({self._new(CUT, name, index, i, index + 1, (), leaf)})
                out.append(leaf)
        return pytree.tree_unflatten(out, spec)

    def _new(self, source: str, name: str, call: int, leaf: int, produced: int, enclosing: tuple[_Call, ...],
             tensor: torch.Tensor | None) -> int:
        ref = None if tensor is None else weakref.ref(tensor)
        self.origins.append(_Origin(source, name, call, leaf, produced, enclosing, tensor=ref))
        return len(self.origins) - 1

    def _slot(self, tensor: torch.Tensor) -> int:
        index = self._slot_origin.get(id(tensor))
        if index is None:
            index = self._slot_origin[id(tensor)] = self._new(SLOT, "", 0, 0, 0, (), None)
        return index

    # -- result --------------------------------------------------------------------------------------------

    def slot_reads(self) -> dict[int, set[int]]:
        """Per parameter or buffer (by ``id``), the segments that read it or a tensor computed from it."""
        return {key: self.origins[index].reads for key, index in self._slot_origin.items()}

    def skips(self, cut_names: tuple[str, ...], spec_of) -> tuple[Skip, ...]:
        """The origins read after a cut, as :class:`Skip` s in the order they were produced.

        ``spec_of(origin)`` gives the :class:`TensorSpec` of a module output leaf or a cut leaf (``None``: it
        cannot be described at 1 and 2 examples).

        Raises:
            CutPointError: a skipped value cannot be carried (computed inside a module that a later stage
                stands in for as a whole, changed in place after it was computed, or with a shape that does
                not follow the batch).
        """
        out = []
        for origin in self.origins:
            later = tuple(sorted(q for q in origin.reads if q > origin.produced))
            if origin.source == SLOT or not later:
                continue
            where, after = origin.describe(), cut_names[origin.produced]
            nested_in = origin.nested_in()
            if nested_in is not None:
                raise CutPointError(
                    f"{where} is computed inside {nested_in} and used after CutPoint {after!r} without "
                    f"leaving that module through its output, so a later stage cannot be given it",
                    hint="return the value from the enclosing module, or pass it through the CutPoint")
            if origin.mutated is not None:
                raise CutPointError(
                    f"{where} is used after CutPoint {after!r} and changed in place (in segment "
                    f"{origin.mutated}) after it was computed, so the value to carry is not defined",
                    hint="use an out-of-place op (x = x + y instead of x += y) on values used after a cut")
            spec = spec_of(origin)
            if spec is None:
                raise CutPointError(
                    f"{where} is used after CutPoint {after!r} but cannot be carried across it: its shape does "
                    f"not follow the batch (or it is not the same kind of value at 1 and 2 examples)",
                    hint="pass it through the CutPoint, or compute it after the cut")
            out.append(Skip(origin.source, origin.name, origin.call, origin.leaf, origin.produced, later, spec))
        return tuple(out)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in "add sub mul truediv floordiv pow and or xor".split())
