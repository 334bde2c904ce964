"""Gradient storage and synchronisation after the pipeline.

Gradients of a stage live in one flat buffer per dtype (``param.grad`` are views into it), so the
data-parallel all-reduce runs on large contiguous buckets with no packing copies, and ``optimizer.zero_grad()``
(which sets grads to ``None``) costs nothing: the views are re-attached, zeroed, at the next step.

[Note: loss weighting] The last stage scales each micro-batch's loss by ``examples in micro-batch / global
batch``. Summing gradients over micro-batches, stages of a tied weight and replicas then gives exactly the
gradient of the global batch's mean loss, in fp32 too; so both syncs below are plain sums. (The original
averaged only in its fp16 path and never copied the reduced fp32 buffer back.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.precision import wire_dtype
from .p2p import wait_all

__all__ = ["GradBuffer", "all_reduce_tensor"]


class GradBuffer:
    """Flat gradient storage for a list of parameters.

    Args:
        params: the stage's trainable parameters (order must be identical on every replica of the stage).
        bucket_bytes: size of each all-reduce bucket.
        reduce_dtype: ``torch.bfloat16`` or ``torch.float16``: each bucket of a wider float buffer is summed in it
            (a narrowed copy, copied back once summed: half the bytes on the wire, the sum rounded at each addition
            of the collective, as torch DDP's compression hooks do); ``None``: in the gradients' own dtype.
    """

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int = 25 * 2**20,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.flats: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []

    @property
    def allocated(self) -> bool:
        return bool(self.flats) or not self.params

    def kinds(self) -> list[list[nn.Parameter]]:
        """The parameters of each flat buffer (one per dtype and device, in order of first appearance), in buffer
        order."""
        by_kind: dict[tuple, list[nn.Parameter]] = {}
        for p in self.params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        return list(by_kind.values())

    def _allocate(self) -> None:
        """The flat buffers, at the first backward rather than at start-up: the peers allocate gradients then
        too, and a stage's gradients are as large as its parameters, which start-up memory must not hold twice."""
        view_of: dict[int, torch.Tensor] = {}
        for group in self.kinds():
            dtype, device = group[0].dtype, group[0].device
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
            offset = 0
            for p in group:
                view_of[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats.append(flat)
        self.views = [view_of[id(p)] for p in self.params]

    def attach(self) -> None:
        """Make every ``param.grad`` a view of the flat buffer, keeping any gradient already accumulated."""
        if not self.allocated:
            self._allocate()
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is None:
                view.zero_()
                p.grad = view
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view

    def zero(self) -> None:
        if not self.allocated:  # nothing accumulated into the buffer yet
            for p in self.params:
                p.grad = None
            return
        for flat in self.flats:
            flat.zero_()
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view

    def all_reduce(self, group, *, timeout: float, describe: Callable[[], str], peer: int | None = None) -> None:
        """Sum the gradients over ``group`` in buckets of ``bucket_bytes``, all posted before any wait (in
        ``reduce_dtype``, if set: each bucket's narrowed copy is summed and copied back)."""
        works: list[Any] = []  # torch.distributed's work handles
        narrowed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bucket, its copy summed in reduce_dtype)
        for flat in self.flats:
            step = max(1, self.bucket_bytes // flat.element_size())
            for start in range(0, flat.numel(), step):
                bucket = flat[start : start + step]
                if wire_dtype(bucket.dtype, self.reduce_dtype) != bucket.dtype:
                    narrowed.append((bucket, bucket.to(self.reduce_dtype)))
                    bucket = narrowed[-1][1]
                works.append(dist.all_reduce(bucket, group=group, async_op=True))
        wait_all(works, timeout=timeout, describe=describe, peer=peer)
        for bucket, summed in narrowed:
            bucket.copy_(summed)


def all_reduce_tensor(tensor: torch.Tensor, group, *, timeout: float, describe: Callable[[], str]) -> None:
    """Sum one tensor over ``group`` with a bounded wait."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    wait_all([work], timeout=timeout, describe=describe, peer=None)


