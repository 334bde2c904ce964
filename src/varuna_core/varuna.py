"""The ``Varuna`` facade: the original's API over this library's discovery, slicing and runtime.

Typical use (every rank runs the same script, e.g. under ``torchrun``)::

    model = Varuna(model, "0;1;2;3", dummy_inputs, batch_size=32, chunk_size=4, shared_weights=[...])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)   # this rank's parameters only
    model.set_optimizer(optimizer)
    for batch in data:                       # this replica's share of the global batch
        loss, overflow = model.step(batch)   # loss of the global batch, on every rank
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .util.checks import integer, real
from .model.discovery import Structure, discover, make_batch_fn
from . import env
from .errors import ConfigError, CutPointError, TopologyError
from .worker.excepthook import install_excepthook
from .pipeline.grads import GradBuffer, all_reduce_tensor
from .pipeline.microbatch import batch_size_of, microbatch_sizes, split_inputs
from .pipeline.p2p import default_timeout
from .ir.partition import Partition, balance, coerce_partition
from .model.precision import LossScaler, resolve_precision
from .pipeline.executor import PipelineRuntime
from .ir.schedule import SCHEDULE_NAMES
from .model.stage import StageModule, TieSet, find_tie_sets, weight_groups
from .worker.supervision import Supervision
from .ir.topology import Topology

__all__ = ["Varuna"]

log = logging.getLogger(__name__)


class Varuna(nn.Module):
    """Pipeline + data parallel training of ``model`` across the ranks of ``stage_to_rank_map``.

    Args:
        model: the full model, on CPU (or the target device), in fp32. Its forward takes keyword inputs and
            returns the loss (a scalar, or a tuple/dict whose first/``"loss"`` entry is it); ``CutPoint``
            modules mark the possible stage boundaries. It is modified in place: other stages' parameters move
            to the ``meta`` device.
        stage_to_rank_map: the original's string, e.g. ``"0,2;1,3"``: stage ``s`` lists its global ranks, the
            position in the list is the data-parallel replica.
        dummy_inputs: example inputs (a dict, batched along dim 0 unless ``input_batch_dims`` says otherwise)
            or a function ``n -> dict`` of inputs for ``n`` examples.
        batch_size: the global batch (all replicas).
        chunk_size: the micro-batch size.
        fp16: fp16 autocast with dynamic loss scaling (the original's flag; same as ``precision="fp16"``).
        local_rank: local rank for device selection (default: ``LOCAL_RANK`` env).
        device: ``-1`` (CUDA ``local_rank`` if available, else CPU), a CUDA index, or a ``torch.device``.
        shared_weights: ``[(name_a, name_b)]`` parameter names that hold one tied weight. A parameter object
            used by two stages is detected without being listed.
        from_cache: reuse the structure discovery of an identical model and inputs.
        schedule: ``"varuna"`` (recompute, opportunistic forwards), ``"1f1b"`` or ``"gpipe"``.
        partition: segment ranges per stage (``[(0, 3), (3, 5)]``, counts ``[3, 2]`` or ``"0-2,3-4"``);
            default balances parameter bytes.
        input_batch_dims: per input name, the dim holding the examples (``None``: not batched).
        validate: compare the sliced pipeline with the unsliced model on ``dummy_inputs`` at start-up and name
            the first cut where they differ (default: only with ``cutpoints="auto"``; it costs one forward of the
            whole model on every rank).
        timeout: seconds any communication wait may take (default ``VARUNA_TIMEOUT`` or 300).
        bucket_mb: size of the data-parallel all-reduce buckets.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and loss scaling); parameters and
            optimizer state stay fp32.
        seed: seeds dropout per (seed, step, micro-batch, segment); default: rank 0's ``torch.initial_seed()``.
        plan: a :class:`~varuna_core.planning.artifacts.Plan` or the path of one (default: ``VARUNA_PLAN``); it sets the
            stage-to-rank map, partition, schedule and micro-batch size. ``stage_to_rank_map`` may then be
            ``None``.
        trace: a directory (default: ``VARUNA_TRACE``) to write a Chrome trace of step ``trace_step``'s actions
            to, one ``trace_rank<R>.json`` per rank (open in Perfetto, or `varuna plan show --measured`).
        cutpoints: ``"auto"`` for a model without ``CutPoint``s: a cut in front of every block of its longest
            ``nn.ModuleList`` (see :mod:`varuna_core.model.autocut`); Hugging Face models need no edits.
        loss_reduction: ``"mean"``: the model's loss is the mean over the micro-batch's examples, and the library
            weights each micro-batch by its share of the global batch. ``"sum"``: the loss is already the
            micro-batch's share of the global loss (e.g. a sum over tokens divided by the global number of
            tokens: Hugging Face's ``num_items_in_batch``, for masked-LM or padded batches whose examples hold
            different numbers of tokens) and the micro-batches are added up.
    """

    def __init__(
        self,
        model: nn.Module,
        stage_to_rank_map: str,
        dummy_inputs: Mapping[str, Any] | Any,
        batch_size: int,
        chunk_size: int,
        fp16: bool = False,
        local_rank: int = -1,
        device: int | str | torch.device = -1,
        shared_weights: Sequence[tuple[str, str]] | None = None,
        from_cache: bool = True,
        *,
        schedule: str = "varuna",
        partition: Partition | Sequence | str | None = None,
        input_batch_dims: Mapping[str, int | None] | None = None,
        validate: bool | None = None,
        timeout: float | None = None,
        bucket_mb: float = 25.0,
        precision: str | None = None,
        seed: int | None = None,
        plan: Any = None,
        trace: str | os.PathLike | None = None,
        trace_step: int = 2,
        cutpoints: str | None = None,
        loss_reduction: str = "mean",
    ) -> None:
        super().__init__()
        install_excepthook()
        batch_size, chunk_size, timeout, bucket_mb, trace_step, seed = _check_arguments(
            batch_size, chunk_size, timeout, bucket_mb, trace_step, seed, plan)
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        if cutpoints not in (None, "auto"):
            raise ConfigError(f"cutpoints must be 'auto' or None, got {cutpoints!r}",
                              hint="'auto' cuts in front of every block of the model's longest nn.ModuleList")
        if cutpoints == "auto":
            from .model.autocut import apply_auto_cutpoints

            apply_auto_cutpoints(model)
        self.precision = resolve_precision(precision, fp16)
        self.plan = _load_plan(plan)
        if self.plan is not None:
            stage_to_rank_map, chunk_size, schedule, partition = _apply_plan(
                self.plan, stage_to_rank_map, batch_size, chunk_size, schedule, partition)
        self.trace_dir = trace if trace is not None else env.text(env.TRACE)
        self.trace_step = trace_step
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"unknown schedule {schedule!r}", hint=f"choose one of {', '.join(SCHEDULE_NAMES)}")
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.world_size, self.rank = _ensure_process_group(stage_to_rank_map, self.timeout)
        if not isinstance(stage_to_rank_map, str):
            raise TopologyError(f"stage_to_rank_map must be a string like '0,2;1,3', got {stage_to_rank_map!r}")
        self.topology = Topology.parse(stage_to_rank_map, self.world_size)
        self.stage, self.replica = self.topology.coords(self.rank)
        self.pp, self.dp = self.topology.pp, self.topology.dp
        self.batch_size, self.chunk_size = int(batch_size), int(chunk_size)
        self.replica_batch_size = _replica_share(self.batch_size, self.dp, self.replica)
        if self.chunk_size < 1 or self.chunk_size > self.replica_batch_size:
            raise ConfigError(
                f"chunk_size={chunk_size} does not fit this replica's batch of {self.replica_batch_size} "
                f"(batch_size={batch_size} over {self.dp} replica(s))",
                hint=f"use 1 ≤ chunk_size ≤ {self.replica_batch_size}, or a larger batch_size",
            )
        self.microbatch_sizes = microbatch_sizes(self.replica_batch_size, self.chunk_size)
        self.num_microbatches = len(self.microbatch_sizes)
        start = self.replica_range[0]  # micro-batches are named by their first example in the global batch
        self._microbatch_ids = [start + sum(self.microbatch_sizes[:i]) for i in range(self.num_microbatches)]
        self.device = _resolve_device(device, local_rank)
        self.schedule_name = schedule

        batch_fn, self.input_batch_dims = make_batch_fn(dummy_inputs, input_batch_dims)
        self.structure: Structure = discover(model, batch_fn, self.input_batch_dims, use_cache=from_cache,
                                             precision=self.precision)
        nseg = self.structure.num_segments
        if self.plan is not None:
            if self.plan.num_segments != nseg:
                raise ConfigError(
                    f"the plan is for a model with {self.plan.num_segments} segments; this model has {nseg}",
                    hint="plan again from a profile of this model",
                )
            if self.plan.profile_hash != self.structure.key:
                log.warning("the plan was made from a profile of a model whose structure differs from this one "
                            "(hash %s vs %s); its partition still applies", self.plan.profile_hash, self.structure.key)
        if self.pp > nseg:
            raise ConfigError(
                f"{self.pp} pipeline stages but the model has only {nseg} segments ({nseg - 1} CutPoints executed)",
                hint=f"use at most {nseg} stages, or add CutPoints",
            )
        if partition is not None:
            self.partition = coerce_partition(partition, num_segments=nseg, num_stages=self.pp)
        else:
            self.partition = balance(_segment_param_bytes(model, self.structure), self.pp)
        if validate is None:
            validate = cutpoints == "auto"
        reference = _reference(model, dummy_inputs, batch_fn, self.chunk_size) if validate else None

        self.weight_groups = weight_groups(model, list(shared_weights or []))  # checkpoint names: any layout
        self.ties: list[TieSet] = find_tie_sets(model, self.structure, self.partition, list(shared_weights or []))
        self.stage_module = StageModule(model, self.structure, self.partition, self.stage, self.ties, self.device,
                                        placeholders="real" if cutpoints == "auto" else "meta")
        self.module = model
        self._build_groups()
        self._sync_initial_state()
        self.runtime = PipelineRuntime(self.stage_module, self.topology, self.rank, schedule, self.timeout,
                                       self.precision)
        self.grad_buffer = GradBuffer([p for _, p in self.stage_module.param_names], int(bucket_mb * 2**20))
        # Each tied weight counts once in the global norm: only its first stage's copy is included.
        skip = {id(self._tie_param(t)) for t in self.ties if self.stage in t.stages[1:]}
        self._norm_params = [p for p in self.grad_buffer.params if id(p) not in skip]
        self.seed, self.run_id = self._agree_identity(seed)
        self.scaler = LossScaler(device=self.device) if self.precision == "fp16" else None
        self.optimizer: torch.optim.Optimizer | None = None
        self.iteration = 0
        self.grad_norm: float | None = None
        self.total_steps: int | None = None  # optional: lets `varuna launch` show an ETA
        self._evaluations = 0
        if reference is not None:
            self._validate(*reference)
        self.supervision = Supervision(self.rank)
        self.supervision.ready(self)
        log.info(
            "rank %d: stage %d/%d (segments %s), replica %d/%d, %d micro-batches of ≤%d, schedule %s, %.1f MB params",
            self.rank, self.stage, self.pp, self.partition.to_string(), self.replica, self.dp,
            self.num_microbatches, self.chunk_size, schedule, self.stage_module.parameter_bytes() / 2**20,
        )

    # ------------------------------------------------------------------------------------------------------
    # Set-up

    def _build_groups(self) -> None:
        """Create every process group on every rank, in one order (``new_group`` is collective)."""
        self.dp_group = None
        self.tie_groups: list[tuple[TieSet, Any]] = []
        if self.world_size == 1:
            return
        for s in range(self.pp):
            ranks = list(self.topology.stage_ranks[s])
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout)) if len(ranks) > 1 else None
            if s == self.stage:
                self.dp_group = group
        made: dict[tuple[int, ...], Any] = {}
        for tie in self.ties:
            if len(tie.stages) < 2:
                continue
            for r in range(self.dp):
                ranks = tuple(self.topology.rank(s, r) for s in tie.stages)
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=self.timeout))
                if r == self.replica and self.stage in tie.stages:
                    self.tie_groups.append((tie, made[ranks]))

    def _tie_param(self, tie: TieSet) -> nn.Parameter:
        """This stage's copy of a tied weight (looked up once; the slicer never replaces it afterwards)."""
        cache = self.__dict__.setdefault("_tie_cache", {})
        if tie.canonical not in cache:
            slots = dict(self.module.named_parameters(remove_duplicate=False))
            cache[tie.canonical] = next(slots[n] for n in tie.names if slots[n].device.type != "meta")
        return cache[tie.canonical]

    def _sync_initial_state(self) -> None:
        """Start every replica of a stage, and every copy of a tied weight, from the same values (like DDP)."""
        if self.world_size == 1:
            return
        if self.dp_group is not None:
            tensors = [p.data for _, p in self.stage_module.param_names]
            tensors += [b for b in self.module.buffers() if b.device.type != "meta"]
            _broadcast_coalesced(tensors, src=self.topology.rank(self.stage, 0), group=self.dp_group)
        for tie, group in self.tie_groups:
            src = self.topology.rank(tie.stages[0], self.replica)
            _broadcast_coalesced([self._tie_param(tie).data], src=src, group=group)

    def _validate(self, inputs: dict, cut_values: list[Any], loss: torch.Tensor) -> None:
        """Run the sliced pipeline on ``inputs`` and compare each stage's output with the unsliced model."""
        training = self.module.training
        self.module.eval()
        captured: list = []
        n = batch_size_of(inputs, self.input_batch_dims)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                self.runtime.run([inputs], [n], [1.0], train=False, capture=captured)
        finally:
            self.module.train(training)
        if self.stage_module.is_last:
            want = [loss]
            index = len(self.structure.cut_names)
        else:
            index = self.partition.segments(self.stage).stop - 1
            want = [t for t in torch.utils._pytree.tree_leaves(cut_values[index]) if isinstance(t, torch.Tensor)]
        got = captured[0]
        ok = len(got) == len(want) and all(
            torch.allclose(g.to(w.device).float(), w.float(), rtol=1e-4, atol=1e-5) for g, w in zip(got, want)
        )
        flag = torch.tensor([index if not ok else 10**9], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        bad = int(flag.item())
        if bad < 10**9:
            name = "the loss" if bad == len(self.structure.cut_names) else f"CutPoint {self.structure.cut_names[bad]!r}"
            raise CutPointError(
                f"validation failed: the sliced pipeline's value at {name} differs from the unsliced model's",
                hint="the stage ending there depends on state not passed through its incoming CutPoint "
                "(e.g. a value computed on an earlier stage); route it through the CutPoint",
            )

    # ------------------------------------------------------------------------------------------------------
    # Seed API

    def set_optimizer(
        self, optimizer: torch.optim.Optimizer, loss_scale: str | float = "dynamic",
        init_loss_scale: float = 2**20, min_loss_scale: float = 1.0,
    ) -> None:
        """Register the optimizer built over :meth:`parameters`.

        ``loss_scale`` (``"dynamic"`` or a fixed float), ``init_loss_scale`` and ``min_loss_scale`` configure
        fp16 loss scaling and are ignored in fp32 and bf16.
        """
        if self.precision == "fp16":
            if loss_scale == "dynamic":
                self.scaler = LossScaler(init_loss_scale, min_loss_scale, dynamic=True, device=self.device)
            elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
                self.scaler = LossScaler(float(loss_scale), min_loss_scale, dynamic=False, device=self.device)
            else:
                raise ConfigError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}")
        mine = {id(p) for _, p in self.stage_module.param_names}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    raise ConfigError(
                        "the optimizer holds a parameter this rank does not own",
                        hint="create the optimizer after Varuna(...), over varuna_model.parameters()",
                    )
        self.optimizer = optimizer
        self.supervision.resume(self)  # under `varuna launch` with VARUNA_RESUME_STEP: continue from there

    def step(self, inputs: Mapping[str, Any], clip_grad_max_norm: float | None = None) -> tuple[float, bool]:
        """Forward and backward of this replica's share of the global batch; gradients synchronised.

        Args:
            inputs: this replica's ``batch_size / dp`` examples (dict of model inputs).
            clip_grad_max_norm: clip the gradients by the norm of the *whole* model (all stages, each tied weight
                once), as ``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model would.

        Returns:
            ``(loss, overflow)``: the mean loss of the global batch (the same on every rank) and whether the
            step must be skipped (fp16 found an inf/NaN on some rank; gradients are then zeroed and the loss
            scale halved). The optimizer is not stepped. The gradient norm before clipping is in
            ``self.grad_norm`` (``inf`` on overflow).
        """
        if clip_grad_max_norm is not None and not clip_grad_max_norm > 0:
            raise ConfigError(f"clip_grad_max_norm must be positive, got {clip_grad_max_norm}")
        self.supervision.before_step(self)  # may checkpoint (periodic, or agreed on demand: then it exits)
        microbatches = split_inputs(inputs, self.input_batch_dims, self.microbatch_sizes,
                                    expected=self.replica_batch_size)
        weights = ([n / self.batch_size for n in self.microbatch_sizes] if self.loss_reduction == "mean"
                   else [1.0] * len(self.microbatch_sizes))
        self.grad_buffer.attach()
        tracing = self.trace_dir is not None and self.iteration == self.trace_step
        if tracing:
            self.runtime.trace = []
        loss_sum = self.runtime.run(
            microbatches, self.microbatch_sizes, weights, train=True, rng=(self.seed, self.iteration),
            rng_ids=self._microbatch_ids,
            loss_scale=self.scaler.scale if self.scaler is not None else None,
        )
        if tracing:
            self._write_trace(self.runtime.trace)
            self.runtime.trace = None
        self._sync_grads()
        grads = [p.grad for p in self.grad_buffer.params]
        found_inf = self.scaler.unscale_(grads) if self.scaler is not None and grads else None
        norm_grads = [p.grad for p in self._norm_params]
        sq_norm = (torch.stack(torch._foreach_norm(norm_grads)).double().pow(2).sum() if norm_grads
                   else torch.zeros((), dtype=torch.float64, device=self.device))
        zero = torch.zeros((), dtype=torch.float64, device=loss_sum.device)
        totals = torch.stack([
            loss_sum.double(), sq_norm.to(loss_sum.device),
            found_inf.double().sum() if found_inf is not None else zero,
            zero + self.supervision.flag(),  # some rank got SIGUSR1: all checkpoint at the next step
        ])
        totals = self._global_sum(totals)
        loss, overflow = float(totals[0]), bool(totals[2] > 0)
        self.grad_norm = float("inf") if overflow else float(totals[1] / self.dp) ** 0.5
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            self.grad_buffer.zero()
        elif clip_grad_max_norm is not None and grads:
            coef = min(clip_grad_max_norm / (self.grad_norm + 1e-6), 1.0)
            torch._foreach_mul_(grads, coef)
        self.iteration += 1
        self.supervision.after_step(self, loss, requested_anywhere=bool(totals[3] > 0))
        return loss, overflow

    def checkpoint(self, global_store: str | os.PathLike, step: int | None = None,
                   tempdir: str | os.PathLike | None = None, shard: bool = True, background: bool = False,
                   keep: int | None = None):
        """Save parameters, buffers, optimizer state, loss scaler, RNG, step, data position and the plan to
        ``global_store/step_<step>`` (collective). See :mod:`varuna_core.checkpoint.saveload`."""
        from .checkpoint.saveload import save

        return save(self, global_store, step=step, tempdir=tempdir, shard=shard, background=background, keep=keep)

    def load_checkpoint(self, global_store: str | os.PathLike, iteration: int | str = "latest",
                        check_complete: bool = True, *, run: str | None = None, load_optimizer: bool = True) -> int:
        """Restore from a checkpoint written under any pipeline depth and width (collective; after
        ``set_optimizer``). Returns the step loaded; ``self.iteration`` continues from it, and later checkpoints
        belong to the loaded checkpoint's run (``self.run_id``).

        ``"latest"`` is the newest complete checkpoint of this run, else of the one run the store holds; with
        several runs in the store, name one (``run=``) or a step. Every file's size and sha256 are checked while
        it is read, and the model's parameter names, shapes and dtypes against the checkpoint's, before anything
        live changes: a refused checkpoint raises :class:`~varuna_core.errors.CheckpointError` on every rank and
        leaves the model, optimizer and RNG untouched. ``load_optimizer=False`` restores the model alone (e.g.
        with another optimizer)."""
        from .checkpoint.saveload import load

        return load(self, global_store, iteration=iteration, check_complete=check_complete, run=run,
                    load_optimizer=load_optimizer)

    def get_loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 in fp32 and bf16)."""
        return self.scaler.value if self.scaler is not None else 1.0

    def evaluate(self, inputs: Mapping[str, Any], batch_size: int | None = None) -> float:
        """The loss over every replica's ``inputs`` (any number of examples; batch dims as discovered): the mean
        over all examples, or with ``loss_reduction="sum"`` the sum of the micro-batch losses."""
        n = batch_size_of(inputs, self.input_batch_dims) if batch_size is None else int(batch_size)
        sizes = microbatch_sizes(n, self.chunk_size)
        microbatches = split_inputs(inputs, self.input_batch_dims, sizes, expected=n)
        self._evaluations += 1
        weights = [m / n for m in sizes] if self.loss_reduction == "mean" else [1.0] * len(sizes)
        with torch.no_grad():
            loss_sum = self.runtime.run(microbatches, sizes, weights, train=False,
                                        rng=(self.seed, -self._evaluations))
        total = loss_sum * n if self.loss_reduction == "mean" else loss_sum
        pair = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=loss_sum.device)])
        if not self.stage_module.is_last:
            pair.zero_()
        if self.world_size > 1:
            all_reduce_tensor(pair, None, timeout=self.timeout, describe=lambda: f"rank {self.rank} evaluate()")
        return float(pair[0] / pair[1]) if self.loss_reduction == "mean" else float(pair[0])

    @property
    def replica_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this replica's examples in the global batch (replicas take consecutive slices;
        the first ``batch_size % dp`` replicas hold one example more)."""
        base, extra = divmod(self.batch_size, self.dp)
        start = self.replica * base + min(self.replica, extra)
        return start, start + self.replica_batch_size

    def replica_slice(self, inputs: Mapping[str, Any]) -> dict:
        """This replica's share of a global batch of ``batch_size`` examples, sliced along each input's batch
        dim (unbatched inputs are passed whole)."""
        have = batch_size_of(inputs, self.input_batch_dims)
        if have != self.batch_size:
            raise ConfigError(f"replica_slice() takes the global batch of {self.batch_size} examples, got {have}")
        start, stop = self.replica_range
        return {
            name: value.narrow(self.input_batch_dims[name], start, stop - start)
            if self.input_batch_dims.get(name) is not None and isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()
        }

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - views are kept, values zeroed
        self.grad_buffer.zero()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("call step(inputs) to train or evaluate(inputs) to evaluate; Varuna has no forward()")

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names (tied copies once)."""
        for name, param in self.stage_module.param_names:
            yield (f"{prefix}.{name}" if prefix else name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in self.module.named_buffers(remove_duplicate=remove_duplicate):
            if buf.device.type != "meta":
                yield (f"{prefix}.{name}" if prefix else name), buf

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        return self.stage_module.parameter_bytes()

    # ------------------------------------------------------------------------------------------------------

    def _write_trace(self, events: list[tuple[str, float, float]]) -> None:
        """Chrome-trace JSON of this rank's actions: pid = replica, tid = stage, times in µs."""
        import json
        from pathlib import Path

        directory = Path(self.trace_dir)
        directory.mkdir(parents=True, exist_ok=True)
        trace = {"traceEvents": [
            {"name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": self.replica,
             "tid": self.stage, "args": {"rank": self.rank, "step": self.iteration}}
            for name, start, end in events
        ], "displayTimeUnit": "ms"}
        (directory / f"trace_rank{self.rank}.json").write_text(json.dumps(trace))

    def _agree_identity(self, seed: int | None) -> tuple[int, str]:
        """The dropout seed (unsigned 64-bit) and the run id, identical on every rank (rank 0's choice wins).

        ``torch.initial_seed()`` of an unseeded process is a random value in ``[0, 2**64)``: it travels as the
        int64 with the same bits. The run id is ``VARUNA_RUN_ID`` (set by ``varuna launch``) or a fresh one."""
        from .checkpoint.layout import check_run_id, new_run_id

        value = (int(seed) if seed is not None else torch.initial_seed()) & _MASK64
        env_run = env.text(env.RUN_ID)
        run = check_run_id(env_run, env.RUN_ID) if env_run else new_run_id()
        if self.world_size > 1:
            packed = torch.zeros(2 + _RUN_ID_BYTES, dtype=torch.int64)
            packed[0] = value - 2**64 if value >= 2**63 else value
            packed[1] = len(run)
            packed[2:2 + len(run)] = torch.tensor(list(run.encode()), dtype=torch.int64)
            dist.broadcast(packed, src=0)
            value = int(packed[0]) & _MASK64
            run = bytes(int(b) for b in packed[2:2 + int(packed[1])]).decode()
        return value, run

    def _sync_grads(self) -> None:
        for tie, group in self.tie_groups:
            param = self._tie_param(tie)
            all_reduce_tensor(param.grad, group, timeout=self.timeout,
                              describe=lambda: f"rank {self.rank} summing gradients of tied weight {tie.canonical!r}")
        if self.dp_group is not None:
            self.grad_buffer.all_reduce(self.dp_group, timeout=self.timeout,
                                        describe=lambda: f"rank {self.rank} (stage {self.stage}) data-parallel all-reduce")

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return value
        value = value.clone()
        all_reduce_tensor(value, None, timeout=self.timeout, describe=lambda: f"rank {self.rank} loss all-reduce")
        return value


