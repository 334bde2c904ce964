"""How many micro-batches each stage holds at once under a schedule (its static order).

``held``: micro-batches between their ``F`` and their ``B`` (their stashed input or graph is kept; under a
schedule that splits the backward, what ``W`` still needs is counted by :func:`pending_weights`);
``graphs``: micro-batches whose autograd graph is alive (``R``..``B`` on stages that recompute, else
``F``..``B``). The planner's memory model (:mod:`varuna_core.planning.memory`) multiplies these by the profiled
activation sizes.

:func:`posted_receives` is the receive window of the runtime (see [Note: receive window]): how many receive
buffers per direction a stage keeps posted and not yet consumed. The executor posts exactly that many and the
memory model charges exactly that many, both through :func:`receive_windows`.

[Note: receive window]
A stage does not post the receives of a whole step up front (that is ``M`` buffers per direction). It keeps a
window per direction in the order of its consumers (its ``F`` actions for activations, its ``B`` actions for
gradients): before the first action it posts the receives of its first ``W`` consumers, and when the ``k``-th
consumer starts (and takes its buffer) it posts the receive of the ``(k+W)``-th. So at most ``W`` buffers per
direction are posted and not consumed, and every consumer finds its receive posted.

``W`` must cover every message a neighbour can have sent and this stage not consumed yet, or that neighbour's
transfer would wait for this stage to post (gloo delivers a message only into a posted receive) and the overlap
of communication with compute would shrink. An activation of micro-batch ``k`` sent by stage ``s-1`` and not yet
consumed by stage ``s`` is held by stage ``s-1`` (its ``F`` ran, its ``B`` cannot have: it needs stage ``s``'s
``B``); a gradient sent by stage ``s+1`` and not consumed by stage ``s`` is held by stage ``s``. Held counts
never exceed the static peaks (the opportunistic forward is capped at them), and neighbouring stages of a
generated schedule run their forwards in the same micro-batch order, and their backwards too; so the unconsumed
messages are always the next ones in this stage's consumer order, and

    activation window of stage ``s`` = held(s-1)  (0 on the first stage)
    gradient window of stage ``s``   = held(s)    (0 on the last stage)

with ``held`` the peak of :func:`inflight`. For ``gpipe`` that is ``M`` (no saving: a stage may really get
every activation before it runs one), for ``1f1b`` ``S-s+1`` and ``S-s``, for ``varuna`` the held peaks of its
order (a few micro-batches, independent of ``M`` once ``M`` exceeds them). A stage whose neighbour runs the same
direction in another order (a hand-written schedule) gets a window of all its consumers: the old behaviour.

[Note: unwaited sends]
A send's work handle holds its tensor until it is waited for, and gloo cannot tell whether a send has completed
without waiting (``is_completed()`` stays false until ``wait()``, and a wait that times out closes the
connection). So a stage waits for its oldest send of a direction before posting one more than the receiving
neighbour's window in that direction (:func:`unwaited_sends`). That wait does not block: more than ``W`` values
sent means the oldest has been consumed (at most ``W`` are sent and unconsumed, and the receiver consumes them in
the order they were sent), so it has arrived. Sent values stay allocated for at most ``W`` micro-batches per
direction, not the whole step's ``M``; the memory model charges exactly that.
"""

from __future__ import annotations

from .schedule import Op, Schedule, generate

__all__ = ["has_closed_form", "inflight", "inflight_named", "pending_weights", "pending_weights_named",
           "posted_receives", "receive_windows", "unwaited_sends"]


def inflight(schedule: Schedule) -> list[tuple[int, int]]:
    """Per stage ``(held, graphs)``: the peak counts over the stage's static action order."""
    out = []
    for stage in schedule.actions:
        recomputes = any(a.op is Op.R for a in stage)
        held = graphs = peak_held = peak_graphs = 0
        for a in stage:
            if a.op is Op.F:
                held += 1
                if not recomputes:
                    graphs += 1
            elif a.op is Op.R:
                graphs += 1
            elif a.op is Op.B:
                held -= 1
                graphs -= 1
            # W: what it still needs is not a held micro-batch (pending_weights counts it)
            peak_held = max(peak_held, held)
            peak_graphs = max(peak_graphs, graphs)
        out.append((peak_held, peak_graphs))
    return out


def pending_weights(schedule: Schedule) -> list[int]:
    """Per stage, the peak count of micro-batches between their ``B`` and their ``W`` (0 for a schedule that does
    not split the backward): each keeps what its weights' gradients need, the inputs and output gradients of
    the split modules (:mod:`varuna_core.model.split`), which the memory model charges per micro-batch."""
    out = []
    for stage in schedule.actions:
        pending = peak = 0
        for a in stage:
            pending += 1 if a.op is Op.B and schedule.splits_backward else -1 if a.op is Op.W else 0
            peak = max(peak, pending)
        out.append(peak)
    return out


