"""Point-to-point transfer of cut values between neighbouring stages, and waits that cannot hang.

Every message is posted asynchronously (``isend``/``irecv``) with a tag derived from the micro-batch, the
direction and the leaf, so messages match regardless of the order in which they are posted. Every wait has a
timeout; when it expires, or a peer's connection closes, the error names this rank, its stage, the action
waiting and the peer.

With a wire dtype (``Varuna(..., wire_dtype=...)``, [Note: wire dtype] in :mod:`varuna_core.model.precision`) the
sender casts a value's wide float leaves with :func:`to_wire` (counting those that overflow), the receiver posts
buffers of the wire dtypes and :meth:`Pending.arrived` casts them back to the recorded dtypes; without one, every
leaf crosses in its recorded dtype, as it always did.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, ShapeMismatchError
from ..model.payload import TensorSpec, ValueSpec
from ..model.precision import overflow_threshold

__all__ = [
    "ACTIVATION", "GRADIENT", "Pending", "default_timeout", "post", "post_recv", "send", "wait_all", "check_value",
    "wire_leaves", "to_wire", "staged_through_host",
]

ACTIVATION = 0
GRADIENT = 1
_MAX_LEAVES = 256
_DEADLINE_REACHED = 0.99  # of the timeout: a wait that failed this late timed out (the backends round to ms)


def default_timeout() -> float:
    """Seconds any single wait may take (``VARUNA_TIMEOUT``, default 300)."""
    from ..env import TIMEOUT
    from ..util.checks import env_real

    value = env_real(TIMEOUT, os.environ.get(TIMEOUT), low=0, low_open=True)
    return 300.0 if value is None else value


def _tag(mb: int, kind: int, leaf: int) -> int:
    return ((mb * 2 + kind) * _MAX_LEAVES + leaf) % (2**31 - 1)


@dataclasses.dataclass
class Pending:
    """Posted receives of one value: the buffers and their work handles. ``device``: where the value is used,
    when the buffers are staged in host memory (see :func:`staged_through_host`). ``dtypes``: the recorded dtype of
    each leaf, when some buffer holds it in a wire dtype instead."""

    tensors: list[torch.Tensor]
    works: list[Any]
    peer: int
    what: str
    device: torch.device | None = None
    dtypes: list[torch.dtype] | None = None

    def ready(self) -> bool:
        """Whether every receive has completed, without waiting (always False on gloo until waited for)."""
        return all(w.is_completed() for w in self.works)

    def arrived(self) -> list[torch.Tensor]:
        """The received tensors on the device they are used on, in their recorded dtypes (call once the works are
        waited for)."""
        tensors = self.tensors
        if self.device is not None:
            tensors = [t.to(self.device, non_blocking=True) for t in tensors]
        if self.dtypes is None:
            return tensors
        return [t if t.dtype == dtype else t.to(dtype) for t, dtype in zip(tensors, self.dtypes, strict=True)]


def staged_through_host(device: torch.device, group=None) -> bool:
    """Whether point-to-point messages of tensors on ``device`` go through host memory: gloo moves CUDA tensors in
    its collectives but not in ``send``/``recv`` (it fails with "Bad address"), so a pipeline on GPUs under a gloo
    group (several ranks sharing one GPU, which NCCL refuses) sends host copies."""
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


def post_recv(
    specs: list[TensorSpec], n: int, *, src: int, mb: int, kind: int, device: torch.device, group, what: str,
    wire: list[torch.dtype] | None = None,
) -> Pending:
    """Post receives for tensors described by ``specs`` for ``n`` examples from global rank ``src``; ``wire``: the
    dtype each crosses in, where it is not the recorded one (see :func:`to_wire`)."""
    staged = staged_through_host(device, group)
    at = torch.device("cpu") if staged else device
    dtypes = [spec.torch_dtype for spec in specs]
    wire = dtypes if wire is None else wire
    tensors, works = [], []
    for leaf, (spec, dtype) in enumerate(zip(specs, wire, strict=True)):
        buf = torch.empty(spec.shape_for(n), dtype=dtype, device=at, pin_memory=staged)
        tensors.append(buf)
        try:
            works.append(dist.irecv(buf, src=src, group=group, tag=_tag(mb, kind, leaf)))
        except RuntimeError as exc:  # the connection to src failed already: gloo says so as the receive is posted
            raise _connection_failed(lambda: what, src, exc) from None
    return Pending(tensors, works, src, what, device if staged else None, None if wire == dtypes else dtypes)


def send(tensors: list[torch.Tensor], *, dst: int, mb: int, kind: int, group) -> list[Any]:
    """Post sends of ``tensors`` to global rank ``dst``; the caller keeps the tensors alive until waited (the
    work handles hold any copy made here: a contiguous one, or a host copy under :func:`staged_through_host`).
    On gloo it then yields the CPU once ([Note: yield after a send])."""
    works = []
    on_host = False
    for leaf, t in enumerate(tensors):
        staged = staged_through_host(t.device, group)
        wire = t.contiguous().to("cpu") if staged else t.contiguous()
        on_host = on_host or staged or wire.device.type == "cpu"
        try:
            works.append(dist.isend(wire, dst=dst, group=group, tag=_tag(mb, kind, leaf)))
        except RuntimeError as exc:  # the connection to dst failed already
            raise _connection_failed(lambda: f"sending micro-batch {mb} to rank {dst}", dst, exc) from None
    if works and on_host:
        os.sched_yield()
    return works


# [Note: yield after a send] gloo hands a send to its communication thread, which writes it to the socket. That
# thread is woken on the CPU the sending thread runs on, and the scheduler lets a thread that computes finish its
# slice before a woken one runs there, even when another core is idle: a sender that goes on computing right after
# posting a send (a stage's next forward) delayed about a third of its messages by its whole action, a few ms, while
# the receiving stage waited (2 local processes, 64 KiB messages, the sender busy 3 ms after each: 14 of 50 arrived
# 3.5 ms late; with a yield after the send none did, the slowest 0.28 ms). One ``sched_yield`` after a value's
# sends lets the communication thread run first; it costs a system call (~1 µs) and the few µs the thread takes.


def post(op: Callable[[], Any], *, describe: Callable[[], str], peer: int) -> Any:
    """``op()``, the posting of a send or receive to or from global rank ``peer``; gloo raises at once when the
    connection to the peer failed already, which becomes the error a failed wait gives (naming the peer)."""
    try:
        return op()
    except RuntimeError as exc:
        raise _connection_failed(describe, peer, exc) from None


def wait_all(works: list[Any], *, timeout: float, describe: Callable[[], str], peer: int | None) -> None:
    """Wait for every work handle, each within ``timeout`` seconds.

    A wait that fails once its deadline has passed timed out; one that fails sooner lost its connection (the
    peer died or closed it). Told apart by the clock, not by the error's text: gloo raises a plain
    ``RuntimeError`` for both, NCCL a ``torch.distributed.DistBackendError`` for both, and neither message is
    an interface.

    Raises:
        CommTimeoutError: naming what waited (``describe()``), the peer, and the rank that failed first.
    """
    delta = datetime.timedelta(seconds=timeout)
    for work in works:
        started = time.monotonic()
        try:
            work.wait(delta)
        except RuntimeError as exc:  # torch.distributed.DistError is one
            timed_out = time.monotonic() - started >= timeout * _DEADLINE_REACHED
            root = _report_failure(peer)
            blame = ""
            if root is not None and root != peer:
                blame = f"; rank {root} failed first"
            if timed_out:
                raise CommTimeoutError(
                    f"{describe()}: no progress within {timeout:g}s{blame}",
                    hint=f"check the log of rank {root if root is not None else peer}; set VARUNA_TIMEOUT "
                    "(seconds) if steps are legitimately slow",
                ) from None
            raise _connection_failed(describe, peer, exc, root) from None


def _connection_failed(describe: Callable[[], str], peer: int | None, exc: BaseException,
                       root: int | None = -1) -> CommTimeoutError:
    """The error of a wait or a post whose connection failed before its deadline (a peer died or closed it),
    naming the rank that failed first (``root``; -1: found here) and marked ``peer_lost``."""
    if root == -1:
        root = _report_failure(peer)
    blame = f"; rank {root} failed first" if root is not None and root != peer else ""
    who = f"rank {root}" if root is not None else "a peer"
    error = CommTimeoutError(f"{describe()}: the connection failed ({str(exc).splitlines()[0][:160]}){blame}",
                             hint=f"{who} crashed or was killed: check its log")
    error.peer_lost = True
    return error


def _report_failure(peer: int | None) -> int | None:
    """Record in the job's store that this rank lost ``peer``, and follow such records to the rank that
    failed first (the first one in the chain that left no record: it died without a word).

    A rank that dies takes its connections down, so its neighbours fail at once, then theirs: without this,
    a rank two hops away would blame its live neighbour instead of the dead rank. Falls back to ``peer``
    when the store is unreachable (e.g. it was hosted by the dead rank).
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        store.set_timeout(datetime.timedelta(seconds=2))
        store.set(f"varuna/lost/{me}", str(-1 if peer is None else peer))
        root, seen = peer, {me}
        while root is not None and root >= 0 and root not in seen:
            seen.add(root)
            if not store.check([f"varuna/lost/{root}"]):
                return root
            nxt = int(store.get(f"varuna/lost/{root}").decode())
            if nxt < 0:
                return root
            root = nxt
        return root if root is not None and root >= 0 else peer
    except Exception:  # noqa: BLE001 - the store is best effort: never mask the original failure
        return peer


