"""What ``Varuna(...)`` was asked to do, checked and resolved before anything is built.

The arguments' numbers (see :mod:`varuna_core.util.checks`), a plan (a :class:`~varuna_core.planning.artifacts.Plan`
or ``VARUNA_PLAN``) that overrides the map, micro-batch size, schedule and partition, the batch each replica and
micro-batch holds, and the partition once the model's structure is known.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from .. import env
from ..errors import ConfigError, TopologyError
from ..ir.partition import Partition, PartitionSpec, balance, coerce_partition
from ..ir.schedule import ScheduleName, check_schedule
from ..model.discovery import Structure
from ..model.precision import WIRE_DTYPES, resolve_precision
from ..model.rng import MASK64
from ..util.checks import integer, real
from .microbatch import batch_size_of, microbatch_sizes
from .p2p import default_timeout

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.artifacts import Plan

__all__ = ["Config", "resolve_config", "BatchLayout", "batch_layout", "check_structure",
           "choose_partition", "loss_weights", "replica_share", "wire_dtype_name"]

log = logging.getLogger(__name__)


@dataclass
class Config:
    """The arguments of ``Varuna(...)`` after checks, defaults and the plan.

    ``partition`` is still as the user gave it (any :data:`~varuna_core.ir.partition.PartitionSpec`): it is
    checked against the model's segments once discovery has found them (:func:`choose_partition`)."""

    stage_to_rank_map: str
    batch_size: int
    chunk_size: int
    schedule: ScheduleName
    partition: PartitionSpec | None
    precision: str
    plan: Plan | None
    timeout: float
    bucket_mb: float
    seed: int | None
    trace_dir: str | os.PathLike | None
    trace_step: int
    cutpoints: Literal["auto"] | None
    loss_reduction: Literal["mean", "sum"]
    shard_optimizer: bool = False
    wire_dtype: Literal["bf16", "fp16"] | None = None  # None: every leaf crosses cuts in its own dtype
    reduce_dtype: Literal["bf16", "fp16"] | None = None  # None: the data-parallel all-reduce sums in fp32

    @property
    def wire(self) -> torch.dtype | None:
        """The wire dtype as a torch dtype (``None``: exact)."""
        return WIRE_DTYPES[self.wire_dtype] if self.wire_dtype is not None else None

    @property
    def reduce(self) -> torch.dtype | None:
        """The dtype the data-parallel all-reduce sums in (``None``: the gradients' own)."""
        return WIRE_DTYPES[self.reduce_dtype] if self.reduce_dtype is not None else None


def resolve_config(model: Any, stage_to_rank_map: Any, batch_size: Any, chunk_size: Any, *, fp16: bool,
                   schedule: str, partition: Any, timeout: Any, bucket_mb: Any, precision: str | None, seed: Any,
                   plan: Any, trace: Any, trace_step: Any, cutpoints: str | None, loss_reduction: str,
                   shard_optimizer: bool | None = None, wire_dtype: Any = None, reduce_dtype: Any = None) -> Config:
    """Check every argument that needs no process group or model structure; apply the plan."""
    batch_size, chunk_size, timeout, bucket_mb, trace_step, seed = _check_arguments(
        batch_size, chunk_size, timeout, bucket_mb, trace_step, seed, plan)
    reduction = _loss_reduction(loss_reduction)
    cuts = _cutpoints(cutpoints)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    resolved_precision = resolve_precision(precision, fp16)
    loaded = _load_plan(plan)
    if loaded is not None:
        stage_to_rank_map, chunk_size, schedule, partition = _apply_plan(
            loaded, stage_to_rank_map, batch_size, chunk_size, schedule, partition)
    if shard_optimizer is None:
        shard_optimizer = loaded.shard_optimizer if loaded is not None else False
    elif not isinstance(shard_optimizer, bool):
        raise ConfigError(f"shard_optimizer must be True, False or None (the plan's), got {shard_optimizer!r}")
    elif loaded is not None and shard_optimizer != loaded.shard_optimizer:
        log.warning("shard_optimizer=%s differs from the plan's %s: its memory predictions do not apply",
                    shard_optimizer, loaded.shard_optimizer)
    wire = _wire_dtype(wire_dtype, loaded)
    reduce = _reduce_dtype(reduce_dtype, resolved_precision, shard_optimizer)
    if not isinstance(stage_to_rank_map, str):
        raise TopologyError(f"stage_to_rank_map must be a string like '0,2;1,3', got {stage_to_rank_map!r}")
    return Config(
        stage_to_rank_map=stage_to_rank_map, batch_size=int(batch_size), chunk_size=int(chunk_size),
        schedule=check_schedule(schedule), partition=partition, precision=resolved_precision, plan=loaded,
        timeout=float(timeout) if timeout is not None else default_timeout(), bucket_mb=bucket_mb, seed=seed,
        trace_dir=trace if trace is not None else env.text(env.TRACE), trace_step=trace_step, cutpoints=cuts,
        loss_reduction=reduction, shard_optimizer=shard_optimizer, wire_dtype=wire, reduce_dtype=reduce,
    )


