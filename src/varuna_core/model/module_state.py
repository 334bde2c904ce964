"""Python state a model's forward keeps on its modules (``self.scale = float(x.mean())``, ``self.calls += 1``).

[Note: module state] A stage runs the user's ``forward`` with other stages' modules stood in for (see [Note:
slicing]), so an attribute that a module of one stage writes during the forward and a module of another stage
reads keeps, on the reader's stage, whatever value ``__init__`` or an earlier run left there: the stages would
train another model than the user's, silently. Discovery finds such state:

* the first dry run swaps every module's class for a dynamic subclass whose ``__setattr__``/``__delattr__``
  record which attributes of its ``__dict__`` are set during the forward, and in which segment;
* only if something was written, the second dry run swaps the classes of the modules that wrote for a subclass
  whose ``__getattribute__`` also records the reads of the written names (reads of instance attributes do not
  reach ``__getattr__``), and where a read sees the value of which write: a *flow* ``(write segment, read
  segment)``. A read before any write of the forward sees the previous forward's last write.

Subclasses keep ``isinstance`` true (``type(m) is C`` in a forward would see the subclass during the dry runs),
and the classes are put back after each run. A model that writes nothing costs one subclass per module class and
one swap per module, and nothing in the second run (0.2 ms of a 20 ms discovery on the example GPT). The dry
runs' writes are undone afterwards: the model leaves discovery as it entered it.

Not seen: a change in place (``self.history.append(v)``, ``self.stat.add_(x)`` on a plain tensor attribute),
``object.__setattr__`` and ``__dict__`` writes, globals. Start-up validation is left for those; the facade undoes
the attributes written by its reference run, so the sliced run starts from the attributes the model came with and
a stale value cannot equal the reference's merely by being computed on the same sample batch.

Slicing refuses a flow between segments of two stages by name (:func:`check_state_crossings`). Carrying the
values instead would need arbitrary Python objects on the wire in the order one process would have produced
them; with several micro-batches in flight on different stages (and a read that sees the previous micro-batch's
write) that order is not the pipeline's, so the refusal is exact and carrying would not be. A parameter-free
module runs for real on every stage up to its own segment ([Note: slicing]), so its write read later is no
crossing, as long as the reading stage can run it: one whose inputs come from an earlier stage is stood in, and
the reading stage then refuses (:func:`stood_in_writer`). Writes and reads within one stage are the user's
business; under recompute (:class:`AttributeSnapshot`) a recomputed forward sees the attributes as its first
forward saw them, and its writes are not applied twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from ..errors import CutPointError
from ..ir.partition import Partition
from .cutpoint import CutPoint

__all__ = ["AttributeUse", "StateWatch", "AttributeSnapshot", "check_state_crossings", "stood_in_writer",
           "written_attributes"]

log = logging.getLogger(__name__)

# nn.Module's own bookkeeping (hooks, the submodule/parameter/buffer tables, ``training``), and what the runtime
# itself sets on an instance (a stage's stand-in ``forward``): never the user's state
_BOOKKEEPING = frozenset(vars(nn.Module())) | {"forward"}
_ABSENT = object()  # an attribute that does not exist (yet)


@dataclasses.dataclass(frozen=True)
class AttributeUse:
    """One attribute a module's forward writes.

    Attributes:
        module: the module's name (``""``: the model itself).
        attr: the attribute's name.
        writes: the segments that write it.
        reads: the segments that read it.
        flows: ``(write segment, read segment)``: the segment whose write a read sees.
    """

    module: str
    attr: str
    writes: tuple[int, ...]
    reads: tuple[int, ...]
    flows: tuple[tuple[int, int], ...]

    def to_json(self) -> list:
        return [self.module, self.attr, list(self.writes), list(self.reads), [list(f) for f in self.flows]]

    @classmethod
    def from_json(cls, data: list) -> AttributeUse:
        module, attr, writes, reads, flows = data
        return cls(str(module), str(attr), tuple(writes), tuple(reads), tuple((int(a), int(b)) for a, b in flows))


def _user_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module by its first name, CutPoints left out (their hook is the runtime's)."""
    return {name: m for name, m in model.named_modules() if not isinstance(m, CutPoint)}


def _spy_class(cls: type, on: Callable[[Any, str, str], None], reads: dict[int, frozenset[str]] | None) -> type:
    """A subclass of ``cls`` telling ``on(module, op, attr)`` of each write (``op`` ``"w"``) and, with ``reads``
    (per module id, the names to follow), of each read of those names (``"r"``). One per class and run: making a
    class costs tens of microseconds, a swap almost nothing."""
    def setattr_(self, name, value):
        if name not in _BOOKKEEPING:
            on(self, "w", name)
        cls.__setattr__(self, name, value)

    def delattr_(self, name):
        if name not in _BOOKKEEPING:
            on(self, "w", name)
        cls.__delattr__(self, name)

    body: dict[str, Any] = {"__setattr__": setattr_, "__delattr__": delattr_, "__module__": cls.__module__,
                            "__qualname__": cls.__qualname__}
    if reads is not None:
        def getattribute(self, name):
            if name in reads.get(id(self), ()):
                on(self, "r", name)
            return cls.__getattribute__(self, name)

        body["__getattribute__"] = getattribute
    return type(cls.__name__, (cls,), body)


