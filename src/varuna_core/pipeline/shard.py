"""Optimizer state sharded over a stage's data-parallel replicas (ZeRO-1; ``Varuna(..., shard_optimizer=True)``).

Each replica owns one contiguous range of every flat gradient buffer (:class:`~varuna_core.pipeline.grads.
GradBuffer`: one per dtype and device, parameters in order). After the pipeline, the gradients are
**reduce-scattered** (each replica ends with the sum over replicas of its own range only), the user's optimizer
steps **only the pieces of the parameters in that range**, and the updated pieces are **all-gathered** into every
replica's parameters. A rank then holds the optimizer state of ``1/dp`` of its stage.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it all-reduces the gradients and then broadcasts
each parameter from its owner, 1.5x the bytes of the all-reduce alone. A reduce-scatter and an all-gather move
exactly what one ring all-reduce moves (``2 (d-1)/d`` of the buffer per rank). gloo's ``reduce_scatter`` is an
all-reduce underneath (measured: the same bytes on the wire), so both collectives here are rings of
point-to-point messages over the stage's data-parallel group, in buckets of ``bucket_bytes``.

**Pieces are boxes.** A range boundary that falls inside a parameter is moved to the nearest row (the first
dimension longer than 1) of it, so each replica's piece of a parameter is ``param.narrow(dim, start, length)``: a
view of the parameter, contiguous, and a box of the parameter's shape, which is what a checkpoint stores as one
chunk of the logical tensor ``optim/<name>/<state>`` (``torch.distributed.checkpoint`` reshards chunks, so a
sharded run's checkpoint loads unsharded and the reverse). The ranges are then uneven by at most a row at each
boundary.

**The user's optimizer stays the user's.** Its ``param_groups`` keep their dicts and hyper-parameters (a learning
rate scheduler works as before); each group's ``params`` become the pieces this replica owns (a
:class:`torch.nn.Parameter` sharing the parameter's storage, whose ``.grad`` is the matching view of the reduced
gradient buffer). ``optimizer.step()`` updates the pieces in place, and a step post-hook all-gathers them.
Only optimizers whose update is element-wise give a piece the update the whole tensor would give it
(:data:`ELEMENTWISE`); others are refused (see :func:`check_shardable`).

After the reduce-scatter, ``param.grad`` outside this replica's range holds partial sums: the gradient norm and
clipping (``step(clip_grad_max_norm=...)``) use the pieces, each element counted once over the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ConfigError
from .p2p import post, staged_through_host, wait_all

__all__ = ["ELEMENTWISE", "Piece", "ShardLayout", "OptimizerShards", "check_shardable",
           "register_elementwise_optimizer"]

# torch.optim classes whose update of an element depends only on that element's parameter, gradient and state
# (and on 0-d state such as ``step``): stepping a piece gives the piece of the whole tensor's update. Not here:
# LBFGS (a closure over the whole model), SparseAdam (sparse gradients), Adafactor (row and column statistics),
# and any optimizer that orthogonalises or normalises whole matrices.
ELEMENTWISE: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in
    ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name))
_registered: list[type] = []


def register_elementwise_optimizer(cls: type) -> type:
    """Declare an optimizer class element-wise, so that ``shard_optimizer=True`` accepts it (usable as a class
    decorator). Its ``step`` must update each element from that element's parameter, gradient and state alone,
    with state tensors shaped as the parameter (or 0-d)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"register_elementwise_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    if cls not in _registered:
        _registered.append(cls)
    return cls


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose update is not known to be element-wise: stepped on pieces it would compute
    something else than on the whole tensors, silently."""
    kind = type(optimizer)
    if kind in ELEMENTWISE or kind in _registered:
        return
    raise ConfigError(
        f"shard_optimizer=True cannot shard {kind.__module__}.{kind.__qualname__}: its update is not known to be "
        "element-wise (each element from its own parameter, gradient and state), and stepped on pieces of tensors "
        "it would compute something else",
        hint="use shard_optimizer=False, or, if its update is element-wise, declare it with "
             "varuna_core.register_elementwise_optimizer(" + kind.__qualname__ + ")")


@dataclass(frozen=True)
class Piece:
    """This replica's piece of one parameter: ``param.narrow(dim, start, length)``, elements
    ``[flat_start, flat_start + numel)`` of its flat buffer. ``dim`` is None for a parameter owned whole with no
    dimension longer than 1 (a scalar): then ``start, length = 0, 1``."""

    index: int  # in ShardLayout.params
    dim: int | None
    start: int
    length: int
    flat_start: int
    numel: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of ``tensor`` (the parameter, its gradient or a state tensor of its shape): a view."""
        return tensor if self.dim is None else tensor.narrow(self.dim, self.start, self.length)

    def offsets(self, ndim: int) -> tuple[int, ...]:
        """Where the piece starts in the whole tensor (a checkpoint chunk's offsets)."""
        return tuple(self.start if d == self.dim else 0 for d in range(ndim))


