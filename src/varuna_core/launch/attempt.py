"""One launch attempt of a job: place the plan's ranks on hosts, start a node agent per host (locally or over
SSH), stream every worker's output into per-rank logs, and watch the workers until they finish, crash, stop
being heard from, or must make way for a new configuration.

In a morph by handover two attempts run at once for a while: the running one watches its successor warm up
(:meth:`Attempt.warming`), asks its workers to publish once the successor is warm, and ends as soon as every rank
has published (its agents keep serving the shelves: the successor retires them after its first step).

:class:`varuna_core.launch.manager.Manager` runs attempts one after another (restarts, morphs); the CLI shows their
progress. The run directory holds what a user (or a benchmark) needs afterwards::

    <run_dir>/logs/rank<R>.log     every line of rank R, attempt after attempt (a header line per attempt)
             /events.jsonl         what the launcher did and when (wall-clock seconds)
             /metrics.jsonl        step, loss and step time of every step the workers reported
             /plans/attempt<K>.yaml the plan each attempt ran
             /slow_machines        hosts whose ranks compute slower than their peers
             /loss.png             the loss curve, drawn when the launcher ends
             /manager.json         where the manager listens, with the job's token (mode 0600)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO, overload

from pydantic import ValidationError

from ..env import WorkerEnv
from ..errors import EXIT_BAD_CHECKPOINT, EXIT_CHECKPOINTED, EXIT_LEFT, ConfigError, VarunaError
from ..planning.artifacts import Plan, save_plan
from .heartbeat import Beat, Listener
from .hosts import Host
from .options import LaunchOptions, forwarded_environ
from .protocol import (
    AgentEvent,
    AgentSpec,
    ErrorEvent,
    ExitEvent,
    ForkServerCommand,
    ForkServerEvent,
    GoneEvent,
    HandoverCommand,
    LegacyArgs,
    LogEvent,
    PreemptEvent,
    ReadyEvent,
    Regroup,
    ShelfSpec,
    SignalCommand,
    SignalledEvent,
    SpotWatch,
    StartedEvent,
    StopCommand,
    StoreEvent,
    WorkerSlot,
    describe,
    encode_regroup,
    regroup_key,
)
from .regroup import REGROUP_WAIT, RegroupPlan, plan_regroup, regrouped_plan
from .shelf import shelf_key
from .ssh import AgentEvents, AgentHandle
from .stragglers import Straggler, StragglerDetector

__all__ = ["Ending", "LaunchError", "AgentStartError", "NoMorph", "Node", "place", "JobFiles", "error_line", "Outcome",
           "Attempt", "Status", "Reporter", "worker_argv", "crash_cause"]

log = logging.getLogger(__name__)


class LaunchError(VarunaError):
    """The job could not be started or kept running (exit code 1)."""


class NoMorph(Exception):
    """Raised by a warm-up to say that the job's hosts need not change after all (the host it was to grow onto
    does not answer, and is left out): the running attempt goes on as it was."""


class AgentStartError(LaunchError):
    """The node agent on ``host`` did not come up (the host is down, SSH failed, the agent exited or stayed
    silent): with ``--morph`` the job leaves that host out rather than starting on it again at once."""

    def __init__(self, message: str, host: Host, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.host = host


@dataclass(frozen=True)
class Node:
    """A host of one attempt and the ``(rank, local rank)`` pairs it runs."""

    index: int
    host: Host
    ranks: tuple[tuple[int, int], ...]


def place(world: int, hosts: list[Host]) -> list[Node]:
    """Ranks ``0..world-1`` on the hosts in order, each host up to its slots (consecutive ranks share a host,
    as the planner assumes: a replica's stages are consecutive ranks).

    Raises:
        ConfigError: the hosts have fewer slots than ``world``.
    """
    capacity = sum(h.slots for h in hosts)
    if world > capacity:
        detail = ", ".join(f"{h.name}: {h.slots}" for h in hosts)
        raise ConfigError(f"the plan needs {world} devices (pp × dp); the hosts provide {capacity} ({detail})",
                          hint="add hosts or slots, or plan for fewer devices (`varuna plan --gpus N`)")
    nodes: list[Node] = []
    rank = 0
    for host in hosts:
        if rank == world:
            break
        count = min(host.slots, world - rank)
        nodes.append(Node(len(nodes), host, tuple((rank + i, i) for i in range(count))))
        rank += count
    return nodes


def worker_argv(script: list[str], python: str) -> list[str]:
    """``python SCRIPT ARGS`` for a ``.py`` script (as torchrun does), else ``SCRIPT ARGS`` (an executable)."""
    return [python, *script] if script[0].endswith(".py") else list(script)


def local_checkpoints_in(events: Path, limit: int = 16 * 2**20) -> dict[str, list[int]]:
    """The checkpoints in the hosts' own stores (``--ckpt-local``) that an earlier launcher recorded in ``events``
    (``checkpoint_local``), by run: what ``--resume`` continues from, since no directory the launcher can see
    holds them whole. Only the last ``limit`` bytes are read; a line that is not such an event is skipped."""
    found: dict[str, list[int]] = {}
    for event in _events_in(events, b'"checkpoint_local"', limit):
        step, run = event.get("step"), event.get("run")
        if event.get("event") == "checkpoint_local" and isinstance(run, str) and isinstance(step, int) \
                and not isinstance(step, bool) and 0 <= step < 2**62:
            found.setdefault(run, []).append(step)
    return {run: sorted(set(steps)) for run, steps in found.items()}


def _events_in(events: Path, marker: bytes, limit: int) -> list[dict[str, Any]]:
    """The events (JSON objects) of the last ``limit`` bytes of ``events`` whose line holds ``marker``."""
    try:
        with open(events, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            data = f.read(limit)
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        if marker not in line:
            continue
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def _attempts_in(events: Path, limit: int = 16 * 2**20) -> int:
    """The highest attempt number an earlier launcher recorded in ``events`` (0: none). A requeued Slurm job runs
    again in the same run directory: its attempts are numbered on, so that their logs, plans and events stay
    apart. Only the last ``limit`` bytes are read; a line that is not an event is skipped."""
    highest = 0
    for event in _events_in(events, b'"starting"', limit):
        attempt = event.get("attempt") if event.get("event") == "starting" else None
        if isinstance(attempt, int) and not isinstance(attempt, bool) and 0 < attempt < 2**31:
            highest = max(highest, attempt)
    return highest


class JobFiles:
    """The run directory (see the module docstring). Thread-safe: an attempt that retires after a handover is
    stopped in a thread of its own while its successor runs, and both write here."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "plans").mkdir(exist_ok=True)
        self._logs: dict[int, TextIO] = {}
        self._lock = threading.Lock()
        self.attempts_before = _attempts_in(self.run_dir / "events.jsonl")
        self._events = open(self.run_dir / "events.jsonl", "a", buffering=1)  # noqa: SIM115 - see close()
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - see close()

    def rank_log(self, rank: int) -> Path:
        return self.run_dir / "logs" / f"rank{rank}.log"

    def log_line(self, rank: int, line: str) -> None:
        with self._lock:
            f = self._logs.get(rank)
            if f is None:
                f = self._logs[rank] = open(self.rank_log(rank), "a", buffering=1)  # noqa: SIM115 - see close()
            f.write(line + "\n")

    def event(self, name: str, **fields: object) -> None:
        line = json.dumps({"t": time.time(), "event": name, **fields}) + "\n"
        with self._lock:
            self._events.write(line)

    def metric(self, **fields: object) -> None:
        line = json.dumps(fields) + "\n"
        with self._lock:
            self._metrics.write(line)

    def slow(self, s: Straggler) -> None:
        with open(self.run_dir / "slow_machines", "a") as f:
            f.write(f"{s.host} rank={s.rank} stage={s.stage} compute={s.ratio:.2f}x_median {time.strftime('%FT%T')}\n")

    def close(self) -> None:
        with self._lock:
            for f in [*self._logs.values(), self._events, self._metrics]:
                f.close()
            self._logs = {}


@dataclass
class Status:
    """What the live view shows."""

    attempt: int = 0
    state: str = "starting"
    pp: int = 0
    dp: int = 0
    hosts: int = 0
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    step_time: float | None = None
    samples_per_step: int | None = None
    restarts: int = 0
    morphs: int = 0
    stragglers: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    local_checkpoints: list[int] = field(default_factory=list)  # --ckpt-local: steps every host holds its part of

    @property
    def samples_per_second(self) -> float | None:
        if self.step_time and self.samples_per_step:
            return self.samples_per_step / self.step_time
        return None

    @property
    def eta(self) -> float | None:
        if self.total_steps and self.step_time and self.step < self.total_steps:
            return (self.total_steps - self.step) * self.step_time
        return None


class Reporter(Protocol):
    def event(self, message: str) -> None: ...

    def status(self, status: Status) -> None: ...


class Ending(str, Enum):
    """How an attempt ended (a ``str``: the ``ending`` event of ``events.jsonl`` records its value)."""

    DONE = "done"  # every worker finished
    CRASH = "crash"  # a worker or an agent failed: restart from the last checkpoint
    MORPH = "morph"  # the workers checkpointed for a change of hosts: continue on Outcome.hosts
    CHECKPOINTED = "checkpointed"  # the workers checkpointed and stopped when asked from outside (SIGUSR1)
    TERMINATED = "terminated"  # the launcher got SIGTERM (or SIGUSR1): checkpoint, then stop
    INTERRUPTED = "interrupted"  # Ctrl-C: stop at once


@dataclass
class Outcome:
    """How an attempt ended, and what the manager needs to go on."""

    kind: Ending
    message: str = ""
    hosts: list[Host] | None = None  # morph: the hosts to continue on
    step: int | None = None  # the last step the workers completed
    refused: bool = False  # crash: the checkpoint to resume from was refused by the workers
    suspects: list[str] | None = None  # crash: the hosts that may be down (None: any of them)
    unstarted: Host | None = None  # crash: the host whose agent did not start (the job leaves it out)
    successor: Attempt | None = None  # morph by handover: the new configuration, warm, waiting for its go
    published: bool = False  # morph by handover: every old rank published step ``step`` on its host's shelf
    copies: bool = False  # recovery from a snapshot: each host's files are also on the next host (the go says so)


# seconds the launcher waits, after ranks failed plainly, for news of the cause (an agent lost with its host, a
# rank killed): a rank whose peer died fails within milliseconds of it, sometimes before the loss is reported
SYMPTOM_WAIT = 1.0


class Attempt:
    """Start the agents of one configuration and watch them (see :meth:`run`)."""

    def __init__(self, number: int, plan: Plan, nodes: list[Node], resume: int | None, opts: LaunchOptions,
                 files: JobFiles, listener: Listener, reporter: Reporter, status: Status, job: str, token: str,
                 manager_address: Callable[[Host], str], run_id: str, *, warm: bool = False) -> None:
        self.number, self.plan, self.nodes, self.resume = number, plan, nodes, resume
        self.warm = warm  # started beside a running configuration: its workers wait for the go of a handover
        self.successor: Attempt | None = None  # the configuration warming up to take over from this one
        self.publish_by: float | None = None  # (of a successor) when the old one must publish even if not warm
        self.publish_asked: float | None = None  # when the workers were asked to publish (monotonic)
        self.retiring: Attempt | None = None  # the attempt this one took over from: stopped after the first step
        self.snapshot_recorded: int | None = None  # the newest snapshot written to events.jsonl
        self._snapshot_reports: dict[int, dict[int, Beat]] = {}  # snapshots not written yet: step -> rank's beat
        self._retirement: threading.Thread | None = None
        self.handover_failed = False  # a rank reported that its publish or its take fell back to the store
        self.recorded: set[int] = set()  # the steps of this attempt written to metrics.jsonl
        self.opts, self.files, self.listener, self.reporter, self.status = opts, files, listener, reporter, status
        self.job, self.token, self.manager_address, self.run_id = job, token, manager_address, run_id
        self.world = plan.pp * plan.dp
        self.events: AgentEvents = queue.Queue()
        self.agents: list[AgentHandle] = []
        self.exits: dict[int, int] = {}
        self.errors: dict[int, str] = {}  # rank -> the last "error: ..." line it printed
        self.last_lines: dict[int, str] = {}  # rank -> the last non-empty line it printed (see error_line)
        self.gone: set[int] = set()
        self.rank_host = {rank: node.host.name for node in nodes for rank, _ in node.ranks}
        self.node_ranks = {node.index: {rank for rank, _ in node.ranks} for node in nodes}
        # a regroup renumbers the workers: an agent names its workers by their first rank, the heartbeats by their
        # current one (None: lost, or left the job)
        self.renumber: dict[int, int | None] = {rank: rank for rank in self.rank_host}
        self.regroups = 0  # regroups of this attempt so far
        self._regrouping: float | None = None  # when the launcher began to wait for the survivors' steps
        self._regroup_failed = False  # a regroup was not possible: the next loss ends the attempt as before
        self._written_off: set[int] = set()  # nodes lost and regrouped around
        self._last_regroup_step = -1
        self._lost_now: set[int] = set()  # the ranks lost with a host while the survivors are asked how far they got
        self._failed_at: float | None = None  # when a rank first failed plainly (see _symptom)
        self._on_regroup: Callable[[list[str], Plan], None] | None = None
        self._new_stragglers(plan)
        self.started_at = time.monotonic()
        self.first_step_seen = False
        self.forked: set[int] = set()  # the ranks the hosts' fork servers started
        self.signalled: str | None = None  # the scheduler's signal an agent reported, and where
        self.scheduler_signal: str | None = None  # that signal's name (SIGUSR1: Slurm's warning, SIGTERM: the end)

    def _new_stragglers(self, plan: Plan) -> None:
        stage_of = {}
        for s, ranks in enumerate(plan.stage_to_rank_map.rstrip(";").split(";")):
            for r in ranks.split(","):
                stage_of[int(r)] = s
        self.stragglers = StragglerDetector(stage_of, [st.busy for st in plan.stages] or None,
                                            threshold=self.opts.straggler_threshold)

    # ------------------------------------------------------------------------------------------------------
    # Start

    def _spec(self, node: Node, master_port: int | None) -> AgentSpec:
        told = WorkerEnv(
            ckpt_dir=str(self.opts.ckpt_dir), run_dir=str(self.opts.run_dir), job_id=self.job, job_token=self.token,
            attempt=self.number, run_id=self.run_id, resume_step=None if self.warm else self.resume,
            handover="wait" if self.warm else None,
            shelf_dir=self.opts.shelf_dir if self.handing_over else None,
            shelf_budget=self.opts.shelf_budget if self.handing_over else None,
            handover_copies=0 if self.handing_over and not self.opts.handover_copies else None,
            snapshot_every=_snapshots(self.opts.snapshot_every) if self.handing_over else None,
            manager=f"{self.manager_address(node.host)}:{self.listener.port}",
            ckpt_every=self.opts.ckpt_every or None, ckpt_keep=self.opts.ckpt_keep or None,
            ckpt_tempdir=str(self.opts.ckpt_tempdir) if self.opts.ckpt_tempdir else None,
            ckpt_local=1 if self.opts.ckpt_local else None,
            regroup=1 if self.handing_over and self.opts.regroup and self.plan.dp > 1 else None,
            total_steps=self.opts.total_steps or None, on_sigterm="checkpoint" if self.opts.slurm else None)
        legacy = None
        if self.opts.legacy_args:
            legacy = LegacyArgs(stage_to_rank_map=self.plan.stage_to_rank_map, chunk_size=self.plan.microbatch_size,
                                batch_size=self.plan.batch_size // self.plan.dp)
        try:
            return self._agent_spec(node, master_port, told, legacy)
        except ValueError as exc:  # pydantic's ValidationError is one
            detail = describe(exc) if isinstance(exc, ValidationError) else str(exc)
            raise LaunchError(f"cannot describe node {node.index} ({node.host.name}) to its agent: {detail}") from None

    def _agent_spec(self, node: Node, master_port: int | None, told: WorkerEnv, legacy: LegacyArgs | None) -> AgentSpec:
        return AgentSpec(
            job=self.job, node=node.index, host=node.host.name, store=node.index == 0,
            master_addr=self.nodes[0].host.address if self.opts.ssh or self.opts.slurm else "127.0.0.1",
            master_port=master_port, world=self.world,
            workers=[WorkerSlot(rank=r, local_rank=lr) for r, lr in node.ranks],
            argv=worker_argv(self.opts.script, self.opts.runtime.python), cwd=self.opts.runtime.code_dir,
            env={**forwarded_environ(os.environ), **self.opts.env, **told.to_environ()},
            plan=self.plan.model_dump(mode="json"),
            grace=self.opts.grace, legacy_args=legacy, scheduler_signals=self.opts.slurm is not None,
            shelf=ShelfSpec(root=self.opts.shelf_dir, key=shelf_key(self.job, self.number),
                            budget=self.opts.shelf_budget,
                            store=str(self.opts.ckpt_dir) if self.opts.ckpt_local else None)
            if self.handing_over else None,
            spot=SpotWatch(source=spot.source,  # type: ignore[arg-type]  # SpotConfig checked it against SOURCES
                           endpoint=spot.endpoint, interval=spot.interval, vm_name=spot.vm_name)
            if (spot := self.opts.spot) is not None else None,
            fork_server=self.handing_over and self.opts.fork_server,
            # before the workers where it saves imports (several on the host) or would be started anyway once the
            # job trains (a handover: then its import is not added to the first steps'); not under Slurm, whose
            # signals must reach the workers as processes of its job step
            fork_now=self.opts.fork_server and (len(node.ranks) > 1 or self.handing_over) and self.opts.slurm is None)

    @property
    def handing_over(self) -> bool:
        """Whether a morph of this job goes by handover (its agents serve shelves, its workers publish)."""
        return self.opts.morph and self.opts.handover

    def beats(self) -> dict[int, Beat]:
        """The latest heartbeat of each of this attempt's ranks."""
        return self.listener.snapshot(self.number)

    def start(self) -> None:
        """Start node 0's agent (it hosts the job's store), then every other; roll everything back if one fails.

        Raises:
            LaunchError: an agent did not come up (the message names its host).
        """
        for node in self.nodes:
            for rank, _ in node.ranks:
                self.files.log_line(rank, f"===== attempt {self.number}: rank {rank} on {node.host.name}, "
                                          f"pp={self.plan.pp} dp={self.plan.dp}, resume "
                                          f"{self._resume_text()} =====")
        try:
            first = self._start_agent(self.nodes[0], None)
            port = self._await(first, "store", timeout=120).port
            for node in self.nodes[1:]:
                self._start_agent(node, port)
            for agent in self.agents:
                self._await(agent, "ready", timeout=60)
        except BaseException:
            self.stop(grace=2)
            raise

    def _resume_text(self) -> str:
        if self.warm:
            return "by handover (warm start)"
        return f"step {self.resume}" if self.resume is not None else "none"

    def _start_agent(self, node: Node, master_port: int | None) -> AgentHandle:
        agent = AgentHandle(node.index, node.host, self._spec(node, master_port), self.events, self.opts.runtime,
                            self.opts.slurm or self.opts.ssh)
        self.agents.append(agent)
        return agent

    @overload
    def _await(self, agent: AgentHandle, kind: Literal["store"], timeout: float) -> StoreEvent: ...

    @overload
    def _await(self, agent: AgentHandle, kind: Literal["ready"], timeout: float) -> ReadyEvent: ...

    def _await(self, agent: AgentHandle, kind: str, timeout: float) -> AgentEvent | GoneEvent:
        """Wait for ``agent``'s event ``kind``; other events are put back for :meth:`run`."""
        if kind == "ready" and agent.ready is not None:
            return agent.ready
        deadline = time.monotonic() + timeout
        held: list[tuple[int, AgentEvent | GoneEvent]] = []
        try:
            while time.monotonic() < deadline:
                try:
                    node, event = self.events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(event, ReadyEvent):
                    self.agents[node].ready = event
                if node == agent.node and event.event == kind:
                    return event
                if isinstance(event, ReadyEvent):
                    self.agents[node].ready = event
                    if node == agent.node and kind == "ready":
                        return event
                    continue
                if isinstance(event, (GoneEvent, ErrorEvent)) and node == agent.node:
                    detail = getattr(event, "message", "") or agent.last_words() or \
                        f"exit code {getattr(event, 'code', None)}"
                    raise AgentStartError(f"the agent on {agent.host.name} failed to start: {detail}", agent.host,
                                          hint="run `varuna launch` with the same hosts file to see the pre-flight "
                                               "check")
                held.append((node, event))
            raise AgentStartError(f"the agent on {agent.host.name} did not report {kind!r} within {timeout:g}s",
                                  agent.host, hint="; ".join(agent.stderr[-3:]) or None)
        finally:
            for item in held:
                self.events.put(item)

    # ------------------------------------------------------------------------------------------------------
    # Watch

    def run(self, changes: Callable[[], tuple[list[Host], str] | None],
            terminating: Callable[[], tuple[int, str]] = lambda: (0, ""),
            warmup: Callable[[list[Host]], Attempt | None] | None = None,
            regrouped: Callable[[list[str], Plan], None] | None = None) -> Outcome:
        """Watch the workers until the attempt ends. ``changes()`` says whether the set of hosts should change
        (the new hosts and why); ``terminating()`` whether the launcher must stop (1: after an on-demand
        checkpoint, 2: now) and why (e.g. ``SIGTERM``). A scheduler's signal reported by an agent counts as 1.
        For either, the workers are asked to checkpoint and stop.

        ``warmup(hosts)``: a morph by handover. On a change of hosts it starts the new configuration beside this
        one (its workers warm up while these train) and returns it, or None if it cannot (the morph then goes
        through the store). Once every new worker is warm (or the successor's ``publish_by`` comes), the workers
        are asked to publish their state on their hosts' shelves and stop (SIGUSR2); the outcome then carries
        the successor. A successor that fails while warming is stopped and reported, and the morph goes
        through the store.

        ``regrouped(hosts, plan)``: the workers of ``hosts`` were lost and the others went on as ``plan``
        (:meth:`_regroup`)."""
        self._on_regroup = regrouped
        request: Outcome | None = None  # what the attempt ends as once the workers have checkpointed and stopped
        asked_at: float | None = None
        try:
            while True:
                # the heartbeats arrive on the listener's thread: while the workers hand over (the new configuration
                # waits for them to have published), look at them more often
                self._drain(0.25 if self.publish_asked is None else 0.02)
                self._heartbeats()
                outcome = self._ended(request)
                if outcome is not None:
                    return self._ending(outcome)
                silent = self._silent()
                if silent:
                    why, host = silent
                    return self._ending(Outcome(Ending.CRASH, why, hosts=request.hosts if request else None,
                                                suspects=[host]))
                urgency, why = terminating()
                if not urgency and self.signalled:
                    urgency, why = 1, self.signalled
                if urgency >= 2:
                    return self._ending(Outcome(Ending.TERMINATED, f"on {why} again, without waiting for the "
                                                                    f"checkpoint"))
                if self.successor is not None and self.publish_asked is not None:
                    urgency = 0  # the state is on its way to the new configuration, which checkpoints it first
                if request is None or (urgency and request.kind is not Ending.TERMINATED):
                    new, reason = None, why
                    if urgency:
                        new = Outcome(Ending.TERMINATED, f"on {why}, after an on-demand checkpoint")
                    elif (warmup is None or self.first_step_seen) and (change := changes()) is not None:
                        # (with a handover, the next change waits for this attempt's first step: the old
                        # configuration's shelves are freed first, and the first step is timed as it happens)
                        new, reason = Outcome(Ending.MORPH, change[1], hosts=change[0]), change[1]
                    if new is not None:
                        first, request = request is None, new
                        warming = self.successor is not None and self.publish_asked is None
                        if warming and urgency:
                            self._drop_successor(f"{why} arrived while it warmed up")
                        if first and new.kind is Ending.MORPH and warmup is not None and self._all_reported():
                            asked_at = time.monotonic()
                            try:
                                self._warm_successor(warmup, new, reason)
                            except NoMorph as exc:
                                self.reporter.event(f"no morph after all: {exc}")
                                self.status.state, request, asked_at = "training", None, None
                                continue
                            if self.successor is not None:
                                continue
                        if first or (warming and urgency):
                            asked_at = time.monotonic()
                            if not self._ask_to_checkpoint(reason):
                                return self._ending(Outcome(new.kind, new.message + " (before the first step: "
                                                            "nothing to checkpoint)", hosts=new.hosts,
                                                            step=self.resume))
                if self.successor is not None and self.publish_asked is None and request is not None:
                    self._watch_successor(request)
                    if self.successor is None:  # it failed: the morph goes through the store
                        asked_at = time.monotonic()
                        if not self._ask_to_checkpoint(request.message):
                            return self._ending(Outcome(request.kind, request.message, hosts=request.hosts,
                                                        step=self.resume))
                    continue
                if request is not None and asked_at is not None and \
                        time.monotonic() - asked_at > self.opts.morph_timeout:
                    return self._ending(Outcome(request.kind, f"{request.message}; the on-demand checkpoint did "
                                                f"not finish within {self.opts.morph_timeout:g}s: continuing from "
                                                f"the last complete checkpoint", hosts=request.hosts))
        except KeyboardInterrupt:
            return self._ending(Outcome(Ending.INTERRUPTED, "interrupted"))

    # ------------------------------------------------------------------------------------------------------
    # A morph by handover

    def _all_reported(self) -> bool:
        """Whether every rank has sent a heartbeat (installed its handlers); before, nothing is worth keeping."""
        beats = self.beats()
        return all(r in beats for r in range(self.world))

    def _warm_successor(self, warmup: Callable[[list[Host]], Attempt | None], request: Outcome, why: str) -> None:
        assert request.hosts is not None  # a morph names its hosts
        self.status.state = "warming up"
        self.reporter.event(f"{why}: starting the new configuration beside this one")
        self.successor = warmup(request.hosts)
        if self.successor is not None:
            self.files.event("warming", attempt=self.number, successor=self.successor.number)

    def _watch_successor(self, request: Outcome) -> None:
        """Ask the workers to publish once the successor is warm (or its ``publish_by`` comes); drop it if it
        failed."""
        successor = self.successor
        assert successor is not None
        state, detail = successor.warming()
        if state == "failed":
            self._drop_successor(detail)
            return
        late = successor.publish_by is not None and time.monotonic() >= successor.publish_by
        if state == "warm" or late:
            if late and state != "warm":
                self.reporter.event("the hosts leave soon: handing over before every new worker is warm")
            self._ask_to_publish(request.message)

    def warming(self) -> tuple[str, str]:
        """(Of a successor) ``("warm", "")`` once every worker waits for its go; ``("failed", why)`` if a worker
        exited, an agent was lost, or a worker was not warm within the start timeout; else ``("warming", "")``."""
        self._drain(0)
        if self.gone:
            return "failed", f"lost the agent on {', '.join(self.agents[n].host.name for n in sorted(self.gone))}"
        if self.exits:
            rank, code = next(iter(self.exits.items()))
            why = self._why(rank)
            return "failed", (f"rank {rank} on {self.rank_host[rank]} exited with {_describe(code)} while warming "
                              f"up{f': {why}' if why else ''} (log: {self.files.rank_log(rank)})")
        beats = self.beats()
        if all(beats.get(r) is not None and beats[r].get("t_warm") is not None for r in range(self.world)):
            return "warm", ""
        if time.monotonic() - self.started_at > self.opts.start_timeout:
            cold = [r for r in range(self.world) if beats.get(r) is None or beats[r].get("t_warm") is None]
            return "failed", (f"rank {cold[0]} on {self.rank_host[cold[0]]} was not warm within "
                              f"{self.opts.start_timeout:g}s")
        return "warming", ""

    def _drop_successor(self, why: str) -> None:
        successor = self.successor
        assert successor is not None
        self.successor = None
        self.reporter.event(f"the new configuration (attempt {successor.number}) is given up: {why}; this one "
                            f"checkpoints to the store instead")
        self.files.event("warm_failed", attempt=self.number, successor=successor.number, reason=why)
        successor.stop(grace=2)
        self.listener.expect(None)

    def _ask_to_publish(self, why: str) -> None:
        """SIGUSR2 to every worker: publish on the host's shelf at the next step, then stop. The agents of hosts
        the new configuration leaves out are told so (their replicas on staying hosts then write the state), and
        so is the agent of a host the new configuration runs on alone (its workers' files are then only linked on
        that host: they need no hash)."""
        self.publish_asked = time.monotonic()
        staying = {n.host.name for n in self.successor.nodes} if self.successor is not None else None
        leaving = sorted({a.host.name for a in self.agents} - staying) if staying is not None else []
        alone = next(iter(staying)) if staying is not None and len(staying) == 1 else None
        self.files.event("handover_asked", attempt=self.number, reason=why, leaving=leaving, alone=alone)
        self.reporter.event("the new configuration is warm: asking every worker to hand its state over")
        self.status.state = "handing over"
        for agent in self.agents:
            agent.send(SignalCommand(signal="SIGUSR2", leaving=agent.host.name in leaving,
                                     alone=agent.host.name == alone))

    def _published(self) -> int | None:
        """The step every rank has published on its host's shelf, if they all have."""
        beats = self.beats()
        steps = {beats[r].get("published") if r in beats else None for r in range(self.world)}
        return steps.pop() if len(steps) == 1 and None not in steps else None

    def _ending(self, outcome: Outcome) -> Outcome:
        """``outcome``, with the successor when the workers stopped for a handover; else the successor (if any)
        is stopped."""
        successor, self.successor = self.successor, None
        if successor is None:
            return outcome
        if outcome.kind is Ending.MORPH and self.publish_asked is not None and outcome.step is not None:
            beats = self.beats()
            published = self._published() == outcome.step
            if published:
                self.files.event("published", attempt=self.number, step=outcome.step,
                                 t_publishing=min(beats[r].get("t_publishing") or 0.0 for r in range(self.world)),
                                 t_published=max(beats[r].get("t_published") or 0.0 for r in range(self.world)),
                                 bytes=sum(beats[r].get("published_bytes") or 0 for r in range(self.world)))
            return dataclasses.replace(outcome, successor=successor, published=published)
        self.reporter.event(f"the new configuration (attempt {successor.number}) is stopped: {outcome.message}")
        successor.stop(grace=2)
        self.listener.expect(None)
        return outcome

    def go(self, message: str) -> None:
        """(Of a successor) tell its workers where their state is: node 0's agent puts the signed go in the
        store."""
        self.agents[0].send(HandoverCommand(message=message))

    def retire(self, old: Attempt) -> None:
        """``old`` handed its state over to this attempt: its agents keep serving their shelves until this
        attempt's first step (or its end), then they are stopped (and their shelves cleared)."""
        self.retiring = old

    def retire_now(self) -> None:
        """Stop the attempt this one took over from, if it still serves its shelves, and wait for it."""
        self._retire_now(wait=True)

    def _retire_now(self, wait: bool = False) -> None:
        old = self.retiring
        if old is not None and self._retirement is None:
            # a host the job leaves with the old configuration keeps no fork server
            leaving = {n.host.name for n in old.nodes} - {n.host.name for n in self.nodes}
            self._retirement = threading.Thread(target=lambda: old.stop(leaving=leaving), name="retire",
                                                daemon=True)
            self._retirement.start()
            self.files.event("retired", attempt=old.number)
        if wait and self._retirement is not None:
            self._retirement.join(timeout=old.opts.grace + 20 if old is not None else 20)

    def _record_snapshot(self, beats: dict[int, Beat]) -> None:
        """A ``snapshot`` event for each snapshot, in step order: its cost (the slowest rank's), the interval to
        the next, and the bytes it holds on each host (a host's own files and its copy of another's). Each rank's
        report of a snapshot is kept as it is heard (a beat carries only its rank's newest), and the event is
        written once every rank's is in, or with those heard when a newer snapshot is reported first."""
        for beat in beats.values():
            step = beat.get("snapshot")
            if isinstance(step, int) and (self.snapshot_recorded is None or step > self.snapshot_recorded):
                self._snapshot_reports.setdefault(step, {})[beat.rank] = beat
        for step in sorted(self._snapshot_reports):
            reports = self._snapshot_reports[step]
            if len(reports) < self.world and step == max(self._snapshot_reports):
                break  # the newest: wait for the other ranks' reports
            del self._snapshot_reports[step]
            self.snapshot_recorded = step
            held: dict[str, int] = {}
            for beat in reports.values():
                held[beat.host] = held.get(beat.host, 0) + (beat.get("snapshot_bytes") or 0)
            self.files.event("snapshot", attempt=self.number, step=step,
                             seconds=max(b.get("snapshot_seconds") or 0.0 for b in reports.values()),
                             every=max(b.get("snapshot_every") or 0 for b in reports.values()),
                             peer=all(b.get("snapshot_peer") for b in reports.values()), host_bytes=held,
                             ranks=len(reports))

    def _record_local_checkpoint(self, beats: dict[int, Beat]) -> None:
        """A checkpoint in the hosts' own stores (``--ckpt-local``), reported once every host has its part (every
        rank reports it after the same agreement): remembered for a restart, and a ``checkpoint_local`` event."""
        steps = [s for b in beats.values() if isinstance(s := b.get("local_ckpt"), int)]
        if not steps or max(steps) in self.status.local_checkpoints:
            return
        step = max(steps)
        self.status.local_checkpoints.append(step)
        self.files.event("checkpoint_local", attempt=self.number, step=step, run=self.run_id)

    def snapshot(self) -> tuple[int, bool] | None:
        """The newest in-memory snapshot, as the workers reported it (a snapshot is reported once it is whole on
        every rank): its step, and whether each host's files are also on the next host; None if none. One taken
        before a regroup is not one: its files are named by the ranks before it (the workers take the next one at
        the step after the regroup)."""
        best: tuple[int, bool] | None = None
        for beat in self.beats().values():
            step = beat.get("snapshot")
            if isinstance(step, int) and step > self._last_regroup_step and (best is None or step > best[0]):
                best = (step, bool(beat.get("snapshot_peer")))
        return best

    def host_order(self) -> list[str]:
        """The attempt's hosts in the order of their first rank (the ring of the snapshots' copies)."""
        return list(dict.fromkeys(self.rank_host[r] for r in range(self.world)))

    def end_workers(self) -> list[str]:
        """SIGKILL every worker that is left, wherever it is (blocked in a collective with a lost peer too), and
        keep the agents: their shelves hold the workers' snapshots for the next configuration. Returns the hosts
        whose agent is gone (it reported nothing since, or the command could not be sent to it)."""
        self.files.event("workers_ended", attempt=self.number)
        gone = {self.agents[n].host.name for n in self.gone}
        for agent in self.agents:
            if not agent.send(SignalCommand(signal="SIGKILL")):
                gone.add(agent.host.name)
        return sorted(gone)

    def _ask_to_checkpoint(self, why: str) -> bool:
        """SIGUSR1 to every worker; False (nothing sent) if some rank has not reported yet, i.e. has not installed
        its handler and has made no step (stopping it loses nothing)."""
        beats = self.beats()
        if any(r not in beats for r in range(self.world)):
            return False
        self.files.event("signal", reason=why, attempt=self.number)
        self.reporter.event(f"{why}: asking every worker to checkpoint and stop")
        self.status.state = "checkpointing"
        for agent in self.agents:
            agent.send(SignalCommand(signal="SIGUSR1"))
        return True

    def _drain(self, timeout: float) -> None:
        try:
            node, event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._handle(node, event)
            try:
                node, event = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, node: int, event: AgentEvent | GoneEvent) -> None:
        rank = getattr(event, "rank", None)
        if rank is not None and rank not in self.node_ranks[node]:
            self.reporter.event(f"agent on {self.agents[node].host.name} reported rank {rank}, which it "
                                f"does not run: ignored")
            return
        current = self.renumber.get(rank) if rank is not None else None
        if isinstance(event, LogEvent):
            self.files.log_line(event.rank, event.line)  # a worker's log keeps its first rank's name
            said = event.line.split("] ", 1)[-1] if event.line.startswith("[rank ") else event.line
            if said.startswith("error: ") and current is not None:
                self.errors[current] = said[len("error: "):][:500]
            if said.strip() and current is not None:
                self.last_lines[current] = said.strip()
        elif isinstance(event, ExitEvent):
            if current is not None:
                self.exits[current] = event.code
            elif event.code not in (0, EXIT_LEFT):  # (a worker that left, or one of a host already lost)
                self.reporter.event(f"worker {event.rank} on {self.agents[node].host.name}, no longer part of the "
                                    f"job, exited with {_describe(event.code)}")
        elif isinstance(event, StartedEvent):
            if event.forked:
                self.forked.add(event.rank)
        elif isinstance(event, ForkServerEvent):
            host = self.agents[node].host.name
            self.files.event("fork_server", attempt=self.number, host=host, pid=event.pid, seconds=event.seconds,
                             message=event.message)
            if event.message:
                self.reporter.event(f"{host}: {event.message} (the workers of later attempts start as new "
                                    f"interpreters)")
        elif isinstance(event, GoneEvent):
            self.gone.add(node)
        elif isinstance(event, ReadyEvent):
            self.agents[node].ready = event
        elif isinstance(event, ErrorEvent):
            self.reporter.event(f"agent on {self.agents[node].host.name}: {event.message}")
        elif isinstance(event, PreemptEvent):
            host = self.agents[node].host.name
            self.files.event("spot_notice", host=host, source=event.source, seconds=event.seconds,
                             detail=event.detail)
            self.reporter.event(f"{event.source} says {host} goes away in {event.seconds:.0f}s ({event.detail})")
            self.listener.add_notice(host, event.seconds, event.source)
        elif isinstance(event, SignalledEvent) and self.signalled is None:
            self.scheduler_signal = event.signal
            self.signalled = f"{event.signal} from the scheduler on {self.agents[node].host.name}"
            self.files.event("scheduler_signal", host=self.agents[node].host.name, signal=event.signal)

    def _heartbeats(self) -> None:
        for step, (loss, step_time) in sorted(self.listener.take_steps().items()):
            if step in self.recorded:  # another rank's report of it, heard in a later poll
                continue
            self.recorded.add(step)
            self.files.metric(step=step, loss=loss, step_time=step_time, attempt=self.number, t=time.time())
            if step + 1 >= self.status.step:
                self.status.step, self.status.loss = step + 1, loss
                if step_time:
                    self.status.step_time = step_time
        beats = self.beats()
        if not beats:
            return
        failed = next((b for b in beats.values() if b.get("handover_failed")), None)
        if failed is not None and not self.handover_failed:
            self.handover_failed = True  # once per attempt: every rank says the same
            self.reporter.event(f"the handover failed on rank {failed.rank} ({failed.get('handover_failed')}): "
                                f"the state goes through the store")
            self.files.event("handover_failed", attempt=self.number, rank=failed.rank,
                             reason=failed.get("handover_failed"))
        if not self.first_step_seen and any(b.get("loss") is not None for b in beats.values()):
            self.first_step_seen = True
            timings = {key: max((b.get(key) for b in beats.values() if b.get(key)), default=None)
                       for key in ("t_start", "t_ready", "t_warm", "t_resumed")}  # the slowest rank's
            taken = {key: sum(b.get(key) or 0 for b in beats.values())
                     for key in ("taken_local", "taken_remote", "taken_copies", "taken_replica")}
            self.files.event("first_step", attempt=self.number, step=self.status.step, **timings,
                             **(taken if self.retiring is not None or any(taken.values()) else {}),
                             forked=len(self.forked))
            if self.handing_over and self.opts.fork_server:
                for agent in self.agents:  # the later attempts' workers: forked, not started
                    agent.send(ForkServerCommand())
            if self.retiring is not None and taken["taken_replica"]:
                self.reporter.event(f"{taken['taken_replica']} bytes of the state came from data-parallel replicas' "
                                    f"copies: the host that wrote them did not give them (see the workers' logs)")
                self.files.event("handover_replica", attempt=self.number, bytes=taken["taken_replica"])
            self.status.state = "training"
            self._retire_now()  # the old configuration's state is no longer needed
        self._record_snapshot(beats)
        self._record_local_checkpoint(beats)
        total = next((b.get("total_steps") for b in beats.values() if b.get("total_steps")), None)
        self.status.total_steps = total or self.opts.total_steps
        self.status.samples_per_step = self.plan.batch_size
        reports = {r: (b.host, b.step, b.get("compute_time")) for r, b in beats.items()}
        for s in self.stragglers.observe(reports):
            self.files.slow(s)
            self.status.stragglers.append(f"{s.host} (rank {s.rank}, {s.ratio:.1f}x)")
            self.reporter.event(f"straggler: rank {s.rank} on {s.host} computes {s.ratio:.2f}x the median")
        self.reporter.status(self.status)

    def _silent(self) -> tuple[str, str] | None:
        """Why the attempt must be given up for lack of news, and the host that fell silent; or None."""
        now = time.monotonic()
        beats = self.beats()
        running = [r for r in range(self.world) if r not in self.exits and r not in self._lost_now]
        for r in running:
            beat = beats.get(r)
            if beat is None:
                if now - self.started_at > self.opts.start_timeout:
                    return (f"rank {r} on {self.rank_host[r]} sent no heartbeat within {self.opts.start_timeout:g}s "
                            f"of its start (log: {self.files.rank_log(r)})"), self.rank_host[r]
            elif now - beat.received > self.opts.heartbeat_timeout:
                return (f"rank {r} on {self.rank_host[r]} missed its heartbeats for "
                        f"{now - beat.received:.0f}s (log: {self.files.rank_log(r)})"), self.rank_host[r]
        return None

    def _ended(self, request: Outcome | None) -> Outcome | None:
        hosts = request.hosts if request else None
        nodes = [n for n in sorted(self.gone) if n not in self._written_off and any(
            (c := self.renumber.get(r)) is not None and c not in self.exits for r, _ in self.nodes[n].ranks)]
        lost = [self.agents[n].host.name for n in nodes]
        if lost and self._regroup(nodes, request):
            return None  # the survivors go on (or are being asked how far they got)
        if lost:
            return Outcome(Ending.CRASH, f"lost the agent on {', '.join(lost)} (host down or SSH dropped)", hosts=hosts,
                           suspects=lost)
        if request is not None and self.successor is not None and self.publish_asked is not None:
            published = self._published()
            if published is not None:  # no need to wait for the old processes to exit: their state is out
                return Outcome(request.kind, request.message, hosts=request.hosts, step=published)
        bad = {r: c for r, c in self.exits.items() if c not in (0, EXIT_CHECKPOINTED)}
        beats = self.beats()
        teardown = {r: c for r, c in bad.items() if _checkpointed_before_exit(beats.get(r))}
        if teardown and len(teardown) == len(bad):
            # Every rank that failed had reported its on-demand checkpoint first: it died leaving the process group
            # or in the interpreter's shutdown, with nothing left to lose. The attempt ends as asked, not as a
            # crash (which would count against --max-restarts), once every rank has exited.
            if len(self.exits) < self.world:
                return None
            r, code = next(iter(teardown.items()))
            late = (f"rank {r} on {self.rank_host[r]} exited with {_describe(code)} after checkpointing step "
                    f"{beats[r].step} (log: {self.files.rank_log(r)})")
            self.reporter.event(f"{late}: counted as a stop, not a crash")
            self.files.event("late_exit", attempt=self.number, rank=r, code=code, step=beats[r].step)
            step: int | None = max(b.step for b in beats.values())
            if request is not None:
                return Outcome(request.kind, f"{request.message}; {late}", hosts=request.hosts, step=step)
            return Outcome(Ending.CHECKPOINTED, f"the workers checkpointed and stopped (SIGUSR1 from outside the "
                           f"launcher); {late}", step=step)
        if bad and self._symptom(bad):
            return None  # a failure that may be the symptom of a host lost a moment ago: let its news arrive
        if bad:
            first = crash_cause(bad)
            what = f"rank {first} on {self.rank_host[first]} exited with {_describe(bad[first])}"
            refused = bad[first] == EXIT_BAD_CHECKPOINT and self.resume is not None
            if refused:
                what = f"rank {first} on {self.rank_host[first]} could not load checkpoint step_{self.resume}"
                if first in self.errors:
                    what += f": {self.errors[first]}"
            said = None if refused else self._why(first)
            return Outcome(Ending.CRASH, f"{what}{f': {said}' if said else ''} (log: {self.files.rank_log(first)})",
                           hosts=hosts, refused=refused, suspects=[])  # its agent reported the exit: the host is up
        if len(self.exits) < self.world:
            return None
        codes = set(self.exits.values())
        step = max((b.step for b in self.beats().values()), default=None)
        if codes == {0}:
            return Outcome(Ending.DONE, "every worker finished", step=step)
        if request is not None:
            return Outcome(request.kind, request.message, hosts=request.hosts, step=step)
        if codes == {EXIT_CHECKPOINTED}:
            return Outcome(Ending.CHECKPOINTED,
                           "the workers checkpointed and stopped (SIGUSR1 from outside the launcher)", step=step)
        return Outcome(Ending.CRASH, "some workers finished while others stopped to checkpoint", step=step, suspects=[])

    def _why(self, rank: int) -> str | None:
        """Why ``rank`` exited, in its own words: its last ``error: ...`` line, else the error its output ended with
        (:func:`error_line`: a worker that cannot import torch, a script's bug), else None."""
        if rank in self.errors:
            return self.errors[rank]
        return error_line(self.last_lines.get(rank, ""))

    def _symptom(self, bad: dict[int, int]) -> bool:
        """Whether to wait a moment before ending the attempt for the failed ranks ``bad``: when every one of them
        exited with a plain failure (code 1, as a rank whose peer died does), for at most :data:`SYMPTOM_WAIT`
        seconds, since the cause (an agent lost with its host, a rank killed) may be reported just after it; the
        crash is then told by its cause."""
        if any(code != 1 for code in bad.values()):
            return False
        now = time.monotonic()
        if self._failed_at is None:
            self._failed_at = now
        return now - self._failed_at < SYMPTOM_WAIT

    # ------------------------------------------------------------------------------------------------------
    # A lost replica stops nobody

    def _regroup(self, nodes: list[int], request: Outcome | None) -> bool:
        """The agents of ``nodes`` are gone: whether the survivors go on without them in their own processes (see
        :mod:`varuna_core.launch.regroup`). True while the launcher waits for every survivor to say at which step
        it lost its peer (at most :data:`REGROUP_WAIT` seconds), and once the decision is sent; False when the
        attempt must end as a crash (the survivors are then ended and the job recovers as before)."""
        lost = {c for n in nodes for r, _ in self.nodes[n].ranks if (c := self.renumber.get(r)) is not None}
        plan = plan_regroup(self.plan.stage_to_rank_map, self.world, lost)
        if (plan is None or self._regroup_failed or not (self.handing_over and self.opts.regroup)
                or request is not None or self.successor is not None or not self.first_step_seen or 0 in nodes):
            return False  # (node 0's agent keeps the job's store: without it, nobody can be told)
        now = time.monotonic()
        self._lost_now = lost  # their heartbeats stopped with them: not what ends the attempt while it waits
        if self._regrouping is None:
            self._regrouping = now
            self.reporter.event(f"lost the agent on {', '.join(self.agents[n].host.name for n in nodes)}: asking "
                                f"the {self.world - len(lost)} workers left how far they got")
        survivors = set(range(self.world)) - lost
        if self._refusing(survivors):
            self._regroup_failed, self._lost_now = True, set()
            self.reporter.event("the workers left cannot go on without the lost ones (their optimizer state is "
                                "sharded over the replicas): ending them")
            return False
        step = self._survivors_step(survivors)
        if step is None:
            if now - self._regrouping <= REGROUP_WAIT:
                return True
            self._regroup_failed, self._lost_now = True, set()
            self.reporter.event(f"the workers left did not all say within {REGROUP_WAIT:g}s at which step they lost "
                                f"their peers: ending them")
            return False
        if step < 0:
            self._regroup_failed, self._lost_now = True, set()
            self.reporter.event("the workers left lost their peers at different steps: ending them")
            return False
        if not self._send_regroup(plan, step, nodes, lost, now - self._regrouping):
            self._regroup_failed, self._lost_now = True, set()
            return False
        return True

    def _refusing(self, survivors: set[int]) -> bool:
        """Whether a rank of ``survivors`` said, since the loss, that it cannot go on without its lost peers
        (``regroup_refused``)."""
        beats = self.beats()
        for r in survivors:
            beat = beats.get(r)
            refused = beat.get("regroup_refused") if beat is not None else None
            if isinstance(refused, int) and refused > self._last_regroup_step:
                return True
        return False

    def _survivors_step(self, survivors: set[int]) -> int | None:
        """The step every rank of ``survivors`` reported losing its peer in (``regroup_asked``, sent since the
        loss); None while some have not said, -1 if they differ."""
        beats = self.beats()
        steps = set()
        for r in survivors:
            beat = beats.get(r)
            asked = beat.get("regroup_asked") if beat is not None else None
            if not isinstance(asked, int) or asked <= self._last_regroup_step:
                return None
            steps.add(asked)
        return steps.pop() if len(steps) == 1 else -1

    def _send_regroup(self, plan: RegroupPlan, step: int, nodes: list[int], lost: set[int], waited: float) -> bool:
        """Tell the survivors (through node 0's agent, which keeps the job's store) and follow their new
        numbering from now on; False if the new layout cannot be described (nothing was sent)."""
        hosts = ", ".join(self.agents[n].host.name for n in nodes)
        renumber = {first: (plan.ranks[c] if c is not None else None) for first, c in self.renumber.items()}
        placed = [sorted(c for r, _ in node.ranks if (c := renumber.get(r)) is not None) for node in self.nodes]
        try:
            layout = regrouped_plan(self.plan, plan, placed, f"{hosts} lost at step {step}")
        except ValueError as exc:  # pydantic's ValidationError is one
            self.reporter.event(f"no regroup: the layout left is not a plan ({exc})".splitlines()[0])
            return False
        self.regroups += 1
        message = Regroup(attempt=self.number, number=self.regroups, step=step, ranks=plan.ranks,
                          stage_to_rank_map=plan.stage_to_rank_map, prefix=f"varuna/regroup-{self.regroups}/")
        self.agents[0].send(HandoverCommand(message=encode_regroup(message, self.token),
                                            key=regroup_key(self.regroups)))
        leaving = plan.leaving(lost)
        self.files.event("regroup", attempt=self.number, number=self.regroups, step=step, lost=sorted(lost),
                         hosts=[self.agents[n].host.name for n in nodes], leaving=leaving, pp=plan.pp, dp=plan.dp,
                         stage_to_rank_map=plan.stage_to_rank_map, waited=round(waited, 3))
        self.reporter.event(f"{hosts} lost: the {plan.world} workers of the whole replicas left go on in their "
                            f"processes as pp={plan.pp} × dp={plan.dp}, redoing step {step}"
                            + (f" ({len(leaving)} whose replica lost a stage leave)" if leaving else ""))
        self.renumber = renumber
        self.rank_host = {new: self.rank_host[old] for old, new in enumerate(plan.ranks) if new is not None}
        self.world = plan.world
        self.exits, self.errors, self.last_lines = {}, {}, {}
        self._written_off |= set(nodes)
        self.plan = layout
        save_plan(self.plan, self.opts.run_dir / "plans" / f"attempt{self.number}-regroup{self.regroups}.yaml")
        self._new_stragglers(self.plan)
        self.status.dp = plan.dp
        self._regrouping, self._last_regroup_step, self._lost_now = None, step, set()
        if self._on_regroup is not None:
            self._on_regroup([self.agents[n].host.name for n in nodes], self.plan)
        return True

    # ------------------------------------------------------------------------------------------------------
    # Stop

    def stop(self, grace: float | None = None, *, retire: bool = True, last: bool = False,
             leaving: set[str] | None = None) -> None:
        """Stop every agent (its workers get SIGTERM, then SIGKILL after ``grace``) and wait for them; and the
        attempt this one took over from, if it still serves its shelves (unless not ``retire``: the launcher may
        hand that state over again). ``last``: the job ends, or (``leaving``) leaves these hosts: their fork
        servers leave too."""
        if retire:
            self._retire_now(wait=True)
        grace = self.opts.grace if grace is None else grace
        for agent in self.agents:
            agent.send(StopCommand(grace=grace, last=last or agent.host.name in (leaving or ())))
        deadline = time.monotonic() + grace + 15
        for agent in self.agents:
            agent.close()
        for agent in self.agents:
            if not agent.wait(max(0.1, deadline - time.monotonic())):
                agent.kill()
        # keep the workers' last words
        while True:
            try:
                node, event = self.events.get_nowait()
            except queue.Empty:
                break
            self._handle(node, event)


def crash_cause(bad: dict[int, int]) -> int:
    """The rank a crash is told by, of the failed ranks' exit codes ``bad`` (in the order the exits were heard):
    the first that did not fail plainly — the cause, which may be heard after its symptoms, since a rank whose
    peer died exits with code 1 at once — else the first to fail."""
    return next((rank for rank, code in bad.items() if code != 1), next(iter(bad)))


def _snapshots(every: int | None) -> str | None:
    """``VARUNA_SNAPSHOT_EVERY`` for ``--snapshot-every``: ``auto`` (None), N steps, or unset (0: none)."""
    return "auto" if every is None else str(every) if every else None


def _checkpointed_before_exit(beat: Beat | None) -> bool:
    """Whether the rank's last heartbeat said it had just written its on-demand checkpoint and was stopping
    (``checkpointed`` at its current step: the last thing a worker sends before it leaves)."""
    return beat is not None and beat.get("checkpointed") == beat.step


# the line a Python process prints last when it dies of an exception (``ModuleNotFoundError: No module named
# 'torch'``, ``torch.OutOfMemoryError: ...``, a bare ``KeyError``)
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b(?::.*)?$")


def error_line(line: str) -> str | None:
    """``line`` (a worker's last line of output) if it is the one a Python process prints when it dies of an
    exception (:data:`_ERROR_LINE`), cut to 300 characters; else None (a rank killed by a signal, a peer's death that
    gloo tells in several lines). Quoted in the crash's one line so that the user sees why without the log."""
    line = line.strip()
    if not _ERROR_LINE.match(line):
        return None
    return line if len(line) <= 300 else line[:297] + "..."


def _describe(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
