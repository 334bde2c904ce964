"""Versioned artifacts exchanged by the verbs, as pydantic models (JSON Schemas in ``schemas/`` are generated
from them by :mod:`varuna_core.schemas`; a test keeps the two in sync). The bounded readers and the bases they
share with checkpoint manifests are in :mod:`varuna_core.util.versioned_io`.

Times are in seconds and sizes in bytes throughout.

Plans and profiles are files people copy, edit and pass around, so loading one checks everything the runtime
and the planner rely on, and refuses the rest with one line naming the file and the field:

* **The file itself.** A regular file (never a FIFO, which would block, or a directory), at most
  :data:`MAX_PLAN_BYTES` / :data:`MAX_PROFILE_BYTES`, UTF-8. Plans are YAML read by a safe loader that refuses
  anchors and aliases (a plan never needs them; a "billion laughs" file expands a few hundred bytes into billions
  of nodes), duplicate keys, nesting deeper than :data:`MAX_NESTING` and more than :data:`MAX_PLAN_EVENTS`
  nodes, so that no plan file takes more than seconds to refuse. JSON (profiles, and plans written as
  ``.json``) is read by the standard parser, whose recursion limit bounds nesting.
* **The numbers.** Counts are integers (``true`` is not 1), sizes and times are finite and not negative, and
  each has a bound past which it can only be a mistake: :data:`MAX_DEVICES` devices, :data:`MAX_SEGMENTS`
  segments, :data:`MAX_MICROBATCHES` micro-batches per replica (the schedule of a step has one action per
  micro-batch and stage, and the planner, the runtime and ``varuna plan show`` all build it).
* **Consistency.** A plan's ``pp × dp`` fits its devices, its ``stage_to_rank_map`` is a ``pp × dp`` grid, its
  partition is ``pp`` contiguous non-empty ranges covering every segment, its micro-batch count follows from
  the batch, its stages and nodes agree with all of that; the last stage sends no activation (no
  ``activation_bytes`` or ``skip_bytes``), a stage's ``skip_bytes`` are at most its ``activation_bytes``, it holds
  at most ``num_microbatches`` and fits ``memory_limit``; its schedule is one of ``schedules`` and every
  alternative fits ``gpus``. A profile measured every segment at every listed micro-batch size, its ``skip_bytes``
  are at most its ``output_bytes``, its last segment sends nothing, its percentiles are ordered, a p2p
  curve has two ranks, and the split backward's measures (B, W, the bytes W keeps) are in every measure or in
  none (profiles made before the profiler measured them have none, and load). Anything else would crash or hang
  a worker far from the file that caused it, or make the planner charge what never happens.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, field_validator, model_validator

from ..errors import ConfigError, TopologyError
from ..ir.units import MAX_BYTES
from ..util.fs import MiB
from ..util.versioned_io import (
    CheckedModel,
    check_document,
    parse_json,
    parse_yaml,
    read_artifact,
    short_repr,
    unique_keys,
    validate,
    write_output,
)

__all__ = [
    "Stat", "SegmentMeasure", "SegmentProfile", "LinearFit", "CommCurve", "Environment", "StopReason", "Profile",
    "TiedWeight", "IdlePenalty",
    "load_profile", "StagePlan", "Prediction", "Candidate", "Plan", "save_plan", "load_plan", "MAX_PLAN_BYTES",
    "MAX_PROFILE_BYTES", "MAX_PLAN_EVENTS", "MAX_NESTING", "MAX_DEVICES", "MAX_SEGMENTS", "MAX_MICROBATCHES",
    "MAX_MICROBATCH_SIZE",
]

MAX_PLAN_BYTES = 4 * MiB  # a plan for MAX_DEVICES devices is about 1 MiB
MAX_PLAN_EVENTS = 400_000  # YAML nodes in a plan: building Python values from YAML takes ~10 µs per node
MAX_PROFILE_BYTES = 64 * MiB
MAX_NESTING = 32  # a plan is 4 levels deep
MAX_DEVICES = 2**16
MAX_SEGMENTS = 4096
MAX_MICROBATCHES = 100_000  # per replica and step
MAX_MICROBATCH_SIZE = 2**20
BUBBLE_ROUNDING = 1e-6  # a bubble fraction computed as 1 - busy / pipeline may come out a rounding error below 0


Count = Annotated[int, Strict(), Field(ge=1)]
Index = Annotated[int, Strict(), Field(ge=0)]
Bytes = Annotated[int, Strict(), Field(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Strict(), Field(ge=0)]
Devices = Annotated[int, Strict(), Field(ge=1, le=MAX_DEVICES)]


class Stat(CheckedModel):
    """Distribution of repeated measurements of one duration."""

    median: Seconds = Field(description="median over the measured repeats (s)")
    p10: Seconds = Field(description="10th percentile (s)")
    p90: Seconds = Field(description="90th percentile (s)")
    repeats: Count = Field(description="number of measured repeats (after warm-up)")


class SegmentMeasure(CheckedModel):
    """One segment at one micro-batch size."""

    microbatch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_MICROBATCH_SIZE)]
    forward: Stat = Field(description="forward without autograd (the varuna schedule's F), from the segment's "
                                      "incoming cut on (without prefix)")
    recompute: Stat = Field(description="forward that records the graph (1F1B/GPipe F, varuna R), from the "
                                        "segment's incoming cut on (without prefix)")
    prefix: Stat | None = Field(
        None, description="what a stage starting at this segment spends in each forward before its incoming cut: the "
                          "model's code of the earlier segments run on placeholders, once per forward of the stage "
                          "however many segments it has (0 for the first segment; None: a profile made before the "
                          "profiler measured it apart, whose forward and recompute include it)")
    backward: Stat = Field(description="backward of the segment, from the output gradient to input and weights")
    split_backward: Stat | None = Field(
        None, description="B of a split backward (the zb and varuna-zb schedules): the input gradient of the split "
                          "modules and the whole backward of the others, after a forward under the split (None: a "
                          "profile made before the profiler measured it)")
    weight: Stat | None = Field(
        None, description="W of a split backward: the weights' gradients B deferred (None: not measured)")
    weight_bytes: Bytes | None = Field(
        None, description="bytes one micro-batch keeps alive from its B to its W, for the weights' gradients (the "
                          "split modules' inputs and output gradients; None: not measured)")
    output_bytes: Bytes = Field(description="bytes of the value leaving the segment at its cut (0 for the last)")
    skip_bytes: Bytes = Field(0, description="of output_bytes, the tensors that skip over the cut to a later "
                              "segment, carried with the cut's value (see skip routing in the docs)")
    wire16_bytes: Bytes | None = Field(
        None, description="bytes of the value at the cut on a 2-byte wire (Varuna(..., wire_dtype='bf16' or "
                          "'fp16')): its floating-point tensors wider than 2 bytes counted at 2 bytes an element, "
                          "the others as they are (None: not measured; the planner then takes half of output_bytes)")
    saved_bytes: Bytes = Field(description="activation bytes autograd keeps for the backward (saved tensors)")
    peak_bytes: Bytes | None = Field(None, description="device max_memory_allocated during the pass (CUDA only)")


class SegmentProfile(CheckedModel):
    """Static sizes of one segment and its measurements per micro-batch size."""

    index: Index
    input_cut: str | None = Field(description="cut the segment starts after (None for the first)")
    skips: list[Annotated[str, Field(max_length=500)]] = Field(
        default_factory=list, max_length=10_000,
        description="the tensors computed before the segment's output cut and read after it, carried with the "
                    "cut's value (what, where from, per-example shape)")
    output_cut: str | None = Field(description="cut the segment ends at (None for the last)")
    param_count: Bytes
    param_bytes: Bytes = Field(
        description="parameters the segment uses (tied weights count in each segment using them)")
    grad_bytes: Bytes
    optimizer_bytes: Bytes = Field(
        description="optimizer state after one step with the spec's optimizer (AdamW by default)")
    optimizer_time: Seconds = Field(0.0, description="one optimizer step over the segment's parameters (s, median)")
    measures: list[SegmentMeasure] = Field(min_length=1)


class LinearFit(CheckedModel):
    """``time = latency + bytes / bandwidth``, least squares over the measured sizes."""

    latency: Seconds = Field(description="s")
    bandwidth: Annotated[float, Strict(), Field(gt=0)] = Field(description="bytes/s")
    rel_error: Seconds = Field(description="root-mean-square relative error of the fit over the measured points")

    def predict(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


class CommCurve(CheckedModel):
    """Measured time of one communication pattern against message size."""

    op: Literal["p2p", "allreduce"]
    link: Literal["intra", "inter"] = Field(description="intra-node or inter-node")
    group_size: Annotated[int, Strict(), Field(ge=2, le=MAX_DEVICES)] = Field(
        description="2 for point-to-point; the number of ranks for all-reduce")
    sizes: list[Bytes] = Field(min_length=1, description="message sizes (bytes)")
    times: list[Seconds] = Field(min_length=1, description="median time per size (s); one-way for p2p")
    fit: LinearFit

    @model_validator(mode="after")
    def _one_time_per_size(self) -> CommCurve:
        if len(self.sizes) != len(self.times):
            raise ValueError(f"{len(self.sizes)} sizes but {len(self.times)} times")
        return self


class Environment(CheckedModel):
    torch_version: str
    python_version: str
    device_type: str
    devices: list[str]
    threads: Count
    hosts: list[str]
    nproc: Count
    precision: str
    cpu_cores: Count | None = Field(None, description="CPU cores the profiling process could run on (its affinity): "
                                    "on a CPU, what the planned workers of one host share (unknown in older "
                                    "profiles)")


class StopReason(CheckedModel):
    """Why profiling stopped before the largest requested micro-batch size."""

    microbatch_size: Count
    segment: Index
    reason: str


class TiedWeight(CheckedModel):
    """A weight that several segments use (a tied embedding and head, declared ``shared_weights``): every step
    its gradient is summed over the stages that hold a copy, which the planner charges when a partition puts
    those segments on several stages."""

    name: Annotated[str, Field(min_length=1, max_length=500)] = Field(description="its canonical parameter name")
    segments: list[Index] = Field(min_length=2, max_length=MAX_SEGMENTS, description="the segments that use it")
    grad_bytes: Bytes = Field(description="bytes of its gradient: what the sum moves")


MAX_IDLE_GAPS = 16


class IdlePenalty(CheckedModel):
    """How much slower work runs right after its process waited ([Note: idle penalty] in
    :mod:`varuna_core.planning.simulate`): one action timed in a tight loop and right after idle gaps of
    ``gaps_s``. The simulator adds ``fraction(gap) · min(duration, action_s)`` to an action that starts after its
    stage idled for ``gap``, ``fraction`` interpolated linearly from 0 at no gap through the measured points and
    constant after the last."""

    gaps_s: list[Annotated[float, Strict(), Field(gt=0, le=10.0)]] = Field(
        min_length=1, max_length=MAX_IDLE_GAPS, description="idle gaps measured, strictly increasing (s)")
    fractions: list[Annotated[float, Strict(), Field(ge=0, le=10.0)]] = Field(
        min_length=1, max_length=MAX_IDLE_GAPS,
        description="per gap, the action's extra time after it as a fraction of its tight-loop time")
    action_s: Annotated[float, Strict(), Field(gt=0, le=3600.0)] = Field(
        description="the measured action's tight-loop time (s): the penalty of a longer action saturates there")

    @model_validator(mode="after")
    def _one_fraction_per_gap(self) -> IdlePenalty:
        if len(self.gaps_s) != len(self.fractions):
            raise ValueError(f"{len(self.gaps_s)} gaps_s but {len(self.fractions)} fractions")
        if any(b <= a for a, b in itertools.pairwise(self.gaps_s)):
            raise ValueError(f"gaps_s {short_repr(self.gaps_s)} is not strictly increasing")
        return self


class Profile(CheckedModel):
    """What ``varuna profile`` measured: the input of ``varuna plan``."""

    schema_version: Literal[1] = 1
    model: str = Field(description="the model spec it was measured from")
    structure_hash: str = Field(description="hash of the model structure and inputs (changes when the model does)")
    num_segments: Annotated[int, Strict(), Field(ge=1, le=MAX_SEGMENTS)]
    cut_names: list[str]
    microbatch_sizes: list[Annotated[int, Strict(), Field(ge=1, le=MAX_MICROBATCH_SIZE)]] = Field(
        min_length=1, description="sizes measured for every segment")
    stopped: StopReason | None = Field(None, description="set when a memory limit or OOM ended the sweep")
    segments: list[SegmentProfile]
    comm: list[CommCurve] = Field(default_factory=list)
    ties: list[TiedWeight] = Field(default_factory=list, max_length=100_000,
                                   description="weights used by several segments (absent in older profiles)")
    idle_penalty: IdlePenalty | None = Field(None, description="how much slower an action runs right after its "
                                             "process waited (absent in older profiles: not charged)")
    environment: Environment
    created: str = Field(description="ISO 8601 time of the measurement")

    @property
    def splits_backward(self) -> bool:
        """Whether every measure has the split backward's B and W (``split_backward``, ``weight``,
        ``weight_bytes``): the planner considers the schedules that split the backward only then."""
        return self.segments[0].measures[0].split_backward is not None

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        _check_segments(self)
        _check_measures(self)
        _check_split(self)
        _check_profile_bytes(self)
        _check_comm(self)
        _check_ties(self)
        return self


def _check_segments(p: Profile) -> None:
    """One segment per index, in order, between the cuts the profile names."""
    n = p.num_segments
    if len(p.segments) != n:
        raise ValueError(f"num_segments is {n} but segments lists {len(p.segments)}")
    if len(p.cut_names) != n - 1:
        raise ValueError(f"{n} segments are separated by {n - 1} cuts, but cut_names lists {len(p.cut_names)}")
    for k, seg in enumerate(p.segments):
        if seg.index != k:
            raise ValueError(f"segments[{k}] has index {seg.index}")
        before = p.cut_names[k - 1] if k > 0 else None
        after = p.cut_names[k] if k < n - 1 else None
        if (seg.input_cut, seg.output_cut) != (before, after):
            raise ValueError(f"segments[{k}] runs from cut {seg.input_cut!r} to {seg.output_cut!r}, but cut_names "
                             f"puts it between {before!r} and {after!r}")


def _check_measures(p: Profile) -> None:
    """Every segment measured at exactly the listed (increasing) sizes, and some time measured at all."""
    sizes = p.microbatch_sizes
    if any(b <= a for a, b in itertools.pairwise(sizes)):
        raise ValueError(f"microbatch_sizes {short_repr(sizes)} is not strictly increasing")
    for seg in p.segments:
        got = [m.microbatch_size for m in seg.measures]
        if got != sizes:
            raise ValueError(f"segments[{seg.index}] is measured at micro-batch sizes {short_repr(got)}, not at "
                             f"microbatch_sizes {short_repr(sizes)}")
    if p.stopped is not None:
        if p.stopped.segment >= p.num_segments:
            raise ValueError(f"stopped.segment is {p.stopped.segment}, but there are {p.num_segments} segments")
        if p.stopped.microbatch_size <= sizes[-1]:
            raise ValueError(f"stopped.microbatch_size {p.stopped.microbatch_size} was measured: the sweep stops "
                             f"after the largest measured size {sizes[-1]}")
    if not any(m.forward.median or m.recompute.median or m.backward.median for s in p.segments for m in s.measures):
        raise ValueError("every measured time is 0")


def _check_profile_bytes(p: Profile) -> None:
    """What a segment sends agrees with itself: the tensors skipping a cut are part of what crosses it, and the
    last segment (which ends at the loss) sends nothing. The planner would otherwise charge sends that never
    happen, or more skipped bytes than the cut carries."""
    last = p.num_segments - 1
    for seg in p.segments:
        for j, m in enumerate(seg.measures):
            where = f"segments[{seg.index}].measures[{j}] (micro-batch {m.microbatch_size})"
            if seg.index == last and (m.output_bytes or m.skip_bytes):
                raise ValueError(f"{where}: output_bytes {m.output_bytes} and skip_bytes {m.skip_bytes} on the last "
                                 f"segment, which ends at the loss and sends nothing (both must be 0)")
            if m.wire16_bytes is not None and m.wire16_bytes > m.output_bytes:
                raise ValueError(f"{where}: wire16_bytes {m.wire16_bytes} is more than output_bytes {m.output_bytes}, "
                                 "the bytes of the same value with every tensor in its own dtype")
            if m.skip_bytes > m.output_bytes:
                raise ValueError(f"{where}: skip_bytes {m.skip_bytes} is more than output_bytes {m.output_bytes}, "
                                 f"of which the skipping tensors are a part")
            for name in ("forward", "recompute", "backward", "split_backward", "weight"):
                stat = getattr(m, name)
                if stat is not None and not stat.p10 <= stat.median <= stat.p90:
                    raise ValueError(f"{where}: {name} has p10 {stat.p10:g}, median {stat.median:g} and p90 "
                                     f"{stat.p90:g}, not in increasing order")
        if seg.index == last and seg.skips:
            raise ValueError(f"segments[{last}] is the last segment but lists {len(seg.skips)} skips: it has no "
                             f"outgoing cut to carry them")


_SPLIT_FIELDS = ("split_backward", "weight", "weight_bytes")


def _check_split(p: Profile) -> None:
    """The split backward's measures (B, W and the bytes W keeps) are in every measure or in none: the planner
    would otherwise plan a split schedule from a part of the model."""
    first = p.segments[0].measures[0].split_backward is not None
    for seg in p.segments:
        for j, m in enumerate(seg.measures):
            where = f"segments[{seg.index}].measures[{j}] (micro-batch {m.microbatch_size})"
            have = [name for name in _SPLIT_FIELDS if getattr(m, name) is not None]
            if have and len(have) < len(_SPLIT_FIELDS):
                lacks = [name for name in _SPLIT_FIELDS if name not in have]
                raise ValueError(f"{where} has {' and '.join(have)} but not {' and '.join(lacks)}: a split "
                                 f"backward is measured whole ({', '.join(_SPLIT_FIELDS)})")
            if bool(have) != first:
                raise ValueError(f"{where} {'has' if have else 'lacks'} the split backward's measures and "
                                 f"segments[0].measures[0] {'lacks' if have else 'has'} them: they are measured "
                                 f"for every segment and micro-batch size, or for none")


def _check_comm(p: Profile) -> None:
    """A point-to-point curve is between two ranks."""
    for i, curve in enumerate(p.comm):
        if curve.op == "p2p" and curve.group_size != 2:
            raise ValueError(f"comm[{i}] is a p2p curve with group_size {curve.group_size}; point-to-point is "
                             f"between 2 ranks")



def _check_ties(p: Profile) -> None:
    """A tied weight names distinct segments of the profile, in order."""
    for i, tie in enumerate(p.ties):
        if tie.segments != sorted(set(tie.segments)):
            raise ValueError(f"ties[{i}] ({tie.name!r}): segments {tie.segments} are not distinct and in order")
        if tie.segments[-1] >= p.num_segments:
            raise ValueError(f"ties[{i}] ({tie.name!r}): segment {tie.segments[-1]} of a profile of "
                             f"{p.num_segments} segments")


def load_profile(path: str | Path) -> Profile:
    """The profile in the JSON file ``path``.

    Raises:
        ConfigError: the file is missing, not a regular file, too large, not UTF-8 JSON, or not a valid profile
            (the message names the first wrong field).
    """
    text = read_artifact(path, MAX_PROFILE_BYTES, "profile", "create it with `varuna profile SPEC -o FILE`")
    data = check_document(parse_json(text, path, "profile"), path, "profile", "`varuna profile`")
    return validate(Profile, data, path, "profile", "re-measure with `varuna profile`")


# ----------------------------------------------------------------------------------------------------------
# Plan


def _schedule_name(value: str) -> str:
    from ..ir.schedule import check_schedule

    try:
        return check_schedule(value)
    except ConfigError as exc:  # pydantic reports a ValueError as the field's problem
        raise ValueError(f"{exc.message}; {exc.hint}") from None


class StagePlan(CheckedModel):
    """One pipeline stage of a plan."""

    stage: Index
    segments: tuple[Index, Index] = Field(description="half-open range of segments")
    forward: Seconds = Field(description="predicted F time per full micro-batch (s)")
    recompute: Seconds = Field(
        description="predicted R time per full micro-batch (s); 0 when the stage does not recompute")
    backward: Seconds = Field(description="predicted B time per full micro-batch (s): the whole backward, or under a "
                                          "schedule that splits it (zb, varuna-zb) the input gradient only")
    weight: Seconds = Field(0.0, description="predicted W time per full micro-batch (s): the weights' gradients "
                            "under a schedule that splits the backward; 0 when it does not")
    weight_bytes: Bytes = Field(0, description="bytes one full micro-batch keeps from its B to its W under a schedule "
                                "that splits the backward (what the weights' gradients need); 0 when it does not")
    pending_weights: Index = Field(0, description="micro-batches waiting for their W at once (each keeping "
                                   "weight_bytes); 0 when the backward is not split")
    send_activation: Seconds = Field(0.0, description="predicted time to send one activation to the next stage (s)")
    activation_bytes: Bytes = Field(0, description="bytes sent to the next stage per full micro-batch (in the "
                                    "plan's wire_dtype, if it has one)")
    skip_bytes: Bytes = Field(0, description="of activation_bytes, the tensors skipping over the stage's "
                              "outgoing cut (carried for a later stage; on a narrow wire, in proportion)")
    send_gradient: Seconds = Field(0.0, description="predicted time to send one gradient to the previous stage (s)")
    allreduce: Seconds = Field(0.0, description="predicted data-parallel gradient all-reduce time (s)")
    tie_sums: Seconds = Field(0.0, description="predicted sums of the stage's tied weights over the stages that hold "
                                               "them, after its last backward (s)")
    optimizer: Seconds = Field(0.0, description="predicted optimizer step time (s)")
    busy: Seconds = Field(description="simulated compute time in one step (s)")
    memory_bytes: Bytes = Field(description="predicted peak memory per device, headroom included")
    held_microbatches: Index = Field(description="micro-batches whose state the stage holds at once")
    state_bytes: Bytes = Field(0, description="what a checkpoint or an in-memory snapshot of the stage holds: "
                               "its parameters and their optimizer state")
    grad_bytes: Bytes = Field(0, description="bytes of the stage's gradients: what its data-parallel all-reduce sums "
                              "each step (0 in plans made before it was recorded)")


Fraction = Annotated[float, Strict(), Field(ge=-BUBBLE_ROUNDING, le=1)]


class Prediction(CheckedModel):
    step_time: Seconds = Field(description="s")
    samples_per_second: Seconds
    bubble_fraction: Fraction
    pipeline_time: Seconds = Field(description="s, before the gradient all-reduce")
    allreduce_time: Seconds = Field(description="s, the slowest stage's gradient all-reduce")


class Candidate(CheckedModel):
    """A configuration the search scored (the winner or an alternative)."""

    pp: Count
    dp: Count
    microbatch_size: Count
    num_microbatches: Count
    schedule: str
    shard_optimizer: StrictBool = Field(False, description="the optimizer state sharded over the dp replicas")
    placement: Literal["pipeline", "stage"] = Field(
        "pipeline", description="ranks on nodes: 'pipeline', a replica's stages on consecutive ranks (the original's); "
                                "'stage', a stage's replicas on consecutive ranks (their all-reduce inside a node)")
    step_time: Seconds
    samples_per_second: Seconds
    bubble_fraction: Fraction
    peak_memory_bytes: Bytes
    reason: str = Field("", description="why it lost to the plan (empty for the plan itself)")

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        return _schedule_name(value)


class Plan(CheckedModel):
    """What ``varuna plan`` chose, and what ``Varuna(..., plan=...)`` and ``varuna launch`` run."""

    schema_version: Literal[1] = 1
    model: str
    profile_hash: str | None = Field(description="structure hash of the profiled model (None: a layout given by "
                                     "hand)")
    num_segments: Annotated[int, Strict(), Field(ge=1, le=MAX_SEGMENTS)] | None = Field(
        description="segments of the profiled model (None: a layout given by hand)")
    gpus: Devices
    gpus_per_node: Devices
    batch_size: Count = Field(description="global batch")
    pp: Count
    dp: Count
    microbatch_size: Count
    num_microbatches: Annotated[int, Strict(), Field(ge=1, le=MAX_MICROBATCHES)] = Field(
        description="per replica (the first replicas may hold one example more)")
    schedule: str
    partition: list[tuple[Index, Index]] | None = Field(
        description="half-open segment range per stage (None: a layout given by hand; Varuna(...) balances the "
                    "parameter bytes of the segments it finds)")
    stage_to_rank_map: str = Field(description="the original's format: stages ';'-separated, replicas ','")
    nodes: list[list[Index]] = Field(description="global ranks on each node")
    memory_limit: Annotated[int, Strict(), Field(ge=1, le=MAX_BYTES)] | None = Field(
        None, description="bytes per device the plan had to fit (None: unlimited)")
    schedules: list[str] = Field(default_factory=lambda: ["varuna", "1f1b", "gpipe"], min_length=1,
                                 description="schedules the search considered")
    headroom: Annotated[float, Strict(), Field(ge=0, lt=1)] = Field(
        0.1, description="fraction of memory the plan kept free")
    profile_path: str | None = Field(None, description="the profile the plan was made from (absolute path): "
                                     "`varuna launch --morph` plans again from it when the device count changes")
    prediction: Prediction | None = Field(description="the simulated step (None: a layout given by hand)")
    shard_optimizer: StrictBool = Field(
        False, description="the optimizer state of each stage is sharded over its data-parallel replicas "
                           "(Varuna(..., shard_optimizer=True)): each rank holds 1/dp of it")
    wire_dtype: Literal["bf16", "fp16"] | None = Field(
        None, description="the dtype floating-point activations and gradients wider than it cross cuts in "
                          "(Varuna(..., wire_dtype=...)), charged at its bytes; None: each in its own dtype")
    link_rate: Annotated[float, Strict(), Field(gt=0)] | None = Field(
        None, description="bytes/s each way of the link between nodes as `varuna plan --link-rate` gave it (messages "
                          "and all-reduces crossing nodes were charged at it); None: the profile's inter-node fit")
    link_latency: Annotated[float, Strict(), Field(ge=0)] | None = Field(
        None, description="seconds per message on that link (--link-latency); None: the profile's")
    idle_penalty: IdlePenalty | None = Field(
        None, description="the profile's measure of how much slower an action runs right after its process waited, "
                          "as the prediction charged it (None: not charged)")
    snapshot_bytes_per_node: Bytes = Field(
        0, description="host memory the in-memory snapshots of `varuna launch --snapshot-every` take on the fullest "
                       "node: the state of the stages its ranks run and of the stages of the node before it, whose "
                       "copy it keeps (nodes in a ring; one node keeps no copy). 0: a layout given by hand")
    stages: list[StagePlan] = Field(default_factory=list, description="per stage (empty for a layout given by "
                                    "hand)")
    alternatives: list[Candidate] = Field(default_factory=list)
    assumptions: list[str] = Field(default_factory=list, description="defaults and approximations used")
    created: str

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        return _schedule_name(value)

    @field_validator("schedules")
    @classmethod
    def _known_schedules(cls, value: list[str]) -> list[str]:
        for name in value:
            _schedule_name(name)
        return value

    @property
    def by_hand(self) -> bool:
        """A layout given by hand (``pp``, ``dp``, micro-batch): no profile, partition or prediction."""
        return self.partition is None

    def predicted(self) -> Prediction:
        """The simulated step of a plan made from a profile (every plan but a layout given by hand)."""
        if self.prediction is None:
            raise ConfigError("the plan is a layout given by hand: it has no predicted step",
                              hint="make the plan from a profile with `varuna plan PROFILE`")
        return self.prediction

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        _check_sizes(self)
        if self.partition is None:  # by_hand
            _check_layout_only(self)
        else:
            _check_partition(self, self.partition)
        _check_stages(self)
        _check_search(self)
        _check_map(self)
        _check_nodes(self)
        return self


def _check_sizes(p: Plan) -> None:
    """The devices, the batch and the micro-batches agree."""
    world = p.pp * p.dp
    if world > p.gpus:
        raise ValueError(f"pp × dp = {p.pp} × {p.dp} = {world} devices, more than gpus = {p.gpus}")
    if p.num_segments is not None and p.pp > p.num_segments:
        raise ValueError(f"pp = {p.pp} stages for {p.num_segments} segments: every stage needs a segment")
    if p.dp > p.batch_size:
        raise ValueError(f"dp = {p.dp} replicas for a global batch of {p.batch_size}: every replica needs an example")
    replica = math.ceil(p.batch_size / p.dp)
    if p.microbatch_size > replica:
        raise ValueError(f"microbatch_size {p.microbatch_size} is larger than a replica's batch of {replica} "
                         f"(batch_size {p.batch_size} over dp = {p.dp})")
    expected = math.ceil(replica / p.microbatch_size)
    if p.num_microbatches != expected:
        raise ValueError(f"num_microbatches is {p.num_microbatches}, but batch_size {p.batch_size} over dp = {p.dp} "
                         f"replicas in micro-batches of {p.microbatch_size} makes {expected}")


def _check_partition(p: Plan, partition: list[tuple[int, int]]) -> None:
    """``pp`` contiguous non-empty ranges covering the segments, and one stage entry for each."""
    for name in ("num_segments", "profile_hash", "prediction"):
        if getattr(p, name) is None:
            raise ValueError(f"{name} is null, but a plan with a partition is made from a profile and sets it")
    if len(partition) != p.pp:
        raise ValueError(f"partition has {len(partition)} ranges for pp = {p.pp} stages")
    start = 0
    for s, (a, b) in enumerate(partition):
        if a != start or b <= a:
            raise ValueError(f"partition[{s}] is [{a}, {b}), but stage {s} must start at segment {start} and hold "
                             f"at least one segment")
        start = b
    if start != p.num_segments:
        raise ValueError(f"partition ends at segment {start}, but the model has {p.num_segments} segments")
    if len(p.stages) != p.pp:
        raise ValueError(f"stages lists {len(p.stages)} entries for pp = {p.pp} stages")
    for s, stage in enumerate(p.stages):
        if stage.stage != s or tuple(stage.segments) != tuple(partition[s]):
            raise ValueError(f"stages[{s}] is stage {stage.stage} over segments {list(stage.segments)}, but "
                             f"partition[{s}] is {list(partition[s])}")


def _check_stages(p: Plan) -> None:
    """Each stage's predictions agree with its place in the pipeline and with the plan: the last stage sends no
    activation and the first no gradient; the tensors skipping a cut are part of what crosses it; a stage holds
    at most the micro-batches of a step, in at most the memory the plan had to fit; only a schedule that splits
    the backward has W times and bytes."""
    from ..ir.schedule import generate

    last = p.pp - 1
    split = bool(p.stages) and generate(p.schedule, 1, 1).splits_backward
    for s, st in enumerate(p.stages):
        if s == last and (st.activation_bytes or st.skip_bytes or st.send_activation):
            raise ValueError(f"stages[{s}] is the last stage, which sends nothing to a next one, but has "
                             f"activation_bytes {st.activation_bytes}, skip_bytes {st.skip_bytes} and "
                             f"send_activation {st.send_activation:g} (all must be 0)")
        if st.skip_bytes > st.activation_bytes:
            raise ValueError(f"stages[{s}]: skip_bytes {st.skip_bytes} is more than activation_bytes "
                             f"{st.activation_bytes}, of which the skipping tensors are a part")
        if s == 0 and st.send_gradient:
            raise ValueError(f"stages[0] is the first stage, which sends no gradient to a previous one, but has "
                             f"send_gradient {st.send_gradient:g}")
        for field in ("held_microbatches", "pending_weights"):
            if getattr(st, field) > p.num_microbatches:
                raise ValueError(f"stages[{s}]: {field} {getattr(st, field)} is more than the num_microbatches "
                                 f"{p.num_microbatches} of a step")
        if (st.weight or st.weight_bytes or st.pending_weights) and not split:
            raise ValueError(f"stages[{s}] has weight {st.weight:g}, weight_bytes {st.weight_bytes} and "
                             f"pending_weights {st.pending_weights}, but schedule {p.schedule} does not split the "
                             f"backward into B and W (all must be 0)")
        if p.memory_limit is not None and st.memory_bytes > p.memory_limit:
            raise ValueError(f"stages[{s}]: memory_bytes {st.memory_bytes} is more than memory_limit "
                             f"{p.memory_limit}, which the plan had to fit")


def _check_search(p: Plan) -> None:
    """The chosen schedule is one the search considered, and every alternative fits the devices."""
    if p.schedule not in p.schedules:
        raise ValueError(f"schedule {p.schedule} is not among schedules {p.schedules}, which the search considered")
    for i, alt in enumerate(p.alternatives):
        if alt.pp * alt.dp > p.gpus:
            raise ValueError(f"alternatives[{i}]: pp × dp = {alt.pp} × {alt.dp} = {alt.pp * alt.dp} devices, more "
                             f"than gpus = {p.gpus}")


def _check_layout_only(p: Plan) -> None:
    """A layout given by hand says nothing a profile would have measured."""
    measured = {"num_segments": p.num_segments, "profile_hash": p.profile_hash, "prediction": p.prediction,
                "profile_path": p.profile_path, "stages": p.stages or None, "alternatives": p.alternatives or None}
    for name, value in measured.items():
        if value is not None:
            raise ValueError(f"partition is null (a layout given by hand), but {name} is set: a plan made from a "
                             f"profile has a partition")


def _check_map(p: Plan) -> None:
    """The map is a grid of ``pp`` stages × ``dp`` replicas over ranks ``0..pp·dp-1``."""
    from ..ir.topology import Topology

    world = p.pp * p.dp
    if len(p.stage_to_rank_map) > 16 * world + 64:
        raise ValueError(f"stage_to_rank_map is {len(p.stage_to_rank_map):,} characters long, too long for "
                         f"{world} ranks")
    try:
        topology = Topology.parse(p.stage_to_rank_map, world)
    except TopologyError as exc:
        raise ValueError(f"stage_to_rank_map: {exc.message}") from None
    if (topology.pp, topology.dp) != (p.pp, p.dp):
        raise ValueError(f"stage_to_rank_map has {topology.pp} stages × {topology.dp} replicas, but the plan has "
                         f"pp = {p.pp}, dp = {p.dp}")


def _check_nodes(p: Plan) -> None:
    """Every rank on exactly one node, and no node with more ranks than it has devices."""
    world = p.pp * p.dp
    seen: set[int] = set()
    for i, ranks in enumerate(p.nodes):
        if not ranks or len(ranks) > p.gpus_per_node:
            raise ValueError(f"nodes[{i}] has {len(ranks)} ranks; a node holds 1 to gpus_per_node = "
                             f"{p.gpus_per_node}")
        for rank in ranks:
            if rank >= world or rank in seen:
                what = "is listed twice" if rank in seen else f"is not a rank of the {world} the plan runs"
                raise ValueError(f"nodes[{i}]: rank {rank} {what}")
            seen.add(rank)
    if len(seen) != world:
        missing = min(set(range(world)) - seen)
        raise ValueError(f"nodes: rank {missing} is on no node (every rank 0..{world - 1} must be on one)")



def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as YAML (``.yaml``/``.yml``) or JSON, atomically."""
    import yaml

    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        text = yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False, width=110)
    else:
        text = plan.model_dump_json(indent=2) + "\n"
    write_output(path, text, "plan")


