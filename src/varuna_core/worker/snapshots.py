"""In-memory snapshots: every N steps each rank's state on its own host's shelf, and a copy of it on one other host
(DESIGN.md §3.8, "sudden loss"), so that a host lost without notice costs at most N steps and no store read.

A snapshot of step ``k`` is a publish (:func:`~varuna_core.checkpoint.handover.publish`: the checkpoint's files,
hashed as written, adopted as blobs ``step_<k>/<file>`` of the attempt's shelf, with copies of the data-parallel
replicas' files where a replica lives on another host) that does not stop the worker, followed by the **peer
copy**: the hosts, in the order of their first rank, form a ring, and the ranks of each host pull over the shelves'
wire (authenticated with the job's token, hash-checked as they arrive) the blobs that the previous host's ranks
wrote and that this host does not hold already, sharing them out among themselves — in a thread, while the next
step computes (the copy of step ``k`` while step ``k + 1`` runs: it only moves bytes between the shelves' servers,
which the step does not touch). At the next step's start every rank waits for its copy and agrees that the snapshot
is whole; only then does each host drop the blobs of the snapshot before it (so a host lost while a
snapshot is written still leaves the previous one, whole, on the others). Memory per host: this host's state and
the previous host's, twice while a snapshot is written; bounded by the shelf's budget (``--shelf-budget``).

Best effort by design: a snapshot that does not fit (the shelf's budget, or host memory) or whose peer copy fails is
reported once (a warning and the heartbeat's ``snapshot_failed``) and training goes on; the periodic checkpoints in
the store remain the durable copy. Which host holds which copy follows from the ring alone, so the launcher, which
knows the hosts' order, tells the new ranks where each file is without any list from the workers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, HandoverError, ShelfFullError, VarunaError
from ..launch.shelf import Shelf, fetch_into, shelf_key
from ..util.text import printable

__all__ = ["AUTO", "OVERHEAD", "Snapshots", "SnapshotReport", "every_for", "ring_source", "step_of"]

log = logging.getLogger(__name__)

_BATCH = 1024  # blobs per request to the previous host (a file per parameter: a large model has thousands)
_TIMEOUT = 60.0  # seconds to connect to the previous host's shelf server and for each chunk of its reply


def ring_source(hosts: list[str], host: str) -> str | None:
    """The host whose snapshot ``host`` keeps a copy of: the one before it in ``hosts`` (the hosts in the order of
    their first rank), around the ring; None for a job on one host."""
    if len(hosts) < 2 or host not in hosts:
        return None
    return hosts[(hosts.index(host) - 1) % len(hosts)]


def step_of(blob: str) -> int | None:
    """The step of a snapshot's blob (``step_<k>/<file>``), None for another name."""
    head, sep, _ = blob.partition("/")
    if not sep or not head.startswith("step_") or not head[5:].isdigit():
        return None
    return int(head[5:])


@dataclass(frozen=True)
class SnapshotReport:
    """One snapshot, as this rank saw it."""

    step: int
    seconds: float  # what the training waited for on this rank: publish, the peer copy's part the step did not cover,
    # agreement
    copied: int  # bytes this rank pulled from the previous host
    held: int  # bytes this rank put on its host's shelf for it: its own files and what it copied
    peer: bool  # every rank's files are also on another host (False on one host, or if a copy failed)
    every: int  # steps to the next snapshot (chosen from this one's cost under AUTO)


AUTO = None  # ``every``: as often as costs at most OVERHEAD of the training time, from each snapshot's cost
OVERHEAD = 0.02  # the share of training time the automatic choice allows snapshots
FIRST_AUTO = 3  # the step of the first automatic snapshot (the first steps are slower: not a step time to go by)
MAX_EVERY = 10_000  # the automatic choice's longest interval
RETRY = 50  # under AUTO, steps to the next try after a snapshot that failed (doubled while they keep failing)
# Under AUTO, the longest wait after a process's first snapshot. That one pays once for what later ones do not
# (the checkpoint code's first use, the first connection to the next host's shelf server, memory touched for the
# first time): 1.6-1.9 s where the next ones take 0.1 s on the example GPT over two test hosts. An interval chosen
# from it left 1,000-1,500 steps unprotected (benchmarks/goodput.py found it: a host lost then cost every one of
# them); the second snapshot comes this soon instead, and its cost sets the interval.
WARM_RETAKE = 10
MIN_FREE = 0.10  # the share of the host's memory a snapshot leaves free (tmpfs pages cannot be reclaimed)


