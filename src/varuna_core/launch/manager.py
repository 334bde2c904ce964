"""The launcher's manager: runs attempts of a job one after another until it finishes.

Between attempts it

* **morphs** (``--morph``): when the hosts file changes, or a preemption notice says a host goes away, the plan
  is made again from the profile for the new device count with the same global batch (without a profile: the
  same pipeline, another data-parallel width), and the job moves onto it **by handover** (DESIGN.md §3.8): the
  new configuration's workers start and warm up beside the running ones (:meth:`Manager._warmup`), the old ones
  publish their state into their hosts' memory at one agreed step (SIGUSR2) and exit, and the new ones take it
  from there once told where it is (:meth:`Manager._go`); the old agents serve it until the first new step.
  ``--no-handover``, or a handover that cannot happen (a new worker that does not warm up, state that does not
  fit a shelf), goes through the store: every worker checkpoints on demand and stops (SIGUSR1, handled by the
  library), and the job restarts from that checkpoint on the new hosts. A host that comes back makes the job
  grow again the same way;
* **restarts** after a crash (a worker's non-zero exit, a lost host, missed heartbeats) from the last complete
  checkpoint of this run, with up to ``max_restarts`` consecutive attempts that make no progress — progress is
  a new complete checkpoint, not training steps, so a job whose every save fails gives up — waiting
  ``backoff``, 2×``backoff``, ... seconds in between, and without hosts that no longer answer. A checkpoint the
  workers refuse to load (corrupt, incomplete) is set aside and the previous one is used;
* **leaves out** a host that does not answer (its check fails, or its node agent does not start), although it
  is still listed, and checks it again in the background with a growing back-off
  (:mod:`varuna_core.launch.exclusion`): the job trains on the other hosts meanwhile, and grows onto the host
  (a morph) once it answers. A host left out is not a change of the hosts, and leaving one out, or checking it
  again, is not a restart. When no host is left, the job waits for one as when the hosts left cannot hold the
  model, and fails (exit 1) after ``start_timeout``.

Without ``--morph`` the first crash ends the job (exit 1) with the rank, host and log that failed.

The job's checkpoints belong to one **run** (:mod:`varuna_core.checkpoint.layout`): a new job refuses a checkpoint
store that already holds checkpoints (``--resume`` continues the run it finds there), so a reused store can
neither delete the new job's checkpoints nor make a restart resume an older job's.

**SIGTERM** or **SIGUSR1** (a scheduler's warning, or a spot VM's shutdown) is treated like a preemption notice for
every host: the workers write an on-demand checkpoint and stop, and the launcher exits with 143; a second one
stops at once. ``--resume`` continues from that checkpoint. Without ``--morph`` a preemption notice for a host of
the job (``varuna notify-preempt``, a spot notice) does the same when the host's time is up: the job cannot move.

**Inside a Slurm allocation** the nodes are the allocation's and the agents are job steps; the scheduler's
signals reach every process of the job at once, and an agent reports its signal like the launcher's own. After
stopping on Slurm's warning signal (``--signal=B:USR1@N``) the launcher requeues the job if it is requeueable
(``sbatch --requeue``); the requeued job resumes from that checkpoint by itself (its run is named after the job).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ..checkpoint.layout import check_run_id, describe_runs, latest, list_runs, new_run_id, runs, scan
from ..errors import ConfigError, VarunaError
from ..planning.artifacts import Plan, load_plan, save_plan
from ..util.fs import atomic_write
from .attempt import (
    AgentStartError,
    Attempt,
    Ending,
    JobFiles,
    LaunchError,
    NoMorph,
    Outcome,
    Reporter,
    Status,
    local_checkpoints_in,
    place,
)
from .exclusion import RECHECK_FIRST, Exclusions
from .heartbeat import Listener
from .hosts import Host, HostsWatcher
from .netinfo import route_to
from .options import LaunchOptions
from .protocol import Go, ShelfHolder, encode_go
from .shelf import shelf_key
from .ssh import HostProblem, check_hosts, probe_agents

__all__ = ["Manager", "replan", "choose_run", "EXIT_TERMINATED"]

# a signal handler as signal.signal returns it: a function, SIG_DFL or SIG_IGN, or None (not set from Python)
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_WAIT_POLL = 1.0
FRESH_CHECK = 30.0  # seconds for which a host's passed background check stands in for the check of a morph
EXIT_TERMINATED = 143  # 128 + SIGTERM: the launcher stopped the job on SIGTERM (after checkpointing it)


def choose_run(store: Path, resume: bool, run_id: str | None, *, or_start: bool = False
               ) -> tuple[str, set[str | None]]:
    """The run a job continues (``resume``) or starts in ``store``, and the run ids whose checkpoints it may
    resume from (its own, plus ``None`` when it continues checkpoints of a release that recorded no run).

    ``resume`` with a ``run_id`` continues that run; when the store holds nothing of it (no step directory,
    complete or not) but holds other runs', it is refused, as a mistyped id would otherwise start a new run
    beside them, unless ``or_start`` says to start it from scratch. ``resume`` without a ``run_id`` continues the
    one run the store holds (complete checkpoints first; else the one run with partial ones), or starts a new one
    in an empty store.

    Raises:
        ConfigError: a new job in a store that already holds checkpoints (any run's, complete or not); ``resume``
            in a store of several runs without ``run_id``; ``resume`` of a run the store holds nothing of, beside
            other runs, without ``or_start``.
    """
    if run_id is not None:
        check_run_id(run_id, "--run-id")
    entries = scan(store)
    if not resume:
        if entries:
            partial = sum(not e.complete for e in entries)
            raise ConfigError(f"checkpoint store {store} already holds checkpoints ({describe_runs(entries)}"
                              + (f"; {partial} partial" if partial else "") + ")",
                              hint="--resume continues from the latest of them; to start afresh, give another "
                                   "--ckpt-dir (or --run-dir) or remove that store")
        chosen = run_id or new_run_id()
        return chosen, {chosen}
    groups = runs([e for e in entries if e.complete])
    held = runs(entries)
    if run_id is not None:
        if run_id not in held and held and not or_start:
            raise ConfigError(f"--resume: checkpoint store {store} holds nothing of run {run_id}, but checkpoints of "
                              f"run(s) {list_runs(entries)}",
                              hint=f"continue one of them with --run-id ID, or start run {run_id} from scratch "
                                   f"beside them with --resume-or-start")
        return run_id, {run_id}
    candidates = groups or held
    if len(candidates) > 1:
        what = "checkpoints" if groups else "only partial checkpoints"
        raise ConfigError(f"checkpoint store {store} holds {what} of {len(candidates)} runs "
                          f"({describe_runs(entries) if groups else list_runs(entries)})",
                          hint="choose the run to resume with --run-id ID")
    found = next(iter(candidates), None)
    chosen = found or new_run_id()
    return chosen, {chosen} | ({None} if None in groups else set())


def replan(plan: Plan, devices: int, per_node: int, keep_microbatch: bool = True) -> tuple[Plan, str]:
    """A plan for ``devices`` devices with ``plan``'s global batch: searched again from the plan's profile when
    it is readable, else the same pipeline with as many replicas as fit.

    ``keep_microbatch`` keeps the micro-batch size (if it fits): every example is then computed with the same
    shapes before and after, so the run's losses equal an uninterrupted run's to fp32 rounding. (Another size
    gives the same mathematics but other rounding, which training amplifies step after step.)

    Raises:
        ConfigError / PlanInfeasible: nothing fits the devices.
    """
    from ..ir.schedule import check_schedule
    from ..planning.planner import PlanInfeasible, PlanRequest, make_plan

    profile_path = plan.profile_path
    if profile_path and Path(profile_path).is_file():
        from ..planning.artifacts import load_profile

        profile = load_profile(profile_path)
        request = PlanRequest(gpus=devices, batch_size=plan.batch_size, gpus_per_node=min(per_node, devices),
                              gpu_memory=plan.memory_limit,
                              schedules=tuple(map(check_schedule, plan.schedules)), headroom=plan.headroom,
                              wire_dtype=plan.wire_dtype, link_rate=plan.link_rate, link_latency=plan.link_latency)

        def search(req: PlanRequest) -> Plan:
            """The plan keeping the run's choice of a sharded optimizer where one fits (a job that was not sharded
            keeps its regroup and its replicas' copies), else either."""
            try:
                return make_plan(profile, dataclasses.replace(req, shard_optimizer=plan.shard_optimizer))
            except (ConfigError, PlanInfeasible):
                return make_plan(profile, req)

        note = ""
        if keep_microbatch:
            try:
                new = search(dataclasses.replace(request, microbatch_sizes=(plan.microbatch_size,)))
                new.profile_path = profile_path
                return new, f"re-planned from {profile_path}, micro-batch {plan.microbatch_size} kept"
            except (ConfigError, PlanInfeasible) as exc:
                note = f" (micro-batch {plan.microbatch_size} does not fit: {exc.message})"
        new = search(request)
        new.profile_path = profile_path
        return new, f"re-planned from {profile_path}{note}"
    from ..ir.topology import Topology

    dp = min(devices // plan.pp, plan.batch_size)
    if dp < 1:
        raise ConfigError(f"{devices} device(s) cannot hold the plan's {plan.pp} pipeline stages, and the plan "
                          f"records no profile to plan again from", hint="make the plan with `varuna plan` from a "
                          "profile file that the launcher can read")
    mbs = min(plan.microbatch_size, plan.batch_size // dp)
    world = plan.pp * dp
    num_mb = math.ceil(math.ceil(plan.batch_size / dp) / mbs)
    new = load_plan(plan.model_copy(update=dict(
        gpus=devices, gpus_per_node=per_node, dp=dp, microbatch_size=mbs, num_microbatches=num_mb,
        stages=[st.model_copy(update={"held_microbatches": min(st.held_microbatches, num_mb)}) for st in plan.stages],
        stage_to_rank_map=Topology.clustered(plan.pp, dp).to_string(),
        nodes=[list(range(i, min(world, i + per_node))) for i in range(0, world, per_node)],
        alternatives=[],
        assumptions=[*plan.assumptions, (f"re-planned without a profile for {devices} devices: same pipeline, "
                      f"dp {plan.dp} -> {dp}; the predictions are the original plan's")])))  # checked: may not fit
    return new, f"no profile to plan from: pp={plan.pp} kept, dp {plan.dp} -> {dp}"


@dataclasses.dataclass
class RestartBudget:
    """How many restarts in a row the job has made without a new checkpoint.

    Progress is a checkpoint newer than the newest one at the previous crash (or at the start), whichever
    attempt wrote it: a morph's or a preemption's on-demand checkpoint counts as much as a periodic one. (Comparing
    with the step the crashed attempt resumed from instead would forget the checkpoints of the morphs between two
    crashes, and give up on a job that is making progress.) A checkpoint the workers refused costs a checkpoint,
    not a restart.
    """

    limit: int
    baseline: int | None = None  # the newest checkpoint at the previous crash (or at the start)
    count: int = 0

    def crash(self, newest: int | None, *, refused: bool = False) -> int:
        """Record a crash, ``newest`` being the newest loadable checkpoint now; returns the restarts in a row."""
        if not refused:
            progressed = newest is not None and (self.baseline is None or newest > self.baseline)
            self.count = 1 if progressed else self.count + 1
        self.baseline = newest
        return self.count

    @property
    def exhausted(self) -> bool:
        return self.count > self.limit


class Manager:
    """Runs a job (see the module docstring). ``hosts`` None: local processes."""

    def __init__(self, opts: LaunchOptions, plan: Plan, hosts: list[Host] | None, hosts_file: Path | None,
                 default_slots: int, reporter: Reporter) -> None:
        self.opts, self.plan, self.reporter = opts, plan, reporter
        self.local = hosts is None
        self.hosts = hosts if hosts is not None else [Host("127.0.0.1", slots=plan.pp * plan.dp)]
        self.desired = list(self.hosts)
        self.watcher = HostsWatcher(hosts_file, default_slots) if hosts_file is not None else None
        self.preempted: dict[str, float] = {}  # host name -> when (monotonic) it goes away
        recorded = local_checkpoints_in(opts.run_dir / "events.jsonl") if opts.ckpt_local else {}
        if opts.ckpt_local and opts.resume:  # the hosts' stores are not here: the run's events say what they hold
            if opts.run_id is None and len(recorded) > 1:
                raise ConfigError(f"--resume: {opts.run_dir}/events.jsonl records checkpoints of {len(recorded)} runs "
                                  f"in the hosts' own stores ({', '.join(sorted(recorded)[:5])})",
                                  hint="say which one to continue with --run-id ID")
            self.run_id = opts.run_id or (next(iter(recorded)) if recorded else new_run_id())
            self.runs: set[str | None] = {self.run_id}
        else:
            self.run_id, self.runs = choose_run(opts.ckpt_dir, opts.resume, opts.run_id,
                                                or_start=opts.resume_or_start)
        self.job = uuid.uuid4().hex
        self.token = secrets.token_hex(32)
        self.files = JobFiles(opts.run_dir)
        self.listener = Listener(self.job, self.token, bind="127.0.0.1" if self.local else "0.0.0.0")
        self.status = Status(local_checkpoints=list(recorded.get(self.run_id, [])) if opts.resume else [])
        self.sigterms = 0  # SIGTERMs received: 1 = checkpoint and stop, 2 = stop now
        self.stop_why = "SIGTERM"  # what asked the job to stop (also SIGUSR1, a preemption notice)
        self.warned = False  # the stop came from the scheduler's warning signal (SIGUSR1): requeue under Slurm
        self.refused: dict[int, str] = {}  # steps that cannot be loaded, and why
        self.exclusions = Exclusions(RECHECK_FIRST, opts.recheck_max)  # hosts left out: they did not answer
        self._checked: queue.Queue[tuple[Host, str | None]] = queue.Queue()  # (host, problem) of the background checks
        self._passed: dict[str, float] = {}  # hosts whose background check passed, and when (monotonic)
        self._closing = threading.Event()  # the job ends: background checks give up
        self._checking: list[threading.Thread] = []  # the background checks under way
        self.current = 0  # the number of the attempt that runs
        self.highest = 0  # the highest number given to an attempt (a warm one's included)
        self._handing_over: Attempt | None = None  # the attempt whose successor takes over next
        self._orphan: tuple[Attempt, Outcome] | None = None  # an old attempt still serving a handover's state
        self._retried: Outcome | None = None  # the handover tried a second time (once at most)
        self._wreck: Attempt | None = None  # a crashed attempt whose agents still serve its snapshot
        self._wreck_gone: list[str] = []  # the hosts whose agent it lost
        self._warm: tuple[list[Host], Plan, str | None] = ([], plan, None)  # the successor's hosts, plan, why
        self._write_manager_file()

    def _write_manager_file(self) -> None:
        """Where ``varuna notify-preempt`` finds the manager, with the token that authenticates it (0600)."""
        info = {"job": self.job, "token": self.token, "port": self.listener.port, "pid": os.getpid(),
                "run": self.run_id}
        atomic_write(self.opts.run_dir / "manager.json", json.dumps(info), mode=0o600)

    def latest(self) -> int | None:
        """The step of this run's newest checkpoint that looks loadable; the ones that do not (or that the
        workers refused) are set aside with the reason, once."""
        if self.opts.ckpt_local:  # no directory here holds them whole: the ones every host reported its part of
            usable = [s for s in self.status.local_checkpoints if s not in self.refused]
            return max(usable) if usable else None
        known = set(self.refused)
        found = latest(self.opts.ckpt_dir, of_runs=self.runs, refused=self.refused, check=True)
        for step, problem in self.refused.items():  # newest first: the order they were looked at
            if step not in known:
                self.reporter.event(f"checkpoint step_{step} cannot be used ({problem}); trying the one before")
                self.files.event("checkpoint_refused", step=step, reason=problem)
        return found.step if found is not None else None

    def manager_address(self, host: Host) -> str:
        """The address of this machine that ``host`` reaches (where its workers send heartbeats)."""
        if self.local:
            return "127.0.0.1"
        return route_to(host.address)[1] or "127.0.0.1"

    # ------------------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Run attempts until the job finishes (0), fails for good (1), is interrupted (130) or stopped by
        SIGTERM (143)."""
        opts = self.opts
        resume = self.latest() if opts.resume else None
        if opts.resume:
            self.reporter.event(f"resuming run {self.run_id} from {opts.ckpt_dir}/step_{resume}" if resume is not None
                                else f"--resume: no loadable checkpoint of run {self.run_id} in {opts.ckpt_dir}; "
                                     f"starting it from scratch")
        budget, number = RestartBudget(opts.max_restarts, baseline=resume), self.files.attempts_before
        self.current = self.highest = number
        previous = self._handle_sigterm()
        handover: Outcome | None = None  # the outcome of an attempt that hands over to its successor
        retiring: Attempt | None = None
        try:
            while True:
                if self.sigterms and handover is None:  # a handover goes on: the successor checkpoints first
                    return self._terminated(f"on {self.stop_why}, between attempts")
                # the next number: the successor's, or one past every attempt started so far (a warm-up that
                # failed used a number too: its plan and logs must not be overwritten)
                number = handover.successor.number if handover is not None and handover.successor is not None \
                    else max(number, self.highest) + 1
                outcome = self._attempt(number, resume, budget.count, handover, retiring)
                handover, retiring = None, None
                if outcome.kind is Ending.DONE:
                    self.reporter.event(f"done: {outcome.message}")
                    return 0
                if outcome.kind is Ending.INTERRUPTED:
                    return 130
                if outcome.kind is Ending.TERMINATED:
                    return self._terminated(outcome.message)
                if outcome.kind is Ending.CRASH and outcome.unstarted is not None:  # (only with --morph)
                    # not a restart: the job goes on at once without that host, which is checked again later
                    self._leave_out(outcome.unstarted, outcome.message, at_start=True)
                    hosts = self._reachable(outcome.hosts or self._wanted(), suspects=[])
                elif outcome.kind is Ending.CRASH and (again := self._hand_over_again(outcome)) is not None:
                    handover, retiring = again  # not a restart: the state is still on the old hosts' shelves
                    continue
                elif outcome.kind is Ending.CRASH and (again := self._recover(outcome, budget)) is not None:
                    handover, retiring = again  # not a restart: the newest snapshot is on the surviving shelves
                    continue
                elif outcome.kind is Ending.CRASH:
                    if not opts.morph:
                        raise LaunchError(outcome.message, hint="--morph restarts a job from its last complete "
                                          "checkpoint after a crash")
                    if outcome.refused and resume is not None:
                        self.refused[resume] = outcome.message
                        self.files.event("checkpoint_refused", step=resume, reason=outcome.message)
                        self.reporter.event(f"checkpoint step_{resume} was refused by the workers; falling back to "
                                            f"the one before it")
                    newest = self.latest()
                    if outcome.refused and newest is None:
                        self.reporter.event(f"no loadable checkpoint of run {self.run_id} is left in "
                                            f"{opts.ckpt_dir}: starting again from step 0")
                    restarts = budget.crash(newest, refused=outcome.refused)
                    if budget.exhausted:
                        raise LaunchError(f"giving up after {opts.max_restarts} restarts without a new checkpoint: "
                                          f"{outcome.message}", hint=f"see the rank logs in {opts.run_dir}/logs")
                    self.status.restarts += 1
                    delay = min(60.0, opts.backoff * 2 ** max(0, restarts - 1))
                    self.reporter.event(f"crash: {outcome.message}; restarting in {delay:.0f}s "
                                        f"(restart {restarts} of at most {opts.max_restarts})")
                    self._sleep(delay)
                    hosts = self._reachable(outcome.hosts or self._wanted(), suspects=outcome.suspects)
                elif outcome.successor is not None:  # a morph by handover: the successor is warm and waits
                    self.status.morphs += 1
                    handover, retiring, resume = outcome, self._handing_over, outcome.step
                    continue
                else:  # morph / checkpointed
                    self.status.morphs += 1
                    hosts = self._reachable(outcome.hosts or self.hosts, only_new=True)
                resume = self.latest()
                self._reconfigure(hosts)
        finally:
            self._end_checks()
            for sig, handler in (previous or {}).items():
                signal.signal(sig, handler)
            self.listener.close()
            self.files.close()
            self._draw_loss()

    def _terminated(self, why: str) -> int:
        last = self.latest()
        self.files.event("terminated", reason=why, checkpoint=last)
        slurm = self.opts.slurm
        then = "(`varuna launch --resume` continues from it)"
        if slurm is not None:
            then = f"(a requeue of job {slurm.job_id} resumes from it; a new job continues it with --resume)"
            if self.warned:
                from .slurm import requeue

                done, detail = requeue(slurm.job_id)
                self.files.event("requeue", job=slurm.job_id, done=done, detail=detail)
                then = f"(job {slurm.job_id} {'requeued: it resumes from it' if done else 'not requeued: ' + detail})"
        self.reporter.event(f"stopped {why}; the latest checkpoint is "
                            + (f"step_{last}" if last is not None else "none") + f" {then}")
        return EXIT_TERMINATED

    def _handle_sigterm(self) -> dict[signal.Signals, _Handler] | None:
        """Count SIGTERMs and SIGUSR1s (see the module docstring); returns the previous handlers (None: not the
        main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_signal(signum: int, frame: FrameType | None) -> None:  # only a counter: the loop acts on it
            self.sigterms += 1
            self.stop_why = signal.Signals(signum).name
            self.warned = self.warned or signum == signal.SIGUSR1

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake for a SIGTERM (the next attempt then stops at once)."""
        deadline = time.monotonic() + seconds
        while not self.sigterms and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _draw_loss(self) -> None:
        """``RUN_DIR/loss.png`` from the metrics, whatever the outcome (a failed run's curve helps most)."""
        from .loss_curve import draw_loss_curve

        try:
            if draw_loss_curve(self.opts.run_dir / "metrics.jsonl", self.opts.run_dir / "loss.png",
                               title=f"{self.plan.model}: loss per step"):
                self.reporter.event(f"loss curve: {self.opts.run_dir / 'loss.png'}")
        except (OSError, ValueError, ImportError) as exc:
            self.reporter.event(f"no loss curve: {exc}")

    def _new_attempt(self, number: int, resume: int | None, plan: Plan, hosts: list[Host], *,
                     warm: bool = False) -> Attempt:
        """Attempt ``number`` of ``plan`` on ``hosts`` (recorded: its plan file, a ``starting`` event)."""
        nodes = place(plan.pp * plan.dp, hosts)
        save_plan(plan, self.opts.run_dir / "plans" / f"attempt{number}.yaml")
        where = ", ".join(f"{n.host.name}×{len(n.ranks)}" for n in nodes)
        self.reporter.event(f"attempt {number}: pp={plan.pp} × dp={plan.dp} ({plan.schedule}, "
                            f"micro-batch {plan.microbatch_size}) on {where}"
                            + (", warming up beside the running one" if warm else
                               f", resuming from step {resume}" if resume is not None else ""))
        self.files.event("starting", attempt=number, pp=plan.pp, dp=plan.dp, microbatch=plan.microbatch_size,
                         schedule=plan.schedule, resume=resume, hosts=[n.host.name for n in nodes], warm=warm)
        return Attempt(number, plan, nodes, resume, self.opts, self.files, self.listener, self.reporter,
                       self.status, self.job, self.token, self.manager_address, self.run_id, warm=warm)

    def _attempt(self, number: int, resume: int | None, restarts: int, handover: Outcome | None = None,
                 retiring: Attempt | None = None) -> Outcome:
        """Run attempt ``number``: a new one, or the successor that ``handover`` (the outcome of ``retiring``, the
        attempt it takes over from) carries, warm already, which is told where its state is."""
        if handover is not None:
            assert handover.successor is not None and retiring is not None
            attempt = handover.successor
            self.listener.promote(number)
        else:
            attempt = self._new_attempt(number, resume, self.plan, self.hosts)
            self.listener.reset(attempt=number)
        self.status.attempt, self.status.state = number, "starting"
        self.status.pp, self.status.dp, self.status.hosts = attempt.plan.pp, attempt.plan.dp, len(attempt.nodes)
        outcome: Outcome | None = None
        try:
            if handover is not None:
                assert retiring is not None
                attempt.retire(retiring)
                self._go(attempt, retiring, handover)
            else:
                try:
                    attempt.start()
                except AgentStartError as exc:
                    if not self.opts.morph:
                        raise
                    # a local job has no other host to go on with: a plain crash, restarted
                    return Outcome(Ending.CRASH, exc.message, step=resume, unstarted=None if self.local else exc.host)
                except LaunchError as exc:
                    if not self.opts.morph:
                        raise
                    return Outcome(Ending.CRASH, exc.message, step=resume)
                except KeyboardInterrupt:
                    return Outcome(Ending.INTERRUPTED, "interrupted while starting")
                self.exclusions.started(n.host.name for n in attempt.nodes)
                self.files.event("started", attempt=number)
                if self.sigterms:
                    return Outcome(Ending.TERMINATED, f"on {self.stop_why}, before the attempt started")
            self.current, self.highest = number, max(self.highest, number)
            outcome = attempt.run(lambda: self._changes(), lambda: (self.sigterms, self.stop_why),
                                  warmup=self._warmup if self.opts.morph and self.opts.handover else None,
                                  regrouped=self._regrouped)
            if attempt.scheduler_signal == "SIGUSR1":
                self.warned = True
            self.status.state = "stopping"
            self.files.event("ending", attempt=number, kind=outcome.kind.value, message=outcome.message,
                             step=outcome.step, handover=outcome.successor is not None)
            return outcome
        finally:
            if outcome is not None and outcome.successor is not None:
                self._handing_over = attempt  # its agents serve their shelves until its successor retires them
                self.files.event("handing_over", attempt=number)
            else:
                # a successor that crashed before its first step leaves the state it took where it was: the
                # attempt it took over from still serves it, for one more try (see run())
                keep = (handover is not None and retiring is not None and not attempt.first_step_seen
                        and outcome is not None and outcome.kind is Ending.CRASH and self._retried is not handover)
                if not keep and outcome is not None and self._recoverable(attempt, outcome):
                    attempt.retire_now()
                    # its agents stay: their shelves hold the snapshot the next one takes
                    self._wreck, self._wreck_gone = attempt, attempt.end_workers()
                else:
                    attempt.stop(retire=not keep, last=outcome is not None and outcome.kind in (
                        Ending.DONE, Ending.TERMINATED, Ending.INTERRUPTED))
                self._orphan = (retiring, handover) if keep and retiring is not None and handover is not None \
                    else None
                self.files.event("stopped", attempt=number)

    # ------------------------------------------------------------------------------------------------------
    # A morph by handover

    def _warmup(self, hosts: list[Host], depth: int = 0) -> Attempt | None:
        """Start the configuration for ``hosts`` beside the running one (its workers warm up and wait for their
        go); None when it cannot start now (the morph then goes through the store), with the reason reported.

        Raises:
            NoMorph: the host it was to start on does not answer (it is left out), and without it the job's hosts
                need not change.
        """
        try:
            hosts = self._reachable(hosts, only_new=True)
            plan, why = self._plan_for(hosts)
        except VarunaError as exc:
            self.reporter.event(f"cannot warm up a new configuration ({exc.message}): the morph goes through the "
                                f"store")
            return None
        number = self.highest = self.highest + 1
        attempt = self._new_attempt(number, None, plan, hosts, warm=True)
        self.listener.expect(number)
        try:
            attempt.start()
        except (LaunchError, KeyboardInterrupt) as exc:
            self.listener.expect(None)
            message = exc.message if isinstance(exc, LaunchError) else "interrupted"
            self.files.event("warm_failed", attempt=self.current, successor=number, reason=message)
            if isinstance(exc, AgentStartError) and not self.local and depth < len(hosts):
                # that host is left out (and checked again in the background); without it, is there a change?
                self._leave_out(exc.host, message, at_start=True)
                change = self._changes()
                if change is None:
                    raise NoMorph(f"{exc.host.name} is left out and the other hosts are the job's") from None
                return self._warmup(change[0], depth + 1)
            self.reporter.event(f"the new configuration did not start ({message}): the morph goes through the store")
            return None
        self.exclusions.started(n.host.name for n in attempt.nodes)
        self.files.event("started", attempt=number, warm=True)
        attempt.publish_by = self._publish_by()
        self._warm = (hosts, plan, why)
        return attempt

    def _hand_over_again(self, crash: Outcome) -> tuple[Outcome, Attempt] | None:
        """After a successor crashed before its first step: a new configuration on the hosts that answer, warm,
        to take the same published state from the old attempt that still serves it (once per handover); None
        when there is none to try (the crash then restarts from the store, as any crash)."""
        orphan, self._orphan = self._orphan, None
        if orphan is None:
            return None
        old, handover = orphan
        self.current = old.number  # the attempt whose state the new one takes (for the warm-up's events)
        self.reporter.event(f"the new configuration failed before its first step ({crash.message}); trying the "
                            f"handover of step {handover.step} once more")
        self.files.event("handover_again", attempt=old.number, step=handover.step, reason=crash.message)
        try:
            successor = self._warmup(self._reachable(crash.hosts or self._wanted(), suspects=crash.suspects))
        except NoMorph:
            successor = None
        if successor is None:
            old.stop()
            return None
        self._retried = again = dataclasses.replace(handover, successor=successor)
        return again, old

    def _recoverable(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Whether a crash of ``attempt`` may go on from its newest in-memory snapshot: one was taken and it is
        newer than the store's newest checkpoint (whether every rank's files are still on a live host is known
        once the hosts are checked: :meth:`_recover`)."""
        if self.opts.snapshot_every == 0 or not (self.opts.morph and self.opts.handover) \
                or outcome.kind is not Ending.CRASH or outcome.refused or outcome.unstarted is not None:
            return False  # (snapshot_every None: auto)
        snapshot, newest = attempt.snapshot(), self.latest()
        return snapshot is not None and (newest is None or newest < snapshot[0])

    def _recover(self, crash: Outcome, budget: RestartBudget) -> tuple[Outcome, Attempt] | None:
        """After a crash whose attempt left its snapshot on its shelves (see :meth:`_recoverable`): the hosts the
        crash names and those whose agent is gone are checked (the others' agents just took the order to end
        their workers; a host lost unnoticed is left out when the new configuration cannot start there); if
        every rank's files are on a host that answers (its own, or the next host's copy), a new configuration on
        the hosts that answer, warm, is told to take that snapshot. None otherwise, or when it cannot start: the
        crash then restarts from the store."""
        wreck, self._wreck = self._wreck, None
        if wreck is None:
            return None
        snapshot = wreck.snapshot()
        assert snapshot is not None  # checked when it was kept
        step, copies = snapshot
        suspects = sorted(set(crash.suspects or []) | set(self._wreck_gone))
        hosts = self._reachable(crash.hosts or self._wanted(), suspects=suspects)
        up = {h.name for h in hosts}
        ring = wreck.host_order()
        lost = [h for h in ring if h not in up]
        if lost and (not copies or len(ring) < 2 or any(ring[(ring.index(h) + 1) % len(ring)] in lost for h in lost)):
            self.reporter.event(f"the in-memory snapshot of step {step} is lost with {', '.join(lost)} (no copy on a "
                                f"host that answers)")
            self.files.event("snapshot_lost", attempt=wreck.number, step=step, lost=lost)
            wreck.stop()
            return None
        newest = self.latest()
        restarts = budget.crash(step if newest is None else max(step, newest))
        if budget.exhausted:
            wreck.stop()
            raise LaunchError(f"giving up after {self.opts.max_restarts} restarts without a new checkpoint or "
                              f"snapshot: {crash.message}", hint=f"see the rank logs in {self.opts.run_dir}/logs")
        self.status.restarts += 1
        self.current = wreck.number  # the attempt whose state the new one takes (for the warm-up's events)
        self.reporter.event(f"crash: {crash.message}; going on from the in-memory snapshot of step {step}"
                            + (f" (the copies of {', '.join(lost)}'s part on the next host)" if lost else "")
                            + f" (restart {restarts} of at most {self.opts.max_restarts})")
        self.files.event("recovering", attempt=wreck.number, step=step, reason=crash.message, lost=lost,
                         copies=copies)
        try:
            successor = self._warmup(hosts)
        except NoMorph:
            successor = None
        if successor is None:
            wreck.stop()
            return None
        return Outcome(Ending.CRASH, crash.message, step=step, successor=successor, published=True,
                       copies=copies), wreck

    def _publish_by(self) -> float | None:
        """When the running workers must hand over even if the new ones are not all warm: before the first host
        of the job that a preemption notice takes away goes (keeping half the margin for the transfer)."""
        due = [when for name, when in self.preempted.items() if any(h.name == name for h in self.hosts)]
        return min(due) - self.opts.preempt_margin / 2 if due else None

    def _go(self, attempt: Attempt, old: Attempt, handover: Outcome) -> None:
        """Tell the warm ``attempt`` where its state is: on ``old``'s shelves, in the store, or nowhere."""
        hosts, plan, why = self._warm
        self.hosts, self.plan = hosts, plan
        if why:
            self.reporter.event(f"{sum(h.slots for h in hosts)} devices: {why}: pp={plan.pp} × dp={plan.dp}, "
                                f"micro-batch {plan.microbatch_size}, {plan.schedule}")
        step, fallback = handover.step, self.latest()
        go, lost = None, None
        if handover.published and step is not None:
            holders = []
            for node in old.nodes:
                ready = old.agents[node.index].ready
                port = ready.shelf_port if ready is not None else None
                address = (ready.address if ready is not None else None) or node.host.address
                holders += [(rank, node.host.name, address, port)  # the ranks it has now (after any regroup)
                            for first, _ in node.ranks if (rank := old.renumber.get(first)) is not None]
            missing = sorted({h for _, h, _, port in holders if port is None})
            if not missing:
                go = Go(attempt=attempt.number, source="shelf", step=step, shelf=shelf_key(self.job, old.number),
                        fallback_step=fallback, copies=handover.copies,
                        holders=[ShelfHolder(host=h, address=a, port=p) for _, h, a, p in sorted(holders)
                                 if p is not None])
            else:
                lost = f"{', '.join(missing)} serve{'s' if len(missing) == 1 else ''} no shelf"
        elif step is not None and step != fallback:
            lost = "the old configuration neither published nor checkpointed it"
        if go is None:
            go = Go(attempt=attempt.number, source="store", step=fallback) if fallback is not None else \
                Go(attempt=attempt.number, source="none")
        if lost is not None and step is not None:
            since = f"step_{fallback} of the store" if fallback is not None else "step 0"
            self.reporter.event(f"the state of step {step} cannot be handed over ({lost}): going on from {since}")
            self.files.event("handover_lost", attempt=old.number, step=step, reason=lost, fallback=fallback)
        self.files.event("go", attempt=attempt.number, source=go.source, step=go.step,
                         hosts=sorted({h.host for h in go.holders}), copies=go.copies)
        self.reporter.event(f"attempt {attempt.number} takes over " + (
            f"step {go.step} from the {'hosts' if go.source == 'shelf' else 'store'}" if go.step is not None
            else "from step 0"))
        attempt.go(encode_go(go, self.token))

    # ------------------------------------------------------------------------------------------------------
    # Changes of the host set

    def _changes(self, current: list[Host] | None = None) -> tuple[list[Host], str] | None:
        """The hosts the job should run on now, and why, if they differ from ``current`` (default: the hosts
        the job runs on)."""
        current = self.hosts if current is None else current
        if not self.opts.morph:
            self._notices_without_morph(current)
            return None
        reasons = []
        if self.watcher is not None:
            try:
                polled = self.watcher.poll()
            except ConfigError as exc:
                self.reporter.event(f"{exc.message}: keeping the current hosts")
                polled = None
            if polled is not None:
                self.files.event("hosts_changed", hosts=[h.name for h in polled])
                reasons.append("the hosts file changed")
                self.desired = polled
                self.preempted.clear()  # a new hosts file is the new truth
                self.exclusions.listed(polled)
        self._take_notices()
        back = self._recheck()
        if back:
            reasons.append(f"{', '.join(back)} answer{'s' if len(back) == 1 else ''} again")
        leaving = self._leaving()
        effective = self._wanted()
        if effective == current:
            return None
        if leaving & {h.name for h in current}:
            reasons.append(f"{', '.join(sorted(leaving))} will be preempted")
        gone = [h.name for h in current if h not in effective]
        new = [h.name for h in effective if h not in current]
        detail = "; ".join(x for x in (f"removed {', '.join(gone)}" if gone else "",
                                       f"added {', '.join(new)}" if new else "") if x)
        return effective, f"{' and '.join(reasons) or 'hosts changed'} ({detail or 'slots changed'})"

    def _take_notices(self) -> None:
        """Record the preemption notices received since the last call (hosts the job does not use: ignored)."""
        for notice in self.listener.take_notices():
            name = str(notice.get("host"))
            match = next((h for h in self.desired if name in (h.name, h.address)), None)
            if match is None:
                self.reporter.event(f"preemption notice for {name}, which the job does not use: ignored")
                continue
            seconds = float(notice.get("seconds") or 0)
            self.preempted[match.name] = time.monotonic() + seconds
            self.files.event("preempt_notice", host=match.name, seconds=seconds, source=notice.get("source"))
            self.reporter.event(f"preemption notice: {match.name} goes away in {seconds:.0f}s")

    def _wanted(self) -> list[Host]:
        """The hosts the job should run on: the listed ones, less those whose preemption is due and those left
        out (they do not answer)."""
        leaving = self._leaving()
        return [h for h in self.desired if h.name not in leaving and h.name not in self.exclusions]

    def _leaving(self) -> set[str]:
        """The hosts whose preemption is due (within ``--preempt-margin`` seconds)."""
        now = time.monotonic()
        return {n for n, when in self.preempted.items() if now >= when - self.opts.preempt_margin}

    def _notices_without_morph(self, current: list[Host]) -> None:
        """Without ``--morph`` the job cannot leave a host: when one of its hosts is about to be preempted, it
        checkpoints and stops as on SIGTERM (exit 143; ``--resume`` continues)."""
        self._take_notices()
        leaving = sorted(self._leaving() & {h.name for h in current})
        if leaving and not self.sigterms:
            self.sigterms = 1
            self.stop_why = f"the preemption notice for {', '.join(leaving)} (without --morph the job cannot move)"

    def _reachable(self, hosts: list[Host], only_new: bool = False, suspects: list[str] | None = None) -> list[Host]:
        """``hosts`` less those left out and those that fail the pre-flight check (left out from now on): all of
        them are checked, only those not in the current set (``only_new``), or only the ``suspects`` (hosts named
        by a crash; the others answered just now). A host whose background check passed moments ago is not checked
        again. (A host whose agent then does not start is left out by the attempt.)"""
        hosts = [h for h in hosts if h.name not in self.exclusions]
        if self.local or self.opts.slurm is not None:  # Slurm's nodes are the allocation's: srun reaches them
            return hosts
        now = time.monotonic()
        fresh = {name for name, when in self._passed.items() if now - when < FRESH_CHECK}
        self._passed.clear()
        to_check = [h for h in hosts if (not only_new or h not in self.hosts) and h.name not in fresh
                    and (suspects is None or h.name in suspects or h not in self.hosts)]
        problems = self._check(to_check) if to_check else []
        for p in problems:
            self._leave_out(p.host, p.message)
        bad = {p.host.name for p in problems}
        return [h for h in hosts if h.name not in bad]

    def _check(self, hosts: list[Host], agents: bool = False) -> list[HostProblem]:
        """The problems of ``hosts``, in their order: over SSH the pre-flight check (SSH, the interpreter, the code
        directory); with ``agents``, for the hosts that pass it and for Slurm's nodes, also a node agent started
        without workers (before the job grows onto a host left out: can its agent start there now?)."""
        problems = check_hosts(hosts, self.opts.ssh, self.opts.runtime) if self.opts.ssh is not None else []
        failed = {p.host.name for p in problems}
        rest = [h for h in hosts if h.name not in failed]
        if agents and rest and not self._closing.is_set():
            problems += probe_agents(rest, self.opts.runtime, self.opts.slurm or self.opts.ssh, self.job,
                                     cancel=self._closing)
        order = {h.name: i for i, h in enumerate(hosts)}
        return sorted(problems, key=lambda p: order[p.host.name])

    def _regrouped(self, lost: list[str], plan: Plan) -> None:
        """The workers left of the running attempt went on as ``plan`` without ``lost``: those hosts are left out
        (checked again in the background: the job grows onto them when they answer, by a handover)."""
        self.plan = plan
        for host in [h for h in self.hosts if h.name in lost]:
            self._leave_out(host, "lost without notice; the workers of the whole replicas left went on without it")
        self.hosts = [h for h in self.hosts if h.name not in lost]
        self.status.morphs += 1

    def _leave_out(self, host: Host, reason: str, at_start: bool = False) -> None:
        """Leave ``host`` out of the job until a check in the background finds it answering (reported once); see
        :meth:`Exclusions.leave_out` for ``at_start``."""
        record = self.exclusions.leave_out(host, reason, at_start=at_start)
        if record.held:
            until = "until the hosts file changes" if self.watcher is not None else "in this job"
            self.reporter.event(f"leaving out {host.name}: {reason}; its check passed but its agent does not start: "
                                f"it is not checked again {until}")
            self.files.event("host_unreachable", host=host.name, message=reason, retry_in=None)
            return
        delay = self.exclusions.delay(record.failures)
        self.reporter.event(f"leaving out {host.name}: {reason}; checking it again in {delay:.0f}s")
        self.files.event("host_unreachable", host=host.name, message=reason, retry_in=round(delay, 1))

    def _recheck(self) -> list[str]:
        """Start the checks of the hosts left out that are due, and take the results of those that finished (each
        reported: still failing, with the wait until the next check, or back). Returns the hosts that answer
        again."""
        due = self.exclusions.due()
        if due:
            self._start_check(due)
        back = []
        while True:
            try:
                host, problem = self._checked.get_nowait()
            except queue.Empty:
                break
            if host.name not in self.exclusions:  # no longer listed
                continue
            if problem is None:
                record = self.exclusions.answered(host)
                self._passed[host.name] = time.monotonic()
                back.append(host.name)
                out_for = self.exclusions.clock() - record.since
                self.files.event("host_back", host=host.name, seconds=round(out_for, 1), failures=record.failures)
                self.reporter.event(f"{host.name} answers again after {out_for:.0f}s left out: taking it back")
            else:
                record = self.exclusions.failed(host, problem)
                delay = self.exclusions.delay(record.failures)
                self.files.event("host_recheck_failed", host=host.name, message=problem, failures=record.failures,
                                 retry_in=round(delay, 1))
                self.reporter.event(f"{host.name} still fails its check ({problem}); checking it again in "
                                    f"{delay:.0f}s")
        return back

    def _start_check(self, hosts: list[Host]) -> None:
        """Check ``hosts`` in a thread of its own (training goes on); :meth:`_recheck` takes the results."""
        self._checking = [t for t in self._checking if t.is_alive()]
        thread = threading.Thread(target=self._check_in_background, args=(hosts,), name="recheck", daemon=True)
        self._checking.append(thread)
        thread.start()

    def _end_checks(self, wait: float = 6.0) -> None:
        """Give up the background checks under way: the node agents they started are stopped (no process of the
        job is left behind); a pre-flight check that still runs is left to end by itself (it carries nothing of
        the job, and starts no agent once the job has ended)."""
        self._closing.set()
        deadline = time.monotonic() + wait
        for thread in self._checking:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _check_in_background(self, hosts: list[Host]) -> None:
        try:
            problems = {p.host.name: p.message for p in self._check(hosts, agents=True)}
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check, not a dead launcher
            problems = {h.name: f"the check did not run: {exc}" for h in hosts}
        for host in hosts:
            self._checked.put((host, problems.get(host.name)))

    def _plan_for(self, hosts: list[Host]) -> tuple[Plan, str | None]:
        """The plan for ``hosts``: the current one if their capacity is the same, else made again (and why).

        Raises:
            VarunaError: nothing fits (no host left, or the hosts cannot hold the model).
        """
        capacity = sum(h.slots for h in hosts)
        if capacity == sum(h.slots for h in self.hosts) and self.plan.pp * self.plan.dp <= capacity:
            return self.plan, None
        if capacity == 0:
            raise ConfigError("no host is left" + (f" (left out, as they do not answer: {self.exclusions.describe()})"
                                                   if len(self.exclusions) else ""))
        t0 = time.time()
        plan, why = replan(self.plan, capacity, max(1, min(h.slots for h in hosts)),
                           keep_microbatch=not self.opts.morph_any_microbatch)
        self.files.event("planned", seconds=time.time() - t0, pp=plan.pp, dp=plan.dp, devices=capacity)
        return plan, why

    def _reconfigure(self, hosts: list[Host]) -> None:
        """Adopt ``hosts``; plan again if their capacity differs; wait (bounded) while nothing fits."""
        deadline = time.monotonic() + self.opts.start_timeout
        while True:
            capacity = sum(h.slots for h in hosts)
            try:
                plan, why = self._plan_for(hosts)
                self.hosts, self.plan = hosts, plan
                if why:
                    self.reporter.event(f"{capacity} devices: {why}: pp={plan.pp} × dp={plan.dp}, "
                                        f"micro-batch {plan.microbatch_size}, {plan.schedule}")
                return
            except VarunaError as exc:
                if self.sigterms:
                    return
                if time.monotonic() > deadline:
                    raise LaunchError(f"no usable configuration on the hosts left: {exc.message}",
                                      hint="add hosts to the hosts file") from None
                self.status.state = "waiting for hosts"
                self.reporter.event(f"waiting for hosts: {exc.message}")
                while time.monotonic() < deadline and not self.sigterms:
                    time.sleep(_WAIT_POLL)
                    change = self._changes(hosts)
                    if change is not None:
                        hosts = self._reachable(change[0])
                        break
