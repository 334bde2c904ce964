"""Observers of the executor: what :class:`~varuna_core.pipeline.executor.PipelineExecutor` tells about each action.

The executor knows nothing of traces or benchmarks: it calls the observers attached to it
(:meth:`PipelineExecutor.add_observer`, or :meth:`PipelineExecutor.observing` for a block) once per action with
an :class:`ActionTiming`, once per run with its start and end, and (told by the facade's ``step()``) once per
gradient synchronisation. An observer subclasses
:class:`ActionObserver` and overrides what it needs. :class:`ChromeTrace` is the one the facade uses for
``Varuna(trace=...)``: Chrome-trace JSON of one step's actions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..ir.schedule import Action

__all__ = ["ActionObserver", "ActionTiming", "ChromeTrace"]


@dataclasses.dataclass(frozen=True)
class ActionTiming:
    """One action as it ran on this rank (times from ``time.perf_counter()``, in seconds).

    Attributes:
        action: the schedule's action (stage, op, micro-batch).
        start, end: when the action started and ended (receive waits included).
        waited: seconds of it spent waiting for a peer's message (activation or gradient).
        compute: seconds of it spent in the stage's forward (F, R) or backward (B), waits excluded; the rest,
            ``end - start - waited - compute``, is the executor's own overhead (checks, posting sends).
    """

    action: Action
    start: float
    end: float
    waited: float
    compute: float

    @property
    def name(self) -> str:
        return str(self.action)


class ActionObserver:
    """Base of the executor's observers; both hooks do nothing unless overridden. Must not raise."""

    def on_action(self, timing: ActionTiming) -> None:
        """After each action of a run."""

    def on_run(self, start: float, end: float) -> None:
        """At the end of a run (its sends completed), with the run's start and end."""

    def on_sync(self, start: float, end: float) -> None:
        """After a training step's gradient synchronisation (tied weights, then data parallel)."""


class ChromeTrace(ActionObserver):
    """Records each action; :meth:`write` saves them as Chrome-trace JSON (times in µs).

    Args:
        pid, tid: the process and thread rows of the trace (the facade uses replica and stage).
        args: added to every event (the facade adds rank and step).
    """

    def __init__(self, *, pid: int = 0, tid: int = 0, args: dict[str, Any] | None = None) -> None:
        self.pid, self.tid, self.args = pid, tid, dict(args or {})
        self.events: list[ActionTiming] = []

    def on_action(self, timing: ActionTiming) -> None:
        self.events.append(timing)

    def to_json(self) -> dict:
        """Each action as a complete event; its args say how much of it waited for a peer's message
        (``waited_us``) and computed (``compute_us``), so that a timeline can tell waiting from compute."""
        return {"traceEvents": [
            {"name": t.name, "ph": "X", "ts": t.start * 1e6, "dur": (t.end - t.start) * 1e6, "pid": self.pid,
             "tid": self.tid, "args": {**self.args, "waited_us": t.waited * 1e6, "compute_us": t.compute * 1e6}}
            for t in self.events
        ], "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        """Write the trace to ``path`` (its directory is created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path
