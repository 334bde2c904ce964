"""Executes this rank's part of a schedule for one step: forwards, recomputes, backwards, and the traffic
between neighbouring stages.

The schedule object is the one :mod:`varuna_core.ir.schedule` generates and validates (the same IR the planner
scores). Actions are interpreted by one loop; there is no per-schedule code path. Receives are posted in a
window per direction ([Note: receive window] in :mod:`varuna_core.ir.inflight`): before the first action the
receives of the first ``W`` consumers (forwards for activations, backwards for gradients, in this stage's static
order), then the ``(k+W)``-th when the ``k``-th consumer starts, so at most ``W`` buffers per direction are
posted and unconsumed (:func:`~varuna_core.ir.inflight.posted_receives`, the count the planner's memory model
charges; ``max_posted`` reports the peak of the last run). ``W`` covers every message a neighbour can have sent
ahead, so no transfer waits for its receive to be posted (gloo delivers only into a posted receive). Sends are
posted as soon as a value exists; a stage keeps at most the receiver's window of them unwaited per direction
(:func:`~varuna_core.ir.inflight.unwaited_sends`), waiting for the oldest, which has arrived by then ([Note:
unwaited sends]), before posting one more, so sent values do not pile up until the step ends. Nothing creates
threads. A run is three steps: post the first receives, run the actions, finish (wait for
the sends). Whoever wants to know how long the actions took (traces, benchmarks) attaches an observer
(:mod:`varuna_core.pipeline.tracing`).

[Note: opportunistic forward] With the ``varuna`` schedule, when the next action is a recompute whose
gradient has not arrived yet and a later forward's input has, the forward runs first (as the original's
runtime did), but only while the stage holds fewer micro-batches than its static order ever does: the swap
must not raise the memory the planner predicted (the original's unbounded swap held up to half again as
many). Only forwards move, and backwards keep their order, so gradients are accumulated in the same order
whatever the timing: results do not depend on it. The simulator applies the same rule. "Has arrived" is the
receive's ``is_completed()``: gloo's point-to-point handles report completion only once waited for, so on gloo
(CPU) the forward never moves and the static order runs; NCCL's handles report it.

[Note: W actions] Under a schedule with ``W`` actions (``zb``, ``varuna-zb``), every forward that builds a
graph (``F`` without recompute, or ``R``) runs under :func:`~varuna_core.model.split.splitting`: the split modules'
nodes then compute only their input's gradient in ``B`` and leave their weights' work in the micro-batch's
:class:`~varuna_core.model.split.WeightGrads`, which ``B`` hands on (the graph itself is freed as usual) and ``W``
runs (see [Note: split backward] in :mod:`varuna_core.model.split`). The schedule's validator guarantees one ``W``
after each ``B``, so no deferred work outlives the run; the weights' gradients are complete when the actions end,
before the gradient synchronisation. Each step gets a new :class:`~varuna_core.model.split.SplitRoute`: its first
forward runs under the mode that sees every call, the later ones skip it where that changes nothing ([Note: split
route]).

[Note: wire overflow count] With a wire dtype, every value a stage sends is cast by
:func:`~varuna_core.pipeline.p2p.to_wire`, which adds the leaves that overflowed to this run's count per direction
(activations, gradients) without waiting for the device. :meth:`PipelineExecutor.wire_counts` lays them out per
stage boundary for the step's one all-reduce, where every rank learns which cut overflowed in which direction
([Note: wire dtype] in :mod:`varuna_core.model.precision`).

[Note: final gradients] A parameter's gradient is final in a step once the stage's last backward has added to
it. With a whole backward in ``B`` that is the stage's last ``B`` action. With a split one it is the last ``B`` for
the parameters that ``B`` accumulates into, and for the weights that ``W`` accumulates into (the split ops' weights
and biases, which ``B`` never touches: [Note: split backward]) the last ``W`` of a micro-batch that used them. Only
``W`` actions follow the last ``B``. A listener given to :meth:`PipelineExecutor.run` (the overlapped gradient
sync, :mod:`varuna_core.pipeline.overlap`) is told, around each of these *final* actions, which parameters some
``W`` still has to add to (``pending``: the leaves of the micro-batches' :class:`~varuna_core.model.split.
WeightGrads` not yet run, apart from the running action's own): before the action, that a parameter accumulated
from then on is final unless pending (its ``post_accumulate_grad`` hook sees it); after it, that every parameter not
pending is final (those the last backward did not reach: unused in the last micro-batch, or in the whole step).

A recompute draws the same dropout masks as its forward because both seed each segment from (seed, step,
micro-batch, segment) (see [Note: deterministic dropout] in :mod:`varuna_core.model.rng`); the original restored a
saved state and then left the live stream at the recomputed micro-batch's state. And it runs on a copy of the
buffers the forward wrote, taken before the forward, so BatchNorm statistics and other buffers a forward updates
change once per micro-batch, as in one process ([Note: buffer writes] in :mod:`varuna_core.model.buffer_writes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ..errors import InternalError, ScheduleError
from ..ir.inflight import inflight, posted_receives, unwaited_sends
from ..ir.schedule import Action, Op, Schedule, check_schedule, generate, validate
from ..ir.topology import Topology
from ..model.buffer_writes import Snapshot
from ..model.payload import ValueSpec, flatten
from ..model.precision import autocast, wire_dtype
from ..model.split import SplitRoute, WeightGrads, splitting
from ..model.stage import StageSlice
from . import p2p
from .microbatch import to_device
from .tracing import ActionObserver, ActionTiming

__all__ = ["GradsFinal", "PipelineExecutor"]

ObserverT = TypeVar("ObserverT", bound=ActionObserver)


class GradsFinal(Protocol):
    """Told when this stage's gradients become final during a training step ([Note: final gradients])."""

    def final_action(self, pending: frozenset[int]) -> None:
        """A final action starts: a parameter accumulated into during it is final unless ``id(param)`` is in
        ``pending``."""

    def final_action_done(self, pending: frozenset[int]) -> None:
        """A final action ended: every parameter whose id is not in ``pending`` is final."""


