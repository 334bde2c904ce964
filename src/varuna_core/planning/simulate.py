"""Event simulation of one training step of a schedule: the cost model of ``varuna plan``.

The simulator executes the *same* action lists the runtime executes (:mod:`varuna_core.ir.schedule`):

* every stage is a sequential processor that runs its actions in order; an ``F`` waits for its activation
  (except on stage 0), a ``B`` for its gradient (except on the last stage), an ``R`` for nothing but its ``F``;
* with ``opportunistic=True`` (the runtime's rule, see [Note: opportunistic forward]; it only concerns ``R``
  actions), when a stage is free, its next action is an ``R`` whose gradient has not arrived yet, a later
  ``F``'s input has arrived, and the stage holds fewer micro-batches than its static order ever does, that
  ``F`` runs first;
* finishing an ``F`` sends the activation to the next stage, finishing a ``B`` sends the gradient to the
  previous one; each stage has ``max_concurrent_sends`` channels per direction, used first-come first-served,
  and a message takes the stage's send time (communication overlaps compute, as the runtime's async p2p does);
* a stage's data-parallel all-reduce (``allreduce``) starts when its last backward action starts (its last ``B``,
  or its last ``W`` under a split backward) and runs on the replicas' link beside what is left of that action, as
  the runtime posts its buckets while the last backward still runs (:mod:`varuna_core.pipeline.overlap`); its
  ``optimizer`` time follows both (a sharded optimizer's collectives, which run after the pipeline, are charged
  there); the step ends when every stage has finished that. The model is optimistic by at most a bucket: the
  runtime posts a bucket once all its gradients are final, so with one bucket per stage the all-reduce starts at
  the end of the last backward.

[Note: idle penalty] With an :class:`IdleCost` (the profile's ``idle_penalty``), an action that starts after its
stage idled for ``gap`` (waiting for a message) takes ``fraction(gap) · min(duration, action_s)`` longer: on some
machines work right after a wait runs slower (a 2-core VM: up to ~1 ms for a 3 ms forward after 5-20 ms idle,
``benchmarks/idle_penalty.py``), which a profile timed in a tight loop does not see. ``fraction`` is linear from 0
at no gap through the measured points and constant after the last; a stage's first action idled since the step
began (a later stage's first forward waits for its input). Without one (older profiles, a device that shows
none) nothing is added.

Events are processed in time order (ties: lower stage first), which makes the opportunistic rule decidable: by
the time a stage is free at ``t``, everything that started before ``t`` has been simulated. Every entry point
(:func:`simulate`, :func:`simulate_generated` and the reference :func:`simulate_python`) applies the rule unless
told not to (:data:`OPPORTUNISTIC`): by default a simulation is of what the runtime does. The C++ functions take
it as an argument without a default.

This module is the reference; ``varuna_core._native`` implements the same algorithm in C++ for the planner's
search and is tested against it. :func:`native_module` is the one place that chooses between the two (the C++ one
when built, unless ``VARUNA_NO_NATIVE=1``); :func:`simulate`, :func:`simulate_generated` and
:func:`inflight_counts` follow it. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any, Protocol

from ..env import NO_NATIVE, flag
from ..errors import VarunaError
from ..ir.inflight import has_closed_form, inflight, inflight_named
from ..ir.schedule import Action, Op, Schedule, generate

__all__ = ["StageCosts", "IdleCost", "idle_cost", "SimResult", "native_module", "require_native", "simulate",
           "simulate_generated", "inflight_counts", "simulate_python", "sync_costs", "OPPORTUNISTIC"]

OPPORTUNISTIC = True  # the simulators' default: apply the runtime's [Note: opportunistic forward], as it does


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Durations (seconds) for one stage. ``*_last`` apply to the last micro-batch, which may be smaller.

    ``forward`` is the time of this stage's ``F`` as the schedule runs it: without autograd when the stage
    recomputes (``varuna``), with it otherwise. ``backward`` is the time of its ``B``: the whole backward, or
    under a schedule that splits it (``zb``, ``varuna-zb``) the input gradient only, with ``weight`` the time of
    its ``W`` (the weights' gradients). ``allreduce`` is the data-parallel gradient all-reduce, which starts with
    the stage's last backward action (overlapping it); ``optimizer`` what follows both the compute and the
    all-reduce (the optimizer's step; with a sharded optimizer also its reduce-scatter and all-gather).
    """

    forward: float
    recompute: float
    backward: float
    send_activation: float = 0.0
    send_gradient: float = 0.0
    allreduce: float = 0.0
    forward_last: float | None = None
    recompute_last: float | None = None
    backward_last: float | None = None
    send_activation_last: float | None = None
    send_gradient_last: float | None = None
    weight: float = 0.0
    weight_last: float | None = None
    optimizer: float = 0.0

    def duration(self, op: Op, last: bool) -> float:
        if op is Op.F:
            return self.forward_last if last and self.forward_last is not None else self.forward
        if op is Op.R:
            return self.recompute_last if last and self.recompute_last is not None else self.recompute
        if op is Op.W:
            return self.weight_last if last and self.weight_last is not None else self.weight
        return self.backward_last if last and self.backward_last is not None else self.backward

    def send(self, gradient: bool, last: bool) -> float:
        if gradient:
            return self.send_gradient_last if last and self.send_gradient_last is not None else self.send_gradient
        return self.send_activation_last if last and self.send_activation_last is not None else self.send_activation

    def as_tuple(self) -> tuple[float, ...]:
        """The 14 numbers in the order the native simulator takes them (``None`` → the full-size value)."""
        def pick(x: float | None, full: float) -> float:
            return full if x is None else x

        return (self.forward, self.recompute, self.backward, self.send_activation, self.send_gradient,
                self.allreduce, pick(self.forward_last, self.forward), pick(self.recompute_last, self.recompute),
                pick(self.backward_last, self.backward), pick(self.send_activation_last, self.send_activation),
                pick(self.send_gradient_last, self.send_gradient), self.weight, pick(self.weight_last, self.weight),
                self.optimizer)


