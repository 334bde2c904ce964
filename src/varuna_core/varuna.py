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

import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .env import WorkerEnv, overlap_sync
from .errors import CommTimeoutError, ConfigError, HandoverError, WireRangeError
from .ir.partition import Partition
from .ir.topology import Topology
from .model.discovery import Structure, discover, dry_forward, make_batch_fn
from .model.lazy_values import ValueSource
from .model.modes import ModeCheck
from .model.module_state import AttributeSnapshot, written_attributes
from .model.precision import LossScaler
from .model.stage import StageSlice, TieSet, find_tie_sets, weight_groups
from .model.values import load_stage_weights, value_source
from .pipeline.config import (
    Config,
    batch_layout,
    check_structure,
    choose_partition,
    loss_weights,
    replica_share,
    resolve_config,
)
from .pipeline.executor import PipelineExecutor
from .pipeline.grads import GradBuffer
from .pipeline.groups import (
    agree_seed_and_run,
    agree_started,
    build_groups,
    ensure_process_group,
    intended_world,
    resolve_device,
    sync_initial_state,
    sync_written_buffers,
    tie_params,
)
from .pipeline.microbatch import split_inputs
from .pipeline.reduce import (
    GradSync,
    check_clip,
    check_optimizer,
    evaluate_loss,
    finish_step,
    global_sum,
    loss_scaler,
    norm_params,
)
from .pipeline.shard import OptimizerShards, ShardLayout, check_shardable
from .pipeline.tracing import ChromeTrace
from .pipeline.validate import check_slicing, reference_run
from .util.heap import available_memory, release_free_memory
from .util.sockets import shut_down, socket_inodes
from .worker.excepthook import install_excepthook
from .worker.regroup import EXIT_LEFT, Regrouper, global_views, peer_lost
from .worker.supervision import Supervision

__all__ = ["Varuna"]

log = logging.getLogger(__name__)


