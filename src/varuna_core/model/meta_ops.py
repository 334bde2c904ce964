"""Cheap ops on placeholders: where the tensors of an op's arguments are, and a memo of meta ops' results.

[Note: meta op memo] Every stage but the first runs its model's code before the incoming cut on placeholders
(``meta`` tensors, [Note: slicing] in :mod:`varuna_core.model.stage`), once per forward and once per recompute.
That code is glue between stubbed modules: an add of two embeddings, a dropout, a layer norm. On ``meta`` most of
torch's ops run their shape rules in Python (``torch._refs``, ``torch._meta_registrations``): an add of
``[4, 64, 64]`` and ``[64, 64]`` takes ~100 µs there against ~3 µs on the CPU with data, a GELU ~400 µs. On the
example GPT's second stage that glue was 0.43 ms of a 2.0 ms forward, on the critical path of the last stage.

A meta op's result is a function of its arguments' metadata, its other arguments and a little global state (grad
mode, the default dtype, autocast): a meta tensor has no data. :class:`MetaResults` keeps, for each op it saw
with such a key, the shape, strides and dtype of what it returned, and on the next call makes a fresh meta tensor
of them instead of running the op. It only memoises what that makes exactly: outputs that are plain, new (not an
argument: in-place ops return theirs), not views (whose base and offset a fresh tensor would not keep), without
autograd history, and a plain tuple or list of such. Every other call runs the op. Keys hold only hashable values
of known types (with the type itself, so ``1``, ``1.0`` and ``True`` differ); anything else (a generator, a
callable, a real tensor) makes a call unmemoised. The memo is bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["MetaResults", "tensor_devices", "has_meta"]

_ATOMS = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tensor_devices(args: Any, kwargs: Any) -> tuple[bool, bool]:
    """(whether some tensor in ``args``/``kwargs`` is on meta, whether some other one is not): the walk that
    :func:`torch.utils._pytree.tree_leaves` would do, without building the list for the common flat case."""
    meta = real = False
    stack: list[Any] = [args, kwargs]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_meta:
                meta = True
            else:
                real = True
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif type(x) in pytree.SUPPORTED_NODES:  # another registered container (an OrderedDict subclass, a user's)
            stack.extend(pytree.tree_leaves(x))
    return meta, real


def has_meta(args: Any, kwargs: Any) -> bool:
    """Whether some tensor in ``args``/``kwargs`` is on ``meta``."""
    return tensor_devices(args, kwargs)[0]


class _Uncacheable(Exception):
    pass


def _key_of(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable description of an argument, for the memo; raises :class:`_Uncacheable`. Tensors met are
    appended to ``tensors`` (to tell an in-place result from a new one)."""
    if isinstance(x, torch.Tensor):
        if type(x) not in _PLAIN or not x.is_meta:
            raise _Uncacheable
        tensors.append(x)
        return (torch.Tensor, tuple(x.shape), x.stride(), x.dtype, x.layout, x.storage_offset(), x.requires_grad)
    if isinstance(x, _ATOMS):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_key_of(v, tensors) for v in x))
    if isinstance(x, dict):
        return (type(x), tuple((k, _key_of(v, tensors)) for k, v in x.items()))
    if isinstance(x, slice):  # unhashable before Python 3.12
        return (slice, _key_of(x.start, tensors), _key_of(x.stop, tensors), _key_of(x.step, tensors))
    raise _Uncacheable


def _recipe(out: Any, inputs: list[torch.Tensor]) -> Any:
    """What :func:`_make` needs to make ``out`` again, or ``None`` when a fresh tensor would not be ``out``."""
    if isinstance(out, torch.Tensor):
        if (type(out) is not torch.Tensor or not out.is_meta or out.requires_grad or out.layout != torch.strided
                or out._is_view() or out.storage_offset() != 0 or any(out is t for t in inputs)):
            return None
        return (tuple(out.shape), out.stride(), out.dtype)
    if type(out) in (tuple, list):
        parts = [_recipe(o, inputs) for o in out]
        if not parts or any(p is None for p in parts):
            return None
        return (type(out), parts)
    return None


def _make(recipe: Any) -> Any:
    if isinstance(recipe[0], tuple):
        shape, stride, dtype = recipe
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    kind, parts = recipe
    return kind(_make(p) for p in parts)


class MetaResults:
    """Memo of ops on meta tensors ([Note: meta op memo]); ``limit``: entries kept before it starts afresh (0: no
    memo, every call runs its op)."""

    def __init__(self, limit: int = 4096) -> None:
        self._memo: dict[Any, Any] = {}
        self._limit = limit
        self.hits = 0

    def __len__(self) -> int:
        return len(self._memo)

    def call(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, whose tensors are all on meta; from the memo when it holds the call."""
        if self._limit <= 0:
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        key: tuple | None
        try:
            key = (func, _key_of(args, tensors), _key_of(kwargs, tensors), _state())
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                key = None  # the result would carry autograd history
            else:
                recipe = self._memo.get(key)
                if recipe is not None:
                    self.hits += 1
                    return _make(recipe)
        except (_Uncacheable, TypeError):  # TypeError: an atom that does not hash
            key = None
        out = func(*args, **kwargs)
        if key is not None:
            recipe = _recipe(out, tensors)
            if recipe is not None:
                if len(self._memo) >= self._limit:
                    self._memo.clear()
                self._memo[key] = recipe
        return out


def _state() -> tuple:
    """The global state a meta op's result depends on beyond its arguments."""
    return (torch.is_grad_enabled(), torch.get_default_dtype(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
