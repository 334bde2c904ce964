"""Pipeline schedules: a small IR, the generators, and a validator that finds deadlocks before a run.

A schedule is, per stage, the ordered list of :class:`Action`\\ s that stage executes in one training step.
The runtime follows this order exactly (apart from the documented opportunistic forward-before-recompute
swap), so an order that is inconsistent between stages hangs every rank. :func:`validate` replays the
schedule in a unit-time lockstep simulation and reports such a hang as a step × stage grid instead.

This module is pure Python on purpose: planning code and the CLI import it and must start fast, so it must
never import torch.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

from varuna_core.errors import ConfigError, ScheduleError
from varuna_core.util.text import short_repr

__all__ = ["Op", "Action", "Schedule", "ScheduleName", "SCHEDULE_NAMES", "check_schedule", "generate",
           "recompute_stages", "validate"]

ScheduleName = Literal["varuna", "1f1b", "gpipe", "zb", "varuna-zb"]
SCHEDULE_NAMES: tuple[ScheduleName, ...] = get_args(ScheduleName)

_ACTION_RE = re.compile(r"^(\d+)([FRBW])(\d+)$")
_HEADER_RE = re.compile(r"^#\s*(.*?)\s+stages=(\d+)\s+microbatches=(\d+)\s*$")
_STAGE_LINE_RE = re.compile(r"^(\d+)\s*:(.*)$")
_MAX_PROBLEMS = 10


class Op(str, enum.Enum):
    """What a stage does with one micro-batch.

    ``R`` exists because Varuna runs forwards without an autograd graph (saving activation memory) and
    rebuilds the graph from the stashed stage input right before the backward. ``W`` exists in the schedules
    that split the backward (zero-bubble, :mod:`varuna_core.model.split`): there ``B`` computes only the
    gradient of the stage's input (what the previous stage waits for) and ``W`` the weights' gradients, which
    nobody waits for and which fill the stage's idle slots. Without ``W`` actions, ``B`` is the whole backward.
    """

    F = "F"
    R = "R"
    B = "B"
    W = "W"


class Action(NamedTuple):
    """One unit of work: ``stage`` runs ``op`` on micro-batch ``mb``. Printed as ``"2F0"``."""

    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the ``str()`` form back, so schedules can be written and edited by hand.

        Raises:
            ScheduleError: if ``text`` is not ``<stage><F|R|B|W><mb>``.
        """
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}",
                hint="write <stage><F|R|B|W><micro-batch>, e.g. '2F0' for stage 2, forward, micro-batch 0",
            )
        return cls(int(match.group(1)), Op(match.group(2)), int(match.group(3)))