@dataclasses.dataclass
class _MicroState:
    """What one micro-batch holds between its actions on this stage."""

    incoming: list[torch.Tensor] | None = None  # tensor leaves received at the incoming cut
    outputs: list[torch.Tensor] | None = None  # tensor leaves of the outgoing value (or [loss])
    attributes: list | None = None  # under recompute: the module attributes as F found them ([Note: module state])
    buffers: Snapshot | None = None  # written buffers as the forward found them, for the recompute
    weights: WeightGrads | None = None  # under a split backward: what this micro-batch's W runs


@dataclasses.dataclass
class _Step:
    """One run of :meth:`PipelineExecutor.run`: its arguments, this stage's actions, and what it holds."""

    microbatches: list[dict]
    sizes: list[int]
    weights: list[float]
    train: bool
    rng: tuple[int, int] | None
    rng_ids: list[int] | None
    loss_scale: torch.Tensor | None
    capture: list | None
    actions: list[Action]  # in the order they run ([Note: opportunistic forward] may move forwards up)
    recompute: bool  # this stage's forwards keep no graph: a recompute (R) precedes each backward
    split: bool  # the backward is split: B computes the input gradient, W the weights' ([Note: W actions])
    cap: int  # fewer micro-batches than this held: a forward may move before a recompute
    state: dict[int, _MicroState]
    loss_sum: torch.Tensor
    windows: tuple[int, int]  # receives kept posted per direction (activations, gradients): [Note: receive window]
    order: tuple[list[int], list[int]]  # micro-batches in the order this stage consumes activations, gradients
    acts: dict[int, p2p.Pending] = dataclasses.field(default_factory=dict)  # posted, unconsumed activation receives
    grads: dict[int, p2p.Pending] = dataclasses.field(default_factory=dict)  # posted, unconsumed gradient receives
    posted: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # receives posted so far per direction
    peak: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # most posted and unconsumed per direction
    send_caps: tuple[int, int] = (0, 0)  # unwaited sends kept per direction: [Note: unwaited sends]
    sends: tuple[list, list] = dataclasses.field(default_factory=lambda: ([], []))  # per direction: works per value
    kept: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # most unwaited sent values per direction
    held: int = 0  # micro-batches forwarded and not yet backwarded
    deferred: dict[int, WeightGrads] = dataclasses.field(default_factory=dict)  # B ran, W not yet: per micro-batch
    route: SplitRoute = dataclasses.field(default_factory=SplitRoute)  # how this step's forwards are split
    busy: float = 0.0  # seconds inside actions
    overflows: torch.Tensor | None = None  # with a wire dtype: [2] leaves sent that overflowed, per direction
    grads_final: GradsFinal | None = None  # told when gradients become final: [Note: final gradients]
    last_backward: Action | None = None  # this stage's last B: the first final action
    final: bool = False  # the final actions have begun

    def rng_key(self, mb: int) -> tuple[int, int, int] | None:
        if self.rng is None:
            return None
        return self.rng[0], self.rng[1], self.rng_ids[mb] if self.rng_ids is not None else mb