@dataclasses.dataclass(frozen=True)
class IdleCost:
    """What an action pays for starting right after its stage idled ([Note: idle penalty]): ``fractions[i]`` of
    ``min(duration, action_s)`` after a gap of ``gaps[i]`` seconds (``gaps`` strictly increasing, positive)."""

    gaps: tuple[float, ...]
    fractions: tuple[float, ...]
    action_s: float

    def __post_init__(self) -> None:
        if len(self.gaps) != len(self.fractions) or not self.gaps:
            raise ValueError(f"{len(self.gaps)} gaps and {len(self.fractions)} fractions (one per gap, at least one)")
        if any(g <= 0 for g in self.gaps) or any(b <= a for a, b in zip(self.gaps, self.gaps[1:], strict=False)):
            raise ValueError(f"gaps must be positive and strictly increasing, got {self.gaps}")
        if any(f < 0 for f in self.fractions) or self.action_s <= 0:
            raise ValueError("fractions must not be negative and action_s must be positive")

    def fraction(self, gap: float) -> float:
        """``fraction(gap)``: 0 at no gap, linear between the measured points, the last one after them."""
        if gap <= 0:
            return 0.0
        previous_gap, previous = 0.0, 0.0
        for g, f in zip(self.gaps, self.fractions, strict=True):
            if gap <= g:
                return previous + (f - previous) * (gap - previous_gap) / (g - previous_gap)
            previous_gap, previous = g, f
        return previous

    def penalty(self, gap: float, duration: float) -> float:
        return self.fraction(gap) * min(duration, self.action_s)

    def as_args(self) -> tuple[list[float], list[float], float]:
        """What the native simulator takes."""
        return list(self.gaps), list(self.fractions), self.action_s


_NO_IDLE: tuple[list[float], list[float], float] = ([], [], 1.0)  # the native simulator's "no penalty"


def idle_cost(measured: Any) -> IdleCost | None:
    """The :class:`IdleCost` of a profile's or plan's ``idle_penalty`` (anything with ``gaps_s``, ``fractions``
    and ``action_s``), or ``None`` where there is none."""
    if measured is None:
        return None
    return IdleCost(tuple(measured.gaps_s), tuple(measured.fractions), measured.action_s)


