"""The step's synchronisation: gradients summed over tied copies and replicas (overlapped with the stage's last
backward, :mod:`varuna_core.pipeline.overlap`, or after the pipeline), then one all-reduce per step that carries
the loss, the squared gradient norm, fp16 overflow and a flag of the caller's (e.g. "some rank was asked to
checkpoint"); then loss scaling and clipping. And evaluation: the pipeline without backward, one loss over all
replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..model.precision import LossScaler
from ..model.stage import TieSet
from . import fused
from .config import loss_weights
from .executor import GradsFinal, PipelineExecutor
from .grads import GradBuffer, post_tie_sum, sum_small, tie_tag
from .groups import Groups
from .microbatch import batch_size_of, microbatch_sizes, split_inputs
from .overlap import OverlappedSync
from .p2p import wait_all
from .shard import OptimizerShards

__all__ = ["GradSync", "StepResult", "check_clip", "norm_params", "finish_step", "global_sum", "evaluate_loss",
           "loss_scaler", "check_optimizer"]


@dataclass(frozen=True)
class StepResult:
    loss: float  # the global batch's loss, the same on every rank
    overflow: bool  # fp16 found an inf/NaN on some rank: gradients were zeroed, the step must be skipped
    grad_norm: float  # before clipping (``inf`` on overflow)
    flags: float  # the caller's flags summed over every rank
    wire: tuple[float, ...] = ()  # with a wire dtype: per stage boundary, activations and gradients that overflowed

    @property
    def flagged(self) -> bool:
        """Some rank raised the caller's flag."""
        return self.flags > 0


def check_clip(clip_grad_max_norm: float | None) -> None:
    if clip_grad_max_norm is not None and not clip_grad_max_norm > 0:
        raise ConfigError(f"clip_grad_max_norm must be positive, got {clip_grad_max_norm}")


class GradSync:
    """Sums the gradients of each tied weight over its stages, then the stage's over its replicas: all-reduced, or
    with a sharded optimizer (``shards``) reduce-scattered to each replica's pieces.

    With ``overlap`` (the default; ``VARUNA_OVERLAP_SYNC=0`` turns it off, for comparison and debugging) the tie
    sums and the all-reduce's buckets start during the stage's last backward (:meth:`begin` gives the executor its
    listener) and calling the sync after the pipeline finishes them; without, calling it does all of it. Both give
    the same gradients bit for bit ([Note: bucket boundaries] in :mod:`varuna_core.pipeline.overlap`).
    """

    def __init__(self, groups: Groups, tied: dict[str, nn.Parameter], grad_buffer: GradBuffer, *, timeout: float,
                 rank: int, stage: int, shards: OptimizerShards | None = None, overlap: bool = True) -> None:
        self.groups, self.tied, self.grad_buffer = groups, tied, grad_buffer
        self.timeout, self.rank, self.stage, self.overlap = timeout, rank, stage, overlap
        self._overlapped: OverlappedSync | None = None
        self.shards = shards
        groups.holders.append(self.close)  # its sync holds the groups: dropped with them at exit

    @property
    def shards(self) -> OptimizerShards | None:
        return self._shards

    @shards.setter
    def shards(self, shards: OptimizerShards | None) -> None:
        """Set when the optimizer is (a sharded optimizer's reduce-scatter replaces the data-parallel buckets)."""
        self._shards = shards
        self.close()
        if self.overlap:
            ties = [(tie, group, self.tied[tie.canonical]) for tie, group in self.groups.ties]
            overlapped = OverlappedSync(self.grad_buffer, ties, self.groups.dp if shards is None else None,
                                        timeout=self.timeout,
                                        describe=lambda what: f"rank {self.rank} (stage {self.stage}) {what}")
            self._overlapped = overlapped if overlapped.active else None

    @property
    def posted_early(self) -> int:
        """How many collectives (tie sums, buckets) the last step posted during its last backward."""
        return self._overlapped.posted_early if self._overlapped is not None else 0

    def close(self) -> None:
        """Remove the gradient hooks of the overlapped sync."""
        if self._overlapped is not None:
            self._overlapped.close()
            self._overlapped = None

    def begin(self) -> GradsFinal | None:
        """Before the pipeline: the listener the executor tells when gradients become final, or ``None`` when the
        whole sync runs after the pipeline."""
        return self._overlapped.begin() if self._overlapped is not None else None

    def __call__(self) -> None:
        if self._overlapped is not None:
            self._overlapped.finish()
        else:  # the sync after the pipeline
            for tie, group in self.groups.ties:
                grad = _attached_grads([self.tied[tie.canonical]])[0]
                wait_all([post_tie_sum(grad, group, tie_tag(tie.canonical))], timeout=self.timeout, peer=None,
                         describe=lambda: f"rank {self.rank} summing gradients of tied weight "
                         f"{tie.canonical!r}")  # noqa: B023 - called (on a failure) before the next tie
            if self.shards is None and self.groups.dp is not None:
                self.grad_buffer.all_reduce(
                    self.groups.dp, timeout=self.timeout,
                    describe=lambda: f"rank {self.rank} (stage {self.stage}) data-parallel all-reduce")
        if self.shards is not None:
            self.shards.reduce_scatter(self.grad_buffer.flats)