class StateWatch:
    """Follows the attributes a model's forward writes over discovery's two dry runs ([Note: module state]):
    :meth:`writes` around the first run, :meth:`reads` around the second, then :meth:`uses`; :meth:`restore`
    puts every attribute back as it was before the first run."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = _user_modules(model)
        self.before = {name: dict(vars(m)) for name, m in self.modules.items()}
        self.first: dict[tuple[str, str], list[int]] = {}  # writes of the first run, in order
        self.events: dict[tuple[str, str], list[tuple[str, int]]] = {}  # second run: (op, segment) in order
        self.blind: set[str] = set()  # modules whose class could not be swapped
        self.changed: set[tuple[str, str]] = set()  # their attributes the dry runs changed (seen by restore)

    @contextlib.contextmanager
    def _spying(self, names: list[str], on: Callable[[str, str, str], None],
                reads: dict[int, frozenset[str]] | None) -> Iterator[None]:
        """Swap the classes of the modules ``names`` for spies telling ``on(module name, op, attr)``; a class that
        cannot be swapped (``__slots__``, a scripted module) leaves its module *blind*: its state is then judged
        from the values alone (:meth:`uses`)."""
        by_id = {id(self.modules[name]): name for name in names}
        spies: dict[type, type] = {}
        classes = {name: type(self.modules[name]) for name in names}

        def tell(module: Any, op: str, attr: str) -> None:
            name = by_id.get(id(module))
            if name is not None:
                on(name, op, attr)

        try:
            for name in names:
                cls = classes[name]
                try:
                    if cls not in spies:
                        spies[cls] = _spy_class(cls, tell, reads)
                    object.__setattr__(self.modules[name], "__class__", spies[cls])
                except Exception:  # noqa: BLE001 - a class that cannot be subclassed or swapped in
                    self.blind.add(name)
            yield
        finally:
            for name in names:
                object.__setattr__(self.modules[name], "__class__", classes[name])

    def writes(self, segment: Callable[[], int]) -> contextlib.AbstractContextManager[None]:
        """Around the first dry run: record each write with ``segment()``, the recorder's current segment."""
        def on(name: str, op: str, attr: str) -> None:
            self.first.setdefault((name, attr), []).append(segment())

        return self._spying(list(self.modules), on, None)

    def reads(self, segment: Callable[[], int]) -> contextlib.AbstractContextManager[None]:
        """Around the second dry run: the modules that wrote record their writes and the reads of the written
        names. Nothing is swapped when nothing was written."""
        written: dict[str, set[str]] = {}
        for name, attr in self.first:
            written.setdefault(name, set()).add(attr)

        def on(name: str, op: str, attr: str) -> None:
            if attr in written[name]:
                self.events.setdefault((name, attr), []).append((op, segment()))

        names = [name for name in written if name not in self.blind]
        return self._spying(names, on, {id(self.modules[n]): frozenset(written[n]) for n in names})

    def uses(self, call_segments: Callable[[str], set[int]]) -> tuple[AttributeUse, ...]:
        """Each written attribute with its writes, reads and flows (after :meth:`restore`). A module whose class
        could not be swapped but whose ``__dict__`` changed is taken to write and read it in every segment it runs
        in (``call_segments(name)``), with a warning: reads by other modules are not known."""
        out = []
        for (name, attr), first in sorted(self.first.items()):
            events = self.events.get((name, attr), [])
            written = [seg for op, seg in events if op == "w"]
            last = written[-1] if written else first[-1]  # what a read before any write of the forward sees
            flows, source = set(), last
            for op, seg in events:
                if op == "w":
                    source = seg
                else:
                    flows.add((source, seg))
            reads = {seg for op, seg in events if op == "r"}
            out.append(AttributeUse(name, attr, tuple(sorted(set(first) | set(written))), tuple(sorted(reads)),
                                    tuple(sorted(flows))))
        for name, attr in sorted(self.changed):
            log.warning("module %r (%s) changes attribute %r during forward, and its class cannot be watched: reads "
                        "of it by another stage would not be found", name, type(self.modules[name]).__name__, attr)
            segments = tuple(sorted(call_segments(name)))
            out.append(AttributeUse(name, attr, segments, segments, tuple((a, b) for a in segments for b in segments)))
        return tuple(out)

    def restore(self) -> None:
        """Put back every attribute the dry runs rebound, added or deleted; note those of blind modules."""
        for name in self.blind:
            now, before = vars(self.modules[name]), self.before[name]
            self.changed |= {(name, attr) for attr in set(now) | set(before)
                             if attr not in _BOOKKEEPING and now.get(attr, _ABSENT) is not before.get(attr, _ABSENT)}
        for name, module in self.modules.items():
            _put_back(module, self.before[name])