# ----------------------------------------------------------------------------------------------------------
# Helpers


_MASK64 = (1 << 64) - 1
_RUN_ID_BYTES = 64


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
        seed = integer("seed", seed, low=-(2**63), high=_MASK64)
    return batch_size, chunk_size, timeout, bucket_mb, trace_step, seed


def _load_plan(plan: Any):
    if plan is None:
        plan = env.text(env.PLAN)
    if plan is None:
        return None
    from .planning.artifacts import load_plan

    return load_plan(plan)


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
    if partition is not None:
        log.warning("the plan's partition replaces the partition argument")
    return plan.stage_to_rank_map, plan.microbatch_size, plan.schedule, [tuple(r) for r in plan.partition]


def _ensure_process_group(stage_to_rank_map: Any, timeout: float) -> tuple[int, int]:
    """Use the default process group if one exists; else create one from torchrun-style env vars."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 1, 0
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set",
                          hint="launch with torchrun or `varuna launch`, which set them")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout, 60)))
    return dist.get_world_size(), dist.get_rank()


def _resolve_device(device: Any, local_rank: int) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    if local_rank < 0:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        index = device if device >= 0 else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _replica_share(batch_size: int, dp: int, replica: int) -> int:
    if batch_size < dp:
        raise ConfigError(f"batch_size={batch_size} is smaller than the {dp} data-parallel replicas",
                          hint=f"use batch_size ≥ {dp}")
    base, extra = divmod(batch_size, dp)
    return base + (1 if replica < extra else 0)


def _segment_param_bytes(model: nn.Module, structure: Structure) -> list[float]:
    weights = [0.0] * structure.num_segments
    counted: set[tuple[int, int]] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        for seg in structure.param_uses.get(name, (0,)):
            if (id(param), seg) not in counted:
                counted.add((id(param), seg))
                weights[seg] += param.numel() * param.element_size()
    return weights


def _reference(model: nn.Module, dummy_inputs: Any, batch_fn, chunk_size: int) -> tuple[dict, list, torch.Tensor]:
    """The unsliced model's value at each cut and its loss on the dummy inputs (eval mode, no grad)."""
    from .model.cutpoint import find_cutpoints
    from .model.discovery import _quiet_run, extract_loss

    inputs = dict(dummy_inputs) if isinstance(dummy_inputs, Mapping) else batch_fn(chunk_size)
    values: list[Any] = []
    cuts = find_cutpoints(model)
    for cut in cuts.values():
        cut.set_hook(lambda c, v: (values.append(torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, v)), v)[1])
    try:
        with _quiet_run(model):
            loss = extract_loss(model(**inputs)).detach().clone()
    finally:
        for cut in cuts.values():
            cut.set_hook(None)
    return inputs, values, loss


def _broadcast_coalesced(tensors: list[torch.Tensor], *, src: int, group) -> None:
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_kind.values():
        flat = torch._utils._flatten_dense_tensors(group_tensors)
        dist.broadcast(flat, src=src, group=group)
        for t, synced in zip(group_tensors, torch._utils._unflatten_dense_tensors(flat, group_tensors)):
            t.copy_(synced)