def _coerce_action(item: object) -> Action:
    """Accept an Action, its text form, or a ``(stage, op, mb)`` triple, so tests and users can be terse."""
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        return Action.parse(item)
    if isinstance(item, tuple) and len(item) == 3:
        stage, op, mb = item
        try:
            return Action(int(stage), Op(op), int(mb))
        except (TypeError, ValueError):
            pass
    raise ScheduleError(f"not an action: {item!r}", hint="use Action(stage, Op.F, mb) or text like '0F1'")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions of one training step.

    Construction only checks the shape (sizes, one action list per stage); call :func:`validate` for the
    semantic checks, so that broken schedules can still be built, printed and diagnosed.

    Attributes:
        name: generator name or any label, shown in the text form and in errors.
        num_stages: pipeline depth ``S``.
        num_microbatches: micro-batches per step ``M``.
        actions: ``actions[s]`` is the ordered tuple of actions of stage ``s``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ScheduleError(
                f"schedule {self.name!r} has {self.num_stages} stages and {self.num_microbatches} micro-batches",
                hint="both must be at least 1",
            )
        actions = tuple(tuple(_coerce_action(a) for a in stage) for stage in self.actions)
        if len(actions) != self.num_stages:
            raise ScheduleError(
                f"schedule {self.name!r} declares {self.num_stages} stages but has {len(actions)} action lists",
                hint="give exactly one (possibly empty) action list per stage",
            )
        object.__setattr__(self, "actions", actions)

    def stage_actions(self, stage: int) -> tuple[Action, ...]:
        """Ordered actions of ``stage``; ScheduleError if the stage does not exist."""
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(
                f"stage {stage} out of range for schedule {self.name!r} with {self.num_stages} stages",
                hint=f"use a stage in 0..{self.num_stages - 1}",
            )
        return self.actions[stage]

    def uses_recompute(self, stage: int) -> bool:
        """True if ``stage`` recomputes: its forwards then run without a graph and R rebuilds it before B."""
        return any(a.op is Op.R for a in self.stage_actions(stage))

    @property
    def splits_backward(self) -> bool:
        """True if the backward is split: ``B`` computes the input gradient and ``W`` the weights' (every stage
        then runs one ``W`` per micro-batch, which :func:`validate` checks)."""
        return any(a.op is Op.W for stage in self.actions for a in stage)

    @property
    def recompute_stages(self) -> tuple[bool, ...]:
        """Per stage, :meth:`uses_recompute` (for a generated schedule: :func:`recompute_stages` of its name)."""
        return tuple(self.uses_recompute(s) for s in range(self.num_stages))

    def to_text(self) -> str:
        """Line-oriented text form (header plus ``"s: 0F0 0F1 ..."`` per stage), stable for golden files."""
        lines = [f"# {self.name} stages={self.num_stages} microbatches={self.num_microbatches}"]
        for s, stage in enumerate(self.actions):
            lines.append(f"{s}: " + " ".join(str(a) for a in stage) if stage else f"{s}:")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text` output; blank lines and further ``#`` comments are ignored.

        Raises:
            ScheduleError: on a missing/garbled header, a bad stage line or action, or a missing/repeated stage.
        """
        hint = "expected '# <name> stages=S microbatches=M' then one line '<s>: <actions>' per stage"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        header = _HEADER_RE.match(lines[0]) if lines else None
        if header is None:
            first = lines[0] if lines else ""
            raise ScheduleError(f"schedule text has no valid header line (got {first!r})", hint=hint)
        name, num_stages, num_mb = header.group(1), int(header.group(2)), int(header.group(3))
        per_stage: dict[int, tuple[Action, ...]] = {}
        for line in lines[1:]:
            if line.startswith("#"):
                continue
            match = _STAGE_LINE_RE.match(line)
            if match is None:
                raise ScheduleError(f"bad schedule line {line!r}", hint=hint)
            stage = int(match.group(1))
            if stage in per_stage:
                raise ScheduleError(f"stage {stage} appears twice in schedule text", hint=hint)
            if stage >= num_stages:
                raise ScheduleError(f"line for stage {stage} but the header says stages={num_stages}", hint=hint)
            per_stage[stage] = tuple(Action.parse(tok) for tok in match.group(2).split())
        missing = [s for s in range(num_stages) if s not in per_stage]
        if missing:
            raise ScheduleError(f"schedule text has no line for stage(s) {missing}", hint=hint)
        return cls(name, num_stages, num_mb, tuple(per_stage[s] for s in range(num_stages)))

    def grid(self) -> str:
        """Step × stage table of the unit-time lockstep simulation (what :func:`validate` replays)."""
        return _render(self, _simulate(self))


# ----------------------------------------------------------------------------------------------------
# generators


def check_schedule(name: object) -> ScheduleName:
    """``name`` if it names a schedule. The one check of a schedule name: arguments, requests, plans and the
    executor all call it, so every refusal says the same and lists the same names.

    Raises:
        ConfigError: any other value (bad input: an argument, an option or a file said it).
    """
    if not isinstance(name, str) or name not in SCHEDULE_NAMES:
        raise ConfigError(f"unknown schedule {short_repr(name, 40)}", hint=f"choose one of {', '.join(SCHEDULE_NAMES)}")
    return name


def generate(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build the named schedule.

    Raises:
        ConfigError: unknown ``name`` (see :func:`check_schedule`).
        ScheduleError: a size below 1.
    """
    generator = _generator(name)
    if not isinstance(num_stages, int) or not isinstance(num_microbatches, int):
        raise ScheduleError(f"sizes must be integers, got stages={num_stages!r} microbatches={num_microbatches!r}")
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"cannot build a {name} schedule with {num_stages} stages and {num_microbatches} micro-batches",
            hint="both must be at least 1",
        )
    return Schedule(name, num_stages, num_microbatches, generator.build(num_stages, num_microbatches))


def recompute_stages(name: str, num_stages: int) -> tuple[bool, ...]:
    """Which stages of the named schedule recompute (run ``R`` actions), without building it: the same for
    every micro-batch count, and equal to ``generate(name, num_stages, M).recompute_stages``.

    Raises:
        ConfigError: unknown ``name`` (see :func:`check_schedule`).
    """
    generator = _generator(name)
    return tuple(generator.recomputes(s, num_stages) for s in range(num_stages))


def _generator(name: str) -> _Generator:
    return _GENERATORS[check_schedule(name)]


def _gpipe(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """All forwards, then all backwards: simplest, but every stage holds M graphs at once."""
    return tuple(
        tuple(Action(s, Op.F, m) for m in range(num_mb)) + tuple(Action(s, Op.B, m) for m in range(num_mb))
        for s in range(num_stages)
    )


def _one_f_one_b(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """PipeDream-Flush: warm-up forwards, then steady F/B alternation, then drain; bounds live graphs to S-s."""
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_mb)
        acts = [Action(s, Op.F, m) for m in range(warmup)]
        for i in range(num_mb - warmup):
            acts += [Action(s, Op.F, warmup + i), Action(s, Op.B, i)]
        acts += [Action(s, Op.B, m) for m in range(num_mb - warmup, num_mb)]
        out.append(tuple(acts))
    return tuple(out)


def _varuna(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """The original's ``generate_schedule.cc``: unit-time F and R, two-unit B, priority bw > bi > rc > fwd.

    Pushes made in a quantum only become visible in the next one, which is what makes stage ``i-1`` recompute
    micro-batch ``k`` while stage ``i`` is still in the second half of its backward. Unlike the original there
    is no cap on the number of quanta, so large ``M`` is never silently truncated.
    """
    last = num_stages - 1
    names = ("bw", "bi", "rc", "fwd")  # priority order
    queues: list[dict[str, collections.deque[int]]] = [{q: collections.deque() for q in names}
                                                        for _ in range(num_stages)]
    queues[0]["fwd"].extend(range(num_mb))
    out: list[list[Action]] = [[] for _ in range(num_stages)]
    while True:
        pushes: list[tuple[int, str, int]] = []
        busy = False
        for i in range(num_stages):
            task = next((q for q in names if queues[i][q]), None)
            if task is None:
                continue
            busy = True
            mb = queues[i][task].popleft()
            if task == "fwd":
                out[i].append(Action(i, Op.F, mb))
                pushes.append((i + 1, "fwd", mb) if i < last else (i, "bi", mb))
            elif task == "rc":
                out[i].append(Action(i, Op.R, mb))
                pushes.append((i, "bi", mb))
            elif task == "bi":
                out[i].append(Action(i, Op.B, mb))
                pushes.append((i, "bw", mb))
                if i > 0:
                    pushes.append((i - 1, "rc", mb))
        if not busy:
            return tuple(tuple(stage) for stage in out)
        for stage, queue, mb in pushes:
            queues[stage][queue].append(mb)


def _zero_bubble(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1 (Qi et al., ICLR'24): 1F1B's order with the backward split and stage ``s``'s ``W`` actions ``s``
    places behind their ``B``: warm-up forwards, then ``F``, ``B`` (and ``W`` of the oldest micro-batch from the
    ``s``-th on), then the drain's ``B``, ``W`` pairs and the ``s`` deferred ``W``. The deferred ``W`` fill the
    drain, where 1F1B waits for gradients: with equal times the bubble is ``(S-1)·(F+B-W)`` instead of 1F1B's
    ``(S-1)·(F+B+W)``, two thirds less, for every ``M``. A stage holds 1F1B's graphs (``S-s``, to their ``B``)
    and up to ``s+1`` micro-batches waiting for their ``W`` (the inputs and output gradients of the split
    modules only), so no stage holds more than 1F1B's first stage does.
    """
    return _split_one_f_one_b(num_stages, num_mb)


def _varuna_zero_bubble(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """Varuna's order with the backward split: each stage runs :func:`_varuna`'s ``F``, ``R``, ``B`` in its order
    (every stage but the last recomputes, so its forwards run ahead with no graph kept, as many as ``varuna``'s),
    and stage ``s`` keeps up to ``s`` micro-batches' ``W`` behind their ``B`` (the oldest runs right after each
    later ``B``; the rest after the last ``B``), as ZB-H1 does: a ``B`` the previous stage waits for goes out a
    ``W`` sooner, and the deferred ``W`` fill the drain. A stage holds ``varuna``'s stashed inputs, one graph at a
    time (``R`` to ``B``) and up to ``min(s+1, M)`` micro-batches waiting for their ``W``. The runtime's
    opportunistic forward ([Note: opportunistic forward]) applies to its ``R`` as to ``varuna``'s.

    Why not ZB-H1's 1F1B order with ``R`` added (what this name meant before): a 1F1B first stage sends its next
    activation only after the previous micro-batch's gradient came back, so on a slow link it waits for a round
    trip per micro-batch; ``varuna``'s stage 0 keeps the link busy (benchmarks/README.md, "Real compute").
    """
    out = []
    for s, stage in enumerate(_varuna(num_stages, num_mb)):
        acts: list[Action] = []
        pending: collections.deque[int] = collections.deque()
        for action in stage:
            acts.append(action)
            if action.op is Op.B:
                pending.append(action.mb)
                if len(pending) > s:
                    acts.append(Action(s, Op.W, pending.popleft()))
        acts += [Action(s, Op.W, mb) for mb in pending]
        out.append(tuple(acts))
    return tuple(out)


def _split_one_f_one_b(num_stages: int, num_mb: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage ``s``: ``min(S-1-s, M)`` warm-up ``F``; then ``F``, ``B`` for each further micro-batch, each
    followed by the oldest ``W`` once ``s`` are pending; then ``B``, ``W`` for the rest; then the ``W`` still
    pending. (In unit times: the ``zb`` of the module's golden files.)"""
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_mb)
        acts = [Action(s, Op.F, mb) for mb in range(warmup)]
        weights = 0  # W actions placed so far (in micro-batch order)
        for i in range(num_mb - warmup):
            acts += [Action(s, Op.F, warmup + i), Action(s, Op.B, i)]
            if i >= s:
                acts.append(Action(s, Op.W, weights))
                weights += 1
        for mb in range(num_mb - warmup, num_mb):
            acts += [Action(s, Op.B, mb), Action(s, Op.W, weights)]
            weights += 1
        acts += [Action(s, Op.W, mb) for mb in range(weights, num_mb)]
        out.append(tuple(acts))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Generator:
    """A named schedule: its builder ``(S, M) -> actions`` and which stages it makes recompute ``(s, S) -> bool``."""

    build: Callable[[int, int], tuple[tuple[Action, ...], ...]]
    recomputes: Callable[[int, int], bool]


_GENERATORS = {
    # every stage but the last rebuilds its graph before each backward (the last runs B right after F)
    "varuna": _Generator(_varuna, lambda stage, num_stages: stage < num_stages - 1),
    "1f1b": _Generator(_one_f_one_b, lambda stage, num_stages: False),
    "gpipe": _Generator(_gpipe, lambda stage, num_stages: False),
    "zb": _Generator(_zero_bubble, lambda stage, num_stages: False),
    "varuna-zb": _Generator(_varuna_zero_bubble, lambda stage, num_stages: stage < num_stages - 1),
}


# ----------------------------------------------------------------------------------------------------
# simulation and validation


@dataclasses.dataclass
class _SimResult:
    rows: list[list[Action | None]]  # rows[step][list index] = action run in that step, or None (stall/done)
    positions: list[int]  # index of each stage's next unrun action
    stuck: bool


def _deps(action: Action, num_stages: int, recomputed: set[tuple[int, int]]) -> list[Action]:
    s, op, mb = action
    if op is Op.F:
        return [Action(s - 1, Op.F, mb)] if s > 0 else []
    if op is Op.R:
        return [Action(s, Op.F, mb)]
    if op is Op.W:
        return [Action(s, Op.B, mb)]
    deps = [Action(s, Op.F, mb)]
    if (s, mb) in recomputed:
        deps.append(Action(s, Op.R, mb))
    if s < num_stages - 1:
        deps.append(Action(s + 1, Op.B, mb))
    return deps


def _simulate(schedule: Schedule) -> _SimResult:
    """Lockstep replay: a stage runs its next action only if every dependency finished in an earlier step."""
    acts = schedule.actions
    recomputed = {(a.stage, a.mb) for stage in acts for a in stage if a.op is Op.R}
    done: set[Action] = set()
    pos = [0] * len(acts)
    rows: list[list[Action | None]] = []
    while any(p < len(stage) for p, stage in zip(pos, acts, strict=True)):
        row: list[Action | None] = [None] * len(acts)
        for s, stage in enumerate(acts):
            if pos[s] < len(stage):
                action = stage[pos[s]]
                if all(d in done for d in _deps(action, schedule.num_stages, recomputed)):
                    row[s] = action
        if all(a is None for a in row):
            return _SimResult(rows, pos, stuck=True)
        for s, taken in enumerate(row):
            if taken is not None:
                done.add(taken)
                pos[s] += 1
        rows.append(row)
    return _SimResult(rows, pos, stuck=False)


def _render(schedule: Schedule, sim: _SimResult) -> str:
    """Format the simulation as text; a deadlocked run gets a last row with each stuck stage's next action."""
    n = len(schedule.actions)
    cells = [[f"{a.op.value}{a.mb}" if a is not None else "." for a in row] for row in sim.rows]
    stuck_row = None
    if sim.stuck:
        stuck_row = [
            f"{stage[p].op.value}{stage[p].mb}" if p < len(stage) else "-"
            for p, stage in zip(sim.positions, schedule.actions, strict=True)
        ]
    width = max([3] + [len(c) + 1 for row in cells + ([stuck_row] if stuck_row else []) for c in row])
    label = max(5, len(str(len(cells))))
    lines = ["step".rjust(label) + " | " + "".join(str(s).ljust(width) for s in range(n)).rstrip()]
    for step, row in enumerate(cells):
        lines.append(str(step).rjust(label) + " | " + "".join(c.ljust(width) for c in row).rstrip())
    if stuck_row is not None:
        lines.append("stuck".rjust(label) + " | " + "".join(c.ljust(width) for c in stuck_row) + "<-- stuck")
    return "\n".join(lines)


def _where(schedule: Schedule, sim: _SimResult, wanted: Action) -> str:
    """Explain where a missing dependency is scheduled, to point at the inconsistent order."""
    for s, stage in enumerate(schedule.actions):
        for p, action in enumerate(stage):
            if action == wanted and p == sim.positions[s]:
                return f"{wanted} (stage {s}'s next action, itself blocked)"
            if action == wanted and p > sim.positions[s]:
                blocker = stage[sim.positions[s]]
                return f"{wanted} (stage {s} runs it at position {p}, after its blocked {blocker})"
    return f"{wanted} (never scheduled)"


def _structure_problems(schedule: Schedule) -> list[str]:
    """Everything wrong with the action lists themselves, independent of timing."""
    problems: list[str] = []
    num_mb = schedule.num_microbatches
    split = schedule.splits_backward  # then every stage runs one W per micro-batch, after its B
    for s, stage in enumerate(schedule.actions):
        where: dict[tuple[Op, int], list[int]] = collections.defaultdict(list)
        for p, action in enumerate(stage):
            if action.stage != s:
                problems.append(f"stage {s} position {p} holds {action}, an action of stage {action.stage}")
            if not 0 <= action.mb < num_mb:
                problems.append(f"stage {s} position {p}: {action} has micro-batch {action.mb} outside 0..{num_mb - 1}")
                continue
            where[(action.op, action.mb)].append(p)
        for mb in range(num_mb):
            for op in (Op.F, Op.B):
                count = len(where[(op, mb)])
                if count != 1:
                    what = "misses" if count == 0 else f"has {count} times"
                    problems.append(f"stage {s} {what} {op.value} of micro-batch {mb} (expected exactly one)")
            weights = where[(Op.W, mb)]
            if split and len(weights) != 1:
                what = "misses" if not weights else f"has {len(weights)} times"
                problems.append(f"stage {s} {what} W of micro-batch {mb} (expected exactly one: the schedule "
                                "splits the backward)")
            elif split and len(where[(Op.B, mb)]) == 1 and weights[0] < where[(Op.B, mb)][0]:
                problems.append(f"stage {s} runs W of micro-batch {mb} at position {weights[0]}, before its B "
                                f"(position {where[(Op.B, mb)][0]})")
            rec = where[(Op.R, mb)]
            if len(rec) > 1:
                problems.append(f"stage {s} recomputes micro-batch {mb} {len(rec)} times (at most once allowed)")
            elif rec and len(where[(Op.F, mb)]) == 1 and len(where[(Op.B, mb)]) == 1:
                f, b = where[(Op.F, mb)][0], where[(Op.B, mb)][0]
                if not f < rec[0] < b:
                    problems.append(
                        f"stage {s} runs R of micro-batch {mb} at position {rec[0]}, not between its F (position "
                        f"{f}) and B (position {b})"
                    )
    return problems


def validate(schedule: Schedule) -> None:
    """Check that every stage runs each micro-batch once and that the stages' orders cannot deadlock.

    Raises:
        ScheduleError: listing the problems found, with the step × stage grid of the lockstep simulation
            (ending in a ``<-- stuck`` row if it deadlocks).
    """
    problems = _structure_problems(schedule)
    sim = _simulate(schedule)
    title = f"schedule {schedule.name!r} ({schedule.num_stages} stages, {schedule.num_microbatches} micro-batches)"
    if problems:
        shown = problems[:_MAX_PROBLEMS]
        more = len(problems) - len(shown)
        text = "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")
        raise ScheduleError(
            f"{title} is malformed:\n  {text}\n{_render(schedule, sim)}",
            hint="every stage needs exactly one F and one B per micro-batch, at most one R between them, and, "
                 "if any stage runs W, one W after each B",
        )
    if sim.stuck:
        recomputed = {(a.stage, a.mb) for stage in schedule.actions for a in stage if a.op is Op.R}
        done = {a for row in sim.rows for a in row if a is not None}
        blocked = []
        for s, stage in enumerate(schedule.actions):
            if sim.positions[s] < len(stage):
                action = stage[sim.positions[s]]
                waits = [_where(schedule, sim, d) for d in _deps(action, schedule.num_stages, recomputed)
                         if d not in done]
                blocked.append(f"stage {s} is blocked at {action}, waiting for {', '.join(waits)}")
        raise ScheduleError(
            f"{title} deadlocks at step {len(sim.rows)}:\n  " + "\n  ".join(blocked) + f"\n{_render(schedule, sim)}",
            hint="reorder the stages' actions so that each dependency is scheduled before the action needing it",
        )