def _dtype_ok(dtype: torch.dtype, want: TensorSpec) -> bool:
    """Exact dtype, or float for float: autocast on another device type may pick another float dtype than the
    CPU dry run did; such leaves are cast to the recorded dtype for the wire (see ``wire_leaves``)."""
    return str(dtype) == want.dtype or (dtype.is_floating_point and want.is_float)


def wire_leaves(leaves: list[torch.Tensor], spec: ValueSpec, wire: list[torch.dtype] | None = None,
                overflows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The tensors to send for a value's tensor leaves: detached, in the recorded dtype, or with ``wire`` (one dtype
    per leaf) as :func:`to_wire` casts them."""
    if wire is not None:
        return to_wire(leaves, wire, overflows)
    wants = [leaf for _, leaf in spec.tensor_leaves]
    return [t.detach() if str(t.dtype) == w.dtype else t.detach().to(w.torch_dtype)
            for t, w in zip(leaves, wants, strict=True)]


def to_wire(tensors: list[torch.Tensor], dtypes: list[torch.dtype],
            overflows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``tensors`` detached and cast to ``dtypes`` (one per tensor: the wire dtype of its leaf, see
    :func:`~varuna_core.model.precision.wire_dtype`). Each cast into a narrower exponent range that turns a finite
    value into inf adds one to ``overflows`` (a 0-d tensor on the tensors' device; no host sync): one ``aminmax``
    over the source decides it, before the cast. A tensor that holds inf or NaN already is not counted (an additive
    ``-inf`` mask is not an overflow; a NaN activation is the model's, not the wire's)."""
    out = []
    for t, dtype in zip(tensors, dtypes, strict=True):
        t = t.detach()
        if t.dtype == dtype:
            out.append(t)
            continue
        limit = overflow_threshold(t.dtype, dtype) if t.numel() else None
        if overflows is not None and limit is not None:
            lo, hi = torch.aminmax(t)
            overflows += (torch.maximum(hi, -lo) >= limit) & torch.isfinite(lo) & torch.isfinite(hi)
        out.append(t.to(dtype))
    return out


