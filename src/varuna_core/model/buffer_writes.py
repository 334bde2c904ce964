"""Buffers a forward writes: found by the dry run, kept as one process would keep them at run time.

[Note: buffer writes] A forward may update buffers in place (BatchNorm's ``running_mean``, ``running_var`` and
``num_batches_tracked``, running averages, step counters registered as buffers) or replace them
(``self.count = self.count + 1`` on a registered buffer). In one process each micro-batch's forward updates them
once, in micro-batch order. A pipeline must do the same whatever the schedule:

* Discovery watches every buffer slot during its dry run (:class:`WriteWatch`): a slot is *written* when its
  tensor's version counter moved, its values changed (BatchNorm's kernel updates ``running_mean`` and
  ``running_var`` without bumping their version counters), or the module's ``_buffers[name]`` holds another
  object afterwards. The names
  go into the :class:`~varuna_core.model.discovery.Structure` (``buffer_writes``). The watch then puts every
  buffer back as it was (values and objects), so a dry run leaves the model untouched.
* A stage that recomputes runs each micro-batch's forward twice: F without a graph, R later with one. F updates
  the live buffers (once, in order); before F the stage takes a :class:`Snapshot` of the written buffers it holds,
  and R runs on that snapshot (:meth:`BufferWrites.installed`): the snapshot's tensor objects are swapped into
  ``module._buffers`` of every module that registers the live object, R computes from the values F saw and
  updates the snapshot, and the live objects are put back. Swapping objects, not copying values, leaves the live
  buffers' version counters alone (a graph that saved a live buffer stays valid) and keeps the snapshot alive for
  the graph R built on it.
* An evaluation and the start-up validation run on a snapshot the same way, so they change no buffer.

A stage without written buffers takes no snapshot: the cost is one ``if``. (The plain Python attributes a
forward writes are another matter, not handled here.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

__all__ = ["WriteWatch", "BufferWrites", "Snapshot"]


def _slots(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every buffer slot: (full name, owning module, attribute), shared objects under each of their names."""
    out = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is not None:
                out.append((f"{module_name}.{attr}" if module_name else attr, module, attr))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN was (a buffer holding NaN is not written by being read)."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.equal(a.isnan(), b.isnan()))
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


class WriteWatch:
    """Around a dry run: which buffer slots the run writes, and every buffer put back as it was afterwards.

    Usage::

        with WriteWatch(model) as watch:
            model(**inputs)
        watch.written   # slot names, sorted
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.written: tuple[str, ...] = ()
        self._before: list[tuple[str, nn.Module, str, torch.Tensor, int, torch.Tensor]] = []

    def __enter__(self) -> WriteWatch:
        saved: dict[int, torch.Tensor] = {}
        for name, module, attr in _slots(self.model):
            buf = module._buffers[attr]
            assert buf is not None  # _slots lists set slots only
            if id(buf) not in saved:  # a meta buffer clones for free; a real one costs its bytes, once per object
                with torch.no_grad():
                    saved[id(buf)] = buf.detach().clone()
            self._before.append((name, module, attr, buf, buf._version, saved[id(buf)]))
        return self

    def __exit__(self, *exc: object) -> None:
        written = set()
        restored: set[int] = set()
        changed: dict[int, bool] = {}
        for name, module, attr, buf, version, value in self._before:
            now = module._buffers.get(attr)
            if id(buf) not in changed:
                changed[id(buf)] = buf._version != version or (not buf.is_meta and not _same(buf, value))
            if now is not buf or changed[id(buf)]:
                written.add(name)
            if now is not buf:
                module._buffers[attr] = buf
            if changed[id(buf)] and id(buf) not in restored:
                restored.add(id(buf))
                with torch.no_grad():
                    buf.copy_(value)
        self.written = tuple(sorted(written))
        self._before = []


class Snapshot:
    """Copies of the written buffers at one moment, per slot (a buffer object registered under several slots is
    copied once, and the slots share the copy)."""

    __slots__ = ("clones",)

    def __init__(self, clones: list[torch.Tensor | None]) -> None:
        self.clones = clones


class BufferWrites:
    """The written buffers one stage holds (see [Note: buffer writes]).

    Args:
        model: the user's model (sliced in place: buffers of other stages are on ``meta``).
        names: the buffer slots the forward writes (``Structure.buffer_writes``); those on ``meta`` here belong to
            other stages and are left alone.

    The slots are resolved to (module, attribute) once; the tensors in them are read at each snapshot, so a
    buffer replaced by the forward, moved by the slicer or loaded from a checkpoint is the one copied.
    """

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        wanted = set(names)
        self._slots = [(module, attr) for name, module, attr in _slots(model) if name in wanted]

    def __bool__(self) -> bool:
        return bool(self._slots)

    def live(self) -> list[torch.Tensor]:
        """The written buffers this stage holds now, each object once."""
        seen: dict[int, torch.Tensor] = {}
        for module, attr in self._slots:
            buf = module._buffers.get(attr)
            if buf is not None and not buf.is_meta:
                seen.setdefault(id(buf), buf)
        return list(seen.values())

    def take(self) -> Snapshot | None:
        """A copy of the written buffers as they are now (``None`` when this stage holds none)."""
        if not self._slots:
            return None
        by_object: dict[int, torch.Tensor] = {}
        clones: list[torch.Tensor | None] = []
        with torch.no_grad():
            for module, attr in self._slots:
                buf = module._buffers.get(attr)
                if buf is None or buf.is_meta:
                    clones.append(None)
                    continue
                if id(buf) not in by_object:
                    by_object[id(buf)] = buf.detach().clone()
                clones.append(by_object[id(buf)])
        return Snapshot(clones)

    @contextlib.contextmanager
    def installed(self, snapshot: Snapshot | None) -> Iterator[None]:
        """Run the block on ``snapshot``'s tensors in place of the live buffers, then put the live objects back.
        The block's writes land in the snapshot's tensors (or in objects it puts in the slots, dropped here); the
        live ones keep their values and version counters."""
        if snapshot is None:
            yield
            return
        live = [module._buffers.get(attr) for module, attr in self._slots]
        for (module, attr), clone in zip(self._slots, snapshot.clones, strict=True):
            if clone is not None:
                module._buffers[attr] = clone
        try:
            yield
        finally:
            for (module, attr), buf in zip(self._slots, live, strict=True):
                module._buffers[attr] = buf

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Run the block on a snapshot taken now: the buffers are afterwards as they were before (an evaluation,
        a validation run)."""
        with self.installed(self.take()):
            yield
