"""How many micro-batches each stage holds at once under a schedule (its static order).

``held``: micro-batches between their ``F`` and their ``B`` (their stashed input or graph is kept);
``graphs``: micro-batches whose autograd graph is alive (``R``..``B`` on stages that recompute, else
``F``..``B``). The planner's memory model multiplies these by the profiled activation sizes.
"""

from __future__ import annotations

from .schedule import Op, Schedule

__all__ = ["inflight"]


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
