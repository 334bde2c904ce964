"""The worker's side of ``varuna launch``: what ``Varuna(...)`` does by itself when the launcher started it.

The launcher's environment (see ``varuna launch --help``) asks for:

* ``VARUNA_RESUME_STEP`` + ``VARUNA_CKPT_DIR``: resume from that checkpoint as soon as the optimizer is known
  (``set_optimizer``); ``model.iteration`` then says where the training loop continues;
* on-demand checkpoints: ``SIGUSR1`` sets a flag; the flag rides on the all-reduce every step already makes
  (loss, gradient norm, overflow), so every rank learns in the same step that some rank was signalled; at the
  start of the next ``step()`` (the optimizer has stepped by then) all ranks write a checkpoint to
  ``VARUNA_CKPT_DIR`` together, leave the process group and exit with :data:`EXIT_CHECKPOINTED`. No signal
  handler in user code, and no rank can checkpoint a step the others have not reached;
* ``VARUNA_ON_SIGTERM=checkpoint`` (the launcher sets it inside a Slurm job, whose scheduler sends SIGTERM to
  every process of the job before a preemption or the time limit): the first ``SIGTERM`` does what ``SIGUSR1``
  does; a second one ends the process as SIGTERM would;
* a script's own ``SIGUSR1`` handler (the original's README had users write one that calls
  ``model.checkpoint(...)`` and exits) is adopted, whether it was installed before ``Varuna(...)`` or later
  (checked at every step): the signal only sets the flag, and the handler runs on every rank at the same point,
  the start of the step after the one that carried the flag. Run when the signal arrives, it would start a
  collective checkpoint on one rank in the middle of a step while the others go on: a hang. Under
  ``varuna launch`` the launcher's on-demand checkpoint (above) takes its place: the launcher resumes from it;
* ``VARUNA_CKPT_EVERY=N``: a checkpoint every ``N`` steps (what a restart after a crash resumes from),
  ``VARUNA_CKPT_KEEP`` of them kept, written in the background through ``VARUNA_CKPT_TEMPDIR`` if set;
* heartbeats to the manager (:class:`~varuna_core.worker.beacon.Beacon`): step, loss, step time and compute time;
* a morph by handover (:mod:`varuna_core.worker.morph`; ``VARUNA_SHELF_DIR`` set): ``SIGUSR2`` is agreed as
  ``SIGUSR1`` is, but every rank publishes its state on its host's shelf instead of writing the store, then exits
  with :data:`EXIT_CHECKPOINTED` (a publish that fails, e.g. a shelf that is full, falls back to the store with
  one line saying so). ``VARUNA_HANDOVER=wait``: the worker was started beside the old configuration; at its resume
  point it tells the launcher it is warm, waits for the go, and takes its state from where the go says;
* ``VARUNA_SNAPSHOT_EVERY`` (``N`` or ``auto``; with a shelf): in-memory snapshots at the start of a step, every
  rank at once (:mod:`varuna_core.worker.snapshots`), each reported to the launcher as soon as it is whole, which
  a crash then goes on from.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from ..env import WorkerEnv
from ..errors import (
    EXIT_BAD_CHECKPOINT,
    EXIT_CHECKPOINTED,
    CheckpointError,
    ConfigError,
    HandoverError,
    ShelfFullError,
)
from .beacon import Beacon
from .local_store import LocalStore
from .morph import Morph
from .snapshots import SnapshotReport, Snapshots

__all__ = ["Supervision", "Progress", "EXIT_CHECKPOINTED", "EXIT_BAD_CHECKPOINT", "ResumeRefused", "STORE_FLAG",
           "HANDOVER_FLAG"]

log = logging.getLogger(__name__)


# A rank's flag on the step's all-reduce: asked to checkpoint to the store (SIGUSR1), or to publish for a handover
# (SIGUSR2). Summed over ranks: at least STORE_FLAG when some rank asked for the store (which then wins), else a
# positive multiple of HANDOVER_FLAG below it (exact in float64 for up to 2**24 ranks).
STORE_FLAG = 1.0
HANDOVER_FLAG = 2.0**-24


class ResumeRefused(CheckpointError):
    """The checkpoint the launcher asked to resume from cannot be loaded (corrupt, incomplete, of another
    model). The worker exits with :data:`EXIT_BAD_CHECKPOINT`, which tells the launcher to fall back to an
    earlier checkpoint instead of retrying this one."""

    exit_code = EXIT_BAD_CHECKPOINT


def _process_start() -> float | None:
    """Wall-clock time this process started (Linux ``/proc``), for the launcher's start-up timings."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Progress(NamedTuple):
    """Where training is, as the facade reports it when asked."""

    iteration: int
    compute_time: float | None = None
    total_steps: int | None = None