class Varuna(nn.Module):
    """Pipeline + data parallel training of ``model`` across the ranks of ``stage_to_rank_map``.

    Args:
        model: the full model in fp32, on CPU (or the target device), or built without memory under
            :func:`~varuna_core.meta_init` (or ``torch.device("meta")``): then each rank allocates and initialises
            only its stage (see ``seed``, ``init``, ``weights``). Its forward takes keyword inputs and returns the
            loss (a scalar, or a tuple/dict whose first/``"loss"`` entry is it); ``CutPoint`` modules mark the
            possible stage boundaries. It is modified in place: other stages' parameters move to the ``meta``
            device. Its mode at construction (training, normally) is the one discovery runs it in; the other
            mode is discovered too, and a ``step``/``evaluate`` in a mode that computes another structure is
            refused ([Note: discovery mode] in :mod:`varuna_core.model.modes`). Buffers its forward writes
            (BatchNorm statistics) change once per micro-batch as in one process, whatever the schedule ([Note:
            buffer writes]); replicas take replica 0's after every step ([Note: replica buffers]).
        stage_to_rank_map: the original's string, e.g. ``"0,2;1,3"``: stage ``s`` lists its global ranks, the
            position in the list is the data-parallel replica.
        dummy_inputs: example inputs (a dict, batched along dim 0 unless ``input_batch_dims`` says otherwise)
            or a function ``n -> dict`` of inputs for ``n`` examples.
        batch_size: the global batch (all replicas).
        chunk_size: the micro-batch size.
        fp16: fp16 autocast with dynamic loss scaling (the original's flag; same as ``precision="fp16"``).
        local_rank: local rank for device selection (default: ``LOCAL_RANK`` env).
        device: ``-1`` (CUDA ``local_rank`` if available, else CPU), a CUDA index, a name (``"cpu"``,
            ``"cuda:1"``) or a ``torch.device``; a device this machine does not have is a ``ConfigError`` naming
            the ones it has, raised before the process group is joined.
        shared_weights: ``[(name_a, name_b)]`` parameter names that hold one tied weight. A parameter object
            used by two stages is detected without being listed.
        from_cache: reuse the structure discovery of an identical model and inputs.
        schedule: ``"varuna"`` (recompute, opportunistic forwards), ``"1f1b"``, ``"gpipe"``, or a zero-bubble
            schedule that splits each backward into the input's gradient (``B``) and the weights' (``W``, run where
            the stage would wait): ``"zb"`` (ZB-H1: 1F1B's memory, two thirds of its bubble gone at equal times)
            or ``"varuna-zb"`` (``"varuna"``'s order, its W deferred as ZB-H1's).
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
        seed: seeds dropout per (seed, step, micro-batch, segment), and the values of a model built on meta
            (:func:`~varuna_core.materialize` with this seed gives a single process the same model); default:
            rank 0's ``torch.initial_seed()``.
        init: for a model built on meta, ``init(module)`` initialises a module's own tensors (default: the
            module's ``reset_parameters()``, or a Hugging Face model's ``_init_weights``; see
            :func:`~varuna_core.materialize`).
        weights: pretrained values: a ``.safetensors`` file, a Hugging Face directory (sharded or not) or the
            output of ``varuna ckpt merge``, names as in ``model.named_parameters()``. Each rank reads only its
            stage's tensors (memory-mapped); a missing or extra name or a wrong shape is an error naming it.
        plan: a :class:`~varuna_core.planning.artifacts.Plan` or the path of one (default: ``VARUNA_PLAN``); it sets the
            stage-to-rank map, partition, schedule and micro-batch size. ``stage_to_rank_map`` may then be
            ``None``.
        trace: a directory (default: ``VARUNA_TRACE``) to write a Chrome trace of step ``trace_step``'s actions
            to, one ``trace_rank<R>.json`` per rank (open in Perfetto, or `varuna plan show --measured`).
        cutpoints: ``"auto"`` for a model without ``CutPoint``s: a cut in front of every block of its block
            stacks (its longest ``nn.ModuleList``...), or, without one, in front of every call of the module its
            forward calls repeatedly (one layer's weights at every depth, as ALBERT's; tied over the stages); on one
            stage a model with neither trains whole (see :mod:`varuna_core.model.autocut`). Hugging Face models
            need no edits.
        loss_reduction: ``"mean"``: the model's loss is the mean over the micro-batch's examples, and the library
            weights each micro-batch by its share of the global batch. ``"sum"``: the loss is already the
            micro-batch's share of the global loss (e.g. a sum over tokens divided by the global number of
            tokens: Hugging Face's ``num_items_in_batch``, for masked-LM or padded batches whose examples hold
            different numbers of tokens) and the micro-batches are added up.
        shard_optimizer: shard each stage's optimizer state over its data-parallel replicas (ZeRO-1, see
            :mod:`varuna_core.pipeline.shard`): gradients are reduce-scattered, the optimizer set with
            :meth:`set_optimizer` steps this replica's pieces of the parameters, and the updated pieces are
            all-gathered (the same bytes on the wire as the all-reduce). A rank then holds ``1/dp`` of the
            optimizer state. The optimizer's update must be element-wise (``SGD``, ``Adam``, ``AdamW``, ...; see
            :data:`~varuna_core.pipeline.shard.ELEMENTWISE`); with one replica it changes nothing. A lost replica
            then takes its shard with it: a job recovers from a snapshot or checkpoint instead of regrouping.
            Default: the plan's choice, else False.
        wire_dtype: ``"bf16"`` or ``"fp16"``: floating-point activations and gradients wider than it (fp32) cross
            cuts in it, in half the bytes, and are cast back on arrival, so every stage computes in the dtypes it
            would without it; integer and bool tensors, and float ones as narrow or narrower, cross as they are
            ([Note: wire dtype] in :mod:`varuna_core.model.precision`). The values are rounded once per crossing.
            With ``"fp16"`` a finite value beyond fp16's range (≥ 65520 in magnitude) is an overflow of the step
            under ``precision="fp16"`` (skipped, the loss scale lowered) and a
            :class:`~varuna_core.errors.WireRangeError` on every rank otherwise. ``"exact"`` (or ``"fp32"``):
            every tensor crosses in its own dtype. Default: the plan's, else exact.
        reduce_dtype: ``"bf16"`` (or ``"fp16"``, under ``precision="fp16"`` only: its loss scaling skips a step
            whose sum overflows): the data-parallel all-reduce sums each fp32 gradient bucket in it, half the bytes,
            and copies the sum back (as torch DDP's compression hooks do). Tied weights' sums stay exact; not with
            ``shard_optimizer``. Default: exact.
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
        init: Callable[[nn.Module], Any] | None = None,
        weights: str | os.PathLike | None = None,
        shard_optimizer: bool | None = None,
        wire_dtype: str | torch.dtype | None = None,
        reduce_dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__()
        install_excepthook()
        sockets_before = set(socket_inodes())  # the process groups' connections are those made from here on
        told = WorkerEnv.from_environ()  # what varuna launch told this worker: read once, handed to who needs it
        self._job_token = told.job_token  # signs a background checkpoint's reports between ranks
        config = resolve_config(
            model, stage_to_rank_map, batch_size, chunk_size, fp16=fp16, schedule=schedule, partition=partition,
            timeout=timeout, bucket_mb=bucket_mb, precision=precision, seed=seed,
            plan=plan if plan is not None else told.plan, trace=trace, trace_step=trace_step, cutpoints=cutpoints,
            loss_reduction=loss_reduction, shard_optimizer=shard_optimizer, wire_dtype=wire_dtype,
            reduce_dtype=reduce_dtype)
        self.shard_optimizer, self.wire_dtype, self._wire = config.shard_optimizer, config.wire_dtype, config.wire
        self.reduce_dtype = config.reduce_dtype
        self.loss_reduction, self.precision, self.plan = config.loss_reduction, config.precision, config.plan
        self.trace_dir, self.trace_step, self.timeout = config.trace_dir, config.trace_step, config.timeout
        self._place(config, device, local_rank)
        # a warm worker of a morph parks its stage in host memory until the go: the worker it replaces still fills
        # the GPU (allocate at the handover, not before; DESIGN.md §3.8)
        self._park = torch.device("cpu") if told.handover == "wait" and self.device.type != "cpu" else None
        self.seed, self.run_id = agree_seed_and_run(config.seed, self.world_size, told.run_id)
        try:  # this rank's own work: an error here is every rank's (agree_started), not a peer's timeout
            reference = self._prepare(model, config, dummy_inputs, input_batch_dims, from_cache, validate, init,
                                      weights, shared_weights)
        except Exception as exc:
            agree_started(exc, rank=self.rank, world_size=self.world_size)
            raise
        agree_started(None, rank=self.rank, world_size=self.world_size)
        self._connect(model)
        self._group_sockets = set(socket_inodes()) - sockets_before  # cut when a peer is lost: _regroup
        release_free_memory()  # the other stages' tensors of a model built for real, the validation's run
        schedule = config.schedule
        self.executor = PipelineExecutor(self.stage_slice, self.topology, self.rank, schedule, self.timeout,
                                         self.precision, wire=self._wire)
        self._communicate(config.bucket_mb, config.reduce)
        if reference is not None:  # from the attributes the model came with: [Note: module state]
            with self.stage_slice.attributes.undone(), self.executor.exact_wire():
                check_slicing(self.executor, self.module, self.structure, self.partition, self.stage,
                              is_last=self.stage_slice.is_last, input_batch_dims=self.input_batch_dims,
                              world_size=self.world_size, reference=reference, rng=self._validation_rng)
        self._supervise(told)
        self._regrouper = Regrouper.launched(told, self.timeout)
        self._sliced: tuple[Mapping[str, Any], dict] | None = None  # the last global batch replica_slice() shared
        log.info(
            "rank %d: stage %d/%d (segments %s), replica %d/%d, %d micro-batches of ≤%d, schedule %s, %.1f MB params",
            self.rank, self.stage, self.pp, self.partition.to_string(), self.replica, self.dp,
            self.num_microbatches, self.chunk_size, schedule, self.stage_slice.parameter_bytes() / 2**20,
        )

    # ------------------------------------------------------------------------------------------------------
    # Set-up (composition: each part lives on its floor)

    def _place(self, config: Config, device: Any, local_rank: int) -> None:
        """This rank's place: device (checked before the process group is joined), process group, topology, batch
        layout."""
        self.device = resolve_device(device, local_rank)
        world_size, _ = intended_world()
        self.topology = Topology.parse(config.stage_to_rank_map, world_size)  # before joining: see intended_world
        self.world_size, self.rank = ensure_process_group(config.timeout, self.device)
        self.stage, self.replica = self.topology.coords(self.rank)
        self.pp, self.dp = self.topology.pp, self.topology.dp
        self.batch_size, self.chunk_size = config.batch_size, config.chunk_size
        self._lay_out()
        self.schedule_name = config.schedule

    def _lay_out(self) -> None:
        """This replica's share of the global batch and its micro-batches, for the current replica set."""
        layout = batch_layout(self.batch_size, self.chunk_size, self.dp, self.replica)
        self.replica_batch_size, self._replica_range = layout.replica_batch_size, layout.replica_range
        self.microbatch_sizes, self._microbatch_ids = layout.microbatch_sizes, layout.microbatch_ids
        self.num_microbatches = len(self.microbatch_sizes)

    def _prepare(self, model: nn.Module, config: Config, dummy_inputs: Any, input_batch_dims: Any,
                 from_cache: bool, validate: bool | None, init: Any, weights: Any, shared_weights: Any) -> Any:
        """Discovery (in the model's mode, and in the other one: [Note: discovery mode]), the partition, the
        validation's reference run, and this stage's slice: work every rank does alone. Returns the reference
        run (``None`` without validation)."""
        self.weight_groups = weight_groups(model, list(shared_weights or []))  # ties; checkpoint names: any layout
        values = value_source(model, self.weight_groups, self.seed, init, weights)
        batch_fn, self.input_batch_dims = make_batch_fn(dummy_inputs, input_batch_dims)
        if config.cutpoints == "auto":
            from .model.autocut import apply_auto_cutpoints

            apply_auto_cutpoints(model, dry_forward(model, batch_fn, precision=self.precision, values=values),
                                 stages=self.pp)

        def discover_now() -> Structure:
            return discover(model, batch_fn, self.input_batch_dims, use_cache=from_cache, precision=self.precision,
                            values=values, require_cuts=config.cutpoints != "auto")

        self.structure: Structure = discover_now()
        self._modes = ModeCheck(model, self.structure, discover_now)
        release_free_memory()  # the dry runs' values and activations, before the stage is allocated
        check_structure(self.structure, self.plan, self.pp)
        self.partition = choose_partition(config.partition, model, self.structure, self.pp)
        if validate is None:
            validate = config.cutpoints == "auto"
        if validate:
            self._park = None  # the validation runs the stage where it computes
        self._validation_rng = (self.seed, -(2**40))  # a stream no step or evaluation draws
        reference = None
        if validate:
            with AttributeSnapshot(written_attributes(model, self.structure.module_state)).undone():
                reference = reference_run(model, dummy_inputs, batch_fn, self.chunk_size, values,
                                          rng=self._validation_rng, device=self.device)
        self._slice(model, config.cutpoints, values)
        return reference

    def _slice(self, model: nn.Module, cutpoints: str | None, values: ValueSource | None) -> None:
        """This stage's module (allocated and loaded here if built on meta) and its tied weights."""
        self.ties: list[TieSet] = find_tie_sets(model, self.structure, self.partition, self.weight_groups)
        self.stage_slice = StageSlice(model, self.structure, self.partition, self.stage, self.ties, self.device,
                                      placeholders="real" if cutpoints == "auto" else "meta", values=values,
                                      written=self._modes.other_writes, park=self._park)
        if values is not None and values.weights is not None:
            load_stage_weights(model, values.weights, self.weight_groups)
        self.module = model

    def _connect(self, model: nn.Module) -> None:
        """The groups that keep replicas and tied copies in step (collective), and their first sync (a parked
        stage's once it is on its device: :meth:`_unpark`)."""
        self.groups = build_groups(self.topology, self.ties, self.stage, self.replica, self.world_size, self.timeout)
        self._tied = tie_params(model, self.ties, self.stage)
        if self.stage_slice.park is None:
            sync_initial_state(self.stage_slice, model, self.groups, self._tied, self.topology, self.stage,
                               self.replica, self.world_size)

    def _unpark(self) -> None:
        """A warm worker's go (collective over the new ranks): its parked stage moves onto its device, where the
        state it takes then lands, and replicas and tied copies start from the same values."""
        if self.stage_slice.unpark():
            sync_initial_state(self.stage_slice, self.module, self.groups, self._tied, self.topology, self.stage,
                               self.replica, self.world_size)
            log.info("rank %d: stage moved onto %s at the handover (%.1f MB of parameters)", self.rank, self.device,
                     self.stage_slice.parameter_bytes() / 2**20)

    def _communicate(self, bucket_mb: float, reduce: torch.dtype | None) -> None:
        """Gradient buckets and their sync (summed in ``reduce``, if given), the loss scaler, the step counter."""
        self.grad_buffer = GradBuffer([p for _, p in self.stage_slice.param_names], int(bucket_mb * 2**20),
                                      reduce_dtype=reduce)
        self._overlap_sync = overlap_sync()  # VARUNA_OVERLAP_SYNC=0: after the pipeline (comparison, debugging)
        self._grad_sync = GradSync(self.groups, self._tied, self.grad_buffer, timeout=self.timeout, rank=self.rank,
                                   stage=self.stage, overlap=self._overlap_sync)
        self._norm_params = norm_params(self.grad_buffer, self.ties, self._tied, self.stage)
        self.scaler = LossScaler(device=self.device) if self.precision == "fp16" else None
        self.optimizer: torch.optim.Optimizer | None = None
        self._shards: OptimizerShards | None = None  # shard_optimizer with replicas: set_optimizer
        self.iteration = 0
        self.grad_norm: float | None = None
        self.total_steps: int | None = None  # optional: lets `varuna launch` show an ETA
        self._evaluations = 0

    def _supervise(self, told: WorkerEnv) -> None:
        """Under `varuna launch`: heartbeats, resume, periodic and on-demand checkpoints (see worker/)."""
        from .checkpoint.handover import reside

        self.supervision = Supervision(
            self.rank, stage=self.stage, replica=self.replica, samples=self.batch_size,
            save=lambda directory, **options: self.checkpoint(directory, **options),
            load=lambda directory, step: self.load_checkpoint(directory, iteration=step),
            progress=lambda: (self.iteration, self.executor.compute_time, self.total_steps), told=told,
            publish=lambda reserve, copies, final=False, leaving=False, alone=False: self.publish_state(
                reserve, copies=copies, final=final, leaving=leaving, hashed=not alone),
            take=lambda step, locate, fetch, staging, link, holder_of, drop, keep, claim=None: self.take_state(
                step=step, locate=locate, fetch=fetch, staging=staging, link=link, holder_of=holder_of, in_place=True,
                map_files=True, drop=drop, keep=keep, claim=claim),
            arrive=self._unpark, release=self.grad_buffer.release,
            reside=lambda keep: reside(self._checkpoint_state(), keep), state_files=self._state_files,
            warm_grads=self._warm_grads)
        self.supervision.ready()

    def _warm_grads(self) -> int:
        """A warm worker's gradient buffers, allocated and written before its go (``Supervision``'s
        ``warm_grads``); returns their bytes, 0 if left for the first step: off the CPU (a GPU's memory is the
        old worker's until the handover), with parameters not yet real, or beyond half the host's available
        memory (the old worker still holds its own)."""
        buffer = self.grad_buffer
        if buffer.allocated or not all(p.device.type == "cpu" for p in buffer.params):
            return 0
        if buffer.nbytes > available_memory() // 2:
            return 0
        return buffer.touch()

    def _state_files(self) -> list[int]:
        """An estimate, before the optimizer made any state, of the sizes of the files this rank's checkpointed
        state is handed over in (``handover.by_parameter``: a file per parameter): each parameter's bytes and as
        many fp32 copies of it as its optimizer keeps (two for the Adam family, one for momentum or a running
        average; an unknown optimizer is taken as Adam-like), a replica's share of them under a sharded
        optimizer."""
        optimizer = self.optimizer
        slots = 2
        if optimizer is not None:
            name = type(optimizer).__name__
            if name in ("SGD", "RMSprop", "Adagrad"):
                slots = 1 if name != "SGD" or any(g.get("momentum") for g in optimizer.param_groups) else 0
        share = self.dp if self._shards is not None else 1  # a replica keeps its pieces of the optimizer state only
        return [p.numel() * p.element_size() + slots * p.numel() * 4 // share for _, p in self.stage_slice.param_names]

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
        self.scaler = loss_scaler(self.precision, loss_scale, init_loss_scale, min_loss_scale, self.device,
                                  self.scaler)
        check_optimizer(optimizer, self.stage_slice.param_names)
        if self._shards is not None:
            self._shards.close()
            self._shards = None
        if self.shard_optimizer:
            check_shardable(optimizer)  # with one replica too: the same script may run with several
        if self.shard_optimizer and self.dp > 1:
            self._shards = OptimizerShards(
                ShardLayout(self.grad_buffer.kinds(), self.dp, self.replica), optimizer, group=self.groups.dp,
                ranks=list(self.topology.stage_ranks[self.stage]), bucket_bytes=self.grad_buffer.bucket_bytes,
                timeout=self.timeout, describe=lambda what: f"rank {self.rank} (stage {self.stage}) {what}")
        self._grad_sync.shards = self._shards
        self.optimizer = optimizer
        self.supervision.resume()  # under `varuna launch` with VARUNA_RESUME_STEP: continue from there

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
        check_clip(clip_grad_max_norm)
        self._modes.check("step()")  # the model in another mode than it was sliced for: [Note: discovery mode]
        self.supervision.before_step()  # may checkpoint (periodic, or agreed on demand: then it exits)
        while True:
            # a sharded optimizer's lost replica takes its shard of the state along: no regroup, a recovery
            regroups = self._regrouper is not None and self.dp > 1 and self._shards is None
            before = self._before_step() if regroups else None
            try:
                return self._step(inputs, clip_grad_max_norm)
            except CommTimeoutError as exc:  # a peer lost with its host: go on without its replica (worker.regroup)
                if before is None or not peer_lost(exc):
                    if self._regrouper is not None and self._shards is not None and peer_lost(exc):
                        log.warning("rank %d: a peer was lost in step %d; the optimizer state is sharded over the "
                                    "replicas, so the lost one's shard is gone: the job recovers from a snapshot "
                                    "or checkpoint instead of going on without it", self.rank, self.iteration)
                        self.supervision.regroup_refused(self.iteration)
                    raise
                inputs = self._regroup(exc, inputs, before)

    def _step(self, inputs: Mapping[str, Any], clip_grad_max_norm: float | None) -> tuple[float, bool]:
        microbatches = split_inputs(inputs, self.input_batch_dims, self.microbatch_sizes,
                                    expected=self.replica_batch_size)
        weights = loss_weights(self.microbatch_sizes, self.batch_size, self.loss_reduction)
        if self._shards is not None:  # the buffer holds partial sums after a reduce-scatter: nothing to add to
            self.grad_buffer.zero()
        self.grad_buffer.attach()
        trace_dir = self.trace_dir if self.iteration == self.trace_step else None
        tracer = self.executor.add_observer(self._chrome_trace()) if trace_dir is not None else None
        loss_sum = self.executor.run(
            microbatches, self.microbatch_sizes, weights, train=True, rng=(self.seed, self.iteration),
            rng_ids=self._microbatch_ids,
            loss_scale=self.scaler.scale if self.scaler is not None else None,
            grads_final=self._grad_sync.begin(),  # the gradient sync starts in the last backward
        )
        if tracer is not None and trace_dir is not None:
            self.executor.remove_observer(tracer)
            tracer.write(os.path.join(trace_dir, f"trace_rank{self.rank}.json"))
        synced = time.perf_counter()
        self._grad_sync()
        for observer in self.executor.observers:
            observer.on_sync(synced, time.perf_counter())
        result = finish_step(
            loss_sum, self.grad_buffer, self._norm_params, self.scaler, dp=self.dp, device=self.device,
            clip_grad_max_norm=clip_grad_max_norm, reduce=self._global_sum, shards=self._shards,
            flag=self.supervision.flag(),  # some rank got SIGUSR1 (SIGUSR2): all checkpoint (publish) next step
            wire=self.executor.wire_counts(self.pp - 1),
        )
        self._wire_checked(result.wire, "step")
        sync_written_buffers(self.stage_slice, self.groups, self.topology, self.stage)  # [Note: replica buffers]
        self.grad_norm = result.grad_norm
        self.iteration += 1
        self.supervision.after_step(result.loss, requested_anywhere=result.flags)
        return result.loss, result.overflow

    def _before_step(self) -> tuple[Any, list[torch.Tensor]]:
        """What a step changes besides the gradients, as it was before it: the loss scaler's state and the buffers
        the forward writes (put back if the step is redone after a regroup)."""
        scaler = copy.deepcopy(self.scaler.__dict__) if self.scaler is not None else None
        return scaler, [t.detach().clone() for t in self.stage_slice.buffer_writes.live()]

    def _regroup(self, exc: CommTimeoutError, inputs: Mapping[str, Any],
                 before: tuple[Any, list[torch.Tensor]]) -> dict[str, Any]:
        """A peer was lost in this step: leave the process group, undo the step, and once the launcher says how
        the survivors go on, join their new group and return this replica's share of the same global batch, to
        redo the step with (see :mod:`varuna_core.worker.regroup`). Re-raises ``exc`` when it cannot."""
        assert self._regrouper is not None
        views = global_views(inputs, self._sliced)
        # every transfer of the group ends at once, on both sides: the survivors waiting on this rank fail too
        cut = shut_down(self._group_sockets, keep_port=self._regrouper.master[1])
        log.info("rank %d: cut %d connections of its process group", self.rank, cut)
        self.groups.release()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        if views is None:
            log.warning("rank %d: a peer was lost, but the inputs are not the share replica_slice() made of a global "
                        "batch: the lost replicas' examples cannot be taken over here (the job restarts instead)",
                        self.rank)
            raise exc
        self.grad_buffer.zero()
        scaler, buffers = before
        if self.scaler is not None:
            self.scaler.__dict__.update(scaler)
        for live, saved in zip(self.stage_slice.buffer_writes.live(), buffers, strict=True):
            live.copy_(saved)
        log.warning("rank %d: a peer was lost in step %d (%s); waiting for the launcher's regroup", self.rank,
                    self.iteration, str(exc).splitlines()[0][:200])
        self.supervision.regroup_asked(self.iteration)
        try:
            regroup = self._regrouper.wait(self.iteration)
        except HandoverError as error:
            log.warning("rank %d: %s", self.rank, error.message)
            raise exc from None
        rank = regroup.ranks[self.rank] if self.rank < len(regroup.ranks) else None
        if rank is None:
            log.warning("rank %d leaves the job at step %d: its replica lost a stage", self.rank, self.iteration)
            self.supervision.left()
            raise SystemExit(EXIT_LEFT)
        world = sum(r is not None for r in regroup.ranks)
        topology = Topology.parse(regroup.stage_to_rank_map, world)
        if topology.pp != self.pp or topology.coords(rank)[0] != self.stage:
            log.warning("rank %d: the regroup would move it off stage %d; giving up", self.rank, self.stage)
            raise exc
        sockets = set(socket_inodes())
        self._regrouper.join(regroup, rank, "nccl" if self.device.type == "cuda" else "gloo")
        old = self.rank
        self.world_size, self.rank, self.topology = world, rank, topology
        self.stage, self.replica = topology.coords(rank)
        self.dp = topology.dp
        self._lay_out()
        self.groups = build_groups(self.topology, self.ties, self.stage, self.replica, self.world_size, self.timeout)
        self._group_sockets = set(socket_inodes()) - sockets
        self.executor = PipelineExecutor(self.stage_slice, self.topology, self.rank, self.schedule_name,
                                         self.timeout, self.precision, wire=self._wire)
        self._grad_sync.close()
        self._grad_sync = GradSync(self.groups, self._tied, self.grad_buffer, timeout=self.timeout, rank=self.rank,
                                   stage=self.stage, overlap=self._overlap_sync)
        self.supervision.regrouped(rank, self.replica, self.iteration)
        log.warning("rank %d is rank %d of %d (stage %d, replica %d of %d) from step %d on", old, rank, world,
                    self.stage, self.replica, self.dp, self.iteration)
        return replica_share(views, self.input_batch_dims, self.batch_size, self.replica_range)

    def checkpoint(self, global_store: str | os.PathLike, step: int | None = None,
                   tempdir: str | os.PathLike | None = None, shard: bool = True, background: bool = False,
                   keep: int | None = None):
        """Save parameters, buffers, optimizer state, loss scaler, RNG, step, data position and the plan to
        ``global_store/step_<step>`` (collective). See :mod:`varuna_core.checkpoint.saveload`."""
        from .checkpoint.saveload import save

        return save(self._checkpoint_state(), global_store, step=step, tempdir=tempdir, shard=shard,
                    background=background, keep=keep)

    def load_checkpoint(self, global_store: str | os.PathLike, iteration: int | str = "latest",
                        check_complete: bool = True, *, run: str | None = None, load_optimizer: bool = True) -> int:
        """Restore from a checkpoint written under any pipeline depth and width (collective; after
        ``set_optimizer``). Returns the step loaded; ``self.iteration`` continues from it, and later checkpoints
        belong to the loaded checkpoint's run (``self.run_id``).

        ``"latest"`` is the newest complete checkpoint of this run, else of the one run the store holds; with
        several runs in the store, name one (``run=``) or a step. Every file's size and digest are checked while
        it is read, and the model's parameter names, shapes and dtypes against the checkpoint's, before anything
        live changes: a refused checkpoint raises :class:`~varuna_core.errors.CheckpointError` on every rank and
        leaves the model, optimizer and RNG untouched. ``load_optimizer=False`` restores the model alone (e.g.
        with another optimizer)."""
        from .checkpoint.saveload import load

        state = self._checkpoint_state()
        try:
            return load(state, global_store, iteration=iteration, check_complete=check_complete, run=run,
                        load_optimizer=load_optimizer)
        finally:
            self._adopt(state)

    def publish_state(self, reserve: Callable[[int], Any], *, step: int | None = None,
                      copies: bool = True, final: bool = False, leaving: bool = False,
                      hashed: bool = True) -> dict[str, int]:
        """Put a checkpoint of every rank's state into its own host's memory for a handover (collective; see
        :mod:`varuna_core.checkpoint.handover`): ``reserve(nbytes)`` gives room on this host's shelf
        (``Shelf.reserve``), where each file is written once and becomes a blob; ``final``: this process trains no
        more (a handover), so the files a take mapped as its state become blobs as they are; ``leaving``: this
        host is not in the next configuration, so its replicas on staying hosts write what they can;
        ``hashed=False`` (with ``final``): the next configuration runs on this host alone, so those files are not
        hashed. Returns ``{blob name: rank}`` on every rank."""
        from .checkpoint.handover import publish

        return publish(self._checkpoint_state(), reserve, step=step, copies=copies, final=final, leaving=leaving,
                       hashed=hashed)

    def take_state(self, *, step: int, locate: Callable[[str], Any], fetch: Callable[..., None],
                   staging: str | os.PathLike, load_optimizer: bool = True,
                   link: Callable[..., tuple[int, str | None] | None] | None = None, in_place: bool = False,
                   holder_of: Callable[[int], Any] | None = None, map_files: bool = False,
                   drop: Callable[[list[str]], object] | None = None,
                   keep: str | os.PathLike | None = None,
                   claim: Callable[[int, Path], bool] | None = None) -> int:
        """Restore from a checkpoint published into the hosts' memory (collective over the new ranks; after
        ``set_optimizer``), as :meth:`load_checkpoint` restores from a store, all or nothing: ``locate(name)``
        names a blob's holder, ``fetch(holder, names, into, max_bytes)`` takes blobs from it, ``link(holder,
        name, path)`` puts one of this host's in place (see :mod:`varuna_core.checkpoint.handover`);
        ``in_place`` reads the model straight into the live tensors (a warm worker's), ``holder_of(rank)`` lets a
        file come from a replica's copy, ``map_files`` (with ``in_place``, on the CPU) makes the taken files the
        live parameters' and optimizer state's memory (blobs of this host's shelf only with ``drop(names)``, which
        takes them off it before the first optimizer step changes them), ``keep`` a directory where they stay named
        for a last publish (``publish_state(final=True)``) to make them blobs without a copy, ``claim(size,
        path)`` moves a file of memory touched before to ``path`` for a file about to arrive over the wire. Returns
        the step restored."""
        from .checkpoint.handover import take

        state = self._checkpoint_state()
        try:
            return take(state, step=step, locate=locate, fetch=fetch, staging=staging, load_optimizer=load_optimizer,
                        link=link, in_place=in_place, holder_of=holder_of, map_files=map_files,
                        drop=drop, keep=keep, claim=claim)
        finally:
            self._adopt(state)

    def _adopt(self, state) -> None:
        """Once the live tensors hold a checkpoint's (even if a later part of the load failed), so does the rest:
        the step, the seed, the run and the loss scale."""
        if state.restored:
            self.iteration, self.seed, self.run_id = state.iteration, state.seed, state.run_id
            if self.scaler is not None and state.loss_scaler is not None:
                self.scaler.load_state_dict(state.loss_scaler)

    def _checkpoint_state(self):
        """What a checkpoint saves and restores of this rank, for the checkpoint floor (which knows nothing of
        this class): the live model, parameters and optimizer, and plain values."""
        from .checkpoint.state import CheckpointState, OptimPiece

        pieces = None
        if self._shards is not None:  # a tied weight's state is written from its first stage (as its norm counts)
            saved = {id(p) for p in self._norm_params}
            pieces = {id(p): OptimPiece(param, offsets, save=id(p) in saved)
                      for p, param, offsets in self._shards.boxes()}
        return CheckpointState(pieces=pieces,
            rank=self.rank, world_size=self.world_size, replica=self.replica, device=self.device,
            timeout=self.timeout, module=self.module, params=list(self.stage_slice.param_names),
            weight_groups=self.weight_groups, optimizer=self.optimizer, structure_hash=self.structure.key,
            num_segments=self.structure.num_segments, pp=self.pp, dp=self.dp,
            stage_to_rank_map=self.topology.to_string(), partition=list(self.partition.ranges),
            precision=self.precision, batch_size=self.batch_size,
            plan=self.plan.model_dump(mode="json") if self.plan is not None else None,
            iteration=self.iteration, seed=self.seed, run_id=self.run_id,
            loss_scaler=self.scaler.state_dict() if self.scaler is not None else None, job_token=self._job_token)

    def get_loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 in fp32 and bf16)."""
        return self.scaler.value if self.scaler is not None else 1.0

    def evaluate(self, inputs: Mapping[str, Any], batch_size: int | None = None) -> float:
        """The loss over every replica's ``inputs`` (any number of examples; batch dims as discovered): the mean
        over all examples, or with ``loss_reduction="sum"`` the sum of the micro-batch losses. It changes no buffer:
        BatchNorm statistics (and whatever else the forward writes) are as before. A model switched to the other
        mode (``.eval()``) must compute the same structure as the mode it was sliced in: otherwise every rank
        raises a :class:`~varuna_core.errors.CutPointError` saying what differs ([Note: discovery mode])."""
        self._modes.check("evaluate()")
        self._unpark()  # a warm worker evaluating before its go computes where its stage computes (collective)

        def rng() -> tuple[int, int]:
            self._evaluations += 1
            return self.seed, -self._evaluations

        return evaluate_loss(self.executor, inputs, self.input_batch_dims, batch_size, chunk_size=self.chunk_size,
                             loss_reduction=self.loss_reduction, rng=rng, is_last=self.stage_slice.is_last,
                             world_size=self.world_size, timeout=self.timeout, rank=self.rank,
                             wire_checked=lambda counts: self._wire_checked(counts, "evaluate()"))

    @property
    def replica_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this replica's examples in the global batch (replicas take consecutive slices;
        the first ``batch_size % dp`` replicas hold one example more)."""
        return self._replica_range

    def replica_slice(self, inputs: Mapping[str, Any]) -> dict:
        """This replica's share of a global batch of ``batch_size`` examples, sliced along each input's batch
        dim (unbatched inputs are passed whole)."""
        share = replica_share(inputs, self.input_batch_dims, self.batch_size, self.replica_range)
        self._sliced = (inputs, share)  # a lost replica's examples are taken from it after a regroup: _regroup
        return share

    def zero_grad(self, set_to_none: bool = True) -> None:  # views are kept, values zeroed
        self.grad_buffer.zero()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("call step(inputs) to train or evaluate(inputs) to evaluate; Varuna has no forward()")

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names (tied copies once)."""
        for name, param in self.stage_slice.param_names:
            yield (f"{prefix}.{name}" if prefix else name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in self.module.named_buffers(remove_duplicate=remove_duplicate):
            if buf.device.type != "meta":
                yield (f"{prefix}.{name}" if prefix else name), buf

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        return self.stage_slice.parameter_bytes()

    # ------------------------------------------------------------------------------------------------------

    def _wire_checked(self, counts: tuple[float, ...], during: str) -> None:
        """What every rank does when values overflowed the wire dtype (``counts``: the step's summed report, per stage
        boundary activations then gradients, see [Note: wire dtype]): under fp16 loss scaling the step is an
        overflow already (skipped, the scale lowered), which is logged; otherwise a
        :class:`~varuna_core.errors.WireRangeError`."""
        if not any(counts):
            return
        where = []
        for boundary in range(len(counts) // 2):
            cut = self.structure.cut_names[self.partition.ranges[boundary][1] - 1]
            for direction, count in zip(("activation", "gradient"), counts[2 * boundary: 2 * boundary + 2],
                                        strict=True):
                if count:
                    arrow = f"{boundary} → {boundary + 1}" if direction == "activation" else \
                        f"{boundary + 1} → {boundary}"
                    where.append(f"{int(count)} {direction} message(s) crossing CutPoint {cut!r} (stage {arrow})")
        what = (f"wire_dtype={self.wire_dtype!r}: in {during} {self.iteration}, " if during == "step" else
                f"wire_dtype={self.wire_dtype!r}: in {during}, ") + "; ".join(where) + \
            f" held finite values beyond {self.wire_dtype}'s range, which the wire would turn into inf"
        if self.precision == "fp16":  # as any fp16 overflow: a skipped step, or the evaluation's inf loss
            log.info("rank %d: %s (%s)", self.rank, what,
                     "an overflow: the step is skipped" if during == "step" else "its loss is not finite")
            return
        raise WireRangeError(what, hint="use wire_dtype='bf16' (fp32's range in the same bytes), or an exact wire "
                                        "(wire_dtype='exact')")

    def _chrome_trace(self) -> ChromeTrace:
        """An observer of the executor recording this step's actions: pid = replica, tid = stage."""
        return ChromeTrace(pid=self.replica, tid=self.stage, args={"rank": self.rank, "step": self.iteration})

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        return global_sum(value, world_size=self.world_size, timeout=self.timeout, rank=self.rank)
