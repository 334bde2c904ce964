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
* after its last action a stage synchronises its gradients (``allreduce``); the step ends when every stage
  has finished that.

Events are processed in time order (ties: lower stage first), which makes the opportunistic rule decidable: by
the time a stage is free at ``t``, everything that started before ``t`` has been simulated.

This module is the reference; ``varuna_core._native`` implements the same algorithm in C++ for the planner's
search and is tested against it. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

from ..ir.inflight import inflight
from ..ir.schedule import Op, Schedule

__all__ = ["StageCosts", "SimResult", "simulate", "simulate_python"]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Durations (seconds) for one stage. ``*_last`` apply to the last micro-batch, which may be smaller.

    ``forward`` is the time of this stage's ``F`` as the schedule runs it: without autograd when the stage
    recomputes (``varuna``), with it otherwise.
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

    def duration(self, op: Op, last: bool) -> float:
        if op is Op.F:
            return self.forward_last if last and self.forward_last is not None else self.forward
        if op is Op.R:
            return self.recompute_last if last and self.recompute_last is not None else self.recompute
        return self.backward_last if last and self.backward_last is not None else self.backward

    def send(self, gradient: bool, last: bool) -> float:
        if gradient:
            return self.send_gradient_last if last and self.send_gradient_last is not None else self.send_gradient
        return self.send_activation_last if last and self.send_activation_last is not None else self.send_activation

    def as_tuple(self) -> tuple[float, ...]:
        """The 11 numbers in the order the native simulator takes them (``None`` → the full-size value)."""
        pick = lambda x, full: full if x is None else x  # noqa: E731
        return (self.forward, self.recompute, self.backward, self.send_activation, self.send_gradient,
                self.allreduce, pick(self.forward_last, self.forward), pick(self.recompute_last, self.recompute),
                pick(self.backward_last, self.backward), pick(self.send_activation_last, self.send_activation),
                pick(self.send_gradient_last, self.send_gradient))


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated step.

    Attributes:
        step_time: end of the last stage's gradient sync.
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


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCosts],
    *,
    max_concurrent_sends: int = 4,
    opportunistic: bool = True,
    timeline: bool = False,
    backend: str = "auto",
) -> SimResult:
    """Simulate ``schedule`` with per-stage ``costs`` (see the module docstring for the rules).

    Args:
        backend: ``"native"`` (C++), ``"python"`` (this module), or ``"auto"`` (native when built, unless
            ``VARUNA_NO_NATIVE=1``).
    """
    if len(costs) != schedule.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {schedule.num_stages} stages")
    if backend != "python":
        from . import native as _native_shim

        native = _native_shim.module() if backend == "auto" else _native_shim.require()
        if native is not None:
            actions = [[(_OP_CODE[a.op], a.mb) for a in stage] for stage in schedule.actions]
            step, pipe, busy, line = native.simulate_actions(
                actions, schedule.num_microbatches, [c.as_tuple() for c in costs], max_concurrent_sends,
                opportunistic, timeline)
            return _result(step, pipe, busy, line)
    return simulate_python(schedule, costs, max_concurrent_sends=max_concurrent_sends,
                           opportunistic=opportunistic, timeline=timeline)


_OP_CODE = {Op.F: 0, Op.R: 1, Op.B: 2}
_OP_NAME = ("F", "R", "B")


def _result(step: float, pipe: float, busy: Sequence[float], line) -> SimResult:
    p = len(busy)
    bubble = 1.0 - sum(busy) / (p * pipe) if pipe > 0 else 0.0
    timeline = None
    if line is not None:
        timeline = tuple((s, _OP_NAME[o] if isinstance(o, int) else o, m, a, b) for s, o, m, a, b in line)
    return SimResult(step, pipe, tuple(busy), bubble, timeline)