def _put_back(module: nn.Module, before: dict[str, Any]) -> None:
    now = vars(module)
    for attr in [a for a in now if a not in before and a not in _BOOKKEEPING]:
        del now[attr]
    for attr, value in before.items():
        if attr not in _BOOKKEEPING and now.get(attr, _ABSENT) is not value:
            now[attr] = value


def written_attributes(model: nn.Module, uses: tuple[AttributeUse, ...]) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` for each use whose module the model still has."""
    modules = dict(model.named_modules())
    return [(modules[u.module], u.attr) for u in uses if u.module in modules]


class AttributeSnapshot:
    """The values of the attributes a forward writes, taken and put back by reference.

    Under recompute a micro-batch's forward runs twice on a stage (F without a graph, then R before its
    backward): :meth:`take` before F, :meth:`installed` around R, so R sees the attributes F saw and their values
    after R are those the live run had (a ``self.calls += 1`` counts once, as in one process). Start-up uses
    the same two calls to leave the model as it found it."""

    def __init__(self, attributes: list[tuple[nn.Module, str]]) -> None:
        self.attributes = attributes

    def take(self) -> list[Any]:
        return [vars(m).get(attr, _ABSENT) for m, attr in self.attributes]

    def put(self, values: list[Any]) -> None:
        for (module, attr), value in zip(self.attributes, values, strict=True):
            if value is _ABSENT:
                vars(module).pop(attr, None)
            else:
                vars(module)[attr] = value

    @contextlib.contextmanager
    def undone(self) -> Iterator[None]:
        """The block's writes undone after it (start-up's runs of the model: it leaves as it entered)."""
        values = self.take()
        try:
            yield
        finally:
            self.put(values)

    @contextlib.contextmanager
    def installed(self, values: list[Any] | None) -> Iterator[None]:
        """``values`` (from :meth:`take`) for the block; the live values back after it. ``None``: nothing."""
        if values is None or not self.attributes:
            yield
            return
        live = self.take()
        self.put(values)
        try:
            yield
        finally:
            self.put(live)


def check_state_crossings(model: nn.Module, uses: tuple[AttributeUse, ...], partition: Partition
                          ) -> dict[int, set[str]]:
    """Refuse a module attribute written on one stage and read on another ([Note: module state]): one line naming
    the module, the attribute and both segments and stages.

    Returns, per stage, the parameter-free modules of earlier stages whose writes it reads: it must run them for
    real (a stage stands one in when its inputs come from an earlier stage; it then refuses, see
    :func:`stood_in_writer`)."""
    modules = dict(model.named_modules())
    relied: dict[int, set[str]] = {}
    for use in uses:
        module = modules.get(use.module)
        param_free = module is not None and not any(True for _ in module.parameters())
        for write, read in use.flows:
            a, b = partition.stage_of_segment(write), partition.stage_of_segment(read)
            if a == b:
                continue
            if param_free and write <= read:
                relied.setdefault(b, set()).add(use.module)
                continue
            raise CutPointError(
                f"{_describe(model, use.module)} keeps attribute {use.attr!r} across stages: segment {write} (stage "
                f"{a}) writes it during forward and segment {read} (stage {b}) reads it, so stage {b} would read a "
                f"stale value",
                hint="return the value from forward or pass it as an argument (a tensor through the CutPoint), or "
                f"cut so that segments {min(write, read)} to {max(write, read)} are on one stage")
    return relied


def stood_in_writer(model: nn.Module, name: str, stage: int, segment: int) -> CutPointError:
    """The error of a stage that must stand in a parameter-free module whose attributes it reads (its inputs come
    from an earlier stage, so it cannot run here)."""
    return CutPointError(
        f"on stage {stage}, {_describe(model, name)} writes attributes that this stage reads, but its input in "
        f"segment {segment} comes from an earlier stage, so it cannot run here and they would be stale",
        hint="return the value from forward or pass it as an argument (a tensor through the CutPoint), or cut so "
        "that the module and the reads are on one stage")


def _describe(model: nn.Module, name: str) -> str:
    modules = dict(model.named_modules())
    cls = type(modules[name]).__name__ if name in modules else "?"
    return f"module {name!r} ({cls})" if name else f"the model ({cls})"
