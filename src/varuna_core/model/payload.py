"""Descriptions of the values that cross cuts and leave modules, as pytrees of tensors.

A value such as ``x`` or ``(hidden, mask)`` or ``{"h": h, "ids": ids}`` is flattened with torch's pytree into
*leaves* and a *treespec*. Each tensor leaf is described by a :class:`TensorSpec` holding its shape at one
example and the dims that grow with the number of examples (found by probing at 1 and 2 examples, so ``[b, t,
h]``, ``[s, b, h]`` and flattened ``[b*t, h]`` layouts all work). Non-tensor leaves (``None``, ints, strings)
are kept as constants (:class:`Const`). Specs are plain data so that discovery results can be cached as JSON.
:meth:`ValueSpec.assemble` is the one way back from a value's tensors to the value.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "TensorSpec",
    "Const",
    "ValueSpec",
    "flatten",
    "unflatten",
    "spec_from_probes",
    "dtype_from_str",
]

CONST_TYPES = (type(None), bool, int, float, str)


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` → ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor as a function of the number of examples ``n``.

    Attributes:
        shape: the shape at ``n = 1``.
        batch_dims: dims whose size is ``shape[d] * n``.
        dtype: dtype name, e.g. ``"torch.float32"``.
    """

    shape: tuple[int, ...]
    batch_dims: tuple[int, ...]
    dtype: str

    def shape_for(self, n: int) -> tuple[int, ...]:
        """The shape for ``n`` examples."""
        return tuple(s * n if d in self.batch_dims else s for d, s in enumerate(self.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)

    @property
    def is_float(self) -> bool:
        """Float tensors carry gradients across cuts; integer and bool tensors do not."""
        return self.torch_dtype.is_floating_point or self.torch_dtype.is_complex

    def describe(self, n: int) -> str:
        return f"{list(self.shape_for(n))} {self.dtype.removeprefix('torch.')}"


@dataclasses.dataclass(frozen=True)
class Const:
    """A leaf of a value that is not a tensor (``None``, a bool, a number, a string): it crosses as itself.
    Written ``{"const": value}`` in JSON."""

    value: Any


@dataclasses.dataclass(frozen=True)
class ValueSpec:
    """A pytree of tensors and constants: its treespec (JSON) and one entry per leaf, a :class:`TensorSpec` or a
    :class:`Const`."""

    treespec: str
    leaves: tuple[TensorSpec | Const, ...]

    @property
    def tensor_leaves(self) -> list[tuple[int, TensorSpec]]:
        return [(i, leaf) for i, leaf in enumerate(self.leaves) if isinstance(leaf, TensorSpec)]

    def describe(self, n: int) -> str:
        parts = [leaf.describe(n) if isinstance(leaf, TensorSpec) else repr(leaf.value) for leaf in self.leaves]
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"

    def assemble(self, tensors: Iterable[torch.Tensor]) -> Any:
        """The value: ``tensors`` (one per tensor leaf, in order) where the tensors go, the constants where
        theirs do."""
        it = iter(tensors)
        return unflatten([next(it) if isinstance(leaf, TensorSpec) else leaf.value for leaf in self.leaves],
                         self.treespec)

    def placeholder(self, n: int, device: torch.device | str = "meta") -> Any:
        """A value of this structure for ``n`` examples whose tensors live on ``device``: no data on ``meta``;
        elsewhere NaN (floats) or zeros, so that a value computed from it is recognisably garbage."""
        make = torch.empty if torch.device(device).type == "meta" else _garbage
        return self.assemble(make(leaf.shape_for(n), dtype=leaf.torch_dtype, device=device)
                             for _, leaf in self.tensor_leaves)

    def to_json(self) -> dict:
        return {
            "treespec": self.treespec,
            "leaves": [dataclasses.asdict(x) if isinstance(x, TensorSpec) else {"const": x.value} for x in self.leaves],
        }

    @classmethod
    def from_json(cls, data: dict) -> ValueSpec:
        leaves = tuple(
            TensorSpec(tuple(x["shape"]), tuple(x["batch_dims"]), x["dtype"]) if "shape" in x else Const(x["const"])
            for x in data["leaves"]
        )
        return cls(data["treespec"], leaves)


def _garbage(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


_DUMPS_CACHE: dict[pytree.TreeSpec, str] = {}


def flatten(value: Any) -> tuple[list[Any], str]:
    """Flatten ``value`` into leaves and a JSON treespec (raises ``TypeError`` for unregistered containers).

    The JSON of a structure is remembered (``treespec_dumps`` takes ~50 µs; the executor flattens every forward's
    output): equal specs serialise equally."""
    leaves, spec = pytree.tree_flatten(value)
    try:
        text = _DUMPS_CACHE.get(spec)
    except TypeError:  # a container whose context does not hash
        return leaves, pytree.treespec_dumps(spec)
    if text is None:
        text = pytree.treespec_dumps(spec)
        if len(_DUMPS_CACHE) < 1024:
            _DUMPS_CACHE[spec] = text
    return leaves, text


_SPEC_CACHE: dict[str, pytree.TreeSpec] = {}


def unflatten(leaves: list[Any], treespec: str) -> Any:
    spec = _SPEC_CACHE.get(treespec)
    if spec is None:
        spec = _SPEC_CACHE[treespec] = pytree.treespec_loads(treespec)
    return pytree.tree_unflatten(leaves, spec)


class ProbeMismatch(ValueError):
    """Raised by :func:`spec_from_probes` when the two probes do not describe one structure."""


def spec_from_probes(value_1: Any, value_2: Any) -> ValueSpec:
    """Describe a value seen with 1 and with 2 examples.

    Raises:
        ProbeMismatch: the structures differ, a dim changes other than doubling, or a leaf is neither a tensor
            nor a JSON-able constant.
    """
    try:
        leaves_1, spec_1 = flatten(value_1)
        leaves_2, spec_2 = flatten(value_2)
    except (TypeError, NotImplementedError, json.JSONDecodeError) as exc:
        raise ProbeMismatch(f"value of type {type(value_1).__name__} cannot be described: {exc}") from exc
    if spec_1 != spec_2 or len(leaves_1) != len(leaves_2):
        raise ProbeMismatch("the structure differs between 1 and 2 examples")
    out: list[TensorSpec | Const] = []
    for a, b in zip(leaves_1, leaves_2, strict=True):
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor) or a.dim() != b.dim() or a.dtype != b.dtype:
                raise ProbeMismatch("a tensor changes rank or dtype between 1 and 2 examples")
            batch_dims = []
            for d, (s1, s2) in enumerate(zip(a.shape, b.shape, strict=True)):
                if s2 == 2 * s1 and s1 > 0:
                    batch_dims.append(d)
                elif s1 != s2:
                    raise ProbeMismatch(
                        f"dim {d} of a tensor is {s1} with 1 example and {s2} with 2 (expected equal or doubled)"
                    )
            out.append(TensorSpec(tuple(a.shape), tuple(batch_dims), str(a.dtype)))
        elif isinstance(a, CONST_TYPES) and a == b:
            out.append(Const(a))
        else:
            raise ProbeMismatch(f"leaf of type {type(a).__name__} is neither a tensor nor a constant")
    return ValueSpec(spec_1, tuple(out))