class PipelineExecutor:
    """Runs micro-batches through this rank's stage according to a schedule.

    Args:
        stage: this rank's :class:`StageSlice`.
        topology: rank ↔ (stage, replica).
        rank: this process's global rank.
        schedule: schedule name (one of :data:`~varuna_core.ir.schedule.SCHEDULE_NAMES`).
        timeout: seconds any wait may take.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast around every forward and recompute).
        wire: the dtype wide float leaves cross cuts in (``torch.bfloat16``, ``torch.float16``), or ``None`` to send
            every leaf in its recorded dtype ([Note: wire dtype] in :mod:`varuna_core.model.precision`).
        observers: told about every action and run (see :mod:`varuna_core.pipeline.tracing`); more can be
            attached later with :meth:`add_observer` or :meth:`observing`.
    """

    def __init__(self, stage: StageSlice, topology: Topology, rank: int, schedule: str, timeout: float,
                 precision: str = "fp32", observers: Sequence[ActionObserver] = (),
                 wire: torch.dtype | None = None) -> None:
        self.stage = stage
        self.topology = topology
        self.rank = rank
        self.stage_index, self.replica = topology.coords(rank)
        self.num_stages = topology.pp
        self.schedule_name = schedule
        self.timeout = timeout
        self.device = stage.device
        self.precision = precision
        s, r = self.stage_index, self.replica
        self.prev_rank = topology.rank(s - 1, r) if s > 0 else None
        self.next_rank = topology.rank(s + 1, r) if s < self.num_stages - 1 else None
        self._in = stage.incoming_spec
        self._out = stage.outgoing_spec
        self._in_tensor_specs = [leaf for _, leaf in self._in.tensor_leaves] if self._in else []
        self._out_tensor_specs = [leaf for _, leaf in self._out.tensor_leaves] if self._out else []
        self._float_out_specs = [spec for spec in self._out_tensor_specs if spec.is_float]  # gradients received
        self.wire = wire
        self.wire_overflows: torch.Tensor | None = None  # the last run's [Note: wire overflow count]
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._caps: dict[int, int] = {}  # per micro-batch count: the static peak of held micro-batches
        self._windows: dict[int, tuple[int, int]] = {}  # per micro-batch count: this stage's receive windows
        self._send_caps: dict[int, tuple[int, int]] = {}  # per micro-batch count: unwaited sends per direction
        self._writes = bool(stage.buffer_writes)  # this stage holds buffers the forward writes
        self._released: tuple[list, list] | None = None  # what release_next sent (kept alive while in flight)
        self.max_posted = (0, 0)  # the last run's peak of posted, unconsumed receives (activations, gradients)
        self.max_unwaited = (0, 0)  # the last run's peak of sent values not yet waited for (activations, gradients)
        self.observers: list[ActionObserver] = list(observers)
        self.compute_time = 0.0  # seconds of the last run() spent in this rank's own work (not waiting for peers)
        self._waited = 0.0  # seconds of this run spent waiting for peers' messages
        self._computed = 0.0  # seconds of the current action spent in forward/backward
        check_schedule(schedule)  # an unknown name fails at construction, not at the first step

    @property
    def wire(self) -> torch.dtype | None:
        """The wire dtype of the cuts this stage sends and receives over (``None``: exact)."""
        return self._wire

    @wire.setter
    def wire(self, wire: torch.dtype | None) -> None:
        """Set it, and the dtype each leaf crosses in per message kind (``None`` lists where it is exact)."""
        self._wire = wire

        def dtypes(specs: list) -> list[torch.dtype] | None:
            return None if wire is None else [wire_dtype(spec.torch_dtype, wire) for spec in specs]

        self._in_wire = dtypes(self._in_tensor_specs)  # activations received
        self._out_wire = dtypes(self._out_tensor_specs)  # activations sent
        self._grad_in_wire = dtypes(self._float_out_specs)  # gradients received
        self._grad_out_wire = dtypes([spec for spec in self._in_tensor_specs if spec.is_float])  # gradients sent

    @contextlib.contextmanager
    def exact_wire(self) -> Iterator[None]:
        """Every leaf crosses in its recorded dtype for the block (the start-up validation compares the pipeline
        with the unsliced model: the slicing, not the rounding of the wire)."""
        wire = self.wire
        self.wire = None
        try:
            yield
        finally:
            self.wire = wire

    def wire_counts(self, boundaries: int) -> torch.Tensor | None:
        """This rank's share of the step's wire overflow report ([Note: wire overflow count]): float64
        ``[2 · boundaries]``, entry ``2b`` the activations that overflowed crossing boundary ``b`` (after stage
        ``b``), ``2b + 1`` the gradients; ``None`` without a wire dtype or a run."""
        if self.wire_overflows is None:
            return None
        counts = torch.zeros(2 * boundaries, dtype=torch.float64, device=self.wire_overflows.device)
        s = self.stage_index
        if self.next_rank is not None:
            counts[2 * s] = self.wire_overflows[p2p.ACTIVATION]
        if self.prev_rank is not None:
            counts[2 * (s - 1) + 1] = self.wire_overflows[p2p.GRADIENT]
        return counts

    def add_observer(self, observer: ObserverT) -> ObserverT:
        """Tell ``observer`` about every action and run from now on; returns it."""
        self.observers.append(observer)
        return observer

    def remove_observer(self, observer: ActionObserver) -> None:
        self.observers.remove(observer)

    @contextlib.contextmanager
    def observing(self, *observers: ActionObserver) -> Iterator[None]:
        """Attach ``observers`` for the block (and detach them after it, also on error)."""
        for observer in observers:
            self.add_observer(observer)
        try:
            yield
        finally:
            for observer in observers:
                self.remove_observer(observer)

    def schedule_for(self, num_microbatches: int) -> Schedule:
        key = (num_microbatches, True)
        sched = self._schedules.get(key)
        if sched is None:
            sched = generate(self.schedule_name, self.num_stages, num_microbatches)
            try:
                validate(sched)
            except ScheduleError as exc:  # a generated schedule: our defect, whatever the sizes
                raise InternalError(f"the generated {self.schedule_name} schedule of {self.num_stages} stages and "
                                    f"{num_microbatches} micro-batches is invalid: {exc.message}") from exc
            self._schedules[key] = sched
            self._caps[num_microbatches] = inflight(sched)[self.stage_index][0]
            self._windows[num_microbatches] = posted_receives(sched)[self.stage_index]
            self._send_caps[num_microbatches] = unwaited_sends(sched)[self.stage_index]
        return sched

    # ------------------------------------------------------------------------------------------------------

    def run(
        self,
        microbatches: list[dict],
        sizes: list[int],
        weights: list[float],
        *,
        train: bool,
        rng: tuple[int, int] | None = None,
        rng_ids: list[int] | None = None,
        loss_scale: torch.Tensor | None = None,
        capture: list | None = None,
        grads_final: GradsFinal | None = None,
    ) -> torch.Tensor:
        """Run one step (``train``) or one evaluation pass over ``microbatches``.

        Args:
            microbatches: model inputs per micro-batch (every stage gets the same; moved to this stage's device).
            sizes: examples per micro-batch.
            weights: per micro-batch factor applied to its loss (see [Note: loss weighting] in grads).
            rng: ``(seed, step)``: seed every segment of micro-batch ``mb`` from ``(seed, step, id, segment)``.
            rng_ids: the ``id`` of each micro-batch (default: its index); the facade passes the position of its
                first example in the global batch (see [Note: deterministic dropout]).
            loss_scale: fp16 loss scale (tensor ``[1]``) the last stage multiplies its loss by before backward.
            capture: if given, receives each forward's output (detached leaves, or the loss on the last stage).
            grads_final: told when gradients become final in a training step ([Note: final gradients]).

        Returns:
            On the last stage, ``Σ weight·loss`` (float64, shape ``[]``); zero elsewhere.
        """
        started = time.perf_counter()
        microbatches = [to_device(mb, self.device) for mb in microbatches]
        step = self._new_step(microbatches, sizes, weights, train=train, rng=rng, rng_ids=rng_ids,
                              loss_scale=loss_scale, capture=capture)
        if train:
            step.grads_final = grads_final
            step.last_backward = next((a for a in reversed(step.actions) if a.op is Op.B), None)
        self._post_receives(step)
        try:
            self._run_actions(step)
        finally:
            self.max_posted = (step.peak[0], step.peak[1])
            self.max_unwaited = (step.kept[0], step.kept[1])
            self.wire_overflows = step.overflows
        return self._finish(step, started)

    def release_next(self, n: int) -> None:
        """After a one-micro-batch run that failed on this stage (the start-up validation): send the next stage
        zeros of ``n`` examples in place of the value it waits for, so it reaches the agreement that follows (and
        hears of this stage's error there) instead of waiting for its timeout. The send is not waited for (the
        tensors are kept until the next call)."""
        if self.next_rank is None:
            return
        dtypes = self._out_wire or [spec.torch_dtype for spec in self._out_tensor_specs]
        blank = [torch.zeros(spec.shape_for(n), dtype=dtype, device=self.device)
                 for spec, dtype in zip(self._out_tensor_specs, dtypes, strict=True)]
        self._released = (blank, p2p.send(blank, dst=self.next_rank, mb=0, kind=p2p.ACTIVATION, group=None))

    # ------------------------------------------------------------------------------------------------------
    # The steps of run()

    def _new_step(self, microbatches: list[dict], sizes: list[int], weights: list[float], *, train: bool,
                  rng: tuple[int, int] | None, rng_ids: list[int] | None, loss_scale: torch.Tensor | None,
                  capture: list | None) -> _Step:
        """This stage's actions for the run, and empty state for each micro-batch."""
        num, s = len(microbatches), self.stage_index
        sched = self.schedule_for(num)
        if train:
            actions = list(sched.stage_actions(s))
            recompute = sched.uses_recompute(s)
        else:  # an evaluation posts activation receives in the training window (its memory stays below a step's)
            actions = [Action(s, Op.F, mb) for mb in range(num)]
            recompute = False
        split = train and sched.splits_backward
        order = ([a.mb for a in actions if a.op is Op.F] if self.prev_rank is not None else [],
                 [a.mb for a in actions if a.op is Op.B] if self.next_rank is not None else [])
        return _Step(
            microbatches=microbatches, sizes=sizes, weights=weights, train=train, rng=rng, rng_ids=rng_ids,
            loss_scale=loss_scale, capture=capture, actions=actions, recompute=recompute, split=split,
            cap=self._caps[num] if train and recompute else 0,
            windows=self._windows[num], send_caps=self._send_caps[num], order=order,
            state={mb: _MicroState() for mb in range(num)},
            loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
            overflows=torch.zeros(2, dtype=torch.float32, device=self.device) if self.wire is not None else None,
        )

    def _post_receives(self, step: _Step) -> None:
        """Post the receives of the first consumers of the run, a window per direction ([Note: receive window])."""
        for kind in (p2p.ACTIVATION, p2p.GRADIENT):
            for _ in range(min(step.windows[kind], len(step.order[kind]))):
                self._post_next(step, kind)

    def _post_next(self, step: _Step, kind: int) -> None:
        """Post the receive of the next consumer (in this stage's order) of ``kind`` that has none yet."""
        k = step.posted[kind]
        if k >= len(step.order[kind]):
            return
        mb = step.order[kind][k]
        n = step.sizes[mb]
        if kind == p2p.ACTIVATION:
            assert self.prev_rank is not None  # activations come to every stage but the first
            step.acts[mb] = p2p.post_recv(self._in_tensor_specs, n, src=self.prev_rank, mb=mb, kind=kind,
                                          device=self.device, group=None, what="activation", wire=self._in_wire)
            pending = len(step.acts)
        else:
            assert self.next_rank is not None  # gradients come to every stage but the last
            step.grads[mb] = p2p.post_recv(self._float_out_specs, n, src=self.next_rank, mb=mb, kind=kind,
                                           device=self.device, group=None, what="gradient", wire=self._grad_in_wire)
            pending = len(step.grads)
        step.posted[kind] = k + 1
        step.peak[kind] = max(step.peak[kind], pending)

    def _take(self, step: _Step, kind: int, mb: int) -> p2p.Pending:
        """The posted receive of ``mb`` for its consumer, which starts now; the window moves on by one."""
        pending = (step.acts if kind == p2p.ACTIVATION else step.grads).pop(mb)
        self._post_next(step, kind)
        return pending

    def _run_actions(self, step: _Step) -> None:
        """Run the actions in order (but for [Note: opportunistic forward]); sets ``compute_time``."""
        self._waited = 0.0
        for i in range(len(step.actions)):
            self._maybe_forward_first(step, i)
            self._run_action(step, step.actions[i])
        self.compute_time = step.busy - self._waited

    def _maybe_forward_first(self, step: _Step, i: int) -> None:
        """[Note: opportunistic forward]: move the next forward before the recompute at ``i`` if it can run."""
        actions = step.actions
        action = actions[i]
        grad = step.grads.get(action.mb)  # not posted yet: it cannot have arrived
        if (action.op is Op.R and self.next_rank is not None and step.held < step.cap
                and (grad is None or not grad.ready())):
            j = next((k for k in range(i + 1, len(actions)) if actions[k].op is Op.F), None)
            if j is not None and (self.prev_rank is None or step.acts[actions[j].mb].ready()):
                actions.insert(i, actions.pop(j))

    def _run_action(self, step: _Step, action: Action) -> None:
        """One action, timed, and told to the observers."""
        started, waited_before = time.perf_counter(), self._waited
        self._computed = 0.0
        listener = step.grads_final
        final = listener is not None and (step.final or action == step.last_backward)
        if final:
            assert listener is not None
            step.final = True
            listener.final_action(self._pending_leaves(step, action))
        if action.op is Op.F:
            self._do_forward(step, action)
        elif action.op is Op.R:
            self._do_recompute(step, action)
        elif action.op is Op.W:
            self._do_weights(step, action)
        else:
            self._do_backward(step, action)
        step.held += 1 if action.op is Op.F else -1 if action.op is Op.B else 0
        if final:
            assert listener is not None
            listener.final_action_done(self._pending_leaves(step, None))
        ended = time.perf_counter()
        step.busy += ended - started
        if self.observers:
            timing = ActionTiming(action, started, ended, self._waited - waited_before, self._computed)
            for observer in self.observers:
                observer.on_action(timing)

    @staticmethod
    def _pending_leaves(step: _Step, running: Action | None) -> frozenset[int]:
        """Ids of the parameters a ``W`` not yet run will add to, but for ``running``'s own ([Note: final
        gradients])."""
        skip = running.mb if running is not None and running.op is Op.W else None
        stores = [w for mb, w in step.deferred.items() if mb != skip]
        return frozenset().union(*(w.leaf_ids() for w in stores)) if stores else frozenset()

    def _send(self, step: _Step, tensors: list[torch.Tensor], kind: int, mb: int) -> None:
        """Post the sends of one value, after waiting for the oldest of ``kind`` if the cap is reached ([Note:
        unwaited sends])."""
        queue = step.sends[kind]
        if queue and len(queue) >= step.send_caps[kind]:
            started = time.perf_counter()
            while queue and len(queue) >= step.send_caps[kind]:
                self._wait_sends(queue.pop(0))
            self._waited += time.perf_counter() - started
        dst = self.next_rank if kind == p2p.ACTIVATION else self.prev_rank
        assert dst is not None  # activations go forward from every stage but the last, gradients back
        queue.append(p2p.send(tensors, dst=dst, mb=mb, kind=kind, group=None))
        step.kept[kind] = max(step.kept[kind], len(queue))

    @staticmethod
    def _overflows(step: _Step, kind: int) -> torch.Tensor | None:
        """The run's count of overflowed leaves of ``kind`` (a view to add to), with a wire dtype."""
        return step.overflows[kind] if step.overflows is not None else None

    def _wait_sends(self, works: list) -> None:
        p2p.wait_all(works, timeout=self.timeout, peer=None,
                     describe=lambda: f"{self._who()} waiting for its sends to complete")

    def _finish(self, step: _Step, started: float) -> torch.Tensor:
        """Wait for this stage's remaining sends to complete; tell the observers the run ended."""
        for queue in step.sends:
            for works in queue:
                self._wait_sends(works)
            queue.clear()
        if self.observers:
            ended = time.perf_counter()
            for observer in self.observers:
                observer.on_run(started, ended)
        return step.loss_sum

    # ------------------------------------------------------------------------------------------------------
    # The actions

    def _do_forward(self, step: _Step, action: Action) -> None:
        mb = action.mb
        st = step.state[mb]
        if self.prev_rank is not None:
            st.incoming = self._receive(self._take(step, p2p.ACTIVATION, mb), action)
        keep_graph = step.train and not step.recompute
        if step.train and step.recompute:
            st.attributes = self.stage.attributes.take()
        if step.train and step.recompute and self._writes:  # R must see the buffers F saw: [Note: buffer writes]
            st.buffers = self.stage.buffer_writes.take()
        out = self._timed_forward(step, mb, st.incoming, grad=keep_graph)
        if self.next_rank is None:
            step.loss_sum += out.detach().reshape(()).to(torch.float64) * step.weights[mb]
            if keep_graph:
                st.outputs = [self._scaled(out, step.weights[mb], step.loss_scale)]
            if step.capture is not None:
                step.capture.append([out.detach()])
        else:
            leaves = self._check_out(out, step.sizes[mb])
            if step.capture is not None:
                step.capture.append([t.detach() for t in leaves])
            wired = p2p.wire_leaves(leaves, self._outgoing(), self._out_wire, self._overflows(step, p2p.ACTIVATION))
            self._send(step, wired, p2p.ACTIVATION, mb)
            st.outputs = leaves if keep_graph else None
        if not keep_graph and not step.recompute:
            st.incoming = None

    def _do_recompute(self, step: _Step, action: Action) -> None:
        mb = action.mb
        st = step.state[mb]
        with contextlib.ExitStack() as replay:  # R sees the attributes and buffers F saw; F's writes stay live
            replay.enter_context(self.stage.attributes.installed(st.attributes))
            if st.buffers is not None:  # F updated the live buffers once already
                replay.enter_context(self.stage.buffer_writes.installed(st.buffers))
            out = self._timed_forward(step, mb, st.incoming, grad=True)
        st.buffers = None
        if self.next_rank is None:
            st.outputs = [self._scaled(out, step.weights[mb], step.loss_scale)]
        else:
            st.outputs = self._leaves(out)

    def _do_backward(self, step: _Step, action: Action) -> None:
        mb = action.mb
        started, waited_before = time.perf_counter(), self._waited
        pending = self._take(step, p2p.GRADIENT, mb) if self.next_rank is not None else None
        st = step.state[mb]
        self._backward(step, st, pending, action)
        self._computed += time.perf_counter() - started - (self._waited - waited_before)
        if st.weights is not None:  # what W needs outlives the graph: [Note: W actions]
            step.deferred[mb] = st.weights
        step.state[mb] = _MicroState()

    def _do_weights(self, step: _Step, action: Action) -> None:
        """W: the weights' gradients of micro-batch ``mb``, deferred by its B ([Note: W actions])."""
        weights = step.deferred.pop(action.mb, None)
        if weights is None:
            raise InternalError(f"{self._who()} reached {action}, whose B has not run (or ran without the split)")
        started = time.perf_counter()
        weights.run()
        self._computed += time.perf_counter() - started

    def _timed_forward(self, step: _Step, mb: int, incoming: list[torch.Tensor] | None, *, grad: bool) -> Any:
        started = time.perf_counter()
        with contextlib.ExitStack() as split:
            if grad and step.split:  # the graph this builds defers its weights' gradients to W
                st = step.state[mb]
                st.weights = WeightGrads()
                split.enter_context(splitting(st.weights, step.route))
            out = self._forward(step.microbatches[mb], incoming, step.sizes[mb], grad=grad, rng=step.rng_key(mb))
        self._computed += time.perf_counter() - started
        return out

    # ------------------------------------------------------------------------------------------------------

    def _who(self) -> str:
        return f"rank {self.rank} (stage {self.stage_index}, replica {self.replica})"

    def _receive(self, pending: p2p.Pending, action: Action) -> list[torch.Tensor]:
        started = time.perf_counter()
        p2p.wait_all(pending.works, timeout=self.timeout, peer=pending.peer,
                     describe=lambda: f"{self._who()} in {action} waiting for the activation of micro-batch "
                     f"{action.mb} from rank {pending.peer} (stage {self.stage_index - 1})")
        self._waited += time.perf_counter() - started
        return pending.arrived()

    @staticmethod
    def _scaled(loss: torch.Tensor, weight: float, scale: torch.Tensor | None) -> torch.Tensor:
        """The root of the last stage's backward: ``loss · weight (· loss scale)`` in fp32."""
        with torch.enable_grad():
            root = loss.float() * weight
            return root * scale if scale is not None else root

    def _forward(self, inputs: dict, incoming: list[torch.Tensor] | None, n: int, *, grad: bool,
                 rng: tuple[int, int, int] | None) -> Any:
        value = None
        if incoming is not None:
            for t in incoming:
                if t.is_floating_point():
                    t.requires_grad_(grad)
            assert self._in is not None  # a stage that receives has an incoming value
            value = self._in.assemble(incoming)
        with torch.set_grad_enabled(grad), autocast(self.precision, self.device):
            return self.stage.forward(inputs, value, n, rng=rng)

    def _leaves(self, out: Any) -> list[torch.Tensor]:
        leaves, _ = flatten(out)
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def _check_out(self, out: Any, n: int) -> list[torch.Tensor]:
        leaves, treespec = flatten(out)
        cut = self.stage.outgoing_cut
        assert cut is not None  # every stage but the last has one
        p2p.check_value(leaves, treespec, self._outgoing(), n, cut=cut, stage=self.stage_index)
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def _outgoing(self) -> ValueSpec:
        """What this stage sends (every stage but the last sends a value)."""
        assert self._out is not None
        return self._out

    def _backward(self, step: _Step, st: _MicroState, pending: p2p.Pending | None, action: Action) -> None:
        if st.outputs is None:
            raise InternalError(f"{self._who()} reached {action}, which has no forward graph (no F or R of micro-batch "
                                f"{action.mb} ran before it on this stage)")
        if pending is None:  # last stage: outputs = [weighted loss]
            roots, grads = [o for o in st.outputs if o.requires_grad], None
        else:
            started = time.perf_counter()
            p2p.wait_all(pending.works, timeout=self.timeout, peer=pending.peer,
                         describe=lambda: f"{self._who()} in {action} waiting for the gradient of micro-batch "
                         f"{action.mb} from rank {pending.peer} (stage {self.stage_index + 1})")
            self._waited += time.perf_counter() - started
            floats = [o for o in st.outputs if o.is_floating_point()]
            pairs = [(o, g if g.dtype == o.dtype else g.to(o.dtype))
                     for o, g in zip(floats, pending.arrived(), strict=True)
                     if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if roots:
            torch.autograd.backward(roots, grads)
        if self.prev_rank is not None:
            assert st.incoming is not None  # received from the previous stage
            back = [
                (t.grad if t.grad is not None else torch.zeros_like(t))
                for t in st.incoming if t.is_floating_point()
            ]
            if self._grad_out_wire is not None:
                back = p2p.to_wire(back, self._grad_out_wire, self._overflows(step, p2p.GRADIENT))
            self._send(step, back, p2p.GRADIENT, action.mb)
