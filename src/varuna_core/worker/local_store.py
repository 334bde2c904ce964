"""Periodic checkpoints on each host's own disk, with a copy of another host's (``varuna launch --ckpt-local``).

Without a file system that every host shares, a checkpoint store cannot be one directory: each host's
``<store>/step_<N>/`` holds part of checkpoint ``N``, and losing a host must not lose its part. So a periodic (or
on-demand) checkpoint of step ``N`` is written as follows, every rank at once:

1. **A snapshot of step N** (:class:`~varuna_core.worker.snapshots.Snapshots`): each rank's files on its host's
   shelf, hashed as written, and each host's ranks pull over the shelves' wire a copy of the files of the host
   before it (a ring over the hosts in the order of their first rank).
2. **Onto the disk.** The ranks of each host share out the data files of step ``N`` on their shelf (their own and
   the copies) and write each into ``<store>/.step_<N>.local-<job>-a<attempt>/``, fsynced; the host's first rank
   writes rank 0's small files there (``RUN``, the manifest, the index; rank 0 sends their bytes to every rank)
   and, once every rank of every host has written its files, a ``PART`` marker listing the data files the
   directory holds (:func:`~varuna_core.checkpoint.layout.write_part`), or ``COMPLETE`` where it holds every file
   of the manifest (a job on one or two hosts), then renames the directory to ``step_<N>`` and applies retention
   (``--ckpt-keep``) to this run's directories. A ``PART`` directory is never taken for a complete checkpoint by
   ``latest``, a load or ``varuna ckpt verify``; ``varuna ckpt assemble`` gathers a whole one from the hosts'.
3. Every rank agrees that every host has its part (one collective); only then does each rank report the
   checkpoint to the launcher (``local_ckpt`` in its heartbeat), which resumes only from checkpoints so reported.

**Resuming** from a checkpoint so spread (:meth:`LocalStore.load`, every new rank at once): each rank says which of
the step's files its host holds and where its host's shelf server is; then
:func:`~varuna_core.checkpoint.handover.take` takes the files of its stage from its own host's directory, else
over the wire from a host that holds them (the node agent serves its store read only:
:mod:`varuna_core.launch.local_store`), checked against the manifest's sizes and SHA-256, all or nothing.

What it costs: a snapshot (host memory for this host's state and the previous host's, within ``--shelf-budget``)
plus writing both to the disk. A checkpoint that does not fit in host memory is not taken: said once, and tried
again at the next interval (training goes on; the previous checkpoint stays the newest).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.layout import (
    COMPLETE_FILE,
    MANIFEST_FILE,
    RUN_FILE,
    read_manifest,
    read_run,
    scan,
    step_dir,
)
from ..checkpoint.manifest import CHECKPOINT_INDEX
from ..checkpoint.part import read_part, write_part
from ..errors import CheckpointError, HandoverError, VarunaError
from ..launch.local_store import store_name
from ..launch.shelf import Shelf, fetch_into, shelf_key
from ..util.fs import atomic_write, fsync_dir, open_regular
from ..util.text import printable
from .snapshots import SnapshotReport, Snapshots, step_of

__all__ = ["LocalStore", "held_files"]

log = logging.getLogger(__name__)

_DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")
_SMALL = (RUN_FILE, MANIFEST_FILE, CHECKPOINT_INDEX)  # rank 0's files, written on every host
_OLD = ".varuna-old-"  # a step directory being deleted (as the store's own retention names it)
_TIMEOUT = 60.0  # seconds to connect to another host's shelf server and for each chunk of its reply
HERE = "this host's store"  # the holder of a file in this host's own store (in messages: where it came from)


def held_files(directory: Path) -> set[str]:
    """The data files of the checkpoint ``directory`` that this host holds: every one of its manifest's when it is
    ``COMPLETE``, those its ``PART`` marker lists otherwise (empty if it has neither, or no valid manifest)."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError:
        return set()
    listed = {f.path for f in manifest.files if _DATA_FILE.fullmatch(f.path)}
    if (directory / COMPLETE_FILE).is_file():
        return listed
    try:
        part = read_part(directory)
    except VarunaError:
        return set()
    return listed & set(part.files) if part is not None and part.step == manifest.step else set()


