"""Splitting a replica's batch into micro-batches along each input's batch dim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["microbatch_sizes", "split_inputs", "batch_size_of", "to_device"]


def microbatch_sizes(batch: int, microbatch: int) -> list[int]:
    """Sizes of the micro-batches of a ``batch``: all ``microbatch`` except a smaller last one.

    >>> microbatch_sizes(10, 4)
    [4, 4, 2]
    """
    if microbatch < 1:
        raise ConfigError(f"chunk_size (micro-batch size) must be ≥ 1, got {microbatch}")
    if batch < 1:
        raise ConfigError(f"the batch must hold at least one example, got {batch}")
    full, rest = divmod(batch, microbatch)
    return [microbatch] * full + ([rest] if rest else [])


def batch_size_of(inputs: Mapping[str, Any], batch_dims: Mapping[str, int | None]) -> int:
    """The number of examples in ``inputs`` (every batched input must agree)."""
    sizes = {}
    for name, value in inputs.items():
        dim = batch_dims.get(name)
        if dim is not None and isinstance(value, torch.Tensor):
            sizes[name] = value.shape[dim]
    if not sizes:
        raise ConfigError(
            f"none of the inputs {sorted(inputs)} is batched",
            hint="pass the same input names as in dummy_inputs",
        )
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"inputs disagree on the number of examples: {sizes}")
    return next(iter(sizes.values()))


def split_inputs(
    inputs: Mapping[str, Any], batch_dims: Mapping[str, int | None], sizes: list[int], *, expected: int | None = None
) -> list[dict]:
    """Split ``inputs`` into micro-batches of ``sizes`` examples; unbatched inputs go whole to each.

    Args:
        inputs: model keyword inputs for the replica's batch.
        batch_dims: per input name, the dim holding the examples (``None``: not batched).
        sizes: examples per micro-batch; must add up to the batch.
        expected: the batch size the inputs must have (checked, with the input named on mismatch).
    """
    if not isinstance(inputs, Mapping):
        raise ConfigError(f"inputs must be a dict of model inputs, got {type(inputs).__name__}")
    unknown = [name for name in inputs if name not in batch_dims]
    if unknown:
        raise ConfigError(
            f"input(s) {unknown} were not in dummy_inputs, so their batch dim is unknown",
            hint=f"pass the inputs named in dummy_inputs: {sorted(batch_dims)}",
        )
    total = sum(sizes)
    pieces: dict[str, list[Any]] = {}
    for name, value in inputs.items():
        dim = batch_dims[name]
        if dim is None or not isinstance(value, torch.Tensor):
            pieces[name] = [value] * len(sizes)
            continue
        have = value.shape[dim] if value.dim() > dim else None
        if have != (expected if expected is not None else total):
            raise ConfigError(
                f"input {name!r} has {have} examples along dim {dim} (shape {list(value.shape)}), expected "
                f"{expected if expected is not None else total}",
                hint="step() takes this replica's share of the global batch: batch_size // data-parallel width",
            )
        pieces[name] = list(torch.split(value, sizes, dim=dim))
    return [{name: pieces[name][i] for name in inputs} for i in range(len(sizes))]


def to_device(inputs: dict, device: torch.device) -> dict:
    """``inputs`` with every tensor (nested in lists, tuples and dicts too) on ``device``; other values as they are.

    A user's batch comes from a CPU data loader (the examples', Hugging Face's), so a stage on a GPU moves it itself
    rather than failing in the model's first op. ``non_blocking`` overlaps the copy from pinned memory with the
    host's work; from pageable memory it is an ordinary copy. A tensor already on ``device`` is not copied."""
    def move(value: Any) -> Any:
        return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value

    return torch.utils._pytree.tree_map(move, inputs)
