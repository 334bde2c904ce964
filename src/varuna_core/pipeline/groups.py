"""The process group, the device, the sub-groups a stage talks in and what every rank must agree on at start-up.

* :func:`intended_world` reads the world size and rank without joining (so bad input is refused on every rank);
* :func:`ensure_process_group` joins (or creates, from torchrun-style variables) the default process group;
* :func:`resolve_device` checks the device asked for (:func:`~varuna_core.model.devices.check_device`), picks
  it and sets it as the current one;
* :func:`build_groups` creates the data-parallel group of every stage and one group per tied weight and replica;
* :func:`sync_initial_state` starts every replica of a stage and every copy of a tied weight from the same values;
* :func:`sync_written_buffers` gives every replica of a stage replica 0's written buffers after a step;
* :func:`agree_seed_and_run` broadcasts rank 0's dropout seed and run id;
* :func:`agree_started` makes a start-up error of one rank the error of every rank.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo  # before any process group exists: see _release_before_exit
import torch.distributed as dist
import torch.nn as nn

from .. import env
from ..errors import ConfigError, VarunaError
from ..ir.topology import Topology
from ..model.devices import check_device
from ..model.rng import MASK64
from ..model.stage import StageSlice, TieSet
from ..util.text import printable

__all__ = ["intended_world", "ensure_process_group", "collective_device", "resolve_device", "Groups",
           "build_groups", "tie_params", "sync_initial_state", "sync_written_buffers", "agree_seed_and_run",
           "agree_started", "broadcast_coalesced", "coalesced_batches"]

_RUN_ID_BYTES = 64


_release_registered = threading.Event()
_made: weakref.WeakSet = weakref.WeakSet()  # every Groups of this process, released before the interpreter exits


def _release_before_exit() -> None:
    """Free the process groups (and the tensors their finished work holds) while the interpreter is alive.

    A ``Varuna`` object sits in reference cycles (its supervision's callables), so a script's ``model`` outlives
    ``main()`` and, with it, the sub-groups and their gloo worker threads. Left to the interpreter's final
    collection, a worker thread that drops a tensor then needs the GIL of an interpreter being torn down, and
    the process dies with ``terminate called without an active exception`` (SIGABRT) after a successful run.
    ``atexit`` runs before that, so the collection and the teardown happen here, in order.

    The collection cannot free a ``Varuna`` that is still reachable: from a script's module globals, or from the
    signal handlers the supervision installs. Its sub-groups would live on into the teardown with their threads
    (destroying a group does not stop them while Python holds it), so every :class:`Groups` drops its groups
    first. And ``torch._dynamo`` (which every ``torch.optim`` optimizer imports), when first imported while a
    default group exists, keeps that group alive past ``destroy_process_group()`` (torch 2.13); this module
    imports it first, so that only a group the script made before importing varuna can still be held."""
    for groups in list(_made):
        groups.release()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def intended_world() -> tuple[int, int]:
    """``(world_size, rank)`` this process has or will have once :func:`ensure_process_group` joins: read from the
    default process group if one exists, else from torchrun-style env vars, without connecting to anyone.

    Lets a rank refuse a configuration that cannot fit the world (a stage-to-rank map for another world size)
    *before* joining: a rank that raised after joining would close its connections while a peer was still
    completing the full mesh, and that peer would report a lost connection instead of the real error."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    world = _env_int("WORLD_SIZE", "1")
    if world <= 1:
        return 1, 0
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set",
                          hint="launch with torchrun or `varuna launch`, which set them")
    rank = _env_int("RANK", "0")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}",
                          hint="ranks run from 0 to WORLD_SIZE-1; launch with torchrun or `varuna launch`")
    return world, rank


def _env_int(name: str, default: str) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer",
                          hint="launch with torchrun or `varuna launch`, which set it") from None


def ensure_process_group(timeout: float, device: torch.device | None = None) -> tuple[int, int]:
    """``(world_size, rank)``: the default process group if one exists; else one created from torchrun-style
    env vars (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, checked by :func:`intended_world`);
    ``(1, 0)`` for a single process. The backend follows the device the stage computes on (NCCL for CUDA,
    gloo otherwise; default: CUDA if this machine has it), so a CPU pipeline runs on a GPU host too.

    Also arranges, once per process, for the groups to be released before the interpreter shuts down (see
    :func:`_release_before_exit`)."""
    if not _release_registered.is_set():
        _release_registered.set()
        atexit.register(_release_before_exit)
    world, _ = intended_world()
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return intended_world()
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    backend = "nccl" if on_cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout, 60)))
    if backend == "gloo":
        # gloo connects every pair inside init_process_group, and a rank can return from it before its peers have:
        # one that then raised (bad input found on every rank) and exited would close its side of the mesh, and
        # the peer still connecting would report "Connection closed by peer" instead of its own, clearer error
        dist.barrier()
    else:
        _check_one_gpu_per_rank(device if device is not None else torch.device("cuda", torch.cuda.current_device()))
    return dist.get_world_size(), dist.get_rank()