def check_value(leaves: list[Any], treespec: str, spec: ValueSpec, n: int, *, cut: str, stage: int) -> None:
    """Refuse to send a value whose structure, shapes or dtypes differ from what discovery recorded.

    A receiver posted buffers of the recorded shape, and a size mismatch aborts gloo; so the sender checks
    and the error names the cut instead.
    """
    problem = None
    if treespec != spec.treespec or len(leaves) != len(spec.leaves):
        problem = "its structure differs"
    else:
        for leaf, want in zip(leaves, spec.leaves, strict=True):
            if isinstance(want, TensorSpec):
                if not isinstance(leaf, torch.Tensor):
                    problem = f"a {type(leaf).__name__} stands where a tensor was recorded"
                elif tuple(leaf.shape) != want.shape_for(n) or not _dtype_ok(leaf.dtype, want):
                    problem = f"it is {list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
            elif isinstance(leaf, torch.Tensor) or leaf != want.value:
                problem = f"a constant changed to {leaf!r}"
            if problem:
                break
    if problem:
        raise ShapeMismatchError(
            f"stage {stage}: the value crossing CutPoint {cut!r} does not match discovery: {problem}; "
            f"expected {spec.describe(n)} for a micro-batch of {n}",
            hint="shapes at a cut must depend only on the batch size (pad variable-length inputs to a fixed length)",
        )