class Supervision:
    """Gets plain values and callables from the facade, returns decisions (checkpoint, exit); never sees it.

    Args:
        rank, stage, replica: this worker's place (reported in heartbeats).
        told: what the launcher told this worker (read once by the facade; default: read from the environment).
        samples: examples per step (the global batch).
        save: ``save(directory, tempdir=..., background=..., keep=...)`` writes a checkpoint of the current step
            (collective) and returns the ``Future`` of a background write, or anything else.
        load: ``load(directory, step)`` restores that checkpoint (collective) and returns the step loaded.
        publish: ``publish(reserve, copies, final=False, leaving=False, alone=False)`` puts a checkpoint of the
            current step on this host's shelf, in the room ``reserve(nbytes)`` gives, with copies of its replicas'
            files if ``copies`` (collective; ``Varuna.publish_state``); returns ``{blob: rank}``. ``final``: a
            handover's, after which this process trains no more; ``leaving``: this host is not in the next
            configuration; ``alone``: the next configuration runs on this host only (its files need no hash).
        take: ``take(step, locate, fetch, staging, link, holder_of, drop, keep, claim)`` restores the state the old
            ranks published (collective; ``Varuna.take_state``); returns the step loaded. ``drop(names)`` takes blobs
            off this host's shelf of the old configuration (those the take made its live memory), ``keep`` is where
            the files that are its memory stay named (on this attempt's shelf) for its own handover's publish,
            ``claim(size, path)`` moves a file of touched memory to ``path`` for a file arriving over the wire.
        arrive: called once by a warm worker when the go has come, before it takes or loads anything (collective
            over the new ranks): the facade moves its parked stage onto its device then.
        release: called once by a worker about to publish for a handover and exit, before it publishes: the facade
            frees what no checkpoint holds (the gradient buffers, as large as the parameters), so that the
            publish writes into memory the process just gave back rather than memory the host has not touched
            lately ([Note: publish into freed memory] in :mod:`varuna_core.checkpoint.handover`).
        warm_grads: called once by a warm worker before it says it is warm: the facade allocates and writes its
            gradient buffers then (on the CPU, within half the host's available memory), off the critical path,
            rather than in the first step; returns the bytes touched.
        state_files: estimates of the sizes of the files this rank's state will be taken in (a parameter with its
            optimizer state in each), asked by a warm worker on a host that holds no old state, which touches that
            much memory, a file each, before it takes its state over the wire, and receives the files into them
            ([Note: receive into touched memory] in :mod:`varuna_core.worker.morph`).
        reside: ``reside(keep)``, called once after the first step (the optimizer's state exists then) where a
            handover may come: moves the parameters and optimizer state into files of ``keep`` on the shelf's
            tmpfs, so that the handover's publish makes them blobs without a copy (``handover.reside``); returns
            the bytes moved.
        progress: the current :class:`Progress` (iteration, compute time of the last step, total steps).
    """

    def __init__(self, rank: int, *, stage: int = 0, replica: int = 0, samples: int | None = None,
                 save: Callable[..., Any], load: Callable[[str, int], int],
                 progress: Callable[[], Progress | tuple[Any, ...]], told: WorkerEnv | None = None,
                 publish: Callable[..., dict[str, int]] | None = None,
                 take: Callable[..., int] | None = None, arrive: Callable[[], None] | None = None,
                 release: Callable[[], None] | None = None, reside: Callable[[Path], int] | None = None,
                 state_files: Callable[[], list[int]] | None = None,
                 warm_grads: Callable[[], int] | None = None) -> None:
        self.rank, self.stage, self.replica, self.samples = rank, stage, replica, samples
        self._save, self._load, self._publish, self._take, self._arrive = save, load, publish, take, arrive
        self._release = release
        self._state_files = state_files
        self._warm_grads = warm_grads
        self._reside = reside  # None once done (or never: no handover)
        self._progress = progress
        self.started = _process_start()
        told = WorkerEnv.from_environ() if told is None else told
        self.ckpt_dir = told.ckpt_dir
        self.resume_step = told.resume_step
        self.every = told.ckpt_every or 0
        self.keep = told.ckpt_keep
        self.tempdir = told.ckpt_tempdir
        self.total_steps = told.total_steps
        if told.on_sigterm not in (None, "checkpoint"):
            raise ConfigError(f"VARUNA_ON_SIGTERM is {told.on_sigterm!r}", hint="it is 'checkpoint' or unset")
        if (self.resume_step is not None or self.every or told.on_sigterm) and not self.ckpt_dir:
            raise ConfigError("VARUNA_RESUME_STEP, VARUNA_CKPT_EVERY or VARUNA_ON_SIGTERM is set but VARUNA_CKPT_DIR "
                              "is not",
                              hint="set VARUNA_CKPT_DIR to the checkpoint store (varuna launch does)")
        self.requested = False
        self.handover_requested = False  # SIGUSR2: publish for a handover
        self.morph = Morph.launched(told) if publish is not None else None
        if self.morph is not None and self.morph.warm and self.resume_step is not None:
            raise ConfigError("VARUNA_HANDOVER=wait and VARUNA_RESUME_STEP are both set",
                              hint="a warm worker learns where its state is from the launcher's go")
        self._terms = 0  # SIGTERMs received (VARUNA_ON_SIGTERM=checkpoint)
        self.stop_agreed: str | None = None  # "store" or "handover": every rank stops at the next step
        self.resumed = False
        self.last_saved: int | None = None
        self._pending = None  # the Future of a background checkpoint in flight
        self._last_step_start: float | None = None
        self.beacon = Beacon.launched(told, rank)
        self.user_handler: Callable[..., Any] | None = None  # the script's own SIGUSR1 handler, adopted
        self._main_thread = threading.current_thread() is threading.main_thread()
        if self.ckpt_dir is not None and not self._main_thread:
            log.warning("Varuna(...) was built outside the main thread: SIGUSR1 (checkpoint and stop) is not handled")
        self._adopt_handler()
        if told.on_sigterm == "checkpoint" and self._main_thread:
            signal.signal(signal.SIGTERM, self._on_term)
        if self.morph is not None and self._main_thread:
            signal.signal(signal.SIGUSR2, self._on_usr2)
        self.snapshots = self._snapshots(told)
        self.local_store = self._local_store(told)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        """The first SIGTERM asks for a checkpoint; the next one ends the process as SIGTERM does by default."""
        if self._terms:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._terms += 1
        self.requested = True

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def _on_usr2(self, signum: int, frame: FrameType | None) -> None:
        self.handover_requested = True

    def _adopt_handler(self) -> None:
        """Make SIGUSR1 set the flag: under ``varuna launch`` always; otherwise when the script has a handler of
        its own, which is then kept and run at the agreed point (see the module docstring)."""
        if not self._main_thread:
            return
        current = signal.getsignal(signal.SIGUSR1)
        if current == self._on_usr1:
            return
        if callable(current) and getattr(current, "__func__", None) is not Supervision._on_usr1:
            self.user_handler = current
            if self.ckpt_dir is not None:
                log.info("rank %d: the script's SIGUSR1 handler is replaced by varuna launch's on-demand checkpoint "
                         "(agreed by all ranks, then exit %d)", self.rank, EXIT_CHECKPOINTED)
        elif self.ckpt_dir is None:
            return  # nothing to do on the signal: the default action stays
        signal.signal(signal.SIGUSR1, self._on_usr1)

    # ------------------------------------------------------------------------------------------------------

    def _now(self) -> Progress:
        return Progress(*self._progress())

    def ready(self) -> None:
        """The model is built: tell the manager (its first heartbeat)."""
        if self.beacon is not None:
            self.beacon.progress(step=self._now().iteration, t_start=self.started, t_ready=time.time(),
                                 stage=self.stage, replica=self.replica, total_steps=self.total_steps)

    def resume(self) -> None:
        """Load ``VARUNA_RESUME_STEP`` (once), now that the optimizer is set; a warm worker waits for the go and
        takes its state from where it says."""
        if self.morph is not None and self.morph.warm and not self.resumed:
            self.resumed = True
            self._take_over(self.morph)
            return
        if self.resume_step is None or self.resumed or self.ckpt_dir is None:  # no store: refused when made
            return
        self.resumed = True
        if self.local_store is not None:
            self.last_saved = self._load_local(self.resume_step)
            taken = self.local_store.taken
            log.info("rank %d resumed from step %d of the hosts' stores %s (%d bytes from this host's, %d from "
                     "others')", self.rank, self.last_saved, self.ckpt_dir, taken["local"], taken["remote"])
            if self.beacon is not None:
                self.beacon.progress(step=self._now().iteration, t_resumed=time.time(), taken_local=taken["local"],
                                     taken_remote=taken["remote"])
            return
        try:
            step = self._load(self.ckpt_dir, self.resume_step)
        except CheckpointError as exc:
            raise ResumeRefused(exc.message, hint="the launcher falls back to an earlier checkpoint") from None
        self.last_saved = step
        log.info("rank %d resumed from %s/step_%d", self.rank, self.ckpt_dir, step)
        if self.beacon is not None:
            self.beacon.progress(step=self._now().iteration, t_resumed=time.time())

    def before_step(self) -> None:
        """At the start of ``step()``: the agreed on-demand checkpoint or publish (then exit) or the script's own
        handler, or a periodic checkpoint."""
        self._adopt_handler()  # a handler the script installed since the last step
        if (self.resume_step is not None or (self.morph is not None and self.morph.warm)) and not self.resumed:
            self.resume()  # no set_optimizer: model state only
        if self.snapshots is not None and self.snapshots.last is None:
            self.snapshots.last = self._now().iteration  # the step it started from: held where it came from
        self._check_background()
        now = time.perf_counter()
        self._step_time = None if self._last_step_start is None else now - self._last_step_start
        self._last_step_start = now
        if self.snapshots is not None and self.snapshots.pending:  # the last step covered its peer copy
            self.snapshots.finish(self._step_time)
        if self.stop_agreed == "handover":
            self._publish_and_exit()
        elif self.stop_agreed:
            if self.user_handler is not None and self.ckpt_dir is None:
                self._run_user_handler()
            else:
                self._checkpoint_and_exit()
        iteration = self._now().iteration
        if self._reside is not None and self.morph is not None and iteration >= 1:
            self._resident(self._reside)
        if self.every and iteration and iteration % self.every == 0 and iteration != self.last_saved:
            self._periodic(iteration)
        if self.snapshots is not None and self.snapshots.due(iteration):
            self._snapshot(iteration)

    def _resident(self, reside: Callable[[Path], int]) -> None:
        """Move the state onto the shelf's tmpfs, once (see ``reside`` in the class docstring)."""
        assert self.morph is not None
        self._reside = None
        started = time.perf_counter()
        try:
            moved = reside(self.morph.keep)
        except OSError as exc:
            log.info("rank %d: the training state stays in process memory (a handover's publish copies it): %s",
                     self.rank, exc.strerror or exc)
            return
        if moved:
            log.info("rank %d: %.1f MB of training state now lives on the shelf's tmpfs (%.2f s); a handover "
                     "publishes it without a copy", self.rank, moved / 1e6, time.perf_counter() - started)

    def regroup_asked(self, iteration: int) -> None:
        """A peer was lost in step ``iteration``: tell the launcher at once (it decides how the survivors go on)."""
        if self.beacon is not None:
            self.beacon.progress(step=iteration, regroup_asked=iteration)
            self.beacon.flush()

    def regroup_refused(self, iteration: int) -> None:
        """A peer was lost in step ``iteration`` and this worker cannot go on without it (its replica held a shard
        of the optimizer state): tell the launcher at once, so that it ends the survivors instead of waiting for
        them to ask for a regroup."""
        if self.beacon is not None:
            self.beacon.progress(step=iteration, regroup_refused=iteration)
            self.beacon.flush()

    def regrouped(self, rank: int, replica: int, iteration: int) -> None:
        """This worker is now ``rank`` (``replica`` of its stage) of the regrouped process group: what its
        heartbeats, snapshots and checkpoints say from now on."""
        self.rank, self.replica = rank, replica
        if self.beacon is not None:
            self.beacon.regrouped(rank)
            self.beacon.progress(step=iteration, regrouped=iteration, replica=replica)
            self.beacon.flush()
        if self.snapshots is not None:
            self.snapshots.regrouped(rank)
        if self.local_store is not None:
            self.local_store.rank = rank

    def left(self) -> None:
        """This worker leaves the job at a regroup (its replica lost a stage): it says nothing more, since its
        rank is another worker's now (its exit reaches the launcher through its agent)."""
        if self.beacon is not None:
            self.beacon.silence()

    def flag(self) -> float:
        """This rank's request, summed over ranks by the step's all-reduce: :data:`STORE_FLAG` if it was asked to
        checkpoint and stop, :data:`HANDOVER_FLAG` if to publish and stop (and it can), else 0."""
        if self.requested:
            return STORE_FLAG
        return HANDOVER_FLAG if self.handover_requested and self.morph is not None else 0.0

    def after_step(self, loss: float, requested_anywhere: bool | float) -> None:
        """The step's loss is known on every rank, and what the ranks asked for (the sum of their flags: a
        checkpoint to the store wins over a publish)."""
        flags = float(requested_anywhere)
        self.stop_agreed = "store" if flags >= STORE_FLAG else "handover" if flags > 0 else None
        if self.beacon is not None:
            now = self._now()
            self.beacon.progress(step=now.iteration, loss_step=now.iteration - 1, loss=loss,
                                 step_time=self._step_time, compute_time=now.compute_time, samples=self.samples,
                                 total_steps=now.total_steps or self.total_steps)

    # ------------------------------------------------------------------------------------------------------

    def _check_background(self) -> None:
        """Raise the error of a background checkpoint as soon as it is known (not at the next checkpoint), so the
        job stops, and the launcher restarts it from the last complete checkpoint."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            pending.result()

    def _periodic(self, iteration: int) -> None:
        if self.local_store is not None:
            self._write_local(iteration)
            return
        if self._pending is not None:
            self._pending.result()  # one background checkpoint at a time
            self._pending = None
        self._pending = self._save(self.ckpt_dir, tempdir=self.tempdir, background=self.tempdir is not None,
                                   keep=self.keep)
        self.last_saved = iteration

    def _snapshots(self, told: WorkerEnv) -> Snapshots | None:
        """This rank's in-memory snapshots (``VARUNA_SNAPSHOT_EVERY``), which need the attempt's shelf."""
        every = told.snapshot_interval
        if every == 0 and not told.ckpt_local:
            return None
        if self.morph is None:
            what = WorkerEnv.variable("ckpt_local" if every == 0 else "snapshot_every")
            raise ConfigError(f"{what} is set but there is no shelf (VARUNA_SHELF_DIR, VARUNA_JOB_ID, "
                              "VARUNA_JOB_TOKEN)", hint="varuna launch --morph sets them; without the handover "
                              "(--no-handover) there are no snapshots and no checkpoints on the hosts' own disks")

        def all_gather(obj: Any) -> list[Any]:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_world_size() == 1:
                return [obj]
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        morph = self.morph
        assert self._publish is not None and told.job_id is not None  # a morph has both
        return Snapshots(every, rank=self.rank, host=told.host or "localhost", shelf=morph.shelf,
                         server=told.shelf_server_address, job=told.job_id, token=told.job_token or "",
                         attempt=told.attempt or 0, publish=self._publish, all_gather=all_gather)

    def _local_store(self, told: WorkerEnv) -> LocalStore | None:
        """This rank's checkpoints in its host's own store (``VARUNA_CKPT_LOCAL``), written through a snapshot."""
        if not told.ckpt_local or self.ckpt_dir is None:
            return None
        assert self.snapshots is not None and self.morph is not None and told.job_id is not None  # made above
        return LocalStore(self.ckpt_dir, rank=self.rank, host=told.host or "localhost", keep=self.keep,
                          snapshots=self.snapshots, shelf=self.morph.shelf, server=told.shelf_server_address,
                          job=told.job_id, token=told.job_token or "", attempt=told.attempt or 0,
                          all_gather=self.snapshots.all_gather)

    def _write_local(self, iteration: int) -> bool:
        """Every rank at once: checkpoint this step into the hosts' own stores; whether it was written."""
        assert self.local_store is not None
        if not self.local_store.write(iteration, self._announcer(iteration), self._step_time):
            if self.beacon is not None:
                self.beacon.progress(step=iteration, snapshot_failed=iteration)
            return False
        self.last_saved = iteration
        if self.beacon is not None:
            self.beacon.progress(step=iteration, local_ckpt=iteration)
            self.beacon.flush()
        return True

    def _load_local(self, step: int) -> int:
        """Every rank at once: restore checkpoint ``step`` from the hosts' own stores (its files from this host's,
        else from a host that holds them); raises ResumeRefused on every rank if it cannot."""
        assert self.local_store is not None and self._take is not None and self.morph is not None
        try:
            locate, fetch = self.local_store.sources(step)
            return self._take(step, locate, fetch, self.morph.staging, None, None, None, self.morph.keep)
        except (CheckpointError, HandoverError) as exc:
            raise ResumeRefused(exc.message, hint="the launcher falls back to an earlier checkpoint") from None

    def _announcer(self, iteration: int) -> Callable[[SnapshotReport], None]:
        beacon = self.beacon

        def announce(report: SnapshotReport) -> None:  # sent at once: the launcher recovers from what it heard of
            if beacon is not None:
                beacon.progress(step=iteration, snapshot=report.step, snapshot_peer=report.peer,
                                snapshot_seconds=round(report.seconds, 4), snapshot_copied=report.copied,
                                snapshot_bytes=report.held, snapshot_every=report.every)
                beacon.flush()

        return announce

    def _snapshot(self, iteration: int) -> None:
        """Every rank at once: a snapshot of this step in host memory, with its copy on the next host (made whole at
        the next step's start)."""
        assert self.snapshots is not None
        if self._pending is not None:  # a background checkpoint reads the same tensors: one thing at a time
            self._pending.result()
            self._pending = None
        # the peer copy runs while the next step computes; that step's start makes the snapshot whole
        if not self.snapshots.start(iteration, self._announcer(iteration), self._step_time, overlap=True) \
                and self.beacon is not None:
            self.beacon.progress(step=iteration, snapshot_failed=iteration)

    def _run_user_handler(self) -> None:
        """Every rank, at the same step boundary: the script's handler (it usually checkpoints and exits). If it
        returns, training goes on and a later signal is handled again."""
        self.stop_agreed, self.requested = None, False
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        log.info("rank %d: running the script's SIGUSR1 handler at step %d", self.rank, self._now().iteration)
        handler = self.user_handler
        assert handler is not None  # called only when the script has one
        try:
            handler(signal.SIGUSR1, None)
        except SystemExit:  # every rank is leaving at this step: leave the process group together, as below
            self._leave()
            raise

    def _take_over(self, morph: Morph) -> None:
        """A warm worker: tell the launcher, wait for the go, take the state from where it says."""
        if self._warm_grads is not None:
            started = time.monotonic()
            if touched := self._warm_grads():
                log.info("rank %d wrote its %d bytes of gradient buffers before its go in %.2f s", self.rank, touched,
                         time.monotonic() - started)
        if self._state_files is not None:
            started = time.monotonic()
            if morph.prepare_take(self._state_files()):
                log.info("rank %d touched %d bytes of memory for its take in %.2f s", self.rank, morph.prefaulted,
                         time.monotonic() - started)
        try:
            self._warm_and_take(morph)
        finally:
            morph.give_back()

    def _warm_and_take(self, morph: Morph) -> None:
        if self.beacon is not None:
            self.beacon.progress(step=self._now().iteration, t_warm=time.time())
            self.beacon.flush()
        log.info("rank %d is warm: waiting for the launcher's go", self.rank)
        go = morph.wait_for_go()
        if self._arrive is not None:
            self._arrive()
        if go.source == "none":
            log.info("rank %d: the old configuration made no step; starting at step 0", self.rank)
        elif go.source == "store":
            self._load_from_store(go.step, "the old configuration wrote it to the store")
        else:
            assert self._take is not None and go.step is not None  # a go from the shelves names its step
            try:
                step = self._take(go.step, morph.locate(go), morph.fetch(go), morph.staging, morph.link(go),
                                  morph.holder_of(go), morph.drop(go), morph.keep, morph.claim)
            except (CheckpointError, HandoverError) as exc:
                if go.fallback_step is None or self.ckpt_dir is None:
                    raise
                log.warning("rank %d: the handover failed (%s); loading step_%d from the store instead",
                            self.rank, exc.message, go.fallback_step)
                if self.beacon is not None:
                    self.beacon.progress(step=self._now().iteration, handover_failed=exc.message[:200])
                self._load_from_store(go.fallback_step, "the handover failed")
                return
            self.last_saved = step
            log.info("rank %d took step %d over from the shelves (%d bytes from this host, %d of them replicas' "
                     "copies; %d over the network, %d of them into memory touched before; %d from replicas because a "
                     "holder failed)", self.rank, step, morph.taken["local"], morph.taken["copies"],
                     morph.taken["remote"], morph.claimed, morph.taken["replica"])
        if self.beacon is not None:
            self.beacon.progress(step=self._now().iteration, t_resumed=time.time(), t_taken=time.time(),
                                 taken_local=morph.taken["local"], taken_remote=morph.taken["remote"],
                                 taken_copies=morph.taken["copies"], taken_replica=morph.taken["replica"])

    def _load_from_store(self, step: int | None, why: str) -> None:
        if self.ckpt_dir is None or step is None:
            raise ResumeRefused(f"cannot load step {step} from the store ({why}): no store is known",
                                hint="varuna launch sets VARUNA_CKPT_DIR")
        if self.local_store is not None:
            self.last_saved = self._load_local(step)
            log.info("rank %d resumed from step %d of the hosts' stores %s (%s)", self.rank, step, self.ckpt_dir, why)
            return
        try:
            self.last_saved = self._load(self.ckpt_dir, step)
        except CheckpointError as exc:
            raise ResumeRefused(exc.message, hint="the launcher falls back to an earlier checkpoint") from None
        log.info("rank %d resumed from %s/step_%d (%s)", self.rank, self.ckpt_dir, step, why)

    def _publish_and_exit(self) -> None:
        """Every rank, at the agreed step: publish on the host's shelf (else write the store) and exit."""
        assert self.morph is not None and self._publish is not None  # only then is the handover flag raised
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        iteration = self._now().iteration
        morph = self.morph
        started = time.time()
        if self._release is not None:  # this process exits after the publish (or the store's write): no more steps
            self._release()
        shelf, copies = morph.shelf, morph.told.handover_copies != 0
        leaving = shelf.leaving  # (marked by the agent before it asked: the next configuration is elsewhere)
        alone = shelf.alone  # (likewise: the next configuration is on this host only)
        try:
            try:
                owners = self._publish(shelf.reserve, copies, True, leaving=leaving, alone=alone)
            except ShelfFullError:  # (on every rank alike) the room the snapshots hold is the publish's now
                if self.snapshots is None:
                    raise
                log.info("rank %d: the shelf is full; dropping the snapshots for the handover's publish", self.rank)
                self.snapshots.drop()
                owners = self._publish(shelf.reserve, copies, True, leaving=leaving, alone=alone)
        except (CheckpointError, HandoverError) as exc:  # ShelfFullError is a HandoverError
            log.warning("rank %d: publishing step %d for a handover failed (%s); writing it to the store instead",
                        self.rank, iteration, exc.message)
            if self.beacon is not None:
                self.beacon.progress(step=iteration, handover_failed=exc.message[:200])
            self.stop_agreed = "store"
            self._checkpoint_and_exit()
            return
        mine = {name for name, rank in owners.items() if rank == self.rank}
        size = sum(entry.size for name, entry in morph.shelf.manifest().items() if name in mine)
        log.info("rank %d: published step %d on its host's shelf (%d blobs, %d bytes); stopping", self.rank,
                 iteration, len(mine), size)
        if self.beacon is not None:
            self.beacon.progress(step=iteration, checkpointed=iteration, published=iteration, t_publishing=started,
                                 t_published=time.time(), published_bytes=size)
            self.beacon.flush()
        self._leave()
        raise SystemExit(EXIT_CHECKPOINTED)

    def _checkpoint_and_exit(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        iteration = self._now().iteration
        if iteration != self.last_saved and self.local_store is not None:
            if not self._write_local(iteration):
                log.warning("rank %d: the checkpoint of step %d asked for could not be written; stopping anyway "
                            "(the job continues from its previous checkpoint)", self.rank, iteration)
        elif iteration != self.last_saved:
            self._save(self.ckpt_dir, keep=self.keep)
        log.info("rank %d: checkpointed step %d on request; stopping", self.rank, iteration)
        if self.beacon is not None:
            self.beacon.progress(step=iteration, checkpointed=iteration, t_checkpointed=time.time())
            self.beacon.flush()
        self._leave()
        raise SystemExit(EXIT_CHECKPOINTED)

    @staticmethod
    def _leave() -> None:
        """Every rank stops at this step: leave the process group together (a rank whose peer has already
        closed its connections can die in gloo's teardown, SIGABRT after a clean run) and flush the output."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
