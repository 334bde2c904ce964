"""How many micro-batches each stage holds at once under a schedule (its static order).

``held``: micro-batches between their ``F`` and their ``B`` (their stashed input or graph is kept);
``graphs``: micro-batches whose autograd graph is alive (``R``..``B`` on stages that recompute, else
``F``..``B``). The planner's memory model (:mod:`varuna_core.planning.memory`) multiplies these by the profiled
activation sizes.
"""

from __future__ import annotations

from .schedule import Op, Schedule, generate

__all__ = ["inflight", "inflight_named"]


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
            else:
                held -= 1
                graphs -= 1
            peak_held = max(peak_held, held)
            peak_graphs = max(peak_graphs, graphs)
        out.append((peak_held, peak_graphs))
    return out


# closed forms of inflight(generate(name, S, M)), checked against it by the tests
_CLOSED_FORMS = {
    "gpipe": lambda stage, num_stages, num_mb: (num_mb, num_mb),  # every forward before any backward
    "1f1b": lambda stage, num_stages, num_mb: (min(num_stages - stage, num_mb),) * 2,  # warm-up + 1
}


def inflight_named(name: str, num_stages: int, num_mb: int) -> list[tuple[int, int]]:
    """``inflight(generate(name, num_stages, num_mb))``, without building the schedule when a closed form is known.

    Raises:
        ScheduleError: unknown ``name`` or a size below 1.
    """
    closed = _CLOSED_FORMS.get(name)
    if closed is None or num_stages < 1 or num_mb < 1:
        return inflight(generate(name, num_stages, num_mb))
    return [closed(s, num_stages, num_mb) for s in range(num_stages)]