def _cut_dim(shape: torch.Size) -> int | None:
    """The dimension pieces of a tensor of ``shape`` are cut along: the first longer than 1 (the leading ones of
    length 1 keep the piece contiguous)."""
    return next((d for d, n in enumerate(shape) if n > 1), None)


class ShardLayout:
    """Which elements of each flat gradient buffer each of ``dp`` replicas owns, and this replica's pieces.

    Args:
        kinds: the parameters of each flat buffer, in buffer order (:attr:`GradBuffer.kinds`).
        dp, replica: the replicas of the stage and this one's index.
    """

    def __init__(self, kinds: list[list[nn.Parameter]], dp: int, replica: int) -> None:
        self.dp, self.replica, self.kinds = dp, replica, kinds
        self.params = [p for kind in kinds for p in kind]
        self.where: list[tuple[int, int]] = []  # per parameter: (its flat buffer, its offset there)
        self.bounds: list[list[int]] = []  # per flat buffer: dp + 1 element offsets, replica r owns [b[r], b[r+1])
        self.pieces: list[Piece] = []  # this replica's, in parameter order
        index = 0
        for k, kind in enumerate(kinds):
            offsets, total = [], 0
            for p in kind:
                offsets.append(total)
                self.where.append((k, total))
                total += p.numel()
            bounds = [0]
            for r in range(1, dp):
                bounds.append(max(bounds[-1], _snap(round(r * total / dp), kind, offsets)))
            bounds.append(total)
            self.bounds.append(bounds)
            lo, hi = bounds[replica], bounds[replica + 1]
            for p, offset in zip(kind, offsets, strict=True):
                start, stop = max(lo, offset), min(hi, offset + p.numel())
                if start < stop:
                    self.pieces.append(_piece(index, p, offset, start, stop))
                index += 1

    def ranges(self, kind: int) -> list[tuple[int, int]]:
        """``[(start, stop)]`` of each replica in flat buffer ``kind``."""
        b = self.bounds[kind]
        return [(b[r], b[r + 1]) for r in range(self.dp)]

    def owned(self) -> Iterator[tuple[nn.Parameter, Piece]]:
        for piece in self.pieces:
            yield self.params[piece.index], piece


def _snap(target: int, kind: list[nn.Parameter], offsets: list[int]) -> int:
    """The row boundary (of the parameter holding element ``target``) nearest to ``target``."""
    for p, offset in zip(kind, offsets, strict=True):
        if offset <= target < offset + p.numel():
            dim = _cut_dim(p.shape)
            row = p.numel() if dim is None else p.numel() // p.shape[dim]  # elements per row (along dim)
            return offset + round((target - offset) / row) * row
    return target  # at the end of the buffer