# closed forms of inflight(generate(name, S, M)), checked against it by the tests
_CLOSED_FORMS = {
    "gpipe": lambda stage, num_stages, num_mb: (num_mb, num_mb),  # every forward before any backward
    "1f1b": lambda stage, num_stages, num_mb: (min(num_stages - stage, num_mb),) * 2,  # warm-up + 1
}


def has_closed_form(name: str) -> bool:
    """Whether :func:`inflight_named` knows the schedule's counts without building it (a few operations per
    stage: cheaper than any simulation of it)."""
    return name in _CLOSED_FORMS


def inflight_named(name: str, num_stages: int, num_mb: int) -> list[tuple[int, int]]:
    """``inflight(generate(name, num_stages, num_mb))``, without building the schedule when a closed form is known.

    Raises:
        ConfigError: unknown ``name``.
        ScheduleError: a size below 1.
    """
    closed = _CLOSED_FORMS.get(name)
    if closed is None or num_stages < 1 or num_mb < 1:
        return inflight(generate(name, num_stages, num_mb))
    return [closed(s, num_stages, num_mb) for s in range(num_stages)]


def _split_pending(stage: int, num_stages: int, num_mb: int) -> int:
    """Peak of :func:`pending_weights` for the zero-bubble order ``zb``. Stage ``s`` warms up with ``w = min(S-1-s,
    M)`` forwards; in its steady ``F``, ``B`` pairs a ``W`` follows from the ``s``-th ``B`` on, so ``min(s+1, M-w)``
    wait at most; the last stage has no drain, the others' drain ``B``, ``W`` pairs add one to the ``min(s, M-w)``
    left waiting."""
    warmup = min(num_stages - 1 - stage, num_mb)
    if warmup == 0:
        return min(stage + 1, num_mb)
    return min(stage, num_mb - warmup) + 1


def pending_weights_named(name: str, num_stages: int, num_mb: int) -> list[int]:
    """``pending_weights(generate(name, num_stages, num_mb))``, without building the schedule when a closed form is
    known (the planner asks it for every configuration it tries).

    Raises:
        ConfigError: unknown ``name``.
        ScheduleError: a size below 1.
    """
    if num_stages >= 1 and num_mb >= 1:
        if name == "zb":
            return [_split_pending(s, num_stages, num_mb) for s in range(num_stages)]
        if name == "varuna-zb":  # up to s behind their B, and the one just run: see _varuna_zero_bubble
            return [min(s + 1, num_mb) for s in range(num_stages)]
        if name in _CLOSED_FORMS or name == "varuna":  # no W actions
            return [0] * num_stages
    return pending_weights(generate(name, num_stages, num_mb))


def receive_windows(held: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Per stage ``(activation window, gradient window)`` from the stages' peak held counts (the ``held`` of
    :func:`inflight`), for a schedule whose neighbouring stages agree on the order of their forwards and of
    their backwards, as every generated schedule does (see [Note: receive window]). The planner's memory model
    calls this on its (native) in-flight counts; :func:`posted_receives` on a schedule."""
    last = len(held) - 1
    return [(held[s - 1] if s > 0 else 0, held[s] if s < last else 0) for s in range(len(held))]


def posted_receives(schedule: Schedule) -> list[tuple[int, int]]:
    """Per stage ``(activation buffers, gradient buffers)``: the most receives the runtime keeps posted and not
    yet consumed per direction, its window ``W`` (see [Note: receive window]).

    Where a stage and its neighbour order a direction's micro-batches differently, the window of that direction
    is all the stage's consumers (every receive posted up front)."""
    windows = receive_windows([held for held, _ in inflight(schedule)])
    orders = [[tuple(a.mb for a in stage if a.op is op) for stage in schedule.actions] for op in (Op.F, Op.B)]
    num = [(len(orders[0][s]), len(orders[1][s])) for s in range(schedule.num_stages)]
    out = []
    for s, (act, grad) in enumerate(windows):
        if s > 0 and orders[0][s] != orders[0][s - 1]:
            act = num[s][0]
        if s < schedule.num_stages - 1 and orders[1][s] != orders[1][s + 1]:
            grad = num[s][1]
        out.append((min(act, num[s][0]) if s > 0 else 0, min(grad, num[s][1]) if s < schedule.num_stages - 1 else 0))
    return out


def unwaited_sends(schedule: Schedule) -> list[tuple[int, int]]:
    """Per stage ``(activation sends, gradient sends)`` the runtime keeps unwaited: the window of the neighbour
    that receives them ([Note: unwaited sends]); 0 where there is no such neighbour."""
    windows = posted_receives(schedule)
    last = schedule.num_stages - 1
    return [(windows[s + 1][0] if s < last else 0, windows[s - 1][1] if s > 0 else 0) for s in range(last + 1)]
