"""Timelines of a step: simulated from a plan, or measured by the runtime (Chrome-trace JSON), drawn to PNG."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import ConfigError
from ..ir.schedule import generate
from ..util.fs import read_regular
from .artifacts import Plan
from .simulate import StageCosts, simulate, sync_costs

__all__ = ["check_drawable", "simulated_timeline", "load_trace", "draw_plan", "draw_timelines"]

_COLORS = {"F": "#4C72B0", "R": "#DD8452", "B": "#55A868", "W": "#8172B3"}


def check_drawable(plan: Plan) -> None:
    """A layout given by hand has no simulated times to draw."""
    if plan.by_hand:
        raise ConfigError("the plan is a layout given by hand: it has no simulated times to draw",
                          hint="make a plan from a profile with `varuna plan` to see its timeline")


def simulated_timeline(plan: Plan) -> list[tuple[int, str, int, float, float]]:
    """``(stage, op, mb, start, end)`` of one step as the planner's simulation predicts it (every micro-batch at
    full size; under a schedule that splits the backward, ``B`` and ``W`` with their own times)."""
    check_drawable(plan)
    costs = [StageCosts(s.forward, s.recompute, s.backward, s.send_activation, s.send_gradient, weight=s.weight,
                        **sync_costs(s.allreduce, s.optimizer, sharded=plan.shard_optimizer))
             for s in plan.stages]
    result = simulate(generate(plan.schedule, plan.pp, plan.num_microbatches), costs, timeline=True)
    return list(result.timeline or ())


TRACE_LIMIT = 256 * 2**20  # bytes of one rank's trace file
_ACTION = re.compile(r"^(\d{1,6})([FRBW])(\d{1,9})$")


def load_trace(path: str | Path, replica: int = 0) -> list[tuple[int, str, int, float, float]]:
    """Read Chrome-trace JSON written by ``Varuna(trace=...)`` (a file, or a directory of per-rank files) and
    return replica ``replica``'s actions as ``(stage, op, mb, start, end)`` in seconds from the step's start."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"no trace files in {path}")
    events = []
    for f in files:
        raw = read_regular(f, TRACE_LIMIT, what="trace")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"cannot read trace {f}: {str(exc)[:200]}") from None
        listed = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(listed, list):
            raise ConfigError(f"{f} is not a Chrome trace (no list of traceEvents)")
        events += [(f, e) for e in listed if isinstance(e, dict) and e.get("ph") == "X" and e.get("pid", 0) == replica]
    if not events:
        raise ConfigError(f"{path} holds no action events for replica {replica}")
    out = [_action(f, e) for f, e in events]
    t0 = min(start for _, _, _, start, _ in out)
    return sorted(((s, op, mb, (a - t0) / 1e6, (b - t0) / 1e6) for s, op, mb, a, b in out), key=lambda x: (x[0], x[3]))


def _action(path: Path, event: dict[str, Any]) -> tuple[int, str, int, float, float]:
    """``(stage, op, mb, start µs, end µs)`` of one trace event named like ``2F0``."""
    name, ts, dur = event.get("name"), event.get("ts"), event.get("dur")
    match = _ACTION.match(name) if isinstance(name, str) else None
    if match is None or not _finite(ts) or not _finite(dur) or dur < 0:
        raise ConfigError(f"{path}: {str(event)[:120]} is not an action event (name like '2F0', finite ts and dur)")
    return int(match.group(1)), match.group(2), int(match.group(3)), float(ts), float(ts) + float(dur)


def _finite(x: object) -> TypeGuard[float]:
    """A finite int or float (a bool is no number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def draw_timelines(panels: Iterable[tuple[str, list[tuple[int, str, int, float, float]]]], png: str | Path,
                   *, stages: int) -> None:
    """Draw one Gantt panel per ``(title, timeline)``, stacked, sharing the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = list(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.5 + 0.45 * stages * len(panels) + 0.6 * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (title, line) in zip(axes[:, 0], panels, strict=True):
        for stage, op, mb, start, end in line:
            ax.barh(stage, (end - start) * 1e3, left=start * 1e3, color=_COLORS[op], edgecolor="white", height=0.8)
            if (end - start) * 1e3 > 0:
                ax.text((start + end) / 2 * 1e3, stage, f"{mb}", ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="upper right", ncol=len(_COLORS))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_plan(plan: Plan, png: str | Path, *, measured: str | Path | None = None) -> None:
    """The plan's simulated step, and the measured one beside it when a trace is given."""
    sim = simulated_timeline(plan)
    panels = [((f"simulated: {plan.schedule}, pp={plan.pp}, {plan.num_microbatches} micro-batches, "
                f"{(max(e for *_, e in sim)) * 1e3:.1f} ms"), sim)]
    if measured is not None:
        got = load_trace(measured)
        panels.append((f"measured: {(max(e for *_, e in got)) * 1e3:.1f} ms", got))
    draw_timelines(panels, png, stages=plan.pp)