def norm_params(grad_buffer: GradBuffer, ties: list[TieSet], tied: dict[str, nn.Parameter],
                stage: int) -> list[nn.Parameter]:
    """The parameters whose gradients make up the global norm: each tied weight counts once, with only its first
    stage's copy."""
    skip = {id(tied[t.canonical]) for t in ties if stage in t.stages[1:]}
    return [p for p in grad_buffer.params if id(p) not in skip]


def _attached_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params``: views of the gradient buffer, attached before the step (never None)."""
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        raise RuntimeError("a parameter of the gradient buffer has no gradient attached")
    return [g for g in grads if g is not None]


def global_sum(value: torch.Tensor, *, world_size: int, timeout: float, rank: int) -> torch.Tensor:
    """``value`` summed over every rank (a copy)."""
    if world_size == 1:
        return value
    value = value.clone()
    sum_small(value, None, timeout=timeout, describe=lambda: f"rank {rank} loss all-reduce")
    return value


def finish_step(loss_sum: torch.Tensor, grad_buffer: GradBuffer, norm_params: list[nn.Parameter],
                scaler: LossScaler | None, *, flag: float, dp: int, device: torch.device,
                clip_grad_max_norm: float | None, reduce: Callable[[torch.Tensor], torch.Tensor],
                shards: OptimizerShards | None = None, wire: torch.Tensor | None = None) -> StepResult:
    """Unscale (fp16), all-reduce loss / squared norm / overflow / flag with ``reduce``, update the loss scale, and
    zero (overflow) or clip the gradients. ``wire``: this rank's counts of values that overflowed the wire dtype
    (:meth:`~varuna_core.pipeline.executor.PipelineExecutor.wire_counts`), reduced with the rest; any makes the
    step an overflow. With a sharded optimizer (``shards``) only this replica's pieces hold
    reduced gradients: they are unscaled, counted in the norm (each element then once over the replicas, so the
    sum is not divided by ``dp``) and clipped."""
    counted = {id(p) for p in norm_params}
    if shards is None:
        grads = _attached_grads(grad_buffer.params)
        norm_mask = [id(p) in counted for p in grad_buffer.params]
    else:
        grads = shards.grads()
        norm_mask = [id(p) in counted for p, _ in shards.layout.owned()]
        dp = 1
    found_inf: torch.Tensor | None
    if grads and fused.fused_grad_pass(grads):
        # one pass over the gradients on the GPU: unscale, overflow flag and every tensor's squared norm
        flag_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        sq = fused.unscale_sq_norms_cuda(grads, scaler.inv_scale() if scaler is not None else None, flag_inf)
        found_inf = flag_inf if scaler is not None else None
        index = [i for i, counts in enumerate(norm_mask) if counts]
        sq_norm = (sq if len(index) == len(grads) else sq[torch.tensor(index, device=sq.device)]).sum()
    else:
        found_inf = scaler.unscale_(grads) if scaler is not None and grads else None
        norm_grads = [g for g, counts in zip(grads, norm_mask, strict=True) if counts]
        sq_norm = (torch.stack(torch._foreach_norm(norm_grads)).double().pow(2).sum() if norm_grads
                   else torch.zeros((), dtype=torch.float64, device=device))
    zero = torch.zeros((), dtype=torch.float64, device=loss_sum.device)
    totals = torch.stack([
        loss_sum.double(), sq_norm.to(loss_sum.device),
        found_inf.double().sum() if found_inf is not None else zero,
        zero + flag,
    ])
    totals = reduce(totals if wire is None else torch.cat([totals, wire.to(totals.device)]))
    wired = tuple(totals[4:].tolist())
    loss, overflow = float(totals[0]), bool(totals[2] > 0) or any(wired)
    grad_norm = float("inf") if overflow else float(totals[1] / dp) ** 0.5
    if scaler is not None:
        scaler.update(overflow)
    if overflow:
        grad_buffer.zero()
    elif clip_grad_max_norm is not None and grads:
        coef = min(clip_grad_max_norm / (grad_norm + 1e-6), 1.0)
        torch._foreach_mul_(grads, coef)
    return StepResult(loss, overflow, grad_norm, float(totals[3]), wired)


def evaluate_loss(executor: PipelineExecutor, inputs: Mapping[str, Any], input_batch_dims: Mapping[str, Any],
                  batch_size: int | None, *, chunk_size: int, loss_reduction: str, rng: Callable[[], tuple[int, int]],
                  is_last: bool, world_size: int, timeout: float, rank: int,
                  wire_checked: Callable[[tuple[float, ...]], None] | None = None) -> float:
    """The loss over every replica's ``inputs``: the mean over all examples, or with ``loss_reduction="sum"`` the
    sum of the micro-batch losses. ``rng()`` names the dropout stream, once the inputs are split. The buffers the
    forward writes are as before afterwards (a model left in training mode would otherwise update its BatchNorm
    statistics with the evaluation's batches). With a wire dtype, ``wire_checked`` gets the counts of activations
    that overflowed it, per stage boundary and direction (as :attr:`StepResult.wire`), summed over every rank."""
    n = batch_size_of(inputs, input_batch_dims) if batch_size is None else int(batch_size)
    sizes = microbatch_sizes(n, chunk_size)
    microbatches = split_inputs(inputs, input_batch_dims, sizes, expected=n)
    with torch.no_grad(), executor.stage.buffer_writes.kept():
        loss_sum = executor.run(microbatches, sizes, loss_weights(sizes, n, loss_reduction), train=False, rng=rng())
    total = loss_sum * n if loss_reduction == "mean" else loss_sum
    pair = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=loss_sum.device)])
    if not is_last:
        pair.zero_()
    wire = executor.wire_counts(executor.num_stages - 1)
    if wire is not None:
        pair = torch.cat([pair, wire.to(pair.device)])
    if world_size > 1:
        sum_small(pair, None, timeout=timeout, describe=lambda: f"rank {rank} evaluate()")
    if wire is not None and wire_checked is not None:
        wire_checked(tuple(pair[2:].tolist()))
    return float(pair[0] / pair[1]) if loss_reduction == "mean" else float(pair[0])


def loss_scaler(precision: str, loss_scale: str | float, init_loss_scale: float, min_loss_scale: float,
                device: torch.device, current: LossScaler | None) -> LossScaler | None:
    """The loss scaler ``set_optimizer`` asks for: dynamic or fixed in fp16, ``current`` otherwise."""
    if precision != "fp16":
        return current
    if loss_scale == "dynamic":
        return LossScaler(init_loss_scale, min_loss_scale, dynamic=True, device=device)
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return LossScaler(float(loss_scale), min_loss_scale, dynamic=False, device=device)
    raise ConfigError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}")


def check_optimizer(optimizer: torch.optim.Optimizer, params: list[tuple[str, nn.Parameter]]) -> None:
    """The optimizer steps only parameters this rank holds."""
    mine = {id(p) for _, p in params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in mine:
                raise ConfigError(
                    "the optimizer holds a parameter this rank does not own",
                    hint="create the optimizer after Varuna(...), over varuna_model.parameters()",
                )
