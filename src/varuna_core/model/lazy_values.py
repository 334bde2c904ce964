"""Run a model built on ``meta`` as if it were whole: each op that reads a parameter or buffer gets real values.

Structure discovery and the start-up validation run the *unsliced* model once on example inputs. A model
built on ``meta`` has no values to run on, and allocating the whole model would defeat building it on meta.
:func:`on_touch` runs it anyway: a ``TorchFunctionMode`` sees every op, and when an op's arguments hold a meta
tensor of the model it calls :func:`~varuna_core.model.materialize.owner_values` for the tensor's owner and
passes real values instead. Those are exactly the values :func:`~varuna_core.model.materialize.materialize`
would give the tensor (the same seed, initialiser and pretrained weights), so activations are those of the
materialised model, and a stage checked against them is checked against the truth.

Memory: only the owners of the last few touched tensors are alive at once (a small LRU), so a forward costs
about one block of parameters, not the model. Compute: each owner is initialised (and its weights read) once
per touch that misses the cache, i.e. about once per forward.

Metadata (shape, dtype, ...) is read from the meta tensor itself; ``.device`` and ``.is_meta`` answer as the
real values would, so code that builds tensors "on the weight's device" builds them where the values are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from ..util.heap import release_free_memory
from .materialize import Init, has_meta, owner_values, value_plan

__all__ = ["ValueSource", "on_touch", "reads_values", "META_PROPERTIES", "META_METHODS"]

# Tensor properties and methods that read metadata only: touching them is not a use of the values.
META_PROPERTIES = frozenset(
    "shape dtype device requires_grad is_leaf grad_fn ndim layout names is_cuda is_meta is_sparse "
    "is_quantized itemsize nbytes _version grad is_mkldnn is_nested".split()
)
META_METHODS = frozenset(
    "size dim numel stride is_floating_point is_contiguous element_size data_ptr __len__ __hash__ "
    "is_complex nelement ndimension get_device __format__ __repr__ storage_offset".split()
)


def _property(func: Any) -> str | None:
    """The name of the tensor property ``func`` reads (``Tensor.shape.__get__`` -> ``"shape"``), else None."""
    if getattr(func, "__name__", "") != "__get__":
        return None
    return getattr(getattr(func, "__self__", None), "__name__", "")


def reads_values(func: Any) -> bool:
    """Whether ``func`` (as a ``__torch_function__`` sees it) may read its tensor arguments' values."""
    prop = _property(func)
    if prop is not None:
        return prop not in META_PROPERTIES
    return getattr(func, "__name__", "") not in META_METHODS


@dataclasses.dataclass(frozen=True)
class ValueSource:
    """Where a model's ``meta`` tensors get their values: ``materialize(seed=, init=)``, then the pretrained
    tensors of ``weights`` (a path :meth:`~varuna_core.model.weights.WeightSource.open` accepts) where it holds
    them. ``aliases``: slot name -> the name whose value it takes (declared tied weights: the canonical)."""

    seed: int
    init: Init | None = None
    weights: str | os.PathLike | None = None
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)


class _OnTouch(TorchFunctionMode):
    def __init__(self, model: nn.Module, values: ValueSource, device: torch.device, keep: int) -> None:
        super().__init__()
        self.plan = value_plan(model, values.seed, values.init, device, values.aliases)
        self.device = device
        self.keep = keep
        self.source: Any = None
        self.cache: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()  # id(owner) -> {id(meta): real}
        self.touched_owners = 0

    def _real(self, tensor: torch.Tensor) -> torch.Tensor:
        target = self.plan.resolve(tensor)
        if not target.is_meta:  # aliased to a tensor that is real already
            return target
        owner = self.plan.owners[id(target)]
        got = self.cache.get(id(owner))
        if got is None:
            got = owner_values(self.plan, owner, self.source)
            self.touched_owners += 1
            self.cache[id(owner)] = got
            if len(self.cache) > self.keep:
                while len(self.cache) > self.keep:
                    self.cache.popitem(last=False)
                release_free_memory(collect=False)  # else glibc keeps the evicted values' pages: RSS would grow
        else:
            self.cache.move_to_end(id(owner))
        return got[id(target)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracked = self.plan.tracked
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and id(t) in tracked for t in leaves):
            return func(*args, **kwargs)
        prop = _property(func)
        if prop == "device":
            return self.device
        if prop == "is_meta":
            return self.device.type == "meta"
        if not reads_values(func):
            return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(
            lambda t: self._real(t) if isinstance(t, torch.Tensor) and id(t) in tracked else t, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_touch(model: nn.Module, values: ValueSource | None, device: Any = "cpu", *, keep: int = 4) -> Iterator[Any]:
    """Run ``model`` (built on meta, wholly or in part) with real values for its meta tensors, made as each op
    reads them (see the module docstring). Yields the mode (``touched_owners`` counts initialisations), or
    ``None`` when the model has no meta tensor (nothing to do) or ``values`` is None.

    Args:
        values: seed, initialiser and pretrained weights (:class:`ValueSource`).
        device: where the values are made (the device the inputs are on).
        keep: owners whose values are kept between ops (bounds the memory).
    """
    if values is None or not has_meta(model):
        yield None
        return
    mode = _OnTouch(model, values, torch.device(device), keep)
    with contextlib.ExitStack() as stack:
        if values.weights is not None:
            from .weights import WeightSource

            mode.source = stack.enter_context(WeightSource.open(values.weights))
        with mode:
            yield mode