class LocalStore:
    """Writes and reads one rank's checkpoints in its host's own store (collective: every rank at once).

    Args:
        store: the store's path (the same on every host, each host's own directory).
        rank, host: this rank and its host (``VARUNA_HOST``).
        keep: keep this run's newest ``keep`` checkpoints on each host (None: every one).
        snapshots: this rank's snapshots: a checkpoint is a snapshot written to the disk.
        shelf: this attempt's shelf on this host.
        server: ``(address, port)`` of this host's shelf server (which serves the store too).
        job, token, attempt: the job's id and token and the attempt, whose shelf servers answer.
        all_gather: ``all_gather(obj)``: every rank's ``obj``, in rank order (collective).
    """

    def __init__(self, store: str | os.PathLike[str], *, rank: int, host: str, keep: int | None,
                 snapshots: Snapshots, shelf: Shelf, server: tuple[str, int] | None, job: str, token: str,
                 attempt: int, all_gather: Callable[[Any], list[Any]]) -> None:
        self.store, self.rank, self.host, self.keep = Path(store), rank, host, keep
        self.snapshots, self.shelf, self.server = snapshots, shelf, server
        self.job, self.token, self.attempt, self._all_gather = job, token, attempt, all_gather
        self.failed = False  # a checkpoint was not written: said once
        self.taken = {"local": 0, "remote": 0}  # bytes a resume read from this host's store, from other hosts'

    # ------------------------------------------------------------------------------------------------------
    # Write

    def write(self, iteration: int, announce: Callable[[SnapshotReport], None] | None = None,
              step_time: float | None = None) -> bool:
        """Checkpoint step ``iteration`` into every host's store (see the module docstring); whether it was
        written whole everywhere (a failure is said once, not raised: training goes on)."""
        started = time.perf_counter()
        report = self.snapshots.take(iteration, announce, step_time)
        if report is None:  # every rank alike: the snapshot did not fit, or failed (said by the snapshots)
            self._say(f"checkpoint of step {iteration} not written: its snapshot failed")
            return False
        places = [str(h) for h in self._all_gather(self.host)]
        mates = [r for r, h in enumerate(places) if h == self.host]
        first = mates[0] == self.rank
        staging = self.store / f".step_{iteration}.local-{self.job[:16]}-a{self.attempt}"
        small: dict[str, bytes] | None = None
        problem = None
        try:
            if self.rank == 0:
                small = {f: bytes(self.shelf.get(f"step_{iteration}/{f}")) for f in _SMALL}
            if first:
                self._fresh(staging)
        except (VarunaError, OSError) as exc:
            problem = self._problem(exc)
        gathered = self._all_gather((problem, small))
        problem = next((p for p, _ in gathered if p), None)
        small = gathered[0][1]
        written: list[str] = []
        if problem is None:
            try:
                written = self._write_share(iteration, staging, mates)
            except (VarunaError, OSError) as exc:
                problem = self._problem(exc)
        gathered = self._all_gather((problem, written))
        problem = next((p for p, _ in gathered if p), None)
        if problem is None and first:
            held = sorted({f for r in mates for f in gathered[r][1]})
            try:
                assert small is not None  # rank 0 read them, or there was a problem
                self._finish(iteration, staging, small, held)
            except (VarunaError, OSError) as exc:
                problem = self._problem(exc)
        problems = [p for p in self._all_gather(problem) if p]
        if problems or problem is not None:
            if first:
                shutil.rmtree(staging, ignore_errors=True)
            self._say(f"checkpoint of step {iteration} not written to the hosts' stores: {problems[0]}")
            return False
        log.info("rank %d: checkpoint of step %d in %s on every host (%d files here, %.2f s)", self.rank, iteration,
                 self.store, len(written), time.perf_counter() - started)
        self.failed = False
        return True

    def _fresh(self, staging: Path) -> None:
        """An empty directory for this host's part (a leftover of a killed write removed first)."""
        self.store.mkdir(parents=True, exist_ok=True)
        if staging.is_symlink() or staging.exists():
            if staging.is_symlink() or not staging.is_dir():
                staging.unlink()
            else:
                shutil.rmtree(staging)
        staging.mkdir(mode=0o755)

    def _write_share(self, iteration: int, staging: Path, mates: list[int]) -> list[str]:
        """Write this rank's share of the step's data files on this host's shelf into ``staging``; their names."""
        names = sorted(n for n in self.shelf.names() if step_of(n) == iteration
                       and _DATA_FILE.fullmatch(n.rsplit("/", 1)[-1]))
        mine = [n for i, n in enumerate(names) if mates[i % len(mates)] == self.rank]
        out = []
        for name in mine:
            file = name.rsplit("/", 1)[-1]
            entry, stream = self.shelf.open(name)
            with stream:
                _copy(stream.fileno(), staging / file, entry.size)
            out.append(file)
        return out

    def _finish(self, iteration: int, staging: Path, small: dict[str, bytes], held: list[str]) -> None:
        """The host's first rank: the small files, the marker, the rename into place, retention."""
        run = small[RUN_FILE].decode(errors="replace").strip()
        for file, data in small.items():
            atomic_write(staging / file, data, durable=True)
        manifest = read_manifest(staging)
        listed = {f.path for f in manifest.files if _DATA_FILE.fullmatch(f.path)}
        if listed <= set(held):
            atomic_write(staging / COMPLETE_FILE, f"{iteration}\n", durable=True)
        else:
            write_part(staging, step=iteration, run_id=run, host=self.host, files=held)
        fsync_dir(staging)
        final = step_dir(self.store, iteration)
        if final.is_symlink() or final.exists():
            owner = read_run(final) if final.is_dir() and not final.is_symlink() else None
            if owner != run:
                raise CheckpointError(f"{final} holds something else than a checkpoint of this run ({run}); "
                                      f"refusing to replace it", hint="give the job another --ckpt-dir")
            _delete(final)
        os.rename(staging, final)
        fsync_dir(self.store)
        self._retain(run, iteration)

    def _retain(self, run: str, newest: int) -> None:
        """Keep this run's newest ``keep`` checkpoints on this host (whole or part); remove the run's older
        directories that are neither (a write killed before its marker) and leftovers of killed writes."""
        mine = [e for e in scan(self.store) if e.run == run]
        kept = [e for e in mine if e.complete or (e.path / "PART").is_file()]
        doomed = [e for e in mine if e not in kept and e.step < newest]
        if self.keep:
            doomed += kept[:-self.keep]
        for entry in doomed:
            _delete(entry.path)
        ours = f".local-{self.job[:16]}-a"
        for leftover in self.store.glob(".step_*.local-*"):
            if ours in leftover.name and not leftover.name.endswith(f"-a{self.attempt}") \
                    and leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
        for old in self.store.glob(f"{_OLD}step_*"):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------------
    # Read

    def sources(self, step: int) -> tuple[Callable[[str], Any], Callable[..., Any]]:
        """``(locate, fetch)`` for :func:`~varuna_core.checkpoint.handover.take` of checkpoint ``step`` from the
        hosts' stores (collective: every rank says what its host holds). Raises HandoverError on every rank when
        some file of the checkpoint is on no host."""
        directory = step_dir(self.store, step)
        held = held_files(directory)
        small = all((directory / f).is_file() for f in _SMALL) and bool(held)
        gathered = self._all_gather((self.host, self.server, sorted(held), small))
        holders: dict[str, list[Any]] = {}
        order = sorted(range(len(gathered)), key=lambda r: (gathered[r][0] != self.host, r))  # this host first
        for r in order:
            host, server, files, has_small = gathered[r]
            if host != self.host and server is None:
                continue  # another host without a shelf server: none of its files can be had
            holder = HERE if host == self.host else (host, *server)
            for file in [*files, *(_SMALL if has_small else ())]:
                if holder not in holders.setdefault(file, []):
                    holders[file].append(holder)
        if not all(f in holders for f in _SMALL):
            raise HandoverError(f"no host holds checkpoint step_{step} of {self.store}",
                                hint="the launcher falls back to an earlier checkpoint")
        holders[COMPLETE_FILE] = [HERE]  # a checkpoint every host reported whole: written here, not fetched
        job = shelf_key(self.job, self.attempt)

        def locate(blob: str) -> list[Any]:
            return holders[blob.rsplit("/", 1)[-1]]

        def fetch(holder: Any, names: list[str], into: Callable[..., Any], max_bytes: int) -> dict[str, str] | None:
            if holder == HERE:  # this host's own store (the load checks every file against the manifest)
                for name in names:
                    file = name.rsplit("/", 1)[-1]
                    if file == COMPLETE_FILE:
                        data = f"{step}\n".encode()
                        into(name, len(data))[:] = data
                        continue
                    self.taken["local"] += _read_into(directory / file, functools.partial(into, name), max_bytes)
                return None
            _, address, port = holder
            wire = {store_name(step, n.rsplit("/", 1)[-1]): n for n in names}
            entries = fetch_into(address, port, job=job, token=self.token, names=list(wire), max_bytes=max_bytes,
                                 into=lambda e: into(wire[e.name], e.size), timeout=_TIMEOUT)
            self.taken["remote"] += sum(e.size for e in entries.values())
            return {wire[name]: entry.digest for name, entry in entries.items() if entry.digest is not None}

        return locate, fetch

    # ------------------------------------------------------------------------------------------------------

    def _problem(self, exc: BaseException) -> str:
        message = getattr(exc, "message", None) or (exc.strerror if isinstance(exc, OSError) else None) or exc
        return f"rank {self.rank} on {printable(self.host)}: {printable(message)}"

    def _say(self, message: str) -> None:
        if not self.failed:
            log.warning("%s; training goes on (the previous checkpoint stays the newest)", message)
        self.failed = True


def _copy(source: int, target: Path, size: int) -> None:
    """``size`` bytes from the start of descriptor ``source`` into the new file ``target``, fsynced."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        done = 0
        while done < size:
            n = os.sendfile(fd, source, done, min(size - done, 1 << 30))
            if n == 0:
                raise CheckpointError(f"a blob ended after {done} of its {size} bytes while written to {target}")
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_into(path: Path, into: Callable[[int], memoryview], limit: int) -> int:
    """The regular file ``path`` (not a link, at most ``limit`` bytes) into the buffer ``into(size)`` returns; its
    size."""
    fd = open_regular(path, what="checkpoint file", follow=False, error=CheckpointError)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path} has {size} bytes, more than the {limit} expected")
        view, done = into(size), 0
        while done < size:
            n = os.readv(fd, [view[done:done + (1 << 26)]])
            if n == 0:
                raise CheckpointError(f"{path} ended after {done} of its {size} bytes")
            done += n
    finally:
        os.close(fd)
    return size


def _delete(directory: Path) -> None:
    """Remove a step directory: renamed out of the way first, so a kill leaves a hidden leftover, never a
    ``step_<N>`` that lost part of its files."""
    doomed = directory.with_name(f"{_OLD}{directory.name}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(directory, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