def _piece(index: int, p: nn.Parameter, offset: int, start: int, stop: int) -> Piece:
    dim = _cut_dim(p.shape)
    if dim is None:
        return Piece(index, None, 0, 1, start, stop - start)
    row = p.numel() // p.shape[dim]
    return Piece(index, dim, (start - offset) // row, (stop - start) // row, start, stop - start)


class OptimizerShards:
    """The user's optimizer stepping this replica's pieces, and the collectives around it.

    Args:
        layout: this replica's pieces.
        optimizer: the user's, over the stage's parameters (checked by :func:`check_shardable`); its
            ``param_groups`` are rewritten to hold the pieces, and state it already holds is cut to them.
        group, ranks: the stage's data-parallel group and its global ranks in replica order.
        bucket_bytes: the most bytes one collective moves at once (per replica: ``bucket_bytes / dp``).
        timeout, describe: bounded waits, named as the rest of the step's communication.
    """

    def __init__(self, layout: ShardLayout, optimizer: torch.optim.Optimizer, *, group: Any, ranks: list[int],
                 bucket_bytes: int, timeout: float, describe: Callable[[str], str]) -> None:
        check_shardable(optimizer)
        self.layout, self.optimizer, self.group, self.ranks = layout, optimizer, group, ranks
        self.bucket_bytes, self.timeout, self.describe = bucket_bytes, timeout, describe
        self.shards: dict[int, tuple[nn.Parameter, Piece]] = {}  # id(parameter) -> (its piece's Parameter, piece)
        for p, piece in layout.owned():
            if not p.is_contiguous():
                raise ConfigError(f"shard_optimizer=True needs contiguous parameters; one of shape {list(p.shape)} "
                                  "is not", hint="make it contiguous in the model, or use shard_optimizer=False")
            self.shards[id(p)] = (nn.Parameter(piece.of(p.detach()), requires_grad=p.requires_grad), piece)
        self._rewrite()
        self._hook = optimizer.register_step_post_hook(lambda *_: self.all_gather())

    @property
    def dp(self) -> int:
        return self.layout.dp

    def boxes(self) -> Iterator[tuple[nn.Parameter, nn.Parameter, tuple[int, ...]]]:
        """``(parameter, the Parameter the optimizer steps for its piece, the piece's offsets in it)`` for each
        piece of this replica."""
        for p, piece in self.layout.owned():
            yield p, self.shards[id(p)][0], piece.offsets(p.dim())

    def _rewrite(self) -> None:
        """Each group's parameters become their pieces on this replica (none: an empty group); state the optimizer
        held for a whole parameter is cut to its piece (dropped for parameters this replica owns none of)."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            pieces = []
            for p in group["params"]:
                shard = self.shards.get(id(p))
                held = state.pop(p, None)
                if shard is None:
                    continue
                pieces.append(shard[0])
                if held:
                    state[shard[0]] = {k: _cut(v, p, shard[1]) for k, v in held.items()}
            group["params"] = pieces

    def close(self) -> None:
        self._hook.remove()

    def _repoint(self) -> None:
        """A parameter whose storage moved (a parked stage put on its device at a handover's go) gets its piece
        made again over the new storage, in the same Parameter object (the optimizer's state is keyed by it)."""
        for p, piece in self.layout.owned():
            shard = self.shards[id(p)][0]
            view = piece.of(p.detach())
            if shard.data_ptr() != view.data_ptr() or shard.device != view.device:
                shard.data = view

    # ------------------------------------------------------------------------------------------------------

    def reduce_scatter(self, flats: list[torch.Tensor]) -> None:
        """Sum each flat gradient buffer over the replicas into this replica's range (the rest of the buffer holds
        partial sums afterwards), then attach each piece's gradient: its view of the buffer."""
        self._repoint()
        for kind, flat in enumerate(flats):
            self._ring(flat, kind, reduce=True)
        views = self._grad_views(flats)
        for (shard, _), grad in zip(self.shards.values(), views, strict=True):
            shard.grad = grad

    def all_gather(self) -> None:
        """Every replica's updated pieces into every replica's parameters (after ``optimizer.step()``)."""
        self._repoint()
        with torch.no_grad():
            for kind in range(len(self.layout.bounds)):
                self._gather_kind(kind)

    def grads(self) -> list[torch.Tensor]:
        """The pieces' gradients (attached by :meth:`reduce_scatter`), in parameter order."""
        grads = [shard.grad for shard, _ in self.shards.values()]
        if any(g is None for g in grads):
            raise RuntimeError("a piece of the sharded optimizer has no gradient attached")
        return [g for g in grads if g is not None]

    def _grad_views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        views = []
        for p, piece in self.layout.owned():
            flat = flats[self.layout.where[piece.index][0]]
            views.append(flat[piece.flat_start : piece.flat_start + piece.numel].view(piece.of(p).shape))
        return views

    # ------------------------------------------------------------------------------------------------------
    # Rings of point-to-point messages over the data-parallel group

    def _buckets(self, kind: int) -> Iterator[list[tuple[int, int]]]:
        """Per bucket, ``[(start, stop)]`` of each replica's chunk in flat buffer ``kind`` (possibly empty)."""
        ranges = self.layout.ranges(kind)
        itemsize = self.layout.kinds[kind][0].element_size()
        per = max(1, self.bucket_bytes // itemsize // self.dp)
        longest = max(stop - start for start, stop in ranges)
        for at in range(0, longest, per):
            yield [(min(start + at, stop), min(start + at + per, stop)) for start, stop in ranges]

    def _ring(self, flat: torch.Tensor, kind: int, *, reduce: bool) -> None:
        host = staged_through_host(flat.device, self.group)
        work = flat.cpu() if host else flat
        for chunks in self._buckets(kind):
            views = [work[a:b] for a, b in chunks]
            if reduce:
                self._reduce_scatter_bucket(views)
            else:
                self._all_gather_bucket(views)
        if host:
            lo, hi = self.layout.ranges(kind)[self.layout.replica]
            flat[lo:hi].copy_(work[lo:hi])

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, what: str) -> None:
        """Send ``send`` to the next replica while ``recv`` arrives from the previous one, in messages of at most
        :data:`MESSAGE_BYTES`, at most :data:`WINDOW` of them in flight each way. Measured over a rate-limited
        full-duplex link (200 Mbit/s, 6 MB each way): one message, or one at a time, took 0.50 s (half the link);
        all of them at once 0.28-0.54 s (the queue behind the link fills and delays the other direction's
        acknowledgements); a few small ones in flight 0.28 s every time. In a step (benchmarks/shard_speed.py)
        256 KiB x 4 cost 6% on the loopback (more messages), 1 MiB x 4 10% on the slow link; 512 KiB x 4 neither.
        Each send goes out in one batch with its receive: under NCCL a send and a receive between the same two
        ranks (dp = 2) must be issued together."""
        d, me = self.dp, self.layout.replica
        nxt, prv = self.ranks[(me + 1) % d], self.ranks[(me - 1) % d]
        sends, recvs = _parts(send), _parts(recv)
        def describe() -> str:
            return self.describe(what)

        pending: list[list[Any]] = []
        for tag in range(max(len(sends), len(recvs))):
            ops = []
            if tag < len(sends):
                ops.append(dist.P2POp(dist.isend, sends[tag], peer=nxt, group=self.group, tag=tag))
            if tag < len(recvs):
                ops.append(dist.P2POp(dist.irecv, recvs[tag], peer=prv, group=self.group, tag=tag))
            pending.append(post(lambda ops=ops: dist.batch_isend_irecv(ops), peer=prv,  # type: ignore[misc]
                                describe=describe))
            if len(pending) >= WINDOW:
                wait_all(pending.pop(0), timeout=self.timeout, describe=describe, peer=prv)
        for works in pending:
            wait_all(works, timeout=self.timeout, describe=describe, peer=prv)

    def _reduce_scatter_bucket(self, chunks: list[torch.Tensor]) -> None:
        """Ring reduce-scatter: after ``dp - 1`` steps this replica's chunk holds the sum of every replica's.
        Step ``s`` sends chunk ``me - s - 1`` (summed over ``s + 1`` replicas) on and adds the one of ``me - s -
        2`` received."""
        d, me = self.dp, self.layout.replica
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
        for s in range(d - 1):
            send, into = chunks[(me - s - 1) % d], chunks[(me - s - 2) % d]
            received = scratch[: into.numel()]
            self._exchange(send, received, "data-parallel reduce-scatter of the gradients")
            into.add_(received)

    def _all_gather_bucket(self, chunks: list[torch.Tensor]) -> None:
        """Ring all-gather: step ``s`` sends chunk ``me - s`` on and receives chunk ``me - s - 1``."""
        d, me = self.dp, self.layout.replica
        for s in range(d - 1):
            self._exchange(chunks[(me - s) % d], chunks[(me - s - 1) % d],
                           "data-parallel all-gather of the updated parameters")

    def _gather_kind(self, kind: int) -> None:
        """All-gather flat buffer ``kind``'s parameters bucket by bucket through one bucket of scratch: this
        replica's chunk copied out of its parameters, the others' copied into them."""
        params = self.layout.kinds[kind]
        if not params:
            return
        device, dtype = params[0].device, params[0].dtype
        host = staged_through_host(device, self.group)
        segments = _segments(params)
        for chunks in self._buckets(kind):
            sizes = [b - a for a, b in chunks]
            scratch = torch.empty(sum(sizes), dtype=dtype, device="cpu" if host else device)
            views = list(scratch.split(sizes))
            me = self.layout.replica
            _copy_range(segments, chunks[me], views[me], out=True)
            self._all_gather_bucket(views)
            for r, (chunk, view) in enumerate(zip(chunks, views, strict=True)):
                if r != me:
                    _copy_range(segments, chunk, view, out=False)


MESSAGE_BYTES = 2**19  # the ring's messages (see OptimizerShards._exchange)
WINDOW = 4  # messages in flight each way


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` (1-D) in views of at most :data:`MESSAGE_BYTES` (none if it is empty)."""
    if not tensor.numel():
        return []
    step = max(1, MESSAGE_BYTES // tensor.element_size())
    return list(tensor.split(step))


def _cut(value: Any, p: nn.Parameter, piece: Piece) -> Any:
    """A state value the optimizer held for the whole parameter, for its piece: a tensor of the parameter's shape
    is cut (a copy), anything else (a 0-d ``step``, a number) is kept."""
    if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
        return piece.of(value).clone()
    return value


def _segments(params: list[nn.Parameter]) -> list[tuple[int, torch.Tensor]]:
    """``(flat offset, flattened view)`` of each parameter of one flat buffer."""
    out, offset = [], 0
    for p in params:
        out.append((offset, p.detach().view(-1)))
        offset += p.numel()
    return out


def _copy_range(segments: list[tuple[int, torch.Tensor]], span: tuple[int, int], buffer: torch.Tensor, *,
                out: bool) -> None:
    """Copy elements ``[start, stop)`` of the parameters' flat space into ``buffer`` (``out``) or back."""
    start, stop = span
    for offset, flat in segments:
        lo, hi = max(start, offset), min(stop, offset + flat.numel())
        if lo >= hi:
            continue
        part, mine = buffer[lo - start : hi - start], flat[lo - offset : hi - offset]
        if out:
            part.copy_(mine)
        else:
            mine.copy_(part if part.device == mine.device else part.to(mine.device))