def _check_one_gpu_per_rank(device: torch.device) -> None:
    """NCCL needs a GPU of its own per rank, and says so only at the first collective, as a ``DistBackendError``
    ("Duplicate GPU detected"). Every rank tells the others its host and GPU over a gloo group (NCCL cannot carry
    the question) and every rank raises the same :class:`ConfigError` naming the ranks that share one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(index).uuid), f"cuda:{index}")
    group = dist.new_group(backend="gloo")
    try:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    problem = shared_gpu(everyone)
    if problem is not None:
        raise ConfigError(problem, hint="give every process its own GPU (torchrun and `varuna launch` set LOCAL_RANK "
                                        "per process); to share one GPU, join a gloo group before Varuna(...) "
                                        "(dist.init_process_group('gloo')): cut values then cross through host memory")


def shared_gpu(devices: list[tuple[str, str, str]]) -> str | None:
    """The first GPU that two ranks would share, described; ``None`` if each rank has its own. ``devices[r]`` is
    rank ``r``'s ``(host, GPU uuid, device name)``."""
    first: dict[tuple[str, str], int] = {}
    for rank, (host, uuid, name) in enumerate(devices):
        other = first.setdefault((host, uuid), rank)
        if other != rank:
            return (f"ranks {other} and {rank} would both compute on {name} of host {printable(host)}, and NCCL needs "
                    f"one GPU per rank")
    return None


def resolve_device(device: Any, local_rank: int) -> torch.device:
    """``device`` as a ``torch.device``; ``-1``: CUDA ``local_rank`` (default ``LOCAL_RANK``) if available, else
    CPU. A CUDA device is made the current one. Checked by :func:`check_device` first."""
    resolved = check_device(device, local_rank)
    if resolved.type == "cuda" and resolved.index is not None and not isinstance(device, (str, torch.device)):
        torch.cuda.set_device(resolved.index)
    return resolved


@dataclass(eq=False)  # compared (and hashed, in _made) by identity
class Groups:
    """The groups this rank belongs to: its stage's data-parallel group (``None`` without replicas) and, per tied
    weight it holds a copy of, the group of its replica's copies."""

    dp: Any = None
    ties: list[tuple[TieSet, Any]] = field(default_factory=list)
    holders: list[Callable[[], None]] = field(default_factory=list)  # drop their own references at release

    def __post_init__(self) -> None:
        _made.add(self)

    def release(self) -> None:
        """Drop the groups (at exit: see :func:`_release_before_exit`), and have whoever keeps references to them
        (the overlapped gradient sync keeps its groups) drop theirs."""
        for drop in self.holders:
            drop()
        self.holders.clear()
        self.dp = None
        self.ties.clear()


def build_groups(topology: Topology, ties: list[TieSet], stage: int, replica: int, world_size: int,
                 timeout: float) -> Groups:
    """Create every process group on every rank, in one order (``new_group`` is collective)."""
    groups = Groups()
    if world_size == 1:
        return groups
    delta = datetime.timedelta(seconds=timeout)
    for s in range(topology.pp):
        ranks = list(topology.stage_ranks[s])
        group = dist.new_group(ranks, timeout=delta) if len(ranks) > 1 else None
        if s == stage:
            groups.dp = group
    made: dict[tuple[int, ...], Any] = {}
    for tie in ties:
        if len(tie.stages) < 2:
            continue
        for r in range(topology.dp):
            tie_ranks = tuple(topology.rank(s, r) for s in tie.stages)
            if tie_ranks not in made:
                made[tie_ranks] = dist.new_group(list(tie_ranks), timeout=delta)
            if r == replica and stage in tie.stages:
                groups.ties.append((tie, made[tie_ranks]))
    return groups


def tie_params(module: nn.Module, ties: list[TieSet], stage: int) -> dict[str, nn.Parameter]:
    """This stage's copy of each tied weight it holds, by canonical name (after slicing; the slicer never
    replaces them afterwards)."""
    slots = dict(module.named_parameters(remove_duplicate=False))
    return {tie.canonical: next(slots[n] for n in tie.names if slots[n].device.type != "meta")
            for tie in ties if stage in tie.stages}


def sync_initial_state(stage_slice: StageSlice, module: nn.Module, groups: Groups, tied: dict[str, nn.Parameter],
                       topology: Topology, stage: int, replica: int, world_size: int) -> None:
    """Start every replica of a stage, and every copy of a tied weight, from the same values (like DDP)."""
    if world_size == 1:
        return
    if groups.dp is not None:
        tensors = [p.data for _, p in stage_slice.param_names]
        tensors += [b for b in module.buffers() if b.device.type != "meta"]
        broadcast_coalesced(tensors, src=topology.rank(stage, 0), group=groups.dp)
    for tie, group in groups.ties:
        src = topology.rank(tie.stages[0], replica)
        broadcast_coalesced([tied[tie.canonical].data], src=src, group=group)