def sync_costs(collectives: float, optimizer: float, *, sharded: bool, ties: float = 0.0) -> dict[str, float]:
    """:class:`StageCosts`' ``allreduce`` and ``optimizer`` for a stage whose gradient collectives take
    ``collectives`` seconds, its tied weights' sums ``ties`` and its optimizer step ``optimizer``: the runtime
    overlaps an all-reduce with the last backward, but runs a sharded optimizer's reduce-scatter and all-gather
    after the pipeline; a tie's sum waits for the gradient that the stage's backward finishes last (an
    embedding's), so it is charged after the pipeline too."""
    if sharded:
        return {"allreduce": 0.0, "optimizer": collectives + ties + optimizer}
    return {"allreduce": collectives, "optimizer": ties + optimizer}


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated step.

    Attributes:
        step_time: end of the last stage's gradient sync and optimizer step.
        pipeline_time: end of the last action on any stage (before gradient syncs).
        busy: per stage, total compute time.
        bubble_fraction: ``1 - Σ busy / (stages · pipeline_time)``; for balanced 1F1B/GPipe with free
            communication it is ``(p - 1) / (m + p - 1)``.
        timeline: ``(stage, op, mb, start, end)`` for every action, when requested.
    """

    step_time: float
    pipeline_time: float
    busy: tuple[float, ...]
    bubble_fraction: float
    timeline: tuple[tuple[int, str, int, float, float], ...] | None = None

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.step_time - b for b in self.busy)


# ----------------------------------------------------------------------------------------------------------
# The native/Python switch


ActionRows = Sequence[Sequence[tuple[int, int]]]  # per stage, (op code, mb) pairs
TimelineRows = list[tuple[int, int, int, float, float]]  # (stage, op code, mb, start, end)


class NativeSimulator(Protocol):
    """The functions of ``varuna_core._native`` (typed in ``_native.pyi``), which the module itself satisfies."""

    def generate(self, name: str, p: int, m: int) -> list[list[tuple[int, int]]]: ...

    def simulate_actions(self, actions: ActionRows, m: int, costs: Sequence[Sequence[float]], max_sends: int,
                         opportunistic: bool, timeline: bool, idle_gaps: Sequence[float],
                         idle_fractions: Sequence[float], idle_action: float
                         ) -> tuple[float, float, list[float], TimelineRows | None]:
        ...

    def simulate_generated(self, name: str, p: int, m: int, costs: Sequence[Sequence[float]], max_sends: int,
                           opportunistic: bool, idle_gaps: Sequence[float], idle_fractions: Sequence[float],
                           idle_action: float) -> tuple[float, float, list[float]]: ...

    def inflight(self, name: str, p: int, m: int) -> list[tuple[int, int]]: ...


_native_cache: list[NativeSimulator | None] = []


def native_module() -> NativeSimulator | None:
    """The C++ simulator ``varuna_core._native``, or ``None`` when it is not built or ``VARUNA_NO_NATIVE=1`` asks
    for the pure-Python reference (e.g. to compare the two). Every native-or-Python choice follows this."""
    if flag(NO_NATIVE):
        return None
    if not _native_cache:
        found: NativeSimulator | None
        try:
            from .. import _native

            found = _native
        except ImportError:
            found = None
        _native_cache.append(found)
    return _native_cache[0]


def require_native() -> NativeSimulator:
    native = native_module()
    if native is None:
        raise VarunaError("the native extension varuna_core._native is not available",
                          hint="reinstall the package (pip install -e .) so the C++ extension is built")
    return native


def _backend(backend: str) -> NativeSimulator | None:
    """The native module to use for ``backend`` (``None``: the Python reference)."""
    if backend == "python":
        return None
    if backend == "native":
        return require_native()
    if backend == "auto":
        return native_module()
    raise ValueError(f"backend must be 'auto', 'native' or 'python', got {backend!r}")


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCosts],
    *,
    max_concurrent_sends: int = 4,
    opportunistic: bool = OPPORTUNISTIC,
    timeline: bool = False,
    backend: str = "auto",
    idle: IdleCost | None = None,
) -> SimResult:
    """Simulate ``schedule`` with per-stage ``costs`` (see the module docstring for the rules).

    Args:
        backend: ``"native"`` (C++), ``"python"`` (this module), or ``"auto"`` (:func:`native_module`).
        idle: what an action pays after its stage idled ([Note: idle penalty]); ``None``: nothing.
    """
    if len(costs) != schedule.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {schedule.num_stages} stages")
    native = _backend(backend)
    if native is None:
        return simulate_python(schedule, costs, max_concurrent_sends=max_concurrent_sends,
                               opportunistic=opportunistic, timeline=timeline, idle=idle)
    actions = [[(_OP_CODE[a.op], a.mb) for a in stage] for stage in schedule.actions]
    step, pipe, busy, line = native.simulate_actions(
        actions, schedule.num_microbatches, [c.as_tuple() for c in costs], max_concurrent_sends,
        opportunistic, timeline, *(idle.as_args() if idle is not None else _NO_IDLE))
    return _result(step, pipe, busy, line)


def simulate_generated(name: str, num_stages: int, num_mb: int, costs: Sequence[StageCosts], *,
                       max_concurrent_sends: int = 4, opportunistic: bool = OPPORTUNISTIC,
                       idle: IdleCost | None = None) -> SimResult:
    """:func:`simulate` of ``generate(name, num_stages, num_mb)`` (no timeline): the planner's inner call, which
    the native module answers without building the schedule in Python."""
    native = native_module()
    if native is None:
        return simulate(generate(name, num_stages, num_mb), costs, max_concurrent_sends=max_concurrent_sends,
                        opportunistic=opportunistic, backend="python", idle=idle)
    step, pipe, busy = native.simulate_generated(name, num_stages, num_mb, [c.as_tuple() for c in costs],
                                                 max_concurrent_sends, opportunistic,
                                                 *(idle.as_args() if idle is not None else _NO_IDLE))
    return _result(step, pipe, busy, None)


def inflight_counts(name: str, num_stages: int, num_mb: int) -> list[tuple[int, int]]:
    """Per stage ``(held, graphs)`` of the named schedule (:func:`varuna_core.ir.inflight.inflight`), the
    memory model's counts."""
    native = native_module()
    if native is None or has_closed_form(name):
        return inflight_named(name, num_stages, num_mb)
    return [(held, graphs) for held, graphs in native.inflight(name, num_stages, num_mb)]