def _loss_reduction(value: object) -> Literal["mean", "sum"]:
    if value == "mean":
        return "mean"
    if value == "sum":
        return "sum"
    raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {value!r}")


_EXACT = "exact"
_WIRE_NAMES: dict[object, str] = {"exact": _EXACT, "fp32": _EXACT, torch.float32: _EXACT, "bf16": "bf16",
                                  torch.bfloat16: "bf16", "fp16": "fp16", torch.float16: "fp16"}


def wire_dtype_name(value: object, field: str = "wire_dtype") -> Literal["bf16", "fp16"] | None:
    """``wire_dtype`` (or ``reduce_dtype``, named by ``field``) checked: ``"bf16"``/``torch.bfloat16`` and
    ``"fp16"``/``torch.float16`` by name, ``None`` for exact (``"exact"``, ``"fp32"``, ``torch.float32``: every
    tensor in its own dtype)."""
    name = _WIRE_NAMES.get(value) if isinstance(value, (str, torch.dtype)) else None
    if name is None:
        raise ConfigError(f"{field} must be 'bf16', 'fp16' or 'exact' (also 'fp32' or None), got {value!r:.80}",
                          hint="'bf16' halves the bytes of fp32 values and keeps fp32's range; 'fp16' keeps more "
                               "digits but overflows beyond 65504")
    return None if name == _EXACT else "bf16" if name == "bf16" else "fp16"


def _wire_dtype(value: object, plan: Plan | None) -> Literal["bf16", "fp16"] | None:
    """The wire dtype: the argument's, else the plan's (``None`` with a plan: the plan's; ``"exact"``: exact
    whatever the plan says), else exact."""
    planned = plan.wire_dtype if plan is not None else None
    if value is None:
        return planned
    wire = wire_dtype_name(value)
    if plan is not None and wire != planned:
        log.warning("wire_dtype=%s differs from the plan's %s: its predicted message times do not apply",
                    wire or "exact", planned or "exact")
    return wire


def _reduce_dtype(value: object, precision: str, shard_optimizer: bool) -> Literal["bf16", "fp16"] | None:
    """The dtype the data-parallel all-reduce sums in (see :class:`~varuna_core.pipeline.grads.GradBuffer`)."""
    reduce = wire_dtype_name(value, "reduce_dtype") if value is not None else None
    if reduce == "fp16" and precision != "fp16":
        raise ConfigError(f"reduce_dtype='fp16' with precision={precision!r}: a sum beyond 65504 would silently "
                          "become inf", hint="use reduce_dtype='bf16' (fp32's range), or precision='fp16', whose loss "
                                             "scaling skips a step whose sum overflows")
    if reduce is not None and shard_optimizer:
        raise ConfigError(f"reduce_dtype={reduce!r} with shard_optimizer=True: the sharded optimizer reduce-scatters "
                          "the gradients instead of all-reducing them, in their own dtype",
                          hint="leave out one of them")
    return reduce


def _cutpoints(value: object) -> Literal["auto"] | None:
    if value is None:
        return None
    if value == "auto":
        return "auto"
    raise ConfigError(f"cutpoints must be 'auto' or None, got {value!r}",
                      hint="'auto' cuts in front of every block of the model's block stacks "
                           "(nn.ModuleList, nn.Sequential of repeated blocks)")


@dataclass(frozen=True)
class BatchLayout:
    """One replica's share of the global batch and its micro-batches."""

    replica_batch_size: int
    replica_range: tuple[int, int]  # [start, stop) in the global batch
    microbatch_sizes: list[int]
    microbatch_ids: list[int]  # micro-batches are named by their first example in the global batch


def batch_layout(batch_size: int, chunk_size: int, dp: int, replica: int) -> BatchLayout:
    """Replicas take consecutive slices of the global batch; the first ``batch_size % dp`` hold one more."""
    if batch_size < dp:
        raise ConfigError(f"batch_size={batch_size} is smaller than the {dp} data-parallel replicas",
                          hint=f"use batch_size ≥ {dp}")
    base, extra = divmod(batch_size, dp)
    share = base + (1 if replica < extra else 0)
    if chunk_size < 1 or chunk_size > share:
        raise ConfigError(
            f"chunk_size={chunk_size} does not fit this replica's batch of {share} "
            f"(batch_size={batch_size} over {dp} replica(s))",
            hint=f"use 1 ≤ chunk_size ≤ {share}, or a larger batch_size",
        )
    start = replica * base + min(replica, extra)
    sizes = microbatch_sizes(share, chunk_size)
    ids = [start + sum(sizes[:i]) for i in range(len(sizes))]
    return BatchLayout(share, (start, start + share), sizes, ids)


