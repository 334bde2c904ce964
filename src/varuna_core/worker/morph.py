"""The worker's side of a morph by handover (DESIGN.md §3.8): publish on request, wait warm for the go, take.

Under ``varuna launch --morph`` every worker knows its host's shelf (``VARUNA_SHELF_DIR``, named after the job
and the attempt: :func:`~varuna_core.launch.shelf.shelf_key`) that its node agent serves to the other hosts.

* **Publish** (old configuration): when the launcher asks for a handover (SIGUSR2, agreed by every rank at one step
  boundary as an on-demand checkpoint is), each rank puts its part of a checkpoint of that step on its own host's
  shelf (:func:`~varuna_core.checkpoint.handover.publish`) instead of writing it to the store, and exits.
* **Wait** (new configuration, ``VARUNA_HANDOVER=wait``): the launcher started these workers while the old ones
  still trained; they ran the script up to its resume point (``set_optimizer``, or the first ``step``), told the
  launcher they are warm, and wait there for the **go**: a message signed with the job's token that node 0's
  agent puts in the new configuration's store (:class:`~varuna_core.launch.protocol.Go`). It says where the state
  is: on the old ranks' shelves (``holders[r]`` is old rank ``r``'s host and shelf server), in the store (the old
  ranks could not publish: a shelf was full), or nowhere (the old configuration had made no step).
* **Take**: each new rank takes only the files that hold its stage's tensors
  (:func:`~varuna_core.checkpoint.handover.take`): from its own host's shelf when the holder is on its host, else
  over the wire from the holder's shelf server, authenticated, bounded and hash-checked.

Which old rank holds a file follows from the checkpoint's own naming: rank ``r`` writes ``__<r>_0.distcp``; the
small files (the run, the manifest, the index, ``COMPLETE``) are rank 0's.

[Note: receive into touched memory] A take over the wire writes every byte it receives into a new file of the
shelf's tmpfs. Each new page of it costs the kernel an allocation, a zeroing and a fault, and on a VM, memory the
guest has not touched lately costs a fault into the hypervisor as well: on the 2-core VM of benchmarks/README.md,
the shelf's wire delivered 0.35-0.6 GB/s into memory untouched for a while, 0.7-1.1 GB/s into new pages of memory
freed moments before, and 1.4-1.6 GB/s into pages a file of the tmpfs already held (1.8-2.1 GB/s into one buffer
used again). A host that rejoins (its last worker's memory long given back) received a 3 GB stage in 9-11 s over a
link of 1.2 GB/s. So a warm worker on a host that holds no state of the old configuration (no shelf of the attempt
before: a host that joins, which will take its whole stage over the wire) first writes a file of zeros into the
shelf's tmpfs for each file of its stage it expects to receive, of the size it estimates from its parameters and
its optimizer (:meth:`Morph.prefault`, before it tells the launcher it is warm: off the critical path, the old
configuration trains meanwhile). Each file that then arrives over the wire is received into one of those
(:meth:`Morph.claim`: the smallest one large enough, moved to the take's name for the file and cut to its size), so
its bytes land in pages the tmpfs holds already. The files make no more memory than the take itself will, and
those left over are removed when the take ends (:meth:`Morph.give_back`). A host that holds old state links what it
has in place and receives the rest (a shrink: the stages of the host that leaves); when its old workers' state
lives in files of their shelf, its new workers touch memory for the part of their stages those files do not cover,
leaving the tmpfs room for those workers' last publish (:meth:`Morph.prepare_take`). No more than half of the
host's free memory, or of the tmpfs's free space, is touched. The files are in the attempt's shelf, which its
node agent removes when the attempt ends, so a worker killed while it holds them does not leave them behind.
The take maps a claimed file with ``MAP_POPULATE``: its pages are in the tmpfs, but not yet in the take's page
tables, and a fault per page as the bytes arrive cost a quarter of the rate (2 requests of 1.6 GB into such files
over loopback: 1.74-1.83 GB/s faulted, 2.36-2.46 populated). A new file is mapped as it is: populating it would
allocate all of it before the first byte arrives (1.34-1.44 GB/s faulted, 1.14-1.18 populated).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..env import WorkerEnv
from ..errors import ConfigError, HandoverError
from ..launch.protocol import GO_KEY, Go, decode_go
from ..launch.shelf import Shelf, fetch_into, shelf_key
from ..util.heap import available_memory as _available_memory  # (tests replace it here)
from ..util.text import printable

__all__ = ["Morph", "WAIT_FOR_GO", "holder_rank"]

WAIT_FOR_GO = 3600.0  # seconds a warm worker waits for the go before it gives up (the launcher sends it sooner)
_DATA_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")
_WAIT = 5.0  # seconds of one wait on the store for the go (then the deadline is looked at again)
_PREFAULT_CHUNK = 64 << 20  # bytes per write while pre-faulting
_POOL_MIN = 1 << 20  # bytes: a smaller file is received into new pages (its faults cost little)
_POOL_SLACK = 64 << 10  # bytes beyond each estimate: the writer's alignment between a parameter and its slots

log = logging.getLogger(__name__)


def holder_rank(blob: str) -> int:
    """The old rank that published ``blob`` (``step_<N>/<file>``): the rank in a data file's name, else rank 0."""
    match = _DATA_FILE.fullmatch(blob.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else 0


@dataclass
class Morph:
    """What a worker needs to publish its state, or to take it, in a morph by handover.

    Args:
        told: what the launcher told this worker (job, token, attempt, host, shelf directory).
        master: ``(address, port)`` of the job's store (torchrun's ``MASTER_ADDR`` and ``MASTER_PORT``).
    """

    told: WorkerEnv
    master: tuple[str, int] | None = None
    # bytes, for the heartbeat: from this host's shelf, over the network; of those, "copies": a replica's copy on
    # this host taken rather than its writer's file elsewhere, "replica": from a replica because the writer's
    # holder failed
    taken: dict[str, int] = field(default_factory=lambda: {"local": 0, "remote": 0, "copies": 0, "replica": 0})
    # [Note: receive into touched memory]: the files of touched memory not yet claimed, as (bytes, path), by size
    _pool: list[tuple[int, Path]] = field(default_factory=list, repr=False)
    local_workers: int = 1  # workers of this configuration on this host (torchrun's LOCAL_WORLD_SIZE)
    prefaulted: int = 0  # bytes pre-faulted (for the log)
    claimed: int = 0  # of those, bytes received into (for the log)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the take's requests run at once

    @classmethod
    def launched(cls, told: WorkerEnv) -> Morph | None:
        """The worker's morph under ``varuna launch`` with a shelf; None otherwise."""
        if told.shelf_dir is None or told.job_id is None or told.job_token is None:
            if told.handover == "wait":
                raise ConfigError("VARUNA_HANDOVER=wait needs VARUNA_SHELF_DIR, VARUNA_JOB_ID and VARUNA_JOB_TOKEN",
                                  hint="these are set by varuna launch; unset VARUNA_HANDOVER to run without it")
            return None
        if told.handover not in (None, "wait"):
            raise ConfigError(f"VARUNA_HANDOVER is {printable(told.handover)!r}", hint="it is 'wait' or unset")
        master = None
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if address and port.isdigit():
            master = (address, int(port))
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return cls(told, master, local_workers=int(local) if local.isdigit() and int(local) > 0 else 1)

    @property
    def warm(self) -> bool:
        """Whether this worker was started beside the old configuration and waits for the go."""
        return self.told.handover == "wait"

    @property
    def shelf(self) -> Shelf:
        """This attempt's shelf on this host."""
        assert self.told.job_id is not None and self.told.shelf_dir is not None  # checked in launched()
        return Shelf(shelf_key(self.told.job_id, self.told.attempt or 0), root=self.told.shelf_dir,
                     budget=self.told.shelf_budget)

    @property
    def keep(self) -> Path:
        """Where the files a take made this worker's memory stay named, for its own handover's publish to make
        them blobs without a copy: a directory of this attempt's shelf, removed with it."""
        return self.shelf.path / f"{os.getpid()}.live"

    @property
    def staging(self) -> Path:
        """Where a publish or a take writes its private files first: the shelf's tmpfs."""
        assert self.told.shelf_dir is not None
        return Path(self.told.shelf_dir)

    # ------------------------------------------------------------------------------------------------------
    # Memory for what arrives ([Note: receive into touched memory])

    def holds_old_state(self) -> bool:
        """Whether this host holds a shelf of the attempt before this one (its old workers' state and copies)."""
        attempt, job = self.told.attempt or 0, self.told.job_id
        if attempt < 2 or job is None or self.told.shelf_dir is None:
            return True  # no attempt before, or unknown: as if it did, and its memory is left alone
        return Shelf(shelf_key(job, attempt - 1), root=self.told.shelf_dir).path.exists()

    def old_live_bytes(self) -> int | None:
        """Bytes of the files that the old configuration's workers on this host train in (the ``*.live``
        directories on the shelf of the attempt before: what their last publish makes blobs without a copy, and
        a take on this host links); None on a host without that shelf (one that joins)."""
        if not self.holds_old_state():
            return None
        attempt, job = self.told.attempt or 0, self.told.job_id
        if attempt < 2 or job is None or self.told.shelf_dir is None:
            return 0
        total = 0
        with contextlib.suppress(OSError):
            for directory in Shelf(shelf_key(job, attempt - 1), root=self.told.shelf_dir).path.glob("*.live"):
                if stat.S_ISDIR(directory.lstat().st_mode):
                    for item in os.scandir(directory):
                        if item.is_file(follow_symlinks=False):
                            total += item.stat(follow_symlinks=False).st_size
        return total

    def prepare_take(self, sizes: list[int]) -> int:
        """Touch memory for the files this worker will receive over the wire ([Note: receive into touched memory]),
        given ``sizes``, estimates of its stage's files; returns the bytes touched.

        * On a host that joins: all of them (its whole stage comes over the wire).
        * On a host whose old workers' state lives in files of their shelf (:meth:`old_live_bytes`; a take here
          links them): what those files do not cover, shared among this host's new workers, with a sample of the
          sizes in their proportions (which files will come from elsewhere is known only at the go); and the old
          workers' last publish keeps room for their state (a publish checks the tmpfs's free space for it).
        * Elsewhere (no attempt before, or the old state is in process memory: its publish will copy it), none.
        """
        old = self.old_live_bytes()
        if old is None:
            return self.prefault(sizes)
        limit = sum(sizes) - old // self.local_workers
        return self.prefault(sizes, limit=limit, keep_free=old) if old > 0 and limit > 0 else 0

    def prefault(self, sizes: Iterable[int], *, limit: int | None = None, keep_free: int = 0) -> int:
        """Write a file of zeros into the shelf's tmpfs for each of ``sizes`` (estimates of the files the take will
        receive; those under a MiB are left out), the largest first, within half the host's available memory and
        half the tmpfs's free space; returns the bytes touched (0: nothing to do, or the tmpfs refused, which is
        only logged: a full tmpfs keeps what was written). The take receives its files into them (:meth:`claim`).
        ``limit``: at most that many bytes, in files sampled from ``sizes`` in their proportions; ``keep_free``:
        bytes of the tmpfs left free beside."""
        wanted = sorted((int(n) + _POOL_SLACK for n in sizes if int(n) >= _POOL_MIN), reverse=True)
        budget = _available_memory() // 2
        if not wanted or budget < _POOL_MIN or self._pool:
            return 0
        if limit is not None and limit < sum(wanted):
            wanted, budget = _sample(wanted, limit / sum(wanted)), min(budget, limit)
            if not wanted:
                return 0
        try:  # in this attempt's shelf: its agent removes it with the shelf if this process dies holding it
            directory = self.shelf.make_dir()
            room = os.statvfs(directory)
        except (OSError, HandoverError) as exc:
            log.info("memory for the take not pre-faulted (%s)", exc)
            return 0
        free = room.f_bavail * room.f_frsize
        budget = min(budget, free // 2, free - keep_free)
        zeros, total = memoryview(bytes(min(_PREFAULT_CHUNK, max(wanted)))), 0
        for i, size in enumerate(wanted):
            size = min(size, budget - total)
            if size < _POOL_MIN:
                break
            path = directory / f"{os.getpid()}-{i}.prefault"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except OSError as exc:
                log.info("memory for the take not pre-faulted (%s)", exc)
                break
            written = 0
            try:
                while written < size:
                    written += os.pwrite(fd, zeros[:min(len(zeros), size - written)], written)
            except OSError as exc:  # a full tmpfs: what was written still helps
                log.info("pre-faulted %d of %d bytes (%s)", total + written, sum(wanted), exc.strerror or exc)
                size = 0
            finally:
                os.close(fd)
            self._pool.append((written, path))
            total += written
            if size == 0:
                break
        self._pool.sort()
        self.prefaulted = total
        return total

    def claim(self, size: int, path: Path) -> bool:
        """Move the smallest file of touched memory (:meth:`prefault`) that holds ``size`` bytes, else the largest,
        to ``path`` (which must not exist), for a file of ``size`` bytes about to arrive; False if there is none,
        or ``size`` is under a MiB: the caller makes the file itself."""
        with self._lock:
            if size < _POOL_MIN or not self._pool:
                return False
            at = bisect.bisect_left([n for n, _ in self._pool], size)
            _, pooled = self._pool.pop(min(at, len(self._pool) - 1))
            self.claimed += size
        try:
            os.link(pooled, path)  # (fails if path exists)
        except OSError:
            with self._lock:
                self.claimed -= size
            return False
        finally:
            pooled.unlink(missing_ok=True)
        return True

    def give_back(self) -> None:
        """Remove the files of touched memory that no file of the take was received into."""
        while self._pool:
            self._pool.pop()[1].unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------------
    # Wait

    def wait_for_go(self, timeout: float = WAIT_FOR_GO) -> Go:
        """Block until the launcher's go for this attempt is in the job's store; the go, checked.

        Raises:
            HandoverError: no go within ``timeout`` seconds, or a message that is not a go of this job for this
                attempt (unsigned, replayed from another attempt, malformed).
        """
        import datetime

        import torch.distributed as dist

        if self.master is None:
            raise HandoverError("a warm worker needs MASTER_ADDR and MASTER_PORT to hear the launcher's go",
                                hint="they are set by varuna launch")
        store = dist.TCPStore(self.master[0], self.master[1], is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        deadline = time.monotonic() + timeout
        while not store.check([GO_KEY]):  # the store answers a wait when the key is set: no polling meanwhile
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoverError(f"the launcher's go did not come within {timeout:g} s",
                                    hint="the launcher stops a warm configuration it does not use; see its log")
            try:
                store.wait([GO_KEY], datetime.timedelta(seconds=min(_WAIT, left)))
            except (RuntimeError, TimeoutError):  # torch's DistStoreError (a RuntimeError) when it times out
                pass
        try:
            return decode_go(store.get(GO_KEY), self.told.job_token or "", self.told.attempt or 0)
        except ValueError as exc:
            raise HandoverError(f"refused the launcher's go: {exc}") from None

    # ------------------------------------------------------------------------------------------------------
    # Take

    def locate(self, go: Go) -> Callable[[str], Any]:
        """``locate(blob)`` for :func:`~varuna_core.checkpoint.handover.take`: the holder ``(host, address, port)``
        of the old rank that published it (KeyError: no such rank); with the go's ``copies``, that holder and then
        the next host's, which keeps a copy of its snapshot."""

        first: dict[str, int] = {}  # each host's first rank, in rank order: the ring of a snapshot's copies
        for rank, holder in enumerate(go.holders):
            first.setdefault(holder.host, rank)
        ring = list(first)

        def locate(blob: str) -> tuple[str, str, int] | list[tuple[str, str, int]]:
            rank = holder_rank(blob)
            if rank >= len(go.holders):
                raise KeyError(blob)
            holder = go.holders[rank]
            own = (holder.host, holder.address, holder.port)
            if not go.copies or len(ring) < 2:
                return own
            after = go.holders[first[ring[(ring.index(holder.host) + 1) % len(ring)]]]
            return [own, (after.host, after.address, after.port)]

        return locate

    def holder_of(self, go: Go) -> Callable[[int], tuple[str, str, int]]:
        """``holder_of(rank)`` for :func:`~varuna_core.checkpoint.handover.take`: the holder ``(host, address,
        port)`` of old rank ``rank``'s shelf (KeyError: no such rank), where its replicas' copies are too."""

        def holder_of(rank: int) -> tuple[str, str, int]:
            if not 0 <= rank < len(go.holders):
                raise KeyError(rank)
            holder = go.holders[rank]
            return holder.host, holder.address, holder.port

        return holder_of

    def _count(self, kind: str, size: int) -> None:
        """Add ``size`` bytes to ``taken[kind]`` (a take runs several requests at once, each on a thread)."""
        with self._lock:
            self.taken[kind] += size

    def _copied(self, go: Go, holder: Any, name: str, size: int, kind: str) -> None:
        """Count ``size`` bytes of ``name`` under ``kind`` if ``holder`` is not its writer's (a replica's copy)."""
        rank = holder_rank(name)
        if rank < len(go.holders) and tuple(holder) != (go.holders[rank].host, go.holders[rank].address,
                                                        go.holders[rank].port):
            self._count(kind, size)

    def link(self, go: Go) -> Callable[[Any, str, Path], tuple[int, str | None] | None]:
        """``link(holder, name, path)`` for :func:`~varuna_core.checkpoint.handover.take`: a blob of this host's own
        shelf put at ``path`` as its file itself (a hard link, no copy), and its data's size and digest as its
        writer recorded them; None for another host's blob, or where no link can be made (then it is fetched)."""
        assert go.shelf is not None
        local = Shelf(go.shelf, root=self.staging)

        def link(holder: tuple[str, str, int], name: str, path: Path) -> tuple[int, str | None] | None:
            if holder[0] != self.told.host or not local.has(name):
                return None
            try:
                entry = local.link(name, path)
            except OSError:
                return None
            self._count("local", entry.size)
            self._copied(go, holder, name, entry.size, "copies")  # linked first: the copy is on this host
            return entry.size, entry.digest

        return link

    def drop(self, go: Go) -> Callable[[list[str]], None]:
        """``drop(names)`` for :func:`~varuna_core.checkpoint.handover.take`: takes blobs off this host's shelf of
        the old configuration, once this rank's live state is their memory (its first optimizer step changes
        them): a take tried again then gets them from elsewhere, never changed under their old names."""
        assert go.shelf is not None
        local = Shelf(go.shelf, root=self.staging)

        def drop(names: list[str]) -> None:
            local.remove(names)

        return drop

    def fetch(self, go: Go, timeout: float = 60.0) -> Callable[[Any, list[str], Callable[..., Any], int], object]:
        """``fetch(holder, names, into, max_bytes)`` for :func:`~varuna_core.checkpoint.handover.take`: from this
        host's own shelf when the holder is this host, else from the holder's shelf server."""
        assert go.shelf is not None  # a go from the shelves names it (checked when decoded)
        job, token, local = go.shelf, self.told.job_token or "", Shelf(go.shelf, root=self.staging)

        def fetch(holder: tuple[str, str, int], names: list[str], into: Callable[..., Any],
                  max_bytes: int) -> dict[str, str | None] | None:
            host, address, port = holder
            if host == self.told.host and all(local.has(name) for name in names):
                unhashed: dict[str, str | None] = {}
                for name in names:  # each file is checked against the manifest's digest as it is loaded
                    entry = local.get_into(name, lambda e: into(e.name, e.size), verify=False)
                    self._count("local", entry.size)
                    self._copied(go, holder, name, entry.size, "replica")  # fetched: the writer's holder failed
                    if entry.digest is None:  # its writer's file on this host, as a link would give it
                        unhashed[name] = None
                return unhashed or None
            entries = fetch_into(address, port, job=job, token=token, names=names, max_bytes=max_bytes,
                                 into=lambda e: into(e.name, e.size), timeout=timeout)
            self._count("remote", sum(e.size for e in entries.values()))
            for entry in entries.values():
                self._copied(go, holder, entry.name, entry.size, "replica")
            return {name: entry.digest for name, entry in entries.items()}  # each checked as it arrived

        return fetch


def _sample(sizes: list[int], fraction: float) -> list[int]:
    """About ``fraction`` of ``sizes`` (sorted), spread evenly over them: each size class in its proportion."""
    out, credit = [], 0.5  # (rounded: a half share picks the file)
    for size in sizes:
        credit += fraction
        if credit >= 1.0:
            out.append(size)
            credit -= 1.0
    return out
