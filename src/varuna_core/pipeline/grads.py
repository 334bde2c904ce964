"""Gradient storage and its data-parallel all-reduce, bucket by bucket.

Gradients of a stage live in one flat buffer per dtype (``param.grad`` are views into it), so the
data-parallel all-reduce runs on large contiguous buckets with no packing copies, and ``optimizer.zero_grad()``
(which sets grads to ``None``) costs nothing: the views are re-attached, zeroed, at the next step.

The buckets (:meth:`GradBuffer.buckets`) are consecutive ranges of ``bucket_bytes`` of each flat buffer; one
bucket is put on the wire by :meth:`GradBuffer.launch` and completed by :meth:`BucketReduction.wait`, whoever
decides when (after the pipeline: :meth:`GradBuffer.all_reduce`; during the last backward:
:mod:`varuna_core.pipeline.overlap`). Their boundaries do not depend on when they are launched: see [Note: bucket
boundaries] there.

[Note: loss weighting] The last stage scales each micro-batch's loss by ``examples in micro-batch / global
batch``. Summing gradients over micro-batches, stages of a tied weight and replicas then gives exactly the
gradient of the global batch's mean loss, in fp32 too; so both syncs below are plain sums. (The original
averaged only in its fp16 path and never copied the reduced fp32 buffer back.)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.precision import wire_dtype
from .p2p import wait_all

__all__ = ["Bucket", "BucketReduction", "GradBuffer", "PairSum", "all_reduce_tensor", "post_tie_sum", "sum_small",
           "tie_tag"]


@dataclass(frozen=True)
class Bucket:
    """Elements ``[start, stop)`` of flat buffer ``kind``, and the parameters whose gradients overlap them (indices
    in :attr:`GradBuffer.params`, in buffer order)."""

    kind: int
    start: int
    stop: int
    params: tuple[int, ...]


@dataclass
class BucketReduction:
    """One bucket's all-reduce, posted: :meth:`wait` completes it (a bounded wait) and, where the bucket was summed
    in a narrower ``reduce_dtype``, copies the sum back into the gradients."""

    bucket: Bucket
    works: list[Any] = field(default_factory=list)  # torch.distributed's work handles
    narrowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (the bucket's gradients, their copy being summed)

    def wait(self, *, timeout: float, describe: Callable[[], str], peer: int | None = None) -> None:
        wait_all(self.works, timeout=timeout, describe=describe, peer=peer)
        if self.narrowed is not None:
            view, summed = self.narrowed
            view.copy_(summed)
            self.narrowed = None


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

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffers, allocated or not: as many as the parameters'."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def touch(self) -> int:
        """Allocate the flat buffers now and write every page of them; returns their bytes. For a warm worker of a
        morph, before its go: its first step would otherwise fault fresh memory in a page at a time, on the
        critical path (1 GiB: 0.45 s on the test VM of benchmarks/README.md, against 0.05 s once written)."""
        if not self.allocated:
            self._allocate()
        for flat in self.flats:
            flat.zero_()
        return sum(flat.numel() * flat.element_size() for flat in self.flats)

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

    def release(self) -> None:
        """Free the flat buffers (every ``param.grad`` becomes ``None``); the next :meth:`attach` allocates them
        again, zeroed. For a process about to stop training: its gradients are no part of a checkpoint."""
        for p in self.params:
            p.grad = None
        self.flats, self.views = [], []

    def zero(self) -> None:
        if not self.allocated:  # nothing accumulated into the buffer yet
            for p in self.params:
                p.grad = None
            return
        for flat in self.flats:
            flat.zero_()
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view

    def buckets(self) -> list[Bucket]:
        """The all-reduce's buckets in buffer order: each flat buffer cut into ranges of ``bucket_bytes`` from its
        start (the last one shorter). They depend only on the parameters' sizes and dtypes, so they are the same
        on every replica and at every step, whoever launches them when."""
        out = []
        index = {id(p): i for i, p in enumerate(self.params)}
        for k, kind in enumerate(self.kinds()):
            spans, offset = [], 0
            for p in kind:  # (first element, end, parameter index) in buffer order
                spans.append((offset, offset + p.numel(), index[id(p)]))
                offset += p.numel()
            step = max(1, self.bucket_bytes // kind[0].element_size())
            for start in range(0, offset, step):
                stop = min(start + step, offset)
                out.append(Bucket(k, start, stop, tuple(i for a, b, i in spans if a < stop and b > start)))
        return out

    def launch(self, bucket: Bucket, group) -> BucketReduction:
        """Post the sum of ``bucket``'s gradients over ``group`` (in place, or in a narrowed copy under
        ``reduce_dtype``); :meth:`BucketReduction.wait` completes it. Every bucket goes on the wire here."""
        view = self.flats[bucket.kind][bucket.start : bucket.stop]
        if wire_dtype(view.dtype, self.reduce_dtype) != view.dtype:  # summed in reduce_dtype, copied back in wait
            summed = view.to(self.reduce_dtype)
            return BucketReduction(bucket, [dist.all_reduce(summed, group=group, async_op=True)], (view, summed))
        return BucketReduction(bucket, [dist.all_reduce(view, group=group, async_op=True)])

    def all_reduce(self, group, *, timeout: float, describe: Callable[[], str], peer: int | None = None) -> None:
        """Sum the gradients over ``group`` in buckets of ``bucket_bytes``, all posted before any wait (in
        ``reduce_dtype``, if set: each bucket's narrowed copy is summed and copied back)."""
        posted = [self.launch(bucket, group) for bucket in self.buckets()]
        for reduction in posted:
            reduction.wait(timeout=timeout, describe=describe, peer=peer)


def all_reduce_tensor(tensor: torch.Tensor, group, *, timeout: float, describe: Callable[[], str]) -> None:
    """Sum one tensor over ``group`` with a bounded wait."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    wait_all([work], timeout=timeout, describe=describe, peer=None)


# [Note: hops of small sums] gloo's all-reduce is a ring: over W ranks, 2(W-1) hops one after the other, each the
# wake-up of a receiving thread. Measured between two processes on one 2-core machine (loopback): 0.65 ms for the
# step's 5 float64, 1.2 ms for a tied embedding's 4,160 float32; an all-gather of the 5 numbers takes 0.32 ms (W-1
# hops), a swap of the 4,160 between the two ranks 0.36 ms (one hop). Both are on the critical path of every step:
# after the last backward comes the tied weights' sum, then the step's sum of loss, norm and flags. So on gloo:
# * the step's sum (and the evaluation's) is an all-gather, each rank adding the W values in rank order: the same
#   bits on every rank; over two ranks the ring's bits too (a + b == b + a); over more, the order of a float64 sum
#   of W numbers is another one than the ring's (last bits of the loss and of the norm);
# * a tied weight held by two stages (the usual embedding and head) is swapped: each rank sends its gradient and
#   adds the other's, a + b on one, b + a on the other, the bits the ring gives both. Ties over more stages, and
#   NCCL, keep the all-reduce.
_SMALL_SUM = 4096  # elements: a step's sum has 4 + 2 * (stages - 1)


def sum_small(tensor: torch.Tensor, group, *, timeout: float, describe: Callable[[], str]) -> None:
    """Sum a small tensor over ``group`` in place, every rank adding the members' values in rank order ([Note:
    hops of small sums]); an all-reduce for a large one or off gloo."""
    if tensor.numel() > _SMALL_SUM or tensor.device.type != "cpu" or dist.get_backend(group) != "gloo":
        all_reduce_tensor(tensor, group, timeout=timeout, describe=describe)
        return
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True)
    wait_all([work], timeout=timeout, describe=describe, peer=None)
    total = parts[0]
    for part in parts[1:]:
        total.add_(part)
    tensor.copy_(total)


class PairSum:
    """A tensor summed over a group of two ranks by swapping copies ([Note: hops of small sums]): the receive and
    the send posted at once; :meth:`wait` (bounded, as a work handle's) completes both and adds the received copy
    into ``tensor`` in place (it keeps its identity: a view of the gradient buffer). Quacks like the work handle
    of an asynchronous all-reduce for :func:`~varuna_core.pipeline.p2p.wait_all`."""

    def __init__(self, tensor: torch.Tensor, group, peer: int, tag: int) -> None:
        self.tensor = tensor
        self._other: torch.Tensor | None = torch.empty_like(tensor)
        self._works: list[Any] = [dist.irecv(self._other, src=peer, group=group, tag=tag),
                                  dist.isend(tensor, dst=peer, group=group, tag=tag)]

    def is_completed(self) -> bool:
        return self._other is None  # gloo cannot tell a receive completed before a wait

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        if self._other is not None:  # the send has completed too: the tensor may change now
            self.tensor.add_(self._other)
            self._other = None
        return True


def post_tie_sum(tensor: torch.Tensor, group, tag: int) -> Any:
    """Post the sum of a tied weight's gradient over its stages' ranks (``group``): a :class:`PairSum` for two on
    gloo, else an asynchronous all-reduce. Either is completed by :func:`~varuna_core.pipeline.p2p.wait_all`."""
    if tensor.device.type == "cpu" and tensor.is_contiguous() and dist.get_backend(group) == "gloo" \
            and dist.get_world_size(group) == 2:
        me = dist.get_rank()
        peer = next(r for r in dist.get_process_group_ranks(group) if r != me)
        return PairSum(tensor, group, peer, tag)
    return dist.all_reduce(tensor, group=group, async_op=True)


def tie_tag(canonical: str) -> int:
    """The message tag of a tied weight's swap: the same on every stage that holds it."""
    return zlib.crc32(canonical.encode()) & 0x7FFFFFFF