_OP_CODE = {Op.F: 0, Op.R: 1, Op.B: 2, Op.W: 3}
_OP_NAME = ("F", "R", "B", "W")


def _result(step: float, pipe: float, busy: Sequence[float],
            line: Sequence[tuple[int, int | str, int, float, float]] | None) -> SimResult:
    """The result of either simulator: the native one codes ops as numbers, the Python one names them."""
    p = len(busy)
    bubble = 1.0 - sum(busy) / (p * pipe) if pipe > 0 else 0.0
    timeline = None
    if line is not None:
        timeline = tuple((s, _OP_NAME[o] if isinstance(o, int) else o, m, a, b) for s, o, m, a, b in line)
    return SimResult(step, pipe, tuple(busy), bubble, timeline)


# ----------------------------------------------------------------------------------------------------------
# The reference


def simulate_python(schedule: Schedule, costs: Sequence[StageCosts], *, max_concurrent_sends: int = 4,
                    opportunistic: bool = OPPORTUNISTIC, timeline: bool = False,
                    idle: IdleCost | None = None) -> SimResult:
    """The reference implementation (see :func:`simulate`)."""
    return _EventSim(schedule, costs, max_concurrent_sends, opportunistic, timeline, idle).run()


class _EventSim:
    """One simulated step: every stage's position in its (mutable) action list, its clocks, the messages in
    flight, and the heap of stages ready to run their next action at a known time."""

    def __init__(self, schedule: Schedule, costs: Sequence[StageCosts], max_concurrent_sends: int,
                 opportunistic: bool, timeline: bool, idle: IdleCost | None = None) -> None:
        p = self.p = schedule.num_stages
        self.m = schedule.num_microbatches
        self.costs, self.opportunistic, self.timeline, self.idle = costs, opportunistic, timeline, idle
        self.pending = [list(stage) for stage in schedule.actions]
        self.pos = [0] * p
        self.free = [0.0] * p
        self.busy = [0.0] * p
        self.end = [0.0] * p
        self.sync_start = [0.0] * p  # start of each stage's last B or W: its all-reduce starts with it
        self.act_arrival: list[dict[int, float]] = [dict() for _ in range(p)]   # at stage s, activation of mb
        self.grad_arrival: list[dict[int, float]] = [dict() for _ in range(p)]  # at stage s, gradient of mb
        self.channels = [[[0.0] * max(1, max_concurrent_sends) for _ in range(2)] for _ in range(p)]
        self.line: list[tuple[int, str, int, float, float]] = []
        self.heap: list[tuple[float, int]] = []
        self.waiting: set[int] = set()  # stages whose next action waits on a message not yet sent
        self.held = [0] * p  # micro-batches between their F and B
        self.cap = [h for h, _ in inflight(schedule)]  # the swap never makes a stage hold more than its static order

    def run(self) -> SimResult:
        """Process events in time order (ties: lower stage first) until every stage is done or stuck."""
        for s in range(self.p):
            self._push(s)
        while self.heap:
            t, s = heapq.heappop(self.heap)
            if self._done(s) or self._ready_time(s) != t:  # finished, or a stale entry
                continue
            self._execute(s, self._next_action(s, t), t)
        self._check_finished()
        end = self.end
        pipe = max(end)
        step = max(max(end[s], self.sync_start[s] + self.costs[s].allreduce) + self.costs[s].optimizer
                   for s in range(self.p))
        return _result(step, pipe, self.busy, self.line if self.timeline else None)

    def _done(self, s: int) -> bool:
        return self.pos[s] >= len(self.pending[s])

    def _ready_time(self, s: int) -> float | None:
        """When stage ``s`` can start its next action (``None``: it waits on something not yet known)."""
        a = self.pending[s][self.pos[s]]
        if a.op is Op.F and s > 0:
            t = self.act_arrival[s].get(a.mb)
            return None if t is None else max(self.free[s], t)
        if a.op is Op.B and s < self.p - 1:
            t = self.grad_arrival[s].get(a.mb)
            return None if t is None else max(self.free[s], t)
        return self.free[s]

    def _push(self, s: int) -> None:
        if self._done(s):
            return
        t = self._ready_time(s)
        if t is None:
            self.waiting.add(s)
        else:
            heapq.heappush(self.heap, (t, s))

    def _next_action(self, s: int, t: float) -> Action:
        """The action stage ``s`` runs at ``t``: its next one, or the opportunistic swap's forward."""
        pending, pos = self.pending[s], self.pos[s]
        a = pending[pos]
        if not (self.opportunistic and a.op is Op.R and s < self.p - 1 and self.held[s] < self.cap[s]):
            return a
        g = self.grad_arrival[s].get(a.mb)
        if g is not None and g <= t:
            return a
        for j in range(pos + 1, len(pending)):
            b = pending[j]
            if b.op is Op.F:
                if s == 0 or self.act_arrival[s].get(b.mb, float("inf")) <= t:  # its input has arrived
                    pending.insert(pos, pending.pop(j))
                    return b
                return a
        return a

    def _execute(self, s: int, a: Action, t: float) -> None:
        """Run ``a`` on stage ``s`` from ``t``, send its result, and schedule the stage's next action."""
        duration = self.costs[s].duration(a.op, a.mb == self.m - 1)
        if self.idle is not None:  # the stage idled since its last action ended (or since the step began)
            duration += self.idle.penalty(t - self.free[s], duration)
        finish = t + duration
        self.busy[s] += duration
        self.free[s] = finish
        self.end[s] = finish
        self.pos[s] += 1
        self.held[s] += 1 if a.op is Op.F else -1 if a.op is Op.B else 0
        if a.op is Op.B or a.op is Op.W:
            self.sync_start[s] = t
        if self.timeline:
            self.line.append((s, a.op.value, a.mb, t, finish))
        if a.op is Op.F and s < self.p - 1:
            self._send(s, s + 1, a.mb, False, finish)
        elif a.op is Op.B and s > 0:
            self._send(s, s - 1, a.mb, True, finish)
        self._push(s)

    def _send(self, s: int, dst: int, mb: int, gradient: bool, at: float) -> None:
        """Send on the first free channel of ``s`` (first-come first-served); wake ``dst`` if it waited on it."""
        chans = self.channels[s][1 if gradient else 0]
        i = min(range(len(chans)), key=lambda k: (chans[k], k))
        start = max(at, chans[i])
        done = start + self.costs[s].send(gradient, mb == self.m - 1)
        chans[i] = done
        (self.grad_arrival if gradient else self.act_arrival)[dst][mb] = done
        if dst in self.waiting:
            self.waiting.discard(dst)
            self._push(dst)

    def _check_finished(self) -> None:
        stuck = [str(self.pending[s][self.pos[s]]) for s in range(self.p) if not self._done(s)]
        if stuck:
            raise ValueError(f"schedule deadlocks in simulation; stuck at {', '.join(stuck)}")