def loss_weights(sizes: Sequence[int], total: int, loss_reduction: str) -> list[float]:
    """Each micro-batch's weight in the loss: its share of ``total`` examples (``"mean"``), or 1 (``"sum"``)."""
    return [n / total for n in sizes] if loss_reduction == "mean" else [1.0] * len(sizes)


def check_structure(structure: Structure, plan: Plan | None, pp: int) -> None:
    """The discovered model fits the plan and the number of stages."""
    nseg = structure.num_segments
    if plan is not None and not plan.by_hand:
        if plan.num_segments != nseg:
            raise ConfigError(
                f"the plan is for a model with {plan.num_segments} segments; this model has {nseg}",
                hint="plan again from a profile of this model",
            )
        if plan.profile_hash != structure.key:
            log.warning("the plan was made from a profile of a model whose structure differs from this one "
                        "(hash %s vs %s); its partition still applies", plan.profile_hash, structure.key)
    if pp > nseg:
        raise ConfigError(
            f"{pp} pipeline stages but the model has only {nseg} segments ({nseg - 1} CutPoints executed)",
            hint=f"use at most {nseg} stages, or add CutPoints",
        )


def choose_partition(partition: PartitionSpec | None, model: nn.Module, structure: Structure, pp: int) -> Partition:
    """The given partition, checked; by default the one balancing parameter bytes."""
    if partition is not None:
        return coerce_partition(partition, num_segments=structure.num_segments, num_stages=pp)
    return balance(_segment_param_bytes(model, structure), pp)


# ----------------------------------------------------------------------------------------------------------


def _check_arguments(batch_size, chunk_size, timeout, bucket_mb, trace_step, seed, plan):
    """The numbers given to ``Varuna(...)``, checked (see :mod:`varuna_core.util.checks`)."""
    batch_size = integer("batch_size", batch_size, low=1)
    if chunk_size is not None or plan is None:
        chunk_size = integer("chunk_size", chunk_size, low=1)
    if timeout is not None:
        timeout = real("timeout", timeout, low=0, low_open=True)
    bucket_mb = real("bucket_mb", bucket_mb, low=0, low_open=True, high=2**20)
    trace_step = integer("trace_step", trace_step, low=0)
    if seed is not None:
        seed = integer("seed", seed, low=-(2**63), high=MASK64)
    return batch_size, chunk_size, timeout, bucket_mb, trace_step, seed


def _load_plan(plan: Plan | str | os.PathLike[str] | None) -> Plan | None:
    if plan is None:
        return None
    from ..planning.artifacts import Plan, load_plan  # Plan at run time, for isinstance

    return load_plan(plan if isinstance(plan, Plan) else os.fspath(plan))


def _apply_plan(plan, stage_to_rank_map, batch_size, chunk_size, schedule, partition):
    """The plan's map, micro-batch size, schedule and partition; differences from the arguments are logged."""
    given = {"stage_to_rank_map": stage_to_rank_map, "chunk_size": chunk_size, "schedule": schedule}
    wanted = {"stage_to_rank_map": plan.stage_to_rank_map, "chunk_size": plan.microbatch_size,
              "schedule": plan.schedule}
    for key, value in given.items():
        if value not in (None, "") and str(value).rstrip(";") != str(wanted[key]).rstrip(";") and key != "schedule":
            log.warning("the plan sets %s=%s (argument %s ignored)", key, wanted[key], value)
    if batch_size != plan.batch_size:
        log.warning("batch_size=%s differs from the plan's %s: its predictions do not apply", batch_size,
                    plan.batch_size)
    if plan.by_hand:  # a layout without a partition: the argument's, or the balanced one
        return plan.stage_to_rank_map, plan.microbatch_size, plan.schedule, partition
    if partition is not None:
        log.warning("the plan's partition replaces the partition argument")
    return plan.stage_to_rank_map, plan.microbatch_size, plan.schedule, [tuple(r) for r in plan.partition]


def _segment_param_bytes(model: nn.Module, structure: Structure) -> list[float]:
    weights = [0.0] * structure.num_segments
    counted: set[tuple[int, int]] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        for seg in structure.param_uses.get(name, (0,)):
            if (id(param), seg) not in counted:
                counted.add((id(param), seg))
                weights[seg] += param.numel() * param.element_size()
    return weights


def replica_share(inputs: Mapping[str, Any], input_batch_dims: Mapping[str, int | None], batch_size: int,
                  replica_range: tuple[int, int]) -> dict:
    """This replica's share of a global batch of ``batch_size`` examples, sliced along each input's batch dim
    (unbatched inputs are passed whole)."""
    have = batch_size_of(inputs, input_batch_dims)
    if have != batch_size:
        raise ConfigError(f"replica_slice() takes the global batch of {batch_size} examples, got {have}")
    start, stop = replica_range
    return {
        name: value.narrow(dim, start, stop - start)
        if (dim := input_batch_dims.get(name)) is not None and isinstance(value, torch.Tensor) else value
        for name, value in inputs.items()
    }