def sync_written_buffers(stage_slice: StageSlice, groups: Groups, topology: Topology, stage: int) -> None:
    """After a step, every replica of the stage takes replica 0's values of the buffers the forward writes.

    [Note: replica buffers] Each replica runs only its own micro-batches, so the buffers its forward updates
    (BatchNorm statistics, counters) drift apart between replicas. As DDP does with ``broadcast_buffers=True``,
    replica 0's buffers win, once per step, and the next step starts from them on every replica. Only the
    written buffers travel (none, and no message, for a stage without any)."""
    if groups.dp is None:
        return
    tensors = stage_slice.buffer_writes.live()
    if tensors:
        broadcast_coalesced(tensors, src=topology.rank(stage, 0), group=groups.dp)


def agree_started(error: BaseException | None, *, rank: int, world_size: int, first_wins: bool = False) -> None:
    """Every rank says whether its start-up so far succeeded; if one failed, every rank raises.

    A start-up error of one rank (slicing its stage, loading its weights: work that differs between ranks) must
    not leave the others in the next collective until their timeout: all meet here first. A failing rank raises
    its own error (with ``first_wins``, only the first failing rank does: the later ones failed because of it,
    as stages running on what a failed stage sent them); the others raise a
    :class:`~varuna_core.errors.ConfigError` naming the first failing rank and its error."""
    if world_size == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (type(error).__name__, str(error).splitlines()[0] if str(error) else "",
                                       isinstance(error, VarunaError))
    reports: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(reports, mine)
    except Exception:
        if error is not None:  # a peer is gone too: this rank's own error says more than the lost connection
            raise error from None
        raise
    failed = [(r, report) for r, report in enumerate(reports) if report is not None]
    if error is not None and (not first_wins or failed[0][0] == rank):
        raise error
    if failed:
        first, (kind, text, ours) = failed[0]
        others = f" (and rank {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
        raise ConfigError(f"rank {first}{others} failed at start-up with {kind}: {text}",
                          hint=f"a pipeline needs every rank, so every rank stops; see rank {first}'s log"
                          + ("" if ours else " for the traceback")) from error


def agree_seed_and_run(seed: int | None, world_size: int, run_id: str | None = None) -> tuple[int, str]:
    """The dropout seed (unsigned 64-bit) and the run id, identical on every rank (rank 0's choice wins).

    ``torch.initial_seed()`` of an unseeded process is a random value in ``[0, 2**64)``: it travels as the
    int64 with the same bits. The run id is ``run_id`` (``VARUNA_RUN_ID``, set by ``varuna launch``: see
    :class:`~varuna_core.env.WorkerEnv`) or a fresh one."""
    from ..checkpoint.layout import check_run_id, new_run_id

    value = (int(seed) if seed is not None else torch.initial_seed()) & MASK64
    run = check_run_id(run_id, env.RUN_ID) if run_id else new_run_id()
    if world_size > 1:
        packed = torch.zeros(2 + _RUN_ID_BYTES, dtype=torch.int64)
        packed[0] = value - 2**64 if value >= 2**63 else value
        packed[1] = len(run)
        packed[2:2 + len(run)] = torch.tensor(list(run.encode()), dtype=torch.int64)
        packed = packed.to(collective_device())
        dist.broadcast(packed, src=0)
        packed = packed.cpu()
        value = int(packed[0]) & MASK64
        run = bytes(int(b) for b in packed[2:2 + int(packed[1])]).decode()
    return value, run


def collective_device() -> torch.device:
    """Where a tensor of a collective on the default group must live: the current CUDA device under NCCL (which
    has no CPU transport), the CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


BROADCAST_BUCKET = 25 * 2**20  # bytes flattened into one message (the gradient buckets' default size)


def broadcast_coalesced(tensors: list[torch.Tensor], *, src: int, group, bucket_bytes: int = BROADCAST_BUCKET) -> None:
    """Broadcast ``tensors`` from ``src``: per dtype and device, small ones flattened together into messages of at
    most ``bucket_bytes``, a contiguous one of that size or more in place. Flattening a stage's whole state at once
    (as this did) held a second copy of it at start-up: a peak of twice the stage under data parallelism."""
    for batch in coalesced_batches(tensors, bucket_bytes):
        if len(batch) == 1 and batch[0].is_contiguous():
            dist.broadcast(batch[0], src=src, group=group)
            continue
        flat = torch._utils._flatten_dense_tensors(batch)
        dist.broadcast(flat, src=src, group=group)
        for t, synced in zip(batch, torch._utils._unflatten_dense_tensors(flat, batch), strict=True):
            t.copy_(synced)


def coalesced_batches(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype and device, each group in order and cut into batches of at most
    ``bucket_bytes`` (a tensor of that size or more alone), the same on every rank."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    out: list[list[torch.Tensor]] = []
    for group_tensors in by_kind.values():
        batch: list[torch.Tensor] = []
        size = 0
        for t in group_tensors:
            nbytes = t.numel() * t.element_size()
            if batch and size + nbytes > bucket_bytes:
                out.append(batch)
                batch, size = [], 0
            batch.append(t)
            size += nbytes
        if batch:
            out.append(batch)
    return out