def load_plan(path: str | Path | Plan) -> Plan:
    """The plan in the YAML or JSON file ``path``, or a :class:`Plan` object checked again (a copy made with
    ``model_copy(update=...)`` skips the checks).

    Raises:
        ConfigError: the file is missing, not a regular file, too large, not UTF-8 YAML/JSON (aliases refused),
            or not a valid plan (the message names the first wrong field).
    """
    if isinstance(path, Plan):
        return validate(Plan, path.model_dump(mode="json"), "the plan object", "plan",
                        "make the plan with `varuna plan` rather than editing it")
    text = read_artifact(path, MAX_PLAN_BYTES, "plan", "create it with `varuna plan PROFILE -o FILE`")
    data = check_document(_parse_plan(text, path), path, "plan", "`varuna plan`")
    return validate(Plan, data, path, "plan", "make the plan again with `varuna plan` rather than editing it")


def _parse_plan(text: str, path: str | Path) -> Any:
    """JSON by the fast standard parser when it is JSON (plans written as ``.json``), else YAML."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text, object_pairs_hook=unique_keys)
        except RecursionError:
            raise ConfigError(f"plan {path} is nested too deeply to be a plan") from None
        except json.JSONDecodeError:
            pass  # a YAML flow mapping such as {pp: 1}: the YAML parser says what is wrong with it
        except ValueError as exc:
            raise ConfigError(f"{path} is not a valid plan: {exc}") from None
    return parse_yaml(text, path, "plan", max_events=MAX_PLAN_EVENTS, max_nesting=MAX_NESTING)