def host_memory() -> tuple[int, int] | None:
    """``(available, total)`` bytes of this host's memory (``/proc/meminfo``); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            fields = {k: v for k, _, v in (line.partition(":") for line in f)}
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def every_for(seconds: float, step_time: float | None, budget: float = OVERHEAD) -> int:
    """Steps between two snapshots so that one taking ``seconds`` costs at most ``budget`` of the training time
    at ``step_time`` seconds a step (1 when the step time is unknown: measured again at the next one)."""
    if not step_time or step_time <= 0 or not seconds > 0:
        return 1
    return max(1, min(MAX_EVERY, math.ceil(seconds / (budget * step_time))))


@dataclass
class _PeerCopy:
    """A snapshot published on its host's shelf whose copy of the previous host's files is pulled (in a thread
    while the next step computes, or at once), waiting for :meth:`Snapshots.finish`."""

    iteration: int
    started: float  # perf_counter at its start
    owners: dict[str, int]  # blob -> the rank that wrote it (every rank's)
    places: list[tuple[str, tuple[str, int] | None]]  # every rank's (host, shelf server)
    announce: Callable[[SnapshotReport], None] | None
    step_time: float | None
    thread: threading.Thread | None = None
    spent: float = 0.0  # seconds the training waited for it so far
    copied: int = 0  # bytes pulled
    problem: str | None = None  # why the copy failed (the snapshot then has no copy on another host)
    cancelled: threading.Event = field(default_factory=threading.Event)  # abandoned: adopt nothing more

    def run(self, copy: Callable[[int, dict[str, int], list[tuple[str, tuple[str, int] | None]], threading.Event],
                                 int], rank: int) -> None:
        try:
            self.copied = copy(self.iteration, self.owners, self.places, self.cancelled)
        except VarunaError as exc:
            self.problem = f"rank {rank}: {exc.message}"
        except OSError as exc:
            self.problem = f"rank {rank}: {printable(exc.strerror or exc)}"
        except Exception as exc:  # noqa: BLE001  (in a thread: anything else is this snapshot's problem too)
            self.problem = f"rank {rank}: {printable(repr(exc))[:300]}"


class Snapshots:
    """Takes the snapshots of one rank (collective: every rank calls :meth:`take` at the same steps).

    Args:
        every: a snapshot every ``every`` steps (0: none), or :data:`AUTO`: the first at step
            :data:`FIRST_AUTO`, then each after as many steps as keep its cost (the slowest rank's) within
            :data:`OVERHEAD` of the step time (the median rank's), chosen again from every snapshot's cost; every
            rank chooses the same from the same gathered numbers.
        rank: this rank.
        host: this rank's host as the launcher names it (``VARUNA_HOST``).
        shelf: this attempt's shelf on this host.
        server: ``(address, port)`` of this host's shelf server (``VARUNA_SHELF_SERVER``), None if it has none
            (then no host copies it, and it copies nothing).
        job, token, attempt: the job's id and token, and the attempt whose shelves these are.
        publish: ``publish(reserve, copies)``, as the handover's (``Varuna.publish_state``): returns
            ``{blob: rank}`` on every rank.
        all_gather: ``all_gather(obj)``: every rank's ``obj``, in rank order (collective).
    """

    def __init__(self, every: int | None, *, rank: int, host: str, shelf: Shelf,
                 server: tuple[str, int] | None, job: str, token: str, attempt: int,
                 publish: Callable[[Callable[..., Any], bool], dict[str, int]],
                 all_gather: Callable[[Any], list[Any]]) -> None:
        self.every, self.rank, self.host = every, rank, host
        self.shelf, self.server, self.job, self.token, self.attempt = shelf, server, job, token, attempt
        self._publish, self._all_gather = publish, all_gather
        self._places: list[tuple[str, tuple[str, int] | None]] | None = None  # every rank's (host, server)
        self.last: int | None = None  # the newest whole snapshot
        self.next: int | None = None  # under AUTO: the step of the next snapshot
        self.failed = False  # a snapshot failed: said once, then quietly retried at the next one
        self.failures = 0  # snapshots that failed in a row (under AUTO, the next try is further away each time)
        self.memory: Callable[[], tuple[int, int] | None] = host_memory  # (available, total) of this host
        self.taken = 0  # whole snapshots this process took (the same on every rank)
        self._pending: _PeerCopy | None = None  # started, not yet whole (its peer copy may run in a thread)

    def regrouped(self, rank: int) -> None:
        """This worker is ``rank`` of a smaller process group now: the hosts of the ranks are gathered again, and
        under :data:`AUTO` the next snapshot is taken at the next step (every survivor regroups at the same one).
        The snapshots taken before name their files by the old ranks, which the launcher no longer follows: a
        recovery uses only those taken since."""
        self.abandon()
        self.rank, self._places = rank, None
        if self.every is AUTO:
            self.next = None

    @property
    def all_gather(self) -> Callable[[Any], list[Any]]:
        """The collective these snapshots agree by: ``all_gather(obj)``, every rank's ``obj`` in rank order."""
        return self._all_gather

    def due(self, iteration: int) -> bool:
        if iteration <= 0 or iteration == self.last:
            return False
        if self.every is AUTO:
            return iteration >= (self.next if self.next is not None else max(FIRST_AUTO, (self.last or 0) + 1))
        return bool(self.every) and iteration % self.every == 0

    def take(self, iteration: int, announce: Callable[[SnapshotReport], None] | None = None,
             step_time: float | None = None) -> SnapshotReport | None:
        """Snapshot step ``iteration`` (every rank at once) and wait until it is whole: :meth:`start` then
        :meth:`finish`; its report, or None if it failed (said, not raised)."""
        if not self.start(iteration, announce, step_time):
            return None
        return self.finish()

    @property
    def pending(self) -> bool:
        """Whether a snapshot was started and not finished (its peer copy may still run)."""
        return self._pending is not None

    def start(self, iteration: int, announce: Callable[[SnapshotReport], None] | None = None,
              step_time: float | None = None, *, overlap: bool = False) -> bool:
        """Begin the snapshot of step ``iteration`` (every rank at once; one still pending is finished first):
        publish this rank's state onto its host's shelf, then pull its share of the previous host's files — in a
        thread while the next step computes when ``overlap`` (it only moves bytes between the shelves' servers, and
        the step does not touch the shelf), else here. :meth:`finish` (every rank, at the next step's start) waits
        for the copy and makes the snapshot whole. False when the publish failed (every rank alike: said, not
        raised; training goes on and the store keeps its checkpoints). ``announce(report)`` is called once the
        snapshot is whole everywhere and before the one before it is dropped (the launcher hears of the new one
        first). ``step_time``: this rank's last step's time, for the automatic interval."""
        self.finish()
        started = time.perf_counter()
        places = self._gather_places()
        mates = sum(h == self.host for h, _ in places)
        try:
            owners = self._publish(lambda nbytes: self._reserve(nbytes, mates), True)
        except (CheckpointError, HandoverError) as exc:  # every rank raises alike (ShelfFullError among them)
            self._say(f"snapshot of step {iteration} not taken: {exc.message}")
            # the next try, from what every rank knows alike (a rank that went by its own clock would meet the
            # others in another collective): further and further apart while it keeps failing
            self.failures += 1
            self.next = iteration + min(MAX_EVERY, RETRY * 2 ** min(self.failures - 1, 16))
            return False
        copy = _PeerCopy(iteration, started, owners, places, announce, step_time)
        if overlap and ring_source(_hosts_in_order(places), self.host) is not None:
            copy.thread = threading.Thread(target=copy.run, args=(self._copy_previous_host, self.rank),
                                           name=f"snapshot-{iteration}", daemon=True)
            copy.thread.start()
        else:
            copy.run(self._copy_previous_host, self.rank)
        copy.spent = time.perf_counter() - started
        self._pending = copy
        return True

    def finish(self, overlapped: float | None = None) -> SnapshotReport | None:
        """Every rank at once: wait for the pending snapshot's peer copy, agree that it is whole (or that it has no
        copy on another host), choose the next interval and drop the snapshot before it; its report, or None if
        none was pending. Its cost is what the training lost to it: the publish, the copy's part that the step
        did not cover, the agreement, and by how much the step it overlapped (``overlapped`` seconds) was slower
        than the one before (the copy shares the host's cores and memory with it)."""
        copy, self._pending = self._pending, None
        if copy is None:
            return None
        if overlapped is not None and copy.step_time is not None and copy.thread is not None:
            copy.spent += max(0.0, overlapped - copy.step_time)
        waiting = time.perf_counter()
        if copy.thread is not None:
            copy.thread.join()
        iteration, places = copy.iteration, copy.places
        sizes = self.shelf.manifest()  # this rank's own files (the small ones differ a little from step to step)
        own = sum(sizes[n].size for n, r in copy.owners.items() if r == self.rank and n in sizes)
        spent = copy.spent + time.perf_counter() - waiting
        gathered = self._all_gather((copy.problem, spent, copy.step_time))
        problems = [p for p, _, _ in gathered if p]
        hosts = _hosts_in_order(places)
        peer = len(hosts) > 1 and not problems and all(server is not None for _, server in places)
        if problems:
            self._say(f"snapshot of step {iteration} has no copy on another host: {problems[0]}")
        every = self.every
        if every is AUTO:
            times = sorted(t for _, _, t in gathered if t)
            every = every_for(max(sec for _, sec, _ in gathered), times[len(times) // 2] if times else None)
            if not self.taken:  # the first one's cost is not the steady one's: measure again soon
                every = min(every, WARM_RETAKE)
        self.next, self.failures = iteration + every, 0
        self.taken += 1
        seconds = copy.spent + time.perf_counter() - waiting
        report = SnapshotReport(iteration, seconds, copy.copied, own + copy.copied, peer, every)
        if copy.announce is not None:
            copy.announce(report)
        previous, self.last = self.last, iteration
        if previous is not None and previous != iteration and self._first_on_host(places):
            self.shelf.remove(n for n in self.shelf.names() if step_of(n) == previous)
        return report

    def abandon(self) -> None:
        """Forget the pending snapshot (this rank alone): its ranks are not the job's any more (a regroup). Its
        copy is not waited for — it may wait on the host whose loss caused the regroup — but told to put nothing
        more on the shelf. The one before it stays the newest whole one."""
        copy, self._pending = self._pending, None
        if copy is not None:
            copy.cancelled.set()

    def _reserve(self, nbytes: int, mates: int) -> AbstractContextManager[Any]:
        """Room on the shelf for this rank's files, if the host keeps :data:`MIN_FREE` of its memory free with
        this host's ranks' files and their copies of the previous host's (about as many bytes again) on it: a
        shelf lives in memory that the training cannot get back (ShelfFullError, agreed by every rank: the
        snapshot is skipped and said)."""
        memory = self.memory()
        if memory is not None:
            available, total = memory
            need = 2 * nbytes * max(1, mates)
            if available - need < MIN_FREE * total:
                raise ShelfFullError(f"a snapshot needs about {need / 2**20:.0f} MiB of {self.host}'s memory, which "
                                     f"has {available / 2**20:.0f} MiB available of {total / 2**20:.0f} MiB (keeping "
                                     f"{MIN_FREE:.0%} free for the training)",
                                     hint="snapshots are skipped until there is room; --snapshot-every 0 turns them "
                                          "off, --shelf-budget bounds them")
        return self.shelf.reserve(nbytes)

    def drop(self) -> None:
        """Every rank at once: take every snapshot off this host's shelf (a handover's publish that needs the room
        supersedes them) and wait until every host has."""
        self.finish()
        self.shelf.remove(n for n in self.shelf.names() if step_of(n) is not None)
        self._all_gather(None)

    # ------------------------------------------------------------------------------------------------------

    def _gather_places(self) -> list[tuple[str, tuple[str, int] | None]]:
        if self._places is None:
            self._places = [(str(h), tuple(s) if s is not None else None)
                            for h, s in self._all_gather((self.host, self.server))]
        return self._places

    def _first_on_host(self, places: list[tuple[str, tuple[str, int] | None]]) -> bool:
        return next(r for r, (h, _) in enumerate(places) if h == self.host) == self.rank

    def _copy_previous_host(self, step: int, owners: dict[str, int],
                            places: list[tuple[str, tuple[str, int] | None]],
                            cancelled: threading.Event | None = None) -> int:
        """Pull this rank's share of the previous host's blobs of ``step`` onto this host's shelf; bytes pulled
        (none adopted once ``cancelled`` is set)."""
        source = ring_source(_hosts_in_order(places), self.host)
        if source is None:
            return 0
        servers = {h: s for h, s in places if s is not None}
        if source not in servers or self.server is None:
            raise HandoverError(f"host {printable(source)} or this one serves no shelf: no copy of its snapshot")
        mates = [r for r, (h, _) in enumerate(places) if h == self.host]
        wanted = sorted(name for name, rank in owners.items() if places[rank][0] == source)
        mine = [name for i, name in enumerate(wanted) if mates[i % len(mates)] == self.rank
                and not self.shelf.has(name)]
        if not mine:
            return 0
        address, port = servers[source]
        total = 0
        for start in range(0, len(mine), _BATCH):
            if cancelled is not None and cancelled.is_set():
                break
            total += self._pull(address, port, mine[start:start + _BATCH], cancelled)
        return total

    def _pull(self, address: str, port: int, names: list[str], cancelled: threading.Event | None = None) -> int:
        """Fetch ``names`` from a shelf server into room on this host's shelf and adopt each as a blob."""
        job = shelf_key(self.job, self.attempt)
        budget = self.shelf.budget if self.shelf.budget is not None else 1 << 62
        files: dict[str, tuple[Path, mmap.mmap | None]] = {}
        with self.shelf.reserve(0) as space:

            def into(entry: Any) -> memoryview:
                path = Path(space.directory) / f"copy-{len(files)}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                try:
                    os.ftruncate(fd, entry.size)
                    buffer = mmap.mmap(fd, entry.size) if entry.size else None
                finally:
                    os.close(fd)
                files[entry.name] = (path, buffer)
                return memoryview(buffer) if buffer is not None else memoryview(bytearray(0))

            try:
                entries = fetch_into(address, port, job=job, token=self.token, names=names, into=into,
                                     max_bytes=budget, timeout=_TIMEOUT)
            finally:
                for _, buffer in files.values():
                    if buffer is not None:
                        with contextlib.suppress(BufferError):
                            buffer.close()
            if cancelled is not None and cancelled.is_set():
                return 0  # (what it fetched goes with the room it had)
            for name, entry in entries.items():
                space.adopt(name, files[name][0], entry.meta, digest=entry.digest)
        return sum(e.size for e in entries.values())

    def _say(self, message: str) -> None:
        if not self.failed:
            log.warning("%s; training goes on (the store's checkpoints remain)", message)
        self.failed = True


def _hosts_in_order(places: list[tuple[str, Any]]) -> list[str]:
    """The hosts in the order of their first rank."""
    return list(dict.fromkeys(h for h, _ in places))

