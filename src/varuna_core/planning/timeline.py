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
from .simulate import StageCosts, idle_cost, simulate, sync_costs

__all__ = ["check_drawable", "simulated_timeline", "load_trace", "draw_plan", "draw_timelines", "compare"]

_COLORS = {"F": "#4C72B0", "R": "#DD8452", "B": "#55A868", "W": "#8172B3"}
_WAIT = "#C8C8C8"  # the part of a measured action spent waiting for a peer's message

Line = list[tuple[int, str, int, float, float]]  # (stage, op, micro-batch, start s, end s)
Waits = dict[tuple[int, str, int], float]  # (stage, op, micro-batch) -> seconds of it spent waiting


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
    result = simulate(generate(plan.schedule, plan.pp, plan.num_microbatches), costs, timeline=True,
                      idle=idle_cost(plan.idle_penalty))
    return list(result.timeline or ())


TRACE_LIMIT = 256 * 2**20  # bytes of one rank's trace file
_ACTION = re.compile(r"^(\d{1,6})([FRBW])(\d{1,9})$")


def load_trace(path: str | Path, replica: int = 0) -> list[tuple[int, str, int, float, float]]:
    """Read Chrome-trace JSON written by ``Varuna(trace=...)`` (a file, or a directory of per-rank files) and
    return replica ``replica``'s actions as ``(stage, op, mb, start, end)`` in seconds from the step's start."""
    return load_measured(path, replica)[0]


def load_measured(path: str | Path, replica: int = 0) -> tuple[Line, Waits]:
    """:func:`load_trace`, and how long each action waited for a peer's message (its event's ``waited_us``;
    0 in traces written before it was recorded): an action's bar includes its wait, which is not compute."""
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
    t0 = min(start for _, _, _, start, _, _ in out)
    line = sorted(((s, op, mb, (a - t0) / 1e6, (b - t0) / 1e6) for s, op, mb, a, b, _ in out),
                  key=lambda x: (x[0], x[3]))
    return line, {(s, op, mb): w / 1e6 for s, op, mb, _, _, w in out}


def _action(path: Path, event: dict[str, Any]) -> tuple[int, str, int, float, float, float]:
    """``(stage, op, mb, start µs, end µs, waited µs)`` of one trace event named like ``2F0``."""
    name, ts, dur = event.get("name"), event.get("ts"), event.get("dur")
    match = _ACTION.match(name) if isinstance(name, str) else None
    if match is None or not _finite(ts) or not _finite(dur) or dur < 0:
        raise ConfigError(f"{path}: {str(event)[:120]} is not an action event (name like '2F0', finite ts and dur)")
    args = event.get("args")
    waited = args.get("waited_us", 0.0) if isinstance(args, dict) else 0.0
    if not _finite(waited) or not 0 <= waited <= dur * (1 + 1e-9) + 1e-3:
        raise ConfigError(f"{path}: action {name} says it waited {str(waited)[:40]} µs of its {dur} µs",
                          hint="a trace's waited_us is between 0 and the action's duration")
    return (int(match.group(1)), match.group(2), int(match.group(3)), float(ts), float(ts) + float(dur),
            min(float(waited), float(dur)))


def _finite(x: object) -> TypeGuard[float]:
    """A finite int or float (a bool is no number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def draw_timelines(panels: Iterable[tuple[str, list[tuple[int, str, int, float, float]]]], png: str | Path,
                   *, stages: int, waits: Iterable[Waits | None] | None = None) -> None:
    """Draw one Gantt panel per ``(title, timeline)``, stacked, sharing the time axis; where ``waits`` gives a
    panel's waits, the start of each action's bar that waited for a message is drawn grey ("wait")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = list(panels)
    panel_waits = list(waits) if waits is not None else [None] * len(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.5 + 0.45 * stages * len(panels) + 0.6 * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (title, line), waited in zip(axes[:, 0], panels, panel_waits, strict=True):
        for stage, op, mb, start, end in line:
            wait = min(end - start, (waited or {}).get((stage, op, mb), 0.0))
            if wait > 0:  # the executor waits for the message first, then computes
                ax.barh(stage, wait * 1e3, left=start * 1e3, color=_WAIT, edgecolor="white", height=0.8)
            ax.barh(stage, (end - start - wait) * 1e3, left=(start + wait) * 1e3, color=_COLORS[op],
                    edgecolor="white", height=0.8)
            if (end - start - wait) * 1e3 > 0:
                ax.text((start + wait + end) / 2 * 1e3, stage, f"{mb}", ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (ms)")
    legend = [Patch(color=c, label=k) for k, c in _COLORS.items()]
    if any(panel_waits):
        legend.append(Patch(color=_WAIT, label="wait"))
    fig.legend(handles=legend, loc="upper right", ncol=len(legend))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_plan(plan: Plan, png: str | Path, *, measured: str | Path | None = None) -> None:
    """The plan's simulated step, and the measured one beside it when a trace is given."""
    sim = simulated_timeline(plan)
    panels = [((f"simulated: {plan.schedule}, pp={plan.pp}, {plan.num_microbatches} micro-batches, "
                f"{(max(e for *_, e in sim)) * 1e3:.1f} ms"), sim)]
    waits: list[Waits | None] = [None]
    if measured is not None:
        got, waited = load_measured(measured)
        panels.append((f"measured: {(max(e for *_, e in got)) * 1e3:.1f} ms (grey: waiting for a message)", got))
        waits.append(waited)
    draw_timelines(panels, png, stages=plan.pp, waits=waits)


def compare(plan: Plan, measured: str | Path) -> list[dict[str, Any]]:
    """Per stage and action kind, the simulation against the measured step: the simulated time of one action,
    the measured median compute (its duration less its wait) and the measured total wait, with the step times.

    Returns rows ``{"stage", "op", "count", "simulated_s", "measured_s", "waited_s"}`` (``op`` "step": the whole
    step, stage -1)."""
    import statistics

    sim = simulated_timeline(plan)
    got, waited = load_measured(measured)
    rows: list[dict[str, Any]] = []
    for stage in range(plan.pp):
        for op in "FRBW":
            simulated = [e - a for s, o, _, a, e in sim if s == stage and o == op]
            actual = [(e - a) - waited.get((s, o, mb), 0.0) for s, o, mb, a, e in got if s == stage and o == op]
            if not simulated and not actual:
                continue
            rows.append({"stage": stage, "op": op, "count": len(actual),
                         "simulated_s": statistics.median(simulated) if simulated else None,
                         "measured_s": statistics.median(actual) if actual else None,
                         "waited_s": sum(waited.get((s, o, mb), 0.0) for s, o, mb, *_ in got
                                         if s == stage and o == op)})
    rows.append({"stage": -1, "op": "step", "count": 1, "simulated_s": max(e for *_, e in sim),
                 "measured_s": max(e for *_, e in got), "waited_s": None})
    return rows
