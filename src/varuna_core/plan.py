"""``varuna plan``: choose pipeline depth, data-parallel width, micro-batch size and schedule from a profile.

For every candidate (pp, dp = ⌊gpus / pp⌋, a profiled micro-batch size, a schedule) the search

1. partitions the segments into ``pp`` contiguous stages minimising the slowest stage's compute time under
   each stage's memory limit (:func:`partition_under_memory`: a binary search on the bottleneck with a
   greedy feasibility check, which is exact for contiguous partitions because both time and memory only grow
   with a stage's segment set);
2. predicts each stage's memory (:func:`stage_memory`): parameters, gradients and optimizer state, the
   activations autograd saves for every graph the schedule keeps alive, the stashed inputs of every
   micro-batch in flight, the receive buffers the runtime posts ahead, and headroom;
3. simulates the exact schedule the runtime would execute (:mod:`varuna_core.simulate`; the C++ simulator
   when built) with point-to-point times from the profile's network fits (intra- or inter-node depending on
   where neighbouring stages are placed) and the data-parallel all-reduce of each stage's gradients.

The fastest predicted step wins; the next ones are kept as alternatives with the reason each lost. This module
imports no torch, so ``varuna plan`` starts fast and runs anywhere.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Sequence

from . import _native_shim
from .artifacts import Candidate, CommCurve, Plan, Prediction, Profile, SegmentMeasure, StagePlan
from .errors import ConfigError, VarunaError
from .partition import Partition
from .schedule import SCHEDULE_NAMES, generate
from .simulate import StageCosts, simulate
from .topology import Topology

__all__ = ["PlanRequest", "make_plan", "plan_for", "partition_under_memory", "PlanInfeasible"]


class PlanInfeasible(VarunaError):
    """No configuration fits; the message names the smallest memory that would."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan for.

    Attributes:
        gpus: devices available.
        batch_size: global batch (fixed; the micro-batch count follows from it).
        gpus_per_node: devices per node (placement: a replica's stages on consecutive ranks).
        gpu_memory: bytes per device, or ``None`` for no limit.
        schedules: schedules to consider.
        headroom: fraction of memory kept free (allocator fragmentation, CUDA context).
        max_concurrent_sends: the runtime's in-flight messages per stage and direction.
        top: alternatives to keep.
    """

    gpus: int
    batch_size: int
    gpus_per_node: int | None = None
    gpu_memory: int | None = None
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    headroom: float = 0.1
    max_concurrent_sends: int = 4
    top: int = 5


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


def _interp(measures: Sequence[SegmentMeasure], n: float, get) -> float:
    """Value at ``n`` examples, linear between (or beyond) the two nearest profiled sizes."""
    points = sorted((m.microbatch_size, get(m)) for m in measures)
    if len(points) == 1:
        size, value = points[0]
        return value * n / size
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if n <= x1:
            break
    if n < points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def _segments_at(profile: Profile, n: float) -> list[_Seg]:
    out = []
    for seg in profile.segments:
        ms = seg.measures
        out.append(_Seg(
            forward=_interp(ms, n, lambda m: m.forward.median),
            recompute=_interp(ms, n, lambda m: m.recompute.median),
            backward=_interp(ms, n, lambda m: m.backward.median),
            output_bytes=_interp(ms, n, lambda m: m.output_bytes),
            saved_bytes=_interp(ms, n, lambda m: m.saved_bytes),
            static_bytes=seg.param_bytes + seg.grad_bytes + seg.optimizer_bytes,
            grad_bytes=seg.grad_bytes,
        ))
    return out


# ----------------------------------------------------------------------------------------------------------
# Memory and partition


def _inflight(schedule: str, pp: int, m: int) -> list[tuple[int, int]]:
    native = _native_shim.module()
    if native is not None:
        return [tuple(x) for x in native.inflight(schedule, pp, m)]
    if schedule == "gpipe":
        return [(m, m)] * pp
    if schedule == "1f1b":
        return [(min(pp - s, m), min(pp - s, m)) for s in range(pp)]
    from .memory_counts import inflight as inflight_python

    return inflight_python(generate(schedule, pp, m))


def stage_memory(segs: Sequence[_Seg], start: int, stop: int, *, held: int, graphs: int, num_mb: int,
                 headroom: float) -> int:
    """Peak bytes of a stage running segments ``[start, stop)``.

    ``graphs`` micro-batches keep their saved activations, ``held`` keep their stashed stage input, and the
    runtime posts receive buffers for every micro-batch of the step (activations in, gradients in).
    """
    static = sum(s.static_bytes for s in segs[start:stop])
    saved = sum(s.saved_bytes for s in segs[start:stop])
    input_bytes = segs[start - 1].output_bytes if start > 0 else 0.0
    output_bytes = segs[stop - 1].output_bytes if stop < len(segs) else 0.0
    activations = graphs * saved + held * input_bytes
    buffers = num_mb * (input_bytes + output_bytes)
    return int((static + activations + buffers) * (1.0 + headroom))


def _stage_cost(segs: Sequence[_Seg], start: int, stop: int, recompute: bool) -> float:
    return sum((s.forward + s.recompute + s.backward) if recompute else (s.recompute + s.backward)
               for s in segs[start:stop])


def partition_under_memory(
    segs: Sequence[_Seg], pp: int, *, recompute_stages: Sequence[bool], counts: Sequence[tuple[int, int]],
    num_mb: int, limit: int | None, headroom: float,
) -> Partition | None:
    """Contiguous partition into ``pp`` stages minimising the slowest stage's compute, each stage within
    ``limit`` bytes; ``None`` if no partition fits.

    Binary search over the bottleneck ``T`` (the candidate values are the stage costs of contiguous ranges);
    for a given ``T`` the greedy that gives each stage as many segments as ``T`` and memory allow is optimal.
    """
    n = len(segs)
    if pp > n:
        return None

    def fits(s: int, a: int, b: int) -> bool:
        if limit is None:
            return True
        held, graphs = counts[s]
        return stage_memory(segs, a, b, held=held, graphs=graphs, num_mb=num_mb, headroom=headroom) <= limit

    def greedy(bound: float) -> list[tuple[int, int]] | None:
        ranges, a = [], 0
        for s in range(pp):
            remaining_stages = pp - s - 1
            b = a
            while b < n - remaining_stages and _stage_cost(segs, a, b + 1, recompute_stages[s]) <= bound + 1e-15 \
                    and fits(s, a, b + 1):
                b += 1
            if b == a:
                return None
            if s == pp - 1 and b < n:
                return None
            ranges.append((a, b))
            a = b
        return ranges if a == n else None

    costs = sorted({_stage_cost(segs, a, b, r) for a in range(n) for b in range(a + 1, n + 1)
                    for r in set(recompute_stages)})
    lo, hi = 0, len(costs) - 1
    if greedy(costs[hi]) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(costs[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    return Partition.from_ranges(greedy(costs[lo]), n)


# ----------------------------------------------------------------------------------------------------------
# Communication


def _curve(profile: Profile, op: str, link: str, group: int) -> CommCurve | None:
    curves = [c for c in profile.comm if c.op == op]
    if not curves:
        return None
    same = [c for c in curves if c.link == link] or curves
    return min(same, key=lambda c: (abs(c.group_size - group), -c.group_size))


def _p2p_time(profile: Profile, nbytes: float, inter: bool) -> float:
    curve = _curve(profile, "p2p", "inter" if inter else "intra", 2)
    return 0.0 if curve is None or nbytes <= 0 else curve.fit.predict(nbytes)


def _allreduce_time(profile: Profile, nbytes: float, d: int, inter: bool) -> float:
    if d < 2 or nbytes <= 0:
        return 0.0
    curve = _curve(profile, "allreduce", "inter" if inter else "intra", d)
    if curve is None:
        return 0.0
    g = curve.group_size
    # ring all-reduce moves 2(d-1)/d of the data and takes 2(d-1) latency steps: rescale from the measured g
    lat = curve.fit.latency * (d - 1) / max(1, g - 1)
    bw_time = (nbytes / curve.fit.bandwidth) * ((d - 1) / d) / ((g - 1) / g)
    return lat + bw_time


def _crossings(pp: int, dp: int, per_node: int) -> tuple[list[bool], bool]:
    """Which stage boundaries cross a node for some replica (ranks: replica·pp + stage), and whether a stage's
    data-parallel group spans nodes."""
    if per_node >= pp * dp:
        return [False] * max(0, pp - 1), False
    residues = {(r * pp) % per_node for r in range(min(dp, per_node))}
    boundary = [any((res + s + 1) % per_node == 0 for res in residues) for s in range(pp - 1)]
    return boundary, dp > 1


# ----------------------------------------------------------------------------------------------------------
# Search


@dataclasses.dataclass
class _Scored:
    pp: int
    dp: int
    mbs: int
    num_mb: int
    schedule: str
    partition: Partition
    costs: list[StageCosts]
    memory: list[int]
    counts: list[tuple[int, int]]
    step: float
    pipeline: float
    busy: list[float]
    bubble: float
    allreduce: float


def _evaluate(profile: Profile, req: PlanRequest, pp: int, dp: int, mbs: int, schedule: str,
              assumptions: set[str]) -> tuple[_Scored | None, int | None]:
    """Score one configuration; returns (scored or None, smallest memory it would need if it did not fit)."""
    replica_batch = math.ceil(req.batch_size / dp)
    num_mb = math.ceil(replica_batch / mbs)
    last = replica_batch - (num_mb - 1) * mbs
    segs = _segments_at(profile, mbs)
    segs_last = _segments_at(profile, last) if last != mbs else segs
    counts = _inflight(schedule, pp, num_mb)
    recompute = [schedule == "varuna" and s < pp - 1 for s in range(pp)]
    part = partition_under_memory(segs, pp, recompute_stages=recompute, counts=counts, num_mb=num_mb,
                                  limit=req.gpu_memory, headroom=req.headroom)
    if part is None:
        if pp > len(segs):
            return None, None
        free = partition_under_memory(segs, pp, recompute_stages=recompute, counts=counts, num_mb=num_mb,
                                      limit=None, headroom=req.headroom)
        need = max(stage_memory(segs, a, b, held=counts[s][0], graphs=counts[s][1], num_mb=num_mb,
                                headroom=req.headroom) for s, (a, b) in enumerate(free.ranges))
        return None, need
    per_node = req.gpus_per_node or req.gpus
    boundary, dp_inter = _crossings(pp, dp, per_node)
    costs, memory = [], []
    for s, (a, b) in enumerate(part.ranges):
        def totals(sg: list[_Seg]) -> tuple[float, float, float]:
            fwd = sum(x.forward if recompute[s] else x.recompute for x in sg[a:b])
            rec = sum(x.recompute for x in sg[a:b]) if recompute[s] else 0.0
            return fwd, rec, sum(x.backward for x in sg[a:b])

        f, r, bw = totals(segs)
        fl, rl, bl = totals(segs_last)
        out_b, out_bl = segs[b - 1].output_bytes, segs_last[b - 1].output_bytes
        in_b = segs[a - 1].output_bytes if a > 0 else 0.0
        in_bl = segs_last[a - 1].output_bytes if a > 0 else 0.0
        send_act = _p2p_time(profile, out_b, boundary[s]) if s < pp - 1 else 0.0
        send_act_l = _p2p_time(profile, out_bl, boundary[s]) if s < pp - 1 else 0.0
        send_grad = _p2p_time(profile, in_b, boundary[s - 1]) if s > 0 else 0.0
        send_grad_l = _p2p_time(profile, in_bl, boundary[s - 1]) if s > 0 else 0.0
        grads = sum(x.grad_bytes for x in segs[a:b])
        costs.append(StageCosts(f, r, bw, send_act, send_grad, _allreduce_time(profile, grads, dp, dp_inter),
                                fl, rl, bl, send_act_l, send_grad_l))
        memory.append(stage_memory(segs, a, b, held=counts[s][0], graphs=counts[s][1], num_mb=num_mb,
                                   headroom=req.headroom))
    step, pipe, busy = _simulate(schedule, pp, num_mb, costs, req.max_concurrent_sends)
    bubble = 1.0 - sum(busy) / (pp * pipe) if pipe > 0 else 0.0
    return _Scored(pp, dp, mbs, num_mb, schedule, part, costs, memory, counts, step, pipe, list(busy), bubble,
                   max(c.allreduce for c in costs)), None


def _simulate(schedule: str, pp: int, num_mb: int, costs: list[StageCosts], sends: int):
    native = _native_shim.module()
    if native is not None:
        return native.simulate_generated(schedule, pp, num_mb, [c.as_tuple() for c in costs], sends,
                                         schedule == "varuna")
    result = simulate(generate(schedule, pp, num_mb), costs, max_concurrent_sends=sends, backend="python")
    return result.step_time, result.pipeline_time, result.busy


def _reason(c: _Scored, best: _Scored) -> str:
    """Why ``c`` lost to ``best``, in a few words: its step-time gap and the component that explains most of it."""
    slower = c.step / best.step - 1.0
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
    what = max(parts, key=parts.get)
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
    if req.gpus < 1:
        raise ConfigError(f"--gpus must be ≥ 1, got {req.gpus}")
    if req.batch_size < 1:
        raise ConfigError(f"--batch-size must be ≥ 1, got {req.batch_size}")
    for name in req.schedules:
        if name not in SCHEDULE_NAMES:
            raise ConfigError(f"unknown schedule {name!r}", hint=f"choose from {', '.join(SCHEDULE_NAMES)}")
    per_node = req.gpus_per_node or req.gpus
    if per_node < 1:
        raise ConfigError(f"--gpus-per-node must be ≥ 1, got {per_node}")
    assumptions: set[str] = set()
    if not any(c.op == "p2p" for c in profile.comm):
        assumptions.add("the profile has no network measurement: communication is taken as free "
                        "(profile with --nproc 2 or more to measure it)")
    elif (req.gpus > per_node) and not any(c.link == "inter" for c in profile.comm):
        assumptions.add("inter-node links are taken to be as fast as the measured intra-node ones")
    if req.gpu_memory is None:
        assumptions.add("no --gpu-memory given: memory is not limited")
    assumptions.add("d = ⌊gpus / pp⌋ replicas; leftover devices idle")

    scored: list[_Scored] = []
    smallest: tuple[int, str] | None = None
    clamped: set[int] = set()
    for pp in range(1, min(profile.num_segments, req.gpus) + 1):
        dp = req.gpus // pp
        if dp > req.batch_size:  # a replica needs at least one example: the rest of the devices would idle
            dp = req.batch_size
            clamped.add(pp)
        for mbs in profile.microbatch_sizes:
            if mbs > math.ceil(req.batch_size / dp):
                continue
            for schedule in req.schedules:
                result, need = _evaluate(profile, req, pp, dp, mbs, schedule, assumptions)
                if result is not None:
                    scored.append(result)
                elif need is not None and (smallest is None or need < smallest[0]):
                    smallest = (need, f"pp={pp}, dp={dp}, micro-batch {mbs}, {schedule}")
    if not scored:
        if smallest is not None:
            from .units import format_bytes

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
    scored.sort(key=lambda c: (c.step, c.pp, -c.dp, c.mbs, SCHEDULE_NAMES.index(c.schedule)))
    best = scored[0]
    if best.pp in clamped:
        assumptions.add(f"the global batch of {req.batch_size} is smaller than the {req.gpus // best.pp} replicas "
                        f"{req.gpus} devices allow at pp={best.pp}: {best.dp} replica(s) used, "
                        f"{req.gpus - best.pp * best.dp} device(s) idle")
    return _to_plan(profile, req, best, scored[1: 1 + req.top], assumptions)


def plan_for(profile: Profile, req: PlanRequest, *, pp: int, dp: int, microbatch_size: int, schedule: str) -> Plan:
    """The plan of one given configuration (no search): for benchmarks and for forcing a layout.

    Raises:
        PlanInfeasible: it does not fit ``req.gpu_memory``.
    """
    if pp * dp > req.gpus:
        raise ConfigError(f"pp={pp} × dp={dp} needs {pp * dp} devices, more than --gpus {req.gpus}")
    if pp > profile.num_segments:
        raise ConfigError(f"pp={pp} exceeds the profile's {profile.num_segments} segments")
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"unknown schedule {schedule!r}", hint=f"choose from {', '.join(SCHEDULE_NAMES)}")
    assumptions: set[str] = set()
    result, need = _evaluate(profile, req, pp, dp, microbatch_size, schedule, assumptions)
    if result is None:
        raise PlanInfeasible(f"pp={pp}, dp={dp}, micro-batch {microbatch_size}, {schedule} needs {need} bytes per "
                             f"device, more than {req.gpu_memory}")
    return _to_plan(profile, req, result, [], assumptions)


def _to_plan(profile: Profile, req: PlanRequest, best: _Scored, others: list[_Scored], assumptions: set[str]) -> Plan:
    per_node = req.gpus_per_node or req.gpus
    topology = Topology.clustered(best.pp, best.dp)
    world = best.pp * best.dp
    nodes = [list(range(i, min(world, i + per_node))) for i in range(0, world, per_node)]
    stages = [
        StagePlan(stage=s, segments=(a, b), forward=c.forward, recompute=c.recompute, backward=c.backward,
                  send_activation=c.send_activation, send_gradient=c.send_gradient, allreduce=c.allreduce,
                  busy=best.busy[s], memory_bytes=best.memory[s], held_microbatches=best.counts[s][0])
        for s, ((a, b), c) in enumerate(zip(best.partition.ranges, best.costs))
    ]

    def candidate(c: _Scored, reason: str) -> Candidate:
        return Candidate(pp=c.pp, dp=c.dp, microbatch_size=c.mbs, num_microbatches=c.num_mb, schedule=c.schedule,
                         step_time=c.step, samples_per_second=req.batch_size / c.step, bubble_fraction=c.bubble,
                         peak_memory_bytes=max(c.memory), reason=reason)

    return Plan(
        model=profile.model, profile_hash=profile.structure_hash, num_segments=profile.num_segments,
        gpus=req.gpus, gpus_per_node=per_node, batch_size=req.batch_size, pp=best.pp, dp=best.dp,
        microbatch_size=best.mbs, num_microbatches=best.num_mb, schedule=best.schedule,
        partition=list(best.partition.ranges), stage_to_rank_map=topology.to_string(), nodes=nodes,
        memory_limit=req.gpu_memory,
        prediction=Prediction(step_time=best.step, samples_per_second=req.batch_size / best.step,
                              bubble_fraction=best.bubble, pipeline_time=best.pipeline,
                              allreduce_time=best.allreduce),
        stages=stages,
        alternatives=[candidate(c, _reason(c, best)) for c in others],
        assumptions=sorted(assumptions),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
