"""``varuna plan``: choose pipeline depth, data-parallel width, micro-batch size and schedule from a profile.

For every candidate (pp, dp = ⌊gpus / pp⌋, a profiled micro-batch size, a schedule) the search

1. partitions the segments into ``pp`` contiguous stages minimising the slowest stage's compute time under
   each stage's memory limit (:func:`partition_under_memory`: a binary search on the bottleneck with a
   greedy feasibility check, which is exact for contiguous partitions because both time and memory only grow
   with a stage's segment set);
2. predicts each stage's memory (:mod:`varuna_core.planning.memory`): parameters, gradients and optimizer state,
   the activations autograd saves for every graph the schedule keeps alive, the stashed inputs of every
   micro-batch in flight, the receive buffers the runtime keeps posted (its receive windows), the values it
   sent and keeps until the step ends, and headroom;
3. simulates the exact schedule the runtime would execute (:mod:`varuna_core.planning.simulate`, which chooses
   the C++ simulator when built) with point-to-point times from the profile's network fits (intra- or inter-node
   depending on where neighbouring stages are placed) and the data-parallel all-reduce of each stage's gradients
   (started with the stage's last backward, as the runtime overlaps it; a sharded optimizer's collectives after
   the pipeline).

The schedules that split the backward (``zb``, ``varuna-zb``) are costed with the profile's ``B`` and ``W`` times
(a stage's compute per micro-batch is then ``F (+ R) + B + W``) and charged what each micro-batch keeps from its
``B`` to its ``W``; a profile without those measures (made before the profiler took them) leaves them out of a
default search, and a request that names one is refused (:func:`schedules_for`). On equal predicted steps the
simpler configuration wins: shallower, wider, smaller micro-batches, then the schedule first in
:data:`~varuna_core.ir.schedule.SCHEDULE_NAMES` (``1f1b`` before ``zb``).

With a wire dtype (``PlanRequest.wire_dtype``, ``varuna plan --wire-dtype``) every activation and gradient is
charged at the bytes it crosses the cut in: the profile's ``wire16_bytes`` (its float leaves wider than 2 bytes at
2 bytes an element), or half its ``output_bytes`` where an older profile did not measure them. Memory is charged
as without it (the receive buffers are narrower, the cast back is not).

The fastest predicted step wins; the next ones are kept as alternatives with the reason each lost. This module
imports no torch, so ``varuna plan`` starts fast and runs anywhere.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import gc
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ..errors import ConfigError, FieldError, VarunaError
from ..ir.inflight import pending_weights_named, receive_windows
from ..ir.partition import Partition
from ..ir.schedule import SCHEDULE_NAMES, ScheduleName, check_schedule, generate, recompute_stages
from ..ir.topology import Topology
from ..ir.units import MAX_BYTES
from ..util.checks import integer, real
from .artifacts import (
    MAX_DEVICES,
    MAX_MICROBATCH_SIZE,
    MAX_MICROBATCHES,
    Candidate,
    CommCurve,
    Plan,
    Prediction,
    Profile,
    SegmentMeasure,
    StagePlan,
)
from .memory import stage_bytes
from .simulate import StageCosts, idle_cost, inflight_counts, simulate_generated, sync_costs

__all__ = ["PlanRequest", "make_plan", "plan_for", "layout_plan", "partition_under_memory", "PlanInfeasible",
           "snapshot_bytes_per_node", "schedules_for", "splits_backward",
           "MAX_TOP", "MAX_CONCURRENT_SENDS"]

MAX_TOP = 100  # alternatives a plan keeps
SHARD_GAIN = 0.01  # a sharded optimizer must be predicted this much faster to win over a whole one that fits
TIE = 1e-9  # predicted steps closer than this (relative) are equal: equal schedules summed in another order
SHARD_BUCKET = 25 * 2**20  # the runtime's default bucket: the all-gather's scratch (and 1/dp of it, the ring's)
MAX_CONCURRENT_SENDS = 1024
MAX_LINK_RATE = 1e13  # bytes/s (80 Tbit/s): beyond any link
MAX_LINK_LATENCY = 10.0  # seconds per message
WIRE_DTYPES = ("bf16", "fp16")  # both 2 bytes: what crosses is charged at the profile's wire16_bytes


class PlanInfeasible(VarunaError):
    """No configuration fits; the message names the smallest memory that would."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan for. It checks itself when made (every field in its range, every schedule known), so that
    every way of planning (``varuna plan``, a morph, ``AutoConfig``, a script) refuses the same requests with the
    same words; a refusal is a :class:`~varuna_core.errors.FieldError` naming the field (the CLI names the option
    that sets it instead). Sequences are kept as tuples, numbers as ``int``/``float``.

    Attributes:
        gpus: devices available.
        batch_size: global batch (fixed; the micro-batch count follows from it).
        gpus_per_node: devices per node (placement: a replica's stages on consecutive ranks).
        gpu_memory: bytes per device, or ``None`` for no limit.
        schedules: schedules to consider (each once, in the order given); ``None``: every schedule the profile
            allows, those that split the backward (``zb``, ``varuna-zb``) only when it measured their ``B`` and ``W``
            (:func:`schedules_for`).
        headroom: fraction of memory kept free (allocator fragmentation, CUDA context).
        max_concurrent_sends: the runtime's in-flight messages per stage and direction.
        top: alternatives to keep.
        microbatch_sizes: the micro-batch sizes to consider (default: the profiled ones). A morph keeps the
            running size, so that the numerics of the run do not change with the device count.
        wire_dtype: ``"bf16"`` or ``"fp16"``: messages between stages are charged at the bytes they cross in
            (the runtime's ``wire_dtype``, which the plan then carries); ``None``: at their own bytes.
        shard_optimizer: shard the optimizer state over the replicas (``True``), never (``False``), or consider
            both wherever ``dp > 1`` (``None``): sharding is chosen when it fits where the whole state does not, or
            is predicted faster by more than :data:`SHARD_GAIN` (its optimizer steps ``1/dp`` of the elements). On a
            tie the state stays whole: then a lost replica costs the job nothing (the survivors regroup), where a
            sharded one took its shard with it.
        link_rate, link_latency: the link between nodes, when the profile did not measure it (profiled on one
            host) or measured another: bytes per second each way, and seconds per message (default: the profile's
            latency). Every message and all-reduce that crosses nodes is charged at that rate instead of the
            profile's inter-node fit; inside a node the profile's fits stay.
        pp, dp: pin the pipeline depth, the data-parallel width, or both (the original launcher's ``--nstages``);
            the search then varies only the rest. A depth alone must divide ``gpus`` (the width is ``gpus / pp``:
            pinning a depth that leaves devices idle is a mistake worth a word); with both, ``pp × dp`` may be
            fewer than ``gpus``. A micro-batch size is pinned with ``microbatch_sizes=(n,)``.
    """

    gpus: int
    batch_size: int
    gpus_per_node: int | None = None
    gpu_memory: int | None = None
    schedules: tuple[ScheduleName, ...] | None = None
    headroom: float = 0.1
    max_concurrent_sends: int = 4
    top: int = 5
    microbatch_sizes: tuple[int, ...] | None = None
    shard_optimizer: bool | None = None
    wire_dtype: str | None = None
    pp: int | None = None
    dp: int | None = None
    link_rate: float | None = None
    link_latency: float | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("gpus", integer("gpus", self.gpus, low=1, high=MAX_DEVICES))
        put("batch_size", integer("batch_size", self.batch_size, low=1))
        if self.gpus_per_node is not None:
            put("gpus_per_node", integer("gpus_per_node", self.gpus_per_node, low=1, high=MAX_DEVICES))
        if self.gpu_memory is not None:  # two checks: "must be ≥ 1" says more than a range of 19 digits
            put("gpu_memory", integer("gpu_memory", integer("gpu_memory", self.gpu_memory, low=1), high=MAX_BYTES))
        if self.schedules is not None:
            put("schedules", self._names(self.schedules))
        put("headroom", real("headroom", self.headroom, low=0, high=1, high_open=True))
        put("max_concurrent_sends", integer("max_concurrent_sends", self.max_concurrent_sends, low=1,
                                            high=MAX_CONCURRENT_SENDS))
        put("top", integer("top", self.top, low=0, high=MAX_TOP))
        if self.microbatch_sizes is not None:
            sizes = tuple(integer("microbatch_sizes", n, low=1, high=MAX_MICROBATCH_SIZE)
                          for n in _sequence("microbatch_sizes", self.microbatch_sizes))
            if not sizes:
                raise FieldError("microbatch_sizes", "names no size", hint="leave it out to use the profiled ones")
            put("microbatch_sizes", sizes)
        if self.shard_optimizer is not None and not isinstance(self.shard_optimizer, bool):
            raise FieldError("shard_optimizer", f"must be True, False or None (consider both), got "
                             f"{self.shard_optimizer!r:.80}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise FieldError("wire_dtype", f"must be {' or '.join(map(repr, WIRE_DTYPES))} or None (exact), got "
                             f"{self.wire_dtype!r:.80}", hint="bf16 keeps fp32's range; fp16 overflows beyond 65504")
        self._check_layout(put)
        if self.link_rate is not None:
            put("link_rate", real("link_rate", self.link_rate, low=0, low_open=True, high=MAX_LINK_RATE))
        if self.link_latency is not None:
            put("link_latency", real("link_latency", self.link_latency, low=0, high=MAX_LINK_LATENCY))

    def _check_layout(self, put: Callable[[str, object], None]) -> None:
        """The pinned depth, width and micro-batch sizes against the devices and the batch."""
        if self.microbatch_sizes is not None:
            for n in self.microbatch_sizes:
                if n > self.batch_size:
                    raise FieldError("microbatch_sizes", f"{n} is larger than the global batch of {self.batch_size}",
                                     hint="a micro-batch holds at most the whole batch")
        for name in ("pp", "dp"):
            value = getattr(self, name)
            if value is not None:
                put(name, integer(name, value, low=1, high=MAX_DEVICES))
        pp, dp = self.pp, self.dp
        if pp is not None and pp > self.gpus:
            raise FieldError("pp", f"{pp} stages need {pp} devices; {self.gpus} are available",
                             hint="pin a depth of at most the devices")
        if dp is not None and dp > self.gpus:
            raise FieldError("dp", f"{dp} replicas need {dp} devices; {self.gpus} are available",
                             hint="pin a width of at most the devices")
        if pp is not None and dp is not None and pp * dp > self.gpus:
            raise FieldError("dp", f"pp={pp} × dp={dp} needs {pp * dp} devices; {self.gpus} are available",
                             hint="pin fewer stages or replicas")
        if pp is not None and dp is None and self.gpus % pp:
            raise FieldError("pp", f"{pp} does not divide the {self.gpus} devices ({self.gpus % pp} would idle)",
                             hint=f"pin a depth that divides {self.gpus}, or pin the width too")
        if dp is not None and dp > self.batch_size:
            raise FieldError("dp", f"{dp} replicas need at least one example each; the global batch is "
                             f"{self.batch_size}", hint="pin fewer replicas or use a larger batch")

    @staticmethod
    def _names(schedules: object) -> tuple[ScheduleName, ...]:
        names = tuple(dict.fromkeys(check_schedule(name) for name in _sequence("schedules", schedules)))
        if not names:
            raise FieldError("schedules", "names no schedule", hint=f"choose from {', '.join(SCHEDULE_NAMES)}")
        return names


def _sequence(name: str, value: object) -> tuple[object, ...]:
    """``value`` as a tuple, if it is a list or tuple (a string is a sequence of characters, not of names)."""
    if not isinstance(value, (list, tuple)):
        raise FieldError(name, f"must be a list or tuple, got {type(value).__name__} {value!r:.80}")
    return tuple(value)


def splits_backward(schedule: str) -> bool:
    """Whether the named schedule splits the backward into ``B`` and ``W`` (``zb``, ``varuna-zb``)."""
    return generate(schedule, 1, 1).splits_backward


def schedules_for(profile: Profile, req: PlanRequest) -> tuple[ScheduleName, ...]:
    """The schedules a search of ``profile`` considers: the request's, or when it names none every schedule, less
    those that split the backward where the profile has no ``B`` and ``W`` measures (older profiles).

    Raises:
        ConfigError: the request names a schedule that splits the backward and the profile did not measure it.
    """
    if req.schedules is None:
        return tuple(name for name in SCHEDULE_NAMES if profile.splits_backward or not splits_backward(name))
    split = [name for name in req.schedules if splits_backward(name)]
    if split and not profile.splits_backward:
        plain = ", ".join(name for name in SCHEDULE_NAMES if not splits_backward(name))
        raise ConfigError(
            f"schedule {', '.join(split)} splits the backward into B (input gradient) and W (weights' gradients), "
            f"but the profile of {profile.model} has no B and W measures (it was made before `varuna profile` "
            f"measured them)", hint=f"profile the model again with `varuna profile`, or choose among {plain}")
    return req.schedules


# ----------------------------------------------------------------------------------------------------------
# Per-segment numbers at a micro-batch size


@dataclasses.dataclass(frozen=True)
class _Seg:
    forward: float
    recompute: float
    backward: float
    output_bytes: float
    saved_bytes: float
    static_bytes: int  # parameters + gradients + optimizer state
    grad_bytes: int
    optimizer_bytes: int = 0
    optimizer_time: float = 0.0
    skip_bytes: float = 0.0  # of output_bytes: tensors skipping over the cut
    split_backward: float = 0.0  # B of a split backward (0: not measured)
    weight: float = 0.0  # W of a split backward
    weight_bytes: float = 0.0  # what one micro-batch keeps from its B to its W
    wire_bytes: float | None = None  # with a wire dtype: the bytes crossing the cut (measured or halved)
    prefix: float = 0.0  # each forward of a stage starting here, before its incoming cut (SegmentMeasure.prefix)

    @property
    def on_wire(self) -> float:
        """The bytes crossing the segment's cut per message: its output's, or those of the wire dtype."""
        return self.output_bytes if self.wire_bytes is None else self.wire_bytes


def _interp(measures: Sequence[SegmentMeasure], n: float, get: Callable[[SegmentMeasure], float]) -> float:
    """Value at ``n`` examples, linear between (or beyond) the two nearest profiled sizes."""
    points = sorted((m.microbatch_size, get(m)) for m in measures)
    if len(points) == 1:
        size, value = points[0]
        return value * n / size
    # the two sizes around n: the first pair whose upper size is >= n; the last pair beyond the largest size
    upper = min(max(bisect.bisect_left([x for x, _ in points], n), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[upper - 1], points[upper]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def _segments_at(profile: Profile, n: float, wire: str | None = None) -> list[_Seg]:
    out = []
    split = profile.splits_backward
    for seg in profile.segments:
        ms = seg.measures
        out.append(_Seg(
            forward=_interp(ms, n, lambda m: m.forward.median),
            recompute=_interp(ms, n, lambda m: m.recompute.median),
            backward=_interp(ms, n, lambda m: m.backward.median),
            output_bytes=_interp(ms, n, lambda m: m.output_bytes),
            wire_bytes=_interp(ms, n, _wire16_bytes) if wire is not None else None,
            saved_bytes=_interp(ms, n, lambda m: m.saved_bytes),
            static_bytes=seg.param_bytes + seg.grad_bytes + seg.optimizer_bytes,
            grad_bytes=seg.grad_bytes, optimizer_bytes=seg.optimizer_bytes,
            optimizer_time=seg.optimizer_time,
            skip_bytes=_interp(ms, n, lambda m: m.skip_bytes),
            split_backward=_interp(ms, n, lambda m: m.split_backward.median if m.split_backward else 0.0)
            if split else 0.0,
            weight=_interp(ms, n, lambda m: m.weight.median if m.weight else 0.0) if split else 0.0,
            weight_bytes=_interp(ms, n, lambda m: m.weight_bytes or 0) if split else 0.0,
            prefix=_interp(ms, n, lambda m: m.prefix.median if m.prefix else 0.0),
        ))
    return out


def _wire16_bytes(m: SegmentMeasure) -> float:
    """The bytes of a segment's output on a bf16/fp16 wire: the measured ``wire16_bytes``, or half of
    ``output_bytes`` (fp32 floats) for a profile made before they were measured."""
    return m.wire16_bytes if m.wire16_bytes is not None else m.output_bytes / 2


# ----------------------------------------------------------------------------------------------------------
# Memory and partition


class _Prefix:
    """Prefix sums over segments, so a stage's cost and memory (:func:`~varuna_core.planning.memory.stage_bytes`)
    are O(1)."""

    def __init__(self, segs: Sequence[_Seg]) -> None:
        self.segs = segs
        self.plain = [0.0]  # recompute (= forward with graph) + backward
        self.full = [0.0]   # forward + recompute + backward
        self.plain_split = [0.0]  # the same with the backward split: recompute + B + W
        self.full_split = [0.0]   # forward + recompute + B + W
        self.split_b = [0.0]  # B of a split backward
        self.weight = [0.0]   # W
        self.weight_bytes = [0.0]  # what a micro-batch keeps from its B to its W
        self.static = [0.0]
        self.saved = [0.0]
        self.rec = [0.0]    # forward with graph (= recompute)
        self.grads = [0.0]  # gradient bytes
        self.opt = [0.0]    # optimizer step time
        self.optb = [0.0]   # optimizer state bytes
        for x in segs:
            self.optb.append(self.optb[-1] + x.optimizer_bytes)
            self.opt.append(self.opt[-1] + x.optimizer_time)
            self.rec.append(self.rec[-1] + x.recompute)
            self.grads.append(self.grads[-1] + x.grad_bytes)
            self.plain.append(self.plain[-1] + x.recompute + x.backward)
            self.full.append(self.full[-1] + x.forward + x.recompute + x.backward)
            self.plain_split.append(self.plain_split[-1] + x.recompute + x.split_backward + x.weight)
            self.full_split.append(self.full_split[-1] + x.forward + x.recompute + x.split_backward + x.weight)
            self.split_b.append(self.split_b[-1] + x.split_backward)
            self.weight.append(self.weight[-1] + x.weight)
            self.weight_bytes.append(self.weight_bytes[-1] + x.weight_bytes)
            self.static.append(self.static[-1] + x.static_bytes)
            self.saved.append(self.saved[-1] + x.saved_bytes)

    def table(self, recompute: bool, split: bool = False) -> list[float]:
        """The prefix sums of a stage's compute per micro-batch: with or without recompute, the backward whole
        or split into B and W."""
        if split:
            return self.full_split if recompute else self.plain_split
        return self.full if recompute else self.plain

    def cost(self, a: int, b: int, recompute: bool, split: bool = False) -> float:
        table = self.table(recompute, split)
        return table[b] - table[a]

    def static_bytes(self, a: int, b: int, shards: int = 1) -> float:
        """Parameters, gradients and optimizer state of segments ``[a, b)`` on one rank; with the optimizer
        sharded over ``shards`` replicas, ``1/shards`` of the state, plus the collectives' scratch (one bucket for
        the all-gather, a replica's share of one for the reduce-scatter)."""
        static = self.static[b] - self.static[a]
        if shards <= 1:
            return static
        grads = self.grads[b] - self.grads[a]
        return static - (self.optb[b] - self.optb[a]) * (1 - 1 / shards) + min(SHARD_BUCKET, grads) * (1 + 1 / shards)

    def memory(self, a: int, b: int, *, held: int, graphs: int, recvs: tuple[int, int], headroom: float,
               num_mb: int, recompute: bool, shards: int = 1, pending: int = 0, output: bool = True) -> float:
        """Peak bytes of a stage running segments ``[a, b)`` (the memory model, :mod:`.memory`); ``recvs``: its
        receive windows (activations, gradients), :func:`~varuna_core.ir.inflight.receive_windows`; ``num_mb``:
        micro-batches per step; ``recompute``: whether the stage recomputes; ``shards``: the replicas its optimizer
        state is sharded over (1: whole); ``pending``: micro-batches waiting for their ``W`` at once (a schedule
        that splits the backward); ``output`` False: without the buffers of the value the stage sends on (what
        remains grows with ``b``, so the search can bisect on it)."""
        segs = self.segs
        return stage_bytes(static=self.static_bytes(a, b, shards), saved=self.saved[b] - self.saved[a],
                           input_bytes=segs[a - 1].output_bytes if a > 0 else 0.0,
                           output_bytes=segs[b - 1].output_bytes if b < len(segs) and output else 0.0,
                           held=held, graphs=graphs, act_recvs=recvs[0], grad_recvs=recvs[1], headroom=headroom,
                           microbatches=num_mb, recompute=recompute, pending=pending,
                           weight_bytes=self.weight_bytes[b] - self.weight_bytes[a] if pending else 0.0)

    def stage_memory(self, a: int, b: int, s: int, *, counts: Sequence[tuple[int, int]],
                     windows: Sequence[tuple[int, int]], recompute: Sequence[bool], num_mb: int,
                     headroom: float, shards: int = 1, pending: Sequence[int] | None = None,
                     output: bool = True) -> float:
        """:meth:`memory` of stage ``s`` of a schedule with these in-flight ``counts``, receive ``windows``,
        ``recompute`` stages and micro-batches ``pending`` their ``W`` (``None``: the backward is not split)."""
        return self.memory(a, b, held=counts[s][0], graphs=counts[s][1], recvs=windows[s], headroom=headroom,
                           num_mb=num_mb, recompute=recompute[s], shards=shards,
                           pending=pending[s] if pending is not None else 0, output=output)


def partition_under_memory(
    segs: Sequence[_Seg], pp: int, *, recompute_stages: Sequence[bool], counts: Sequence[tuple[int, int]],
    limit: int | None, headroom: float, num_mb: int, prefix: _Prefix | None = None, shards: int = 1,
    pending: Sequence[int] | None = None,
) -> Partition | None:
    """Contiguous partition into ``pp`` stages minimising the slowest stage's compute, each stage within
    ``limit`` bytes; ``None`` if no partition fits. ``pending``: per stage, the micro-batches waiting for their
    ``W`` at once under a schedule that splits the backward (its compute is then ``B + W``); ``None``: no split.

    Bisection on the bottleneck ``T`` between ``max(total / pp, largest segment)`` and that plus the largest
    segment (the optimum lies there); for a given ``T`` the greedy that gives each stage as many segments as
    ``T`` and memory allow finds a partition if one exists, because a stage's time and memory only grow with its
    segment set — unless it is stuck at a segment too costly for its stage alone where stages sum their compute
    differently (``exact()`` then decides). The result is then tightened to the partition's own bottleneck.
    """
    n = len(segs)
    if pp > n:
        return None
    pre = prefix or _Prefix(segs)
    windows = receive_windows([held for held, _ in counts])
    split = pending is not None
    reach: dict[tuple[int, int], int] = {}  # (a, s): the last end that fits before the sent value is counted

    def memory(a: int, b: int, s: int, output: bool = True) -> float:
        return pre.stage_memory(a, b, s, counts=counts, windows=windows, recompute=recompute_stages,
                                num_mb=num_mb, headroom=headroom, shards=shards, pending=pending, output=output)

    def reach_of(a: int, s: int, top: int) -> int:
        """The largest end in ``(a, top]`` whose stage fits ``limit`` without its sent value's buffers (``a`` if
        none): that memory grows with the end, so a bisection finds it, and no later end can fit with them. The
        greedy's bisection starts stages at the same segments again and again: each (a, s) is bisected once."""
        assert limit is not None
        end = reach.get((a, s))
        if end is None:
            lo_, hi_ = a, top + 1  # lo_ fits (a: nothing to fit), hi_ does not (past the top)
            while hi_ - lo_ > 1:
                mid = (lo_ + hi_) // 2
                if memory(a, mid, s, output=False) <= limit:
                    lo_ = mid
                else:
                    hi_ = mid
            end = reach[(a, s)] = lo_
        return end

    stage_tables = [pre.table(recompute_stages[s], split) for s in range(pp)]  # looked up once, not per probe
    # stages whose compute is summed differently (a recomputing stage next to one that does not): the greedy can
    # then be stuck where a partition exists (see exact())
    mixed = len({id(table) for table in stage_tables}) > 1
    least_more = math.inf  # set by a greedy that fails: see failed()
    stuck = False  # the last greedy that failed did so at a stage that could not take its first segment
    bisect_right = bisect.bisect_right

    def end_of(a: int, s: int, slack: float) -> int:
        """The last end of stage ``s`` started at ``a`` within the bound (``slack``) and the memory limit; ``a``
        if not even one segment fits."""
        table = stage_tables[s]
        last_allowed = n - (pp - s - 1)
        b = bisect_right(table, table[a] + slack, a + 1, last_allowed + 1) - 1
        if limit is not None:
            b = min(b, reach_of(a, s, last_allowed))
            while b > a and memory(a, b, s) > limit:
                b -= 1
        return b

    def greedy(bound: float) -> list[tuple[int, int]] | None:
        nonlocal stuck
        ranges, a = [], 0
        slack = bound * (1 + 1e-12)
        after = n - pp + 2  # stage s may end at most at n - (pp - s - 1): bisect below after + s
        stuck = False
        if limit is None:  # the bisection's probes without a memory limit: the search's hottest loop
            for s, table in enumerate(stage_tables):
                b = bisect_right(table, table[a] + slack, a + 1, after + s) - 1
                if b <= a:
                    ranges.append((a, a))
                    stuck = True
                    break
                ranges.append((a, b))
                a = b
        else:
            for s in range(pp):
                b = end_of(a, s, slack)
                if b <= a:
                    ranges.append((a, a))
                    stuck = True
                    break
                ranges.append((a, b))
                a = b
        if a == n:
            return ranges
        failed(ranges)
        return None

    def failed(ranges: list[tuple[int, int]]) -> None:
        """Record the least bound at which a greedy that failed with these stages could take one segment more.

        Below it every stage ends where it did (a stage's end only grows with the bound, and so does the next
        stage's start), so the greedy fails there too: the bisection's lower end moves up to it. Stages that
        memory stops count as well, which only makes the value smaller, so it is never past the optimum."""
        nonlocal least_more
        least_more = min((stage_tables[s][b + 1] - stage_tables[s][a] for s, (a, b) in enumerate(ranges)
                          if b < n - (pp - s - 1)), default=math.inf)

    def exact(bound: float) -> list[tuple[int, int]] | None:
        """A partition within ``bound`` found from every stage's reachable ends, where the greedy was stuck.

        The greedy's proof that it is optimal (by induction, each of its stages ends no earlier than the same stage
        of any partition within the bound) holds while every stage can take one segment. Where stages sum their
        compute differently (a recomputing stage costs ``F + R + B`` per segment, the last stage ``R + B``), one
        that is ahead can meet a segment too costly for it alone that another stage could have taken: stuck,
        though a partition exists. Here every end stage ``s`` can reach is kept, as sorted disjoint intervals:
        from starts ``[lo, hi]`` it reaches each ``p`` in ``(lo, hi]`` whose segment ``p - 1`` fits it alone (a
        stage's end only grows with its start), and ``(hi, end_of(hi)]``. A partition is then walked back from
        ``n``, each stage's start the latest reachable one that fits it; memory is checked for each stage as
        taken (``None`` if a check fails: the memory model need not grow with the end, which the walk assumes)."""
        slack = bound * (1 + 1e-12)
        levels: list[list[tuple[int, int]]] = []
        starts = [(0, 0)]
        for s in range(pp):
            first, last_allowed = s + 1, n - (pp - s - 1)
            ends: list[tuple[int, int]] = []
            for lo, hi in starts:
                run = None
                for p in range(max(lo + 1, first), min(hi, last_allowed) + 1):
                    if end_of(p - 1, s, slack) >= p:
                        run = (run[0] if run else p, p)
                    elif run:
                        _add_interval(ends, *run)
                        run = None
                if run:
                    _add_interval(ends, *run)
                far = min(end_of(hi, s, slack), last_allowed)
                if far > hi:
                    _add_interval(ends, max(hi + 1, first), far)
            if not ends:
                return None
            levels.append(ends)
            starts = ends
        if not any(lo <= n <= hi for lo, hi in levels[-1]):
            return None
        ranges, b = [], n
        for s in range(pp - 1, -1, -1):
            table = stage_tables[s]
            cands = [(0, 0)] if s == 0 else levels[s - 1]
            a = next((a for lo, hi in reversed(cands) for a in range(min(hi, b - 1), lo - 1, -1)
                      if table[b] - table[a] <= slack and (limit is None or memory(a, b, s) <= limit)), None)
            if a is None:
                return None
            ranges.append((a, b))
            b = a
        return ranges[::-1] if b == 0 else None

    def probe(bound: float) -> list[tuple[int, int]] | None:
        found = greedy(bound)
        if found is None and stuck and (mixed or limit is not None):
            return exact(bound)
        return found

    def bottleneck(ranges: list[tuple[int, int]]) -> float:
        return max(stage_tables[s][b] - stage_tables[s][a] for s, (a, b) in enumerate(ranges))

    any_rec = any(recompute_stages)
    lo = max(pre.cost(0, n, False, split) / pp, max(pre.cost(k, k + 1, False, split) for k in range(n)))
    hi = pre.cost(0, n, any_rec, split) + 1.0
    best = probe(hi)
    if best is None:
        return None
    hi = min(hi, bottleneck(best))
    lo = min(lo, hi)
    for _ in range(60):
        if hi - lo <= 1e-7 * hi:  # the bottleneck is then within 1e-7 of optimal (far below measurement noise)
            break
        mid = (lo + hi) / 2
        found = probe(mid)
        if found is not None:
            best, hi = found, bottleneck(found)
        elif limit is None and not (stuck and mixed):
            # fails up to the least bound that changes a stage (less a margin for the sums' rounding): without a
            # memory limit, a greedy that failed where exact() was not needed fails only where no partition exists
            lo = max(mid, min(least_more / (1 + 1e-12) * (1 - 1e-12), hi))
        else:
            lo = mid
    return Partition.from_ranges(best, n)


def _add_interval(ends: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Add ``[lo, hi]`` to sorted disjoint intervals whose last one starts no later than ``lo``, merging."""
    if lo > hi:
        return
    if ends and lo <= ends[-1][1] + 1:
        ends[-1] = (ends[-1][0], max(ends[-1][1], hi))
    else:
        ends.append((lo, hi))


# ----------------------------------------------------------------------------------------------------------
# Communication


def _curve(profile: Profile, op: str, link: str, group: int) -> CommCurve | None:
    curves = [c for c in profile.comm if c.op == op]
    if not curves:
        return None
    same = [c for c in curves if c.link == link] or curves
    return min(same, key=lambda c: (abs(c.group_size - group), -c.group_size))


@dataclasses.dataclass(frozen=True)
class Link:
    """The link between nodes as the request gives it (``--link-rate``, ``--link-latency``): it replaces the
    profile's inter-node fits. ``latency`` None: the profile's (inter-node if measured, else intra-node)."""

    rate: float  # bytes/s each way
    latency: float | None = None

    @classmethod
    def of(cls, req: PlanRequest) -> Link | None:
        return None if req.link_rate is None else cls(req.link_rate, req.link_latency)

    def latency_for(self, profile: Profile, op: str) -> float:
        if self.latency is not None:
            return self.latency
        curve = _curve(profile, op, "inter", 2)
        return curve.fit.latency if curve is not None else 0.0


def _p2p_time(profile: Profile, nbytes: float, inter: bool, link: Link | None = None) -> float:
    if nbytes <= 0:
        return 0.0
    if inter and link is not None:
        return link.latency_for(profile, "p2p") + nbytes / link.rate
    curve = _curve(profile, "p2p", "inter" if inter else "intra", 2)
    return 0.0 if curve is None else curve.fit.predict(nbytes)


def _allreduce_parts(profile: Profile, nbytes: float, d: int, inter: bool,
                     link: Link | None = None) -> tuple[float, float]:
    """(latency, transfer) seconds of an all-reduce of ``nbytes`` over ``d`` ranks, alone on its links: the ring's
    ``2(d-1)`` latency steps, and its ``2(d-1)/d`` of the data at the link's rate (the part that links share)."""
    if d < 2 or nbytes <= 0:
        return 0.0, 0.0
    if inter and link is not None:  # a ring: 2(d-1) steps, each rank sends 2(d-1)/d of the data
        return 2 * (d - 1) * link.latency_for(profile, "p2p"), nbytes * 2 * (d - 1) / d / link.rate
    curve = _curve(profile, "allreduce", "inter" if inter else "intra", d)
    if curve is None:
        return 0.0, 0.0
    g = curve.group_size
    # ring all-reduce moves 2(d-1)/d of the data and takes 2(d-1) latency steps: rescale from the measured g
    lat = curve.fit.latency * (d - 1) / max(1, g - 1)
    bw_time = (nbytes / curve.fit.bandwidth) * ((d - 1) / d) / ((g - 1) / g)
    return lat, bw_time



PLACEMENTS = ("pipeline", "stage")  # how ranks go onto nodes (Topology.placed), in the order ties prefer them


@dataclasses.dataclass(frozen=True)
class LinkLayout:
    """What crosses the nodes' links under one placement of ``pp`` stages × ``dp`` replicas on nodes of
    ``per_node`` consecutive ranks (the launcher fills nodes in rank order).

    ``sends[s]``: how many replicas' messages of the boundary between stages ``s`` and ``s + 1`` go through one
    node's link at once, at most over the nodes (0: none crosses; the replicas run the schedule in step, so
    their messages coincide and share the link). ``crossing[s]``: stage ``s``'s replicas are on several nodes
    (its all-reduce crosses their links). ``node_stages``: the distinct sets of crossing stages that share a
    node, whose rings go through its link at once."""

    placement: str
    sends: tuple[int, ...]
    crossing: tuple[bool, ...]
    node_stages: tuple[tuple[int, ...], ...]


def link_layout(placement: str, pp: int, dp: int, per_node: int) -> LinkLayout:
    """The :class:`LinkLayout` of ``Topology.placed(placement, pp, dp)`` on nodes of ``per_node`` ranks."""
    world = pp * dp
    if world <= per_node:  # one node: nothing crosses
        return LinkLayout(placement, (0,) * max(0, pp - 1), (False,) * pp, ())
    nodes = -(-world // per_node)
    sets: set[tuple[int, ...]]
    if placement == "pipeline":  # rank = replica·pp + stage
        # a boundary crosses where a replica's stage s is a node's last rank: one such rank per node
        residues = {(r * pp) % per_node for r in range(min(dp, per_node))}
        sends = tuple(int(any((res + s + 1) % per_node == 0 for res in residues)) for s in range(pp - 1))
        crossing = tuple(s // per_node != (s + (dp - 1) * pp) // per_node for s in range(pp))
        # a node's stages are the residues mod pp of its ranks: the same for nodes whose first ranks agree mod
        # pp, so one period of nodes (and the last, which may be partial) gives every distinct set
        firsts = {n * per_node for n in range(min(nodes, pp // math.gcd(pp, per_node)))} | {(nodes - 1) * per_node}
        sets = {tuple(sorted({r % pp for r in range(first, min(first + per_node, world))})) for first in firsts}
    elif placement == "stage":  # rank = stage·dp + replica
        # boundary s: replica r's message goes from rank x = s·dp + r to x + dp, and crosses where they are on other
        # nodes; counted per node (a node's ranks are a range), not per replica: pp·dp can be thousands
        most = []
        for s in range(pp - 1):
            lo, hi = s * dp, (s + 1) * dp  # the senders' ranks [lo, hi); the receivers' are [hi, hi + dp)
            top = 0
            for a in range(lo // per_node, (hi - 1) // per_node + 1):  # leaving node a: senders x + dp past its end
                top = max(top, min((a + 1) * per_node, hi) - max(a * per_node, lo, (a + 1) * per_node - dp))
            for b in range(hi // per_node, (hi + dp - 1) // per_node + 1):  # entering b: receivers y - dp before it
                top = max(top, min((b + 1) * per_node, hi + dp, b * per_node + dp) - max(b * per_node, hi))
            most.append(top)
        sends = tuple(most)
        crossing = tuple(s * dp // per_node != ((s + 1) * dp - 1) // per_node for s in range(pp))
        # a node's stages are those of its ranks; a node that holds no stage's first or last rank lies inside one
        # stage, as the node after that stage's first does: those nodes give every distinct set (3·pp at most,
        # where the nodes can be thousands)
        some: set[int] = set()
        for g in range(pp):
            first, last_node = g * dp // per_node, ((g + 1) * dp - 1) // per_node
            some.update((first, last_node) if first + 1 >= last_node else (first, first + 1, last_node))
        sets = {tuple(range(n * per_node // dp, (min(world, (n + 1) * per_node) - 1) // dp + 1)) for n in some}
    else:
        raise ValueError(f"unknown placement {placement!r}")
    node_stages = tuple(sorted({tuple(g for g in members if crossing[g]) for members in sets} - {()}))
    return LinkLayout(placement, sends, crossing, node_stages)


def shared_link_syncs(parts: Sequence[tuple[float, float]], layout: LinkLayout) -> list[float]:
    """Per stage, its data-parallel all-reduce's time when the stages' groups cross their nodes' links at once.

    ``parts[s]``: stage ``s``'s all-reduce alone (latency, transfer) (:func:`_allreduce_parts`). A node's ranks
    belong to several stages (:class:`LinkLayout`), and every group with ranks on several nodes sends its ring's
    ``2(d-1)/d`` of the gradient out through each of its nodes' link (one ring crossing a node, however many of its
    ranks are there). The groups start within one backward of each other (each with its stage's last backward),
    so they are taken to start together and share each link fairly: a group whose transfer alone takes ``x_s``
    ends, on a node whose groups take ``x_g``, after ``Σ_g min(x_g, x_s)`` (processor sharing), and on its slowest
    node. Without sharing (one node, or one crossing stage per node) this is ``x_s``; the last group to end meets
    the link bound, ``Σ_g x_g`` on the busiest node."""
    transfer = [x for _, x in parts]
    shared = list(transfer)
    for members in layout.node_stages:
        n = len(members)
        if n < 2:  # alone on its nodes' links: the sum below is its own transfer
            continue
        xs = sorted([transfer[g] for g in members])
        prefix = list(itertools.accumulate(xs, initial=0.0))
        for g in members:
            x = transfer[g]
            k = bisect.bisect_right(xs, x)
            value = prefix[k] + x * (n - k)
            if value > shared[g]:
                shared[g] = value
    return [lat + x for (lat, _), x in zip(parts, shared, strict=True)]


# ----------------------------------------------------------------------------------------------------------
# Search


@dataclasses.dataclass
class _Scored:
    pp: int
    dp: int
    mbs: int
    num_mb: int
    last: int
    schedule: str
    partition: Partition
    recompute: list[bool]
    counts: list[tuple[int, int]]
    layout: LinkLayout  # the placement, and what crosses the nodes' links under it
    lower_bound: float
    shard: bool = False  # the optimizer state sharded over the dp replicas
    pending: list[int] | None = None  # per stage, micro-batches waiting for their W (None: the backward is whole)
    costs: list[StageCosts] = dataclasses.field(default_factory=list)
    sync: list[float] = dataclasses.field(default_factory=list)  # per stage, its gradient collectives' time
    ties: list[float] = dataclasses.field(default_factory=list)  # per stage, its tied weights' sums
    optimizer: list[float] = dataclasses.field(default_factory=list)
    memory: list[int] = dataclasses.field(default_factory=list)
    step: float = 0.0
    pipeline: float = 0.0
    busy: list[float] = dataclasses.field(default_factory=list)
    bubble: float = 0.0
    allreduce: float = 0.0


class _Tables:
    """Everything the search computes once: per micro-batch size the segment numbers and their prefix sums,
    shared partitions, and message times."""

    def __init__(self, profile: Profile, wire: str | None = None, link: Link | None = None) -> None:
        self.profile, self.wire, self.link = profile, wire, link
        self.idle = idle_cost(profile.idle_penalty)  # what an action pays after its stage waited ([Note: idle penalty])
        self._segs: dict[float, list[_Seg]] = {}
        self._prefix: dict[float, _Prefix] = {}
        self._free: dict[tuple[int, int, tuple[bool, ...], bool], Partition | None] = {}
        self._p2p: dict[tuple[float, bool], float] = {}
        self._allreduce: dict[tuple[float, int, bool], tuple[float, float]] = {}
        self._layouts: dict[tuple[str, int, int, int], LinkLayout] = {}
        self._schedule: dict[tuple[str, int, int], tuple[list[tuple[int, int]], list[bool], list[int] | None]] = {}
        self._syncs: dict[tuple[tuple[float, ...], int, int], tuple[LinkLayout, list[float]]] = {}
        self._ties: dict[tuple[Any, ...], tuple[LinkLayout, list[float]]] = {}
        self._sends: dict[tuple[float, int], float] = {}
        self._stage_bounds: dict[tuple[object, ...], list[_StageBound]] = {}
        self._fits: dict[tuple[object, ...], bool] = {}  # the free partition fits with the whole optimizer state
        # _bound's result per (stages, layout, sharded): those two objects, the all-reduce times and the bound
        self.lower: dict[tuple[int, int, bool], tuple[list[_StageBound], LinkLayout, list[float], float]] = {}
        # per stage_bounds() list (by id): that list and the one with the whole optimizer state (the same values
        # but the optimizer step), whose _chains() the sharded list shares
        self.whole_state: dict[int, tuple[list[_StageBound], list[_StageBound]]] = {}
        # _chains's result per (stages, layout): those two objects, then the all-reduce times, fills and returns
        self.chains: dict[tuple[int, int], tuple[list[_StageBound], LinkLayout,
                                                 tuple[list[float], list[float], list[float]]]] = {}

    def schedule(self, name: str, pp: int, num_mb: int) -> tuple[list[tuple[int, int]], list[bool], list[int] | None]:
        """What the search needs of a schedule's shape: per stage its in-flight ``(held, graphs)``, whether it
        recomputes, and its micro-batches pending their ``W`` (``None``: the backward is whole); the same for every
        width, micro-batch size and placement with these sizes, so worked out once."""
        key = (name, pp, num_mb)
        found = self._schedule.get(key)
        if found is None:
            found = self._schedule[key] = (
                inflight_counts(name, pp, num_mb), list(recompute_stages(name, pp)),
                pending_weights_named(name, pp, num_mb) if splits_backward(name) else None)
        return found

    def segs(self, n: float) -> list[_Seg]:
        if n not in self._segs:
            self._segs[n] = _segments_at(self.profile, n, self.wire)
        return self._segs[n]

    def prefix(self, n: float) -> _Prefix:
        if n not in self._prefix:
            self._prefix[n] = _Prefix(self.segs(n))
        return self._prefix[n]

    def p2p(self, nbytes: float, inter: bool) -> float:
        key = (nbytes, inter)
        if key not in self._p2p:
            self._p2p[key] = _p2p_time(self.profile, nbytes, inter, self.link)
        return self._p2p[key]

    def allreduce(self, nbytes: float, d: int, inter: bool) -> float:
        return sum(self.allreduce_parts(nbytes, d, inter))

    def allreduce_parts(self, nbytes: float, d: int, inter: bool) -> tuple[float, float]:
        key = (nbytes, d, inter)
        if key not in self._allreduce:
            self._allreduce[key] = _allreduce_parts(self.profile, nbytes, d, inter, self.link)
        return self._allreduce[key]

    def layout(self, placement: str, pp: int, dp: int, per_node: int) -> LinkLayout:
        key = (placement, pp, dp, per_node)
        if key not in self._layouts:
            self._layouts[key] = link_layout(placement, pp, dp, per_node)
        return self._layouts[key]

    def syncs(self, grads: Sequence[float], dp: int, layout: LinkLayout) -> list[float]:
        """Per stage, its gradient all-reduce of ``grads[s]`` bytes, between nodes where its replicas are on
        several, with the other stages' groups sharing the nodes' links (:func:`shared_link_syncs`). The same
        partition comes back for many schedules, micro-batch sizes and the optimizer sharded or not (4532
        candidates, 221 distinct at 4096 devices): worked out once (the list is shared: read it only)."""
        key = (tuple(grads), dp, id(layout))  # the entry keeps its layout alive: no other can take its id
        found = self._syncs.get(key)
        if found is None or found[0] is not layout:
            found = self._syncs[key] = (layout, shared_link_syncs(
                [self.allreduce_parts(g, dp, inter) for g, inter in zip(grads, layout.crossing, strict=True)], layout))
        return found[1]

    def tie_sums(self, ranges: Sequence[tuple[int, int]], layout: LinkLayout) -> list[float]:
        """Per stage, the seconds its tied weights' sums take: each weight the profile says several segments use,
        once ``ranges`` puts them on several stages, summed over those stages' ranks of one replica. On gloo (a
        CPU profile) a weight of two stages is swapped, one message each way at once; otherwise a ring
        all-reduce ([Note: hops of small sums] in ``pipeline.grads``). Between nodes if a boundary between the
        first and the last of them crosses one. Charged after the stage's last backward, not overlapped with it:
        the usual tie, an embedding and the head, has the embedding's gradient final only when the first stage's
        backward ends."""
        costs = [0.0] * len(ranges)
        if not self.profile.ties:
            return costs
        key = (tuple(ranges), id(layout))
        found = self._ties.get(key)
        if found is not None and found[0] is layout:
            return found[1]
        stage_of = {seg: s for s, (a, b) in enumerate(ranges) for seg in range(a, b)}
        gloo = self.profile.environment.device_type == "cpu"
        for tie in self.profile.ties:
            stages = sorted({stage_of[seg] for seg in tie.segments})
            if len(stages) < 2:
                continue
            inter = any(layout.sends[k] for k in range(stages[0], stages[-1]))
            seconds = (self.p2p(tie.grad_bytes, inter) if gloo and len(stages) == 2
                       else self.allreduce(tie.grad_bytes, len(stages), inter))
            for s in stages:
                costs[s] += seconds
        self._ties[key] = (layout, costs)
        return costs

    def stage_bounds(self, mbs: int, num_mb: int, last: int, shards: int, part: Partition, recompute: list[bool],
                     split: bool) -> list[_StageBound]:
        """:func:`_stage_bounds`, once per partition and sizes (schedules of one recompute pattern share them)."""
        key = (mbs, num_mb, last, shards, part.ranges, tuple(recompute), split)
        found = self._stage_bounds.get(key)
        if found is None:
            if shards == 1:
                found = _stage_bounds(self, mbs, num_mb, last, 1, part, recompute, split)
                base = found
            else:  # only the optimizer step differs from the whole state's: the rest, and its chains, are shared
                base = self.stage_bounds(mbs, num_mb, last, 1, part, recompute, split)
                found = [(t[0], t[1], t[2] / shards, t[3], t[4], t[5], t[6], t[7], t[8]) for t in base]
            self._stage_bounds[key] = found
            self.whole_state[id(found)] = (found, base)
        return found

    def send(self, nbytes: float, flows: int) -> float:
        """A message of ``nbytes`` over a boundary whose ``flows`` replicas' messages share a node's link at
        once (0: inside a node)."""
        key = (nbytes, flows)
        found = self._sends.get(key)
        if found is None:
            found = self._sends[key] = self.p2p(nbytes * flows, True) if flows else self.p2p(nbytes, False)
        return found

    def partition(self, pp: int, mbs: int, recompute: list[bool], counts: Sequence[tuple[int, int]], num_mb: int,
                  req: PlanRequest, shards: int = 1, pending: Sequence[int] | None = None) -> Partition | None:
        """The time-optimal partition ignoring memory is shared by every schedule with the same recompute
        pattern and the backward split or not; only when it does not fit is the memory-constrained search run for
        this schedule."""
        key = (pp, mbs, tuple(recompute), pending is not None)
        free = self._free.get(key)
        if free is None:
            free = self._free[key] = partition_under_memory(
                self.segs(mbs), pp, recompute_stages=recompute, counts=counts, limit=None,
                headroom=req.headroom, num_mb=num_mb, prefix=self.prefix(mbs), pending=pending)
        if free is None or req.gpu_memory is None:
            return free
        # a stage needs less with its optimizer state sharded: where the whole state fit, the shards do too
        whole = (key, tuple(counts), num_mb, tuple(pending) if pending is not None else None)
        if shards > 1 and self._fits.get(whole):
            return free
        pre = self.prefix(mbs)
        windows = receive_windows([held for held, _ in counts])
        fits = all(pre.stage_memory(a, b, s, counts=counts, windows=windows, recompute=recompute, num_mb=num_mb,
                                    headroom=req.headroom, shards=shards, pending=pending) <= req.gpu_memory
                   for s, (a, b) in enumerate(free.ranges))
        if shards == 1:
            self._fits[whole] = fits
        if fits:
            return free
        return partition_under_memory(self.segs(mbs), pp, recompute_stages=recompute, counts=counts,
                                      limit=req.gpu_memory, headroom=req.headroom, num_mb=num_mb, prefix=pre,
                                      shards=shards, pending=pending)


def _stage_times(pre: _Prefix, a: int, b: int, recompute: bool,
                 split: bool = False) -> tuple[float, float, float, float]:
    """(F, R, B, W) of a stage per micro-batch: F is the no-grad forward when the stage recomputes; with the
    backward split, B is its input gradient and W its weights' gradients, else B is the whole backward and W 0."""
    fwd_grad = pre.rec[b] - pre.rec[a]
    if split:
        bwd, weight = pre.split_b[b] - pre.split_b[a], pre.weight[b] - pre.weight[a]
    else:
        bwd, weight = (pre.plain[b] - pre.plain[a]) - fwd_grad, 0.0
    if recompute:
        return (pre.full[b] - pre.full[a]) - (pre.plain[b] - pre.plain[a]), fwd_grad, bwd, weight
    return fwd_grad, 0.0, bwd, weight


def _prepare(tables: _Tables, req: PlanRequest, pp: int, dp: int, mbs: int, schedule: str, shard: bool = False,
             placements: Sequence[str] = PLACEMENTS[:1]) -> tuple[list[_Scored], int | None]:
    """Partition one configuration and bound its step time from below (no simulation yet); returns
    (a candidate per placement, none if it does not fit; the smallest memory it would need if it did not).
    ``shard``: the optimizer state sharded over the ``dp`` replicas (less memory; each replica steps ``1/dp`` of
    the state; the reduce-scatter and all-gather move the all-reduce's bytes). The placements share the partition
    (memory does not depend on them) and differ in what crosses the nodes' links."""
    shards = dp if shard else 1
    replica_batch = math.ceil(req.batch_size / dp)
    num_mb = math.ceil(replica_batch / mbs)
    last = replica_batch - (num_mb - 1) * mbs
    segs = tables.segs(mbs)
    counts, recompute, pending = tables.schedule(schedule, pp, num_mb)
    part = tables.partition(pp, mbs, recompute, counts, num_mb, req, shards, pending)
    if part is None:
        if pp > len(segs):
            return [], None
        pre = tables.prefix(mbs)
        free = partition_under_memory(segs, pp, recompute_stages=recompute, counts=counts,
                                      limit=None, headroom=req.headroom, num_mb=num_mb, prefix=pre, pending=pending)
        assert free is not None  # without a memory limit, pp <= segments always has a partition
        windows = receive_windows([held for held, _ in counts])
        need = max(int(pre.stage_memory(a, b, s, counts=counts, windows=windows, recompute=recompute,
                                        num_mb=num_mb, headroom=req.headroom, shards=shards, pending=pending))
                   for s, (a, b) in enumerate(free.ranges))
        return [], need
    stages = tables.stage_bounds(mbs, num_mb, last, shards, part, recompute, pending is not None)
    return [_bound(tables, pp, dp, mbs, num_mb, last, schedule, shard, part, recompute, counts, pending, stages,
                   tables.layout(placement, pp, dp, req.gpus_per_node or req.gpus)) for placement in placements], None


_StageBound = tuple[float, float, float, float, float, float, float, float, float]


def _stage_bounds(tables: _Tables, mbs: int, num_mb: int, last: int, shards: int, part: Partition,
                  recompute: list[bool], split: bool) -> list[_StageBound]:
    """Per stage what its bound needs, whatever the placement: ``(busy, longest, optimizer, forward, sent,
    forwards, forward_min, backward_min, sent_min)``: the compute of all its micro-batches, the longest of its
    backward parts (B or W, the last micro-batch's included), its optimizer step, one forward, the bytes it sends
    on per micro-batch; then all its forwards together, and the least of a micro-batch's forward, backward (B
    alone where it is split) and bytes sent, whichever its size (profiles need not grow with the size)."""
    segs, segs_last = tables.segs(mbs), tables.segs(last)
    pre, pre_last = tables.prefix(mbs), tables.prefix(last)
    out = []
    for s, (a, b) in enumerate(part.ranges):
        f, r, bw, w = _stage_times(pre, a, b, recompute[s], split)
        fl, rl, bl, wl = _stage_times(pre_last, a, b, recompute[s], split)
        busy = (num_mb - 1) * (f + r + bw + w) + fl + rl + bl + wl
        sent, sent_last = segs[b - 1].on_wire, segs_last[b - 1].on_wire
        out.append((busy, max(bw, bl, w, wl), (pre.opt[b] - pre.opt[a]) / shards, f, sent, (num_mb - 1) * f + fl,
                    f if f <= fl else fl, bw if bw <= bl else bl, sent if sent <= sent_last else sent_last))
    return out


def _bound(tables: _Tables, pp: int, dp: int, mbs: int, num_mb: int, last: int, schedule: str, shard: bool,
           part: Partition, recompute: list[bool], counts: list[tuple[int, int]], pending: list[int] | None,
           stages: list[_StageBound], layout: LinkLayout) -> _Scored:
    """A partitioned configuration under one placement, with its lower bound on the step (``stages``:
    :func:`_stage_bounds`). The stages' all-reduce times under this placement are kept for :func:`_score`.

    Two chains bound each stage's end, both chains of work that must run one after another in every schedule (the
    search simulates in order of the bound and stops once it passes the best steps, so a tighter bound simulates
    fewer and a bound above a step would lose the best: every term is a least time):

    * its busy time after the first activation reaches it (``fill``), its all-reduce starting with its last B;
    * the micro-batch whose forward is the stage's last: all its forwards after ``fill``, then that micro-batch
      through every later stage forward and back (``tails``: each later stage's least forward and B, the messages
      both ways), then its own least B, the all-reduce starting with it (the bubble a deep pipeline with few
      micro-batches pays, which the first chain leaves out). A recompute is not in it: it may run while the stage
      waits for the gradient.

    Each ends with the stage's optimizer step. Schedules of one recompute pattern (``1f1b`` and ``gpipe``) share
    ``stages``, so the bound is worked out once for them (``tables.lower``)."""
    key = (id(stages), id(layout), shard)  # the entry keeps both alive: no other can take their ids
    found = tables.lower.get(key)
    if found is not None and found[0] is stages and found[1] is layout:
        return _Scored(pp, dp, mbs, num_mb, last, schedule, part, recompute, counts, layout, found[3], shard, pending,
                       sync=found[2])
    syncs, fills, returns = _chains(tables, mbs, part, dp, stages, layout)
    ties = tables.tie_sums(part.ranges, layout)
    lower = 0.0
    for s, (busy, longest, opt, _, _, _, _, b_min, _) in enumerate(stages):
        # as sync_costs: a sharded optimizer's collectives run after the pipeline, an all-reduce overlaps the last B,
        # the tied weights' sums follow it
        allreduce, optimizer = (0.0, syncs[s] + ties[s] + opt) if shard else (syncs[s], ties[s] + opt)
        # it cannot start before the first activation reaches it; its all-reduce starts with its last B or W at the
        # earliest, which starts once everything else it computes is done
        overlapped = busy - longest + allreduce
        end = fills[s] + (busy if busy >= overlapped else overlapped) + optimizer
        if end > lower:
            lower = end
        end = (returns[s] + b_min if b_min >= allreduce else returns[s] + allreduce) + optimizer
        if end > lower:
            lower = end
    tables.lower[key] = (stages, layout, syncs, lower)
    return _Scored(pp, dp, mbs, num_mb, last, schedule, part, recompute, counts, layout, lower, shard, pending,
                   sync=syncs)


def _chains(tables: _Tables, mbs: int, part: Partition, dp: int, stages: list[_StageBound],
            layout: LinkLayout) -> tuple[list[float], list[float], list[float]]:
    """What :func:`_bound` needs of a placement whether the optimizer is sharded or not, once for both: per stage
    its all-reduce time, ``fill`` (when the first activation reaches it) and when its last forward's micro-batch is
    back from the later stages (``fill``, all its forwards, then ``tails``: each later stage's least forward and B,
    the messages both ways)."""
    known = tables.whole_state.get(id(stages))
    if known is not None and known[0] is stages:  # a sharded state's stages share the whole state's chains
        stages = known[1]
    key = (id(stages), id(layout))  # the entry keeps both alive: no other can take their ids
    found = tables.chains.get(key)
    if found is not None and found[0] is stages and found[1] is layout:
        return found[2]
    grads = tables.prefix(mbs).grads
    syncs = tables.syncs([grads[b] - grads[a] for a, b in part.ranges], dp, layout)
    send, flows, pp = tables.send, layout.sends, len(stages)
    tails = [0.0] * pp  # tails[s]: from stage s's last forward's end to the gradient's return, through stages > s
    for s in range(pp - 2, -1, -1):
        _, _, _, _, _, _, f_next, b_next, _ = stages[s + 1]
        message = send(stages[s][8], flows[s])
        tails[s] = message + f_next + tails[s + 1] + b_next + message
    fills, returns, fill = [], [], 0.0
    for s, (_, _, _, f, sent, forwards, _, _, _) in enumerate(stages):
        fills.append(fill)
        returns.append(fill + forwards + tails[s])
        if s < pp - 1:
            fill += f + send(sent, flows[s])
    chains = (syncs, fills, returns)
    tables.chains[key] = (stages, layout, chains)
    return chains


def _score(c: _Scored, tables: _Tables, req: PlanRequest) -> _Scored:
    """Cost every stage of a prepared candidate, then simulate it."""
    segs, segs_last = tables.segs(c.mbs), tables.segs(c.last)
    pre, pre_last = tables.prefix(c.mbs), tables.prefix(c.last)
    pp = c.pp
    windows = receive_windows([held for held, _ in c.counts])
    split = c.pending is not None
    # the stages' groups cross the nodes' links together: each one's time with the others sharing them (the bound
    # worked it out)
    if not c.sync:
        c.sync = tables.syncs([pre.grads[b] - pre.grads[a] for a, b in c.partition.ranges], c.dp, c.layout)
    ties = c.ties = tables.tie_sums(c.partition.ranges, c.layout)
    for s, (a, b) in enumerate(c.partition.ranges):
        f, r, bw, w = _stage_times(pre, a, b, c.recompute[s], split)
        fl, rl, bl, wl = _stage_times(pre_last, a, b, c.recompute[s], split)
        # every forward (F, and R where the stage recomputes) first runs the code before the stage's incoming cut,
        # once whatever the stage's segments. The bounds leave it out: they stay below the step
        f, fl = f + segs[a].prefix, fl + segs_last[a].prefix
        if r:
            r, rl = r + segs[a].prefix, rl + segs_last[a].prefix
        sends = c.layout.sends
        send_act = tables.send(segs[b - 1].on_wire, sends[s]) if s < pp - 1 else 0.0
        send_act_l = tables.send(segs_last[b - 1].on_wire, sends[s]) if s < pp - 1 else 0.0
        send_grad = tables.send(segs[a - 1].on_wire, sends[s - 1]) if s > 0 else 0.0
        send_grad_l = tables.send(segs_last[a - 1].on_wire, sends[s - 1]) if s > 0 else 0.0
        # sharded: a reduce-scatter and an all-gather, the all-reduce's bytes in the same ring steps
        c.optimizer.append((pre.opt[b] - pre.opt[a]) / (c.dp if c.shard else 1))
        # the all-reduce starts with the stage's last B (or W) and overlaps it; the optimizer's step follows both
        # (a sharded optimizer's collectives run after the pipeline)
        c.costs.append(StageCosts(f, r, bw, send_act, send_grad, forward_last=fl, recompute_last=rl,
                                  backward_last=bl, send_activation_last=send_act_l, send_gradient_last=send_grad_l,
                                  weight=w, weight_last=wl,
                                  **sync_costs(c.sync[s], c.optimizer[-1], sharded=c.shard, ties=ties[s])))
        c.memory.append(int(pre.stage_memory(a, b, s, counts=c.counts, windows=windows, recompute=c.recompute,
                                             num_mb=c.num_mb, headroom=req.headroom,
                                             shards=c.dp if c.shard else 1, pending=c.pending)))
    # messages between nodes go through the link one after the other (each pair of ranks has one connection, and
    # the link's rate is what each is charged at): in flight at once they would each get it whole
    channels = 1 if any(c.layout.sends) else req.max_concurrent_sends
    sim = simulate_generated(c.schedule, c.pp, c.num_mb, c.costs, max_concurrent_sends=channels, idle=tables.idle)
    # every step ends with one small sum over all ranks (loss, gradient norm, overflow): an all-reduce on NCCL, on
    # gloo (a CPU profile) an all-gather: half the ring's hops ([Note: hops of small sums] in pipeline.grads)
    hops, transfer = tables.allreduce_parts(64.0, c.pp * c.dp, c.pp * c.dp > (req.gpus_per_node or req.gpus))
    gathered = tables.profile.environment.device_type == "cpu"
    step = sim.step_time + (hops / 2 if gathered else hops) + transfer
    c.step, c.pipeline, c.busy, c.bubble = step, sim.pipeline_time, list(sim.busy), sim.bubble_fraction
    c.allreduce = max(c.sync)
    return c


def _reason(c: _Scored, best: _Scored) -> str:
    """Why ``c`` lost to ``best``, in a few words: its step-time gap and the component that explains most of it."""
    slower = c.step / best.step - 1.0
    same = (c.pp, c.dp, c.mbs, c.schedule) == (best.pp, best.dp, best.mbs, best.schedule)
    if same and c.shard == best.shard and c.layout.placement != best.layout.placement:
        where = {"pipeline": "a replica's stages", "stage": "a stage's replicas"}[c.layout.placement]
        return (f"{slower:+.0%} with {where} on consecutive ranks (all-reduce {c.allreduce * 1e3:.3g} vs "
                f"{best.allreduce * 1e3:.3g} ms, slowest stage {max(c.busy) * 1e3:.3g} vs {max(best.busy) * 1e3:.3g} "
                "ms with its messages)")
    if same and c.shard != best.shard:
        if c.shard:
            return (f"{slower:+.0%} with the optimizer state sharded (a lost replica would then stop the job "
                    f"until it recovers; the state fits whole)")
        return f"{slower:+.0%} with the optimizer state whole"

    if slower < 0.005:
        more = max(c.memory) - max(best.memory)
        if more > 0:
            return f"ties; needs {more / max(1, max(best.memory)):.0%} more memory"
        return "ties (equivalent configuration)"
    parts = {
        "bubble": (c.bubble - best.bubble) * c.pipeline,
        "all-reduce": c.allreduce - best.allreduce,
        "compute": max(c.busy) - max(best.busy),
    }
    what = max(parts, key=lambda part: parts[part])
    detail = {
        "bubble": f"bubble {c.bubble:.0%} vs {best.bubble:.0%}",
        "all-reduce": f"all-reduce {c.allreduce * 1e3:.3g} vs {best.allreduce * 1e3:.3g} ms",
        "compute": f"slowest stage {max(c.busy) * 1e3:.3g} vs {max(best.busy) * 1e3:.3g} ms",
    }[what]
    return f"{slower:+.0%}: {detail}"


def make_plan(profile: Profile, req: PlanRequest) -> Plan:
    """Search every configuration and return the best as a :class:`Plan`.

    Raises:
        ConfigError: bad request (sizes, unknown schedule, batch smaller than the data-parallel width).
        PlanInfeasible: nothing fits in ``gpu_memory``; names the smallest memory that would, and with what.
    """
    _check_microbatches(profile, req)
    schedules = schedules_for(profile, req)
    assumptions = _assumptions(profile, req)
    tables = _Tables(profile, req.wire_dtype, Link.of(req))
    with _collector_paused():
        prepared, smallest, clamped = _prepare_all(tables, profile, req, schedules)
        scored = _score_best(prepared, tables, req)
    if not scored:
        _raise_nothing_fits(profile, req, smallest)
    scored.sort(key=lambda c: (_preference(c), *_simplicity(c)))
    fastest = _preference(scored[0])
    best = min((c for c in scored if _preference(c) <= fastest * (1 + TIE)), key=_simplicity)
    scored.remove(best)
    sharing = _cores_shared(profile, req, best.pp * best.dp)
    if sharing:
        assumptions.add(sharing)
    if req.dp is not None and best.pp * best.dp < req.gpus:
        assumptions.add(f"dp={req.dp} pinned: {req.gpus - best.pp * best.dp} of the {req.gpus} devices idle")
    if best.pp in clamped:
        assumptions.add(f"the global batch of {req.batch_size} is smaller than the {req.gpus // best.pp} replicas "
                        f"{req.gpus} devices allow at pp={best.pp}: {best.dp} replica(s) used, "
                        f"{req.gpus - best.pp * best.dp} device(s) idle")
    return _to_plan(profile, req, best, scored[: req.top], assumptions, schedules)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector during the search, as it was before once done. The search makes millions of
    short-lived tuples and lists and no cycles (reference counting frees everything it drops), so the collector's
    passes find nothing and cost ~8% of the search (4096 devices: 0.93 -> 0.86 s of CPU)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _simplicity(c: _Scored) -> tuple[int, int, int, int, bool, int]:
    """How the search breaks a tie (steps within :data:`TIE`): the shallower pipeline, more replicas, smaller
    micro-batches, the schedule first in :data:`~varuna_core.ir.schedule.SCHEDULE_NAMES` (``1f1b`` before ``zb``:
    a split backward keeps the weights' inputs longer for nothing), the optimizer state whole, the original's
    placement (:data:`PLACEMENTS`)."""
    return c.pp, -c.dp, c.mbs, SCHEDULE_NAMES.index(c.schedule), c.shard, PLACEMENTS.index(c.layout.placement)


def _check_microbatches(profile: Profile, req: PlanRequest) -> None:
    """Refuse a batch that no configuration splits into at most MAX_MICROBATCHES micro-batches per replica (the
    most replicas, the largest micro-batch size), before the search spends minutes simulating it."""
    replicas = req.dp if req.dp is not None else min(req.gpus // (req.pp or 1), req.batch_size)
    largest = max(req.microbatch_sizes or profile.microbatch_sizes)
    fewest = math.ceil(math.ceil(req.batch_size / replicas) / largest)
    if fewest > MAX_MICROBATCHES:
        raise FieldError("batch_size", f"{req.batch_size} over at most {replicas} replicas in micro-batches of at "
                         f"most {largest} makes {fewest:,} micro-batches per replica; a plan holds at most "
                         f"{MAX_MICROBATCHES:,}", hint="use more devices, or profile larger micro-batch sizes")


def _assumptions(profile: Profile, req: PlanRequest) -> set[str]:
    """What the prediction takes for granted, whatever configuration wins."""
    per_node = req.gpus_per_node or req.gpus
    assumptions: set[str] = set()
    if not any(c.op == "p2p" for c in profile.comm):
        assumptions.add("the profile has no network measurement: communication is taken as free "
                        "(profile with --nproc 2 or more to measure it)")
    elif req.gpus > per_node and req.link_rate is None and not any(c.link == "inter" for c in profile.comm):
        assumptions.add("inter-node links are taken to be as fast as the measured intra-node ones (give "
                        "--link-rate, or profile over --hosts)")
    if req.gpus > per_node and req.link_rate is not None:
        link = Link(req.link_rate, req.link_latency)
        assumptions.add(f"between nodes every message and all-reduce is charged at the given link: "
                        f"{req.link_rate * 8 / 1e6:.4g} Mbit/s each way, "
                        f"{link.latency_for(profile, 'p2p') * 1e6:.4g} µs per message"
                        f"{'' if req.link_latency is not None else ' (the profile latency)'}")
    if req.gpu_memory is None:
        assumptions.add("no --gpu-memory given: memory is not limited")
    idle = profile.idle_penalty
    if idle is None:
        assumptions.add("the profile has no idle penalty: an action after a wait is taken to run as fast as in a "
                        "tight loop (profile again to measure it)")
    else:
        assumptions.add(f"an action that starts after its stage waited runs slower, as measured: "
                        f"+{idle.fractions[-1]:.0%} of up to {idle.action_s * 1e3:.3g} ms after "
                        f"{idle.gaps_s[-1] * 1e3:.3g} ms idle (the profile's idle_penalty)")
    if req.wire_dtype is not None and any(m.wire16_bytes is None for seg in profile.segments for m in seg.measures):
        assumptions.add(f"the profile does not say which bytes at the cuts are floats wider than 2 bytes: on the "
                        f"{req.wire_dtype} wire, half of them are charged (profile again to measure them)")
    if req.schedules is None and not profile.splits_backward:
        assumptions.add("the profile has no B and W measures of a split backward: the zero-bubble schedules (zb, "
                        "varuna-zb) were not considered (profile again with `varuna profile` to measure them)")
    pins = [f"{name}={value}" for name, value in (("pp", req.pp), ("dp", req.dp)) if value is not None]
    if req.microbatch_sizes is not None and len(req.microbatch_sizes) == 1:
        pins.append(f"micro-batch size {req.microbatch_sizes[0]}")
    if pins:
        assumptions.add(f"pinned by the request: {', '.join(pins)} (the search varied the rest)")
    if req.dp is None:
        assumptions.add("d = ⌊gpus / pp⌋ replicas; leftover devices idle")
    return assumptions


def _prepare_all(tables: _Tables, profile: Profile, req: PlanRequest,
                 schedules: tuple[ScheduleName, ...]) -> tuple[list[_Scored], tuple[int, str] | None, set[int]]:
    """Partition and bound every configuration; returns the ones that fit, the smallest memory need of those
    that did not (and which it was), and the depths whose data-parallel width the batch clamped."""
    prepared: list[_Scored] = []
    smallest: tuple[int, str] | None = None
    clamped: set[int] = set()
    for pp in _depths(profile, req):
        dp = req.dp if req.dp is not None else req.gpus // pp
        if dp > req.batch_size:  # a replica needs at least one example: the rest of the devices would idle
            dp = req.batch_size
            clamped.add(pp)
        for mbs in req.microbatch_sizes or profile.microbatch_sizes:
            if mbs > math.ceil(req.batch_size / dp) or math.ceil(math.ceil(req.batch_size / dp) / mbs) > \
                    MAX_MICROBATCHES:  # a plan holds at most that many (see varuna_core.planning.artifacts)
                continue
            for schedule in schedules:
                for shard in _shard_choices(req, dp):
                    results, need = _prepare(tables, req, pp, dp, mbs, schedule, shard, _placements(req, pp, dp))
                    prepared.extend(results)
                    if need is not None and (smallest is None or need < smallest[0]):
                        what = f"pp={pp}, dp={dp}, micro-batch {mbs}, {schedule}"
                        smallest = (need, what + (", optimizer sharded" if shard else ""))
    return prepared, smallest, clamped


def _cores_shared(profile: Profile, req: PlanRequest, workers: int) -> str | None:
    """On CPU devices: a note that the prediction cannot hold where the workers of a node need more cores than
    the profiled host had (the profile timed each process with its threads to itself; workers sharing cores
    each run slower, which no profile taken with fewer processes shows)."""
    env = profile.environment
    if env.device_type != "cpu" or env.cpu_cores is None:
        return None
    per_node = min(workers, req.gpus_per_node or req.gpus)
    need = per_node * env.threads
    if need <= env.cpu_cores:
        return None
    return (f"the devices are CPUs: the {per_node} workers of a node run {env.threads} thread(s) each, {need} in all, "
            f"where the profiled host has {env.cpu_cores} core(s); on nodes like it they share the cores and the "
            f"predicted step will not hold (plan for at most {max(1, env.cpu_cores // env.threads)} devices per "
            "node there)")


def _depths(profile: Profile, req: PlanRequest) -> list[int]:
    """The pipeline depths to search: the pinned one, or every depth the devices (and the pinned width) and the
    model's segments allow."""
    if req.pp is not None:
        if req.pp > profile.num_segments:
            raise FieldError("pp", f"{req.pp} stages need at least {req.pp} segments; the profiled model has "
                             f"{profile.num_segments}", hint=f"pin a depth of at most {profile.num_segments}")
        return [req.pp]
    most = req.gpus // req.dp if req.dp is not None else req.gpus
    return list(range(1, min(profile.num_segments, most) + 1))


def _placements(req: PlanRequest, pp: int, dp: int) -> tuple[str, ...]:
    """The placements to try: both where they differ (several stages and replicas over several nodes), the
    original's (a replica's pipeline on consecutive ranks) alone elsewhere. Memory does not depend on it."""
    if pp > 1 and dp > 1 and pp * dp > (req.gpus_per_node or req.gpus):
        return PLACEMENTS
    return PLACEMENTS[:1]


def _shard_choices(req: PlanRequest, dp: int) -> tuple[bool, ...]:
    """Whether to try the optimizer state whole, sharded, or both, at ``dp`` replicas."""
    if dp < 2 or req.shard_optimizer is False:
        return (False,)
    return (True,) if req.shard_optimizer else (False, True)


def _preference(c: _Scored) -> float:
    """What the search ranks by: the step time, a sharded optimizer's charged :data:`SHARD_GAIN` more (on a tie
    the state stays whole, see :class:`PlanRequest`)."""
    return c.step * (1 + SHARD_GAIN) if c.shard else c.step


def _score_best(prepared: list[_Scored], tables: _Tables, req: PlanRequest) -> list[_Scored]:
    """Simulate in order of a lower bound on the step time; once the bound exceeds the k-th best simulated step,
    nothing later can enter the top k. The winner and alternatives are exactly those of a full search."""

    def bound(c: _Scored) -> float:
        return c.lower_bound * (1 + SHARD_GAIN) if c.shard else c.lower_bound

    prepared.sort(key=bound)
    keep = 1 + req.top
    scored: list[_Scored] = []
    best_steps: list[float] = []  # the k smallest ranked steps (_preference), sorted
    for cand in prepared:
        if len(best_steps) >= keep and bound(cand) > best_steps[keep - 1] * (1 + TIE):  # ties: see _simplicity
            break
        scored.append(_score(cand, tables, req))
        bisect.insort(best_steps, _preference(cand))
        del best_steps[keep:]
    return scored


def _raise_nothing_fits(profile: Profile, req: PlanRequest, smallest: tuple[int, str] | None) -> NoReturn:
    if smallest is not None and req.gpu_memory is not None:  # a smallest need is only known under a limit
        from ..ir.units import format_bytes

        raise PlanInfeasible(
            f"no configuration fits in {format_bytes(req.gpu_memory)} per device; the smallest need is "
            f"{format_bytes(smallest[0])} ({smallest[1]})",
            hint="use devices with more memory, more devices, or profile smaller micro-batch sizes",
        )
    raise ConfigError(
        f"no configuration: batch {req.batch_size} with the profiled micro-batch sizes "
        f"{profile.microbatch_sizes} over {req.gpus} device(s)",
        hint="the global batch must hold at least one micro-batch per data-parallel replica",
    )


def plan_for(profile: Profile, req: PlanRequest, *, pp: int, dp: int, microbatch_size: int, schedule: str,
             shard_optimizer: bool = False, placement: str = "pipeline") -> Plan:
    """The plan of one given configuration (no search): for benchmarks and for forcing a layout. ``placement``:
    one of :data:`PLACEMENTS`.

    Raises:
        PlanInfeasible: it does not fit ``req.gpu_memory``.
    """
    if pp * dp > req.gpus:
        raise ConfigError(f"pp={pp} × dp={dp} needs {pp * dp} devices, more than the request's {req.gpus}")
    if pp > profile.num_segments:
        raise ConfigError(f"pp={pp} exceeds the profile's {profile.num_segments} segments")
    name = check_schedule(schedule)
    schedules_for(profile, dataclasses.replace(req, schedules=(name,)))  # refuses a split without B and W measures
    schedules = schedules_for(profile, req)
    assumptions: set[str] = set()
    tables = _Tables(profile, req.wire_dtype, Link.of(req))
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown placement {placement!r}", hint=f"one of {', '.join(PLACEMENTS)}")
    results, need = _prepare(tables, req, pp, dp, microbatch_size, schedule, shard_optimizer and dp > 1, (placement,))
    result = _score(results[0], tables, req) if results else None
    if result is None:
        raise PlanInfeasible(f"pp={pp}, dp={dp}, micro-batch {microbatch_size}, {schedule} needs {need} bytes per "
                             f"device, more than {req.gpu_memory}")
    return _to_plan(profile, req, result, [], assumptions, schedules if name in schedules else (*schedules, name))


def layout_plan(*, pp: int, dp: int, microbatch_size: int, batch_size: int, gpus: int, gpus_per_node: int,
                schedule: str = "varuna", model: str = "", note: str = "") -> Plan:
    """The plan of a layout given by hand, without a profile (the original's ``--nstages``/``--chunk_size``).

    It has no partition (``Varuna(...)`` balances the parameter bytes of the segments it finds), no prediction
    and no stage entries; ``varuna launch`` runs it like any plan, and a morph keeps ``pp`` and changes ``dp``.

    Raises:
        ConfigError: the numbers do not make a layout (the message names which).
    """
    from pydantic import ValidationError

    check_schedule(schedule)
    replica = -(-batch_size // max(dp, 1))
    try:
        return Plan(
            model=model, profile_hash=None, num_segments=None, gpus=gpus, gpus_per_node=gpus_per_node,
            batch_size=batch_size, pp=pp, dp=dp, microbatch_size=microbatch_size,
            num_microbatches=-(-replica // max(microbatch_size, 1)), schedule=schedule, partition=None,
            stage_to_rank_map=Topology.clustered(pp, dp).to_string(), nodes=_nodes(pp * dp, gpus_per_node),
            schedules=[schedule], prediction=None,
            assumptions=[("layout given by hand: no profile, so no partition (Varuna(...) balances parameter bytes) "
                          "and no prediction"), *([note] if note else [])],
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ConfigError(f"no layout pp={pp} × dp={dp}, micro-batch {microbatch_size}, batch {batch_size}: "
                          f"{error['msg'].removeprefix('Value error, ')}") from None


def snapshot_bytes_per_node(state_bytes: list[int], nodes: list[list[int]], topology: Topology) -> int:
    """Host memory the in-memory snapshots take on the fullest node (``varuna_core.worker.snapshots``): a node holds
    the state of every stage its ranks run once (replicas on one node share a copy; under data parallelism a
    publish also keeps a copy of the files a stage's other replicas wrote) and a copy of what the node before it in
    the ring holds and it lacks. Rank ``r`` runs the stage ``topology`` gives it."""
    stages = [{topology.coords(rank)[0] for rank in node} for node in nodes]
    if len(stages) == 1:
        return sum(state_bytes[s] for s in stages[0])
    return max(sum(state_bytes[s] for s in here | stages[i - 1]) for i, here in enumerate(stages))


def _on_wire(nbytes: float, seg: _Seg) -> float:
    """``nbytes`` of a segment's output as the wire carries them: in the proportion of its whole value (a skipped
    tensor is taken to be narrowed as the rest is)."""
    if seg.wire_bytes is None:
        return nbytes
    return nbytes * seg.wire_bytes / seg.output_bytes if seg.output_bytes else 0.0


def _nodes(world: int, per_node: int) -> list[list[int]]:
    """Ranks ``0..world-1`` on nodes of ``per_node`` devices, consecutively (a replica's stages stay together)."""
    return [list(range(i, min(world, i + per_node))) for i in range(0, world, per_node)]


def _to_plan(profile: Profile, req: PlanRequest, best: _Scored, others: list[_Scored], assumptions: set[str],
             schedules: Sequence[ScheduleName]) -> Plan:
    per_node = req.gpus_per_node or req.gpus
    topology = Topology.placed(best.layout.placement, best.pp, best.dp)
    nodes = _nodes(best.pp * best.dp, per_node)
    segs = _segments_at(profile, best.mbs, req.wire_dtype)
    pending = best.pending or [0] * best.pp
    stages = [
        StagePlan(stage=s, segments=(a, b), forward=c.forward, recompute=c.recompute, backward=c.backward,
                  weight=c.weight, pending_weights=pending[s],
                  weight_bytes=round(sum(seg.weight_bytes for seg in segs[a:b])) if best.pending is not None else 0,
                  send_activation=c.send_activation, send_gradient=c.send_gradient,
                  activation_bytes=round(segs[b - 1].on_wire) if b < len(segs) else 0,
                  skip_bytes=round(_on_wire(segs[b - 1].skip_bytes, segs[b - 1])) if b < len(segs) else 0,
                  allreduce=best.sync[s], tie_sums=best.ties[s], optimizer=best.optimizer[s],
                  busy=best.busy[s], memory_bytes=best.memory[s], held_microbatches=best.counts[s][0],
                  state_bytes=sum(seg.param_bytes + seg.optimizer_bytes for seg in profile.segments[a:b]),
                  grad_bytes=sum(seg.grad_bytes for seg in profile.segments[a:b]))
        for s, ((a, b), c) in enumerate(zip(best.partition.ranges, best.costs, strict=True))
    ]

    def candidate(c: _Scored, reason: str) -> Candidate:
        return Candidate(pp=c.pp, dp=c.dp, microbatch_size=c.mbs, num_microbatches=c.num_mb, schedule=c.schedule,
                         shard_optimizer=c.shard, placement=c.layout.placement, step_time=c.step,
                         samples_per_second=req.batch_size / c.step,
                         bubble_fraction=c.bubble,
                         peak_memory_bytes=max(c.memory), reason=reason)

    return Plan(
        model=profile.model, profile_hash=profile.structure_hash, num_segments=profile.num_segments,
        gpus=req.gpus, gpus_per_node=per_node, batch_size=req.batch_size, pp=best.pp, dp=best.dp,
        microbatch_size=best.mbs, num_microbatches=best.num_mb, schedule=best.schedule,
        shard_optimizer=best.shard, wire_dtype=req.wire_dtype, link_rate=req.link_rate,
        link_latency=req.link_latency, idle_penalty=profile.idle_penalty, partition=list(best.partition.ranges),
        stage_to_rank_map=topology.to_string(), nodes=nodes,
        memory_limit=req.gpu_memory, schedules=list(schedules), headroom=req.headroom,
        prediction=Prediction(step_time=best.step, samples_per_second=req.batch_size / best.step,
                              bubble_fraction=best.bubble, pipeline_time=best.pipeline,
                              allreduce_time=best.allreduce),
        snapshot_bytes_per_node=snapshot_bytes_per_node([st.state_bytes for st in stages], nodes, topology),
        stages=stages,
        alternatives=[candidate(c, _reason(c, best)) for c in others],
        assumptions=sorted(assumptions),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