def simulate_python(schedule: Schedule, costs: Sequence[StageCosts], *, max_concurrent_sends: int = 4,
                    opportunistic: bool = False, timeline: bool = False) -> SimResult:
    """The reference implementation (see :func:`simulate`)."""
    p, m = schedule.num_stages, schedule.num_microbatches
    pending = [list(stage) for stage in schedule.actions]
    pos = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    end = [0.0] * p
    act_arrival: list[dict[int, float]] = [dict() for _ in range(p)]   # at stage s, activation of mb
    grad_arrival: list[dict[int, float]] = [dict() for _ in range(p)]  # at stage s, gradient of mb
    channels = [[[0.0] * max(1, max_concurrent_sends) for _ in range(2)] for _ in range(p)]
    line: list[tuple[int, str, int, float, float]] = []
    heap: list[tuple[float, int]] = []
    waiting: set[int] = set()  # stages whose next action waits on a message not yet sent
    held = [0] * p  # micro-batches between their F and B
    cap = [h for h, _ in inflight(schedule)]  # the swap never makes a stage hold more than its static order

    def ready_time(s: int) -> float | None:
        """When stage ``s`` can start its next action (``None``: it waits on something not yet known)."""
        a = pending[s][pos[s]]
        if a.op is Op.F and s > 0:
            t = act_arrival[s].get(a.mb)
            return None if t is None else max(free[s], t)
        if a.op is Op.B and s < p - 1:
            t = grad_arrival[s].get(a.mb)
            return None if t is None else max(free[s], t)
        return free[s]

    def push(s: int) -> None:
        if pos[s] >= len(pending[s]):
            return
        t = ready_time(s)
        if t is None:
            waiting.add(s)
        else:
            heapq.heappush(heap, (t, s))

    def send(s: int, dst: int, mb: int, gradient: bool, at: float) -> None:
        chans = channels[s][1 if gradient else 0]
        i = min(range(len(chans)), key=lambda k: (chans[k], k))
        start = max(at, chans[i])
        done = start + costs[s].send(gradient, mb == m - 1)
        chans[i] = done
        (grad_arrival if gradient else act_arrival)[dst][mb] = done
        if dst in waiting:
            waiting.discard(dst)
            push(dst)

    for s in range(p):
        push(s)
    while heap:
        t, s = heapq.heappop(heap)
        if pos[s] >= len(pending[s]):
            continue
        current = ready_time(s)
        if current is None or current != t:  # stale entry
            continue
        a = pending[s][pos[s]]
        if opportunistic and a.op is Op.R and s < p - 1 and held[s] < cap[s]:
            g = grad_arrival[s].get(a.mb)
            if g is None or g > t:
                for j in range(pos[s] + 1, len(pending[s])):
                    b = pending[s][j]
                    if b.op is Op.F:
                        arrived = s == 0 or act_arrival[s].get(b.mb, float("inf")) <= t
                        if arrived:
                            pending[s].insert(pos[s], pending[s].pop(j))
                            a = b
                        break
        duration = costs[s].duration(a.op, a.mb == m - 1)
        finish = t + duration
        busy[s] += duration
        free[s] = finish
        end[s] = finish
        pos[s] += 1
        held[s] += 1 if a.op is Op.F else -1 if a.op is Op.B else 0
        if timeline:
            line.append((s, a.op.value, a.mb, t, finish))
        if a.op is Op.F and s < p - 1:
            send(s, s + 1, a.mb, False, finish)
        elif a.op is Op.B and s > 0:
            send(s, s - 1, a.mb, True, finish)
        push(s)
    if any(pos[s] < len(pending[s]) for s in range(p)):
        stuck = [str(pending[s][pos[s]]) for s in range(p) if pos[s] < len(pending[s])]
        raise ValueError(f"schedule deadlocks in simulation; stuck at {', '.join(stuck)}")
    pipe = max(end)
    step = max(end[s] + costs[s].allreduce for s in range(p))
    return _result(step, pipe, busy, line if timeline else None)
