"""A checkpoint handed over through host memory: published by the old ranks into their own hosts' shelves, taken
back by the new ranks from those hosts, with no file system that the hosts share (DESIGN.md §3.8).

**Publish** (:func:`publish`, collective over the old ranks): each rank writes its part of the checkpoint of one
step, with the same machinery as :func:`~varuna_core.checkpoint.saveload.save` (the same DCP entries under the
model's names, raw ``.distcp`` files hashed while written, the same manifest; but a file per parameter, with its
optimizer state, rather than one per rank: :func:`by_parameter`), straight into room reserved on its own host's
shelf (a private directory on the shelf's tmpfs, refused before anything is written if the state does not fit);
rank 0 completes the manifest from every rank's reported size and digest, since it cannot see the other hosts'
files. Each rank then adopts each of its files as a blob named ``step_<N>/<file>`` (meta: ``bytes``, ``digest``,
``rank``): a rename, so that every byte is written once, and every rank returns the same map from blob name to
the rank that holds it, for whoever starts the new ranks to tell them where each blob lives.

**Take** (:func:`take`, collective over the new ranks): each rank takes, into a private staging directory of its
own, the blobs ``RUN``, ``COMPLETE``, the manifest and the index, then reads the index to find which data files
hold its stage's tensors (its parameters, their optimizer state, its buffers and, under the same world size, its
RNG state) and takes only those: a blob of its own host's shelf is linked in place (no copy), one of another host
arrives over the wire, hashed as it comes; then it loads them with
:func:`~varuna_core.checkpoint.saveload.load`, which checks every file against the manifest's size and digest
(hashing those it did not see arrive or linked) and changes no live tensor unless everything is right. The
staging directory is removed afterwards, whatever happened.

[Note: publish into freed memory] A publish writes the whole state into new pages of the shelf's tmpfs. On a VM,
memory the guest has not touched lately is the slow kind (each page faults into the hypervisor: 0.4–0.6 GB/s
measured on the 2-core VM of benchmarks/README.md, against 3–5 GB/s for pages just freed), and a handover's publish
is on the critical path. So a worker about to publish and exit first frees what no checkpoint holds, its gradient
buffers (as large as its parameters: a third of the state under Adam), and the publish's first pages are those
(``Supervision(release=...)``, ``GradBuffer.release``). A snapshot's publish keeps them: training goes on.

[Note: a take maps its files] A warm worker's take (``map_files``: the CPU, the optimizer state whole) does not copy
the files it took into its parameters and optimizer state: each tensor stored whole at an aligned offset of a file
this rank owns becomes a view of that file's shared mapping (``p.data``, the optimizer's slot), and training goes
on in those pages. Memory fresh to the process costs a page fault per 4 KiB; on the 2-core VM of
benchmarks/README.md a copy into it ran at 0.4-0.9 GB/s, so the load after the take was 2-7 s of the big GPT's
handover. A rank owns what it fetched over the wire (its private file, hashed on arrival) and, of the blobs linked
from its own host's shelf, those that no lower rank of the new configuration linked as well (:func:`_owned`: the
others copy theirs, before anyone trains: the load ends on a barrier). A blob so mapped becomes the new rank's live
state, so it is taken off the shelf (``drop``) just before the first optimizer step changes it: until then a take
tried again (a new configuration that crashed before its first step) finds it as it was, after that it finds it gone
and takes the file from a replica's copy or falls back, never a changed file under its old name (a linked blob's
data is not hashed again). The pages stay while mapped, and are freed with the last tensor that views them.

The same files serve the next handover. A file mapped whole stays named in ``keep`` (on this attempt's shelf,
cleared with it), and a worker that took nothing moves its state into such files once, after its first step
(:func:`reside`). A worker's last publish (``final``: it trains no more) then makes each file whose tensors are
still the views it was mapped as a blob by a rename, hashed in threads, not written (:func:`_adopt_live`), its
replicas' copies likewise; so a state is copied neither out of the old worker nor into the new one, and only what
crosses hosts moves. A snapshot's publish copies: training goes on in those pages.

[Note: hash while the others finish] A final publish hashes every file it adopts, and the ranks enter the publish
one by one: each as its last optimizer step ends, the largest stage last (in the big GPT's shrink of
benchmarks/README.md, the stage-0 rank waited 0.36 s for the stage-1 rank, then both hashed 1.2 and 1.8 GB on the
same two cores). The state of a final publish changes no more, so a rank hashes the files it trains in from its
first line (:func:`_hash_early`), on one thread fewer than it has cores (the others may still be stepping on the
rest). The adoption takes a digest begun there, and hashes a file whose hash had not begun as before, on all its
threads (a lone rank, which waits for nobody, would otherwise hash on one thread fewer). A file that turns out not
to be adopted as it is (a replica writes it, its tensors moved) leaves its hash unused: cancelled if not begun.

[Note: a lone host's files are not hashed] When the next configuration runs on one host only (a preemption that
leaves one host, a shrink to one), the old ranks of that host make their live files blobs, and the new ranks there
link those blobs in place: no byte crosses a wire or a disk, which is what a hash guards against, and a link's bytes
are not hashed again anyway (``link`` in :func:`take`). The hash was still the publish's largest part: on the
2-core VM of benchmarks/README.md, 0.5 s of the preemption's 0.6 s publish for 3 GB, on the critical path. So the
launcher marks that host's shelf (``Shelf.mark_alone``), and its ranks publish with ``hashed=False``: a file adopted
as it is gets no digest, in its blob's entry and in the manifest. What keeps such a file from being trusted where
it should not be: a read that verifies refuses it, a checkpoint store's manifest may not have one
(``read_manifest``), and a take's load accepts no digest only for a file it linked or read from that host's own
shelf, or received with the digest its holder's server computed before sending it (a take tried again on other
hosts still gets the state, every byte of the wire checked; only the writer's word is missing, as it is for a
link). Files written anew (a tensor that is not a live file's) are hashed as they are written, as always.

Why plain callables, not the shelf: this floor (L2) may not import the launcher's (L3), where the shelf and its wire
live. A publish gets ``reserve(nbytes)`` (``Shelf.reserve`` as it is); a take gets ``locate(name)``,
the holder of a blob (any value the ``fetch`` callable understands: ``"host:port"``, or a marker for this host's own
shelf), and ``fetch(holder, names, into, max_bytes)``, which puts each blob's bytes into the writable buffer
``into(name, size)`` returns, checked against the blob's hash (it may return ``{name: digest}`` of the blobs it
checked on arrival: a file whose hash is the manifest's is then not hashed again by the load; ``Shelf.get_into`` or
``shelf.fetch_into``, each wrapped in a few lines), and may get ``link(holder, name, path)`` (``Shelf.link``, for
a holder on this host). A failure anywhere raises on every rank:
:class:`~varuna_core.errors.HandoverError` naming the blob and its holder for a blob that cannot be had,
:class:`~varuna_core.errors.CheckpointError` for a checkpoint that does not fit; the live state is then as it was.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import re
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..errors import HandoverError, VarunaError
from ..ir.topology import Topology
from ..util.checks import integer
from ..util.digest import Hasher, of_bytes
from ..util.fs import atomic_write, in_memory
from ..util.text import printable
from .chunks import Chunk
from .io import FileSink, bounce_buffers
from .layout import COMPLETE_FILE, MANIFEST_FILE, RUN_FILE, read_manifest, step_dir
from .saveload import (
    _buffers,
    _entries,
    _gather,
    _keys,
    _manifest,
    _reason,
    _state_dict,
    _whole_chunk,
    load,
)
from .state import CheckpointState
from .storage import (
    INDEX_LIMIT,
    METADATA_FILE,
    RawWriter,
    _bytes_view,
    _DeviceStaging,
    dcp_save,
    read_metadata,
)

__all__ = ["publish", "take", "blob_name", "reside"]

log = logging.getLogger(__name__)



class Space(Protocol):
    """Room on a host's shelf (``launch.shelf.Space``): files written into :attr:`directory` become blobs."""

    directory: Path
    home: str  # the shelf's identity: the same for every writer on one host

    def adopt(self, name: str, path: Path, meta: dict[str, Any] | None = None, *, digest: str) -> object: ...


Reserve = Callable[[int], AbstractContextManager[Space]]  # reserve(nbytes): room on this host's shelf
Into = Callable[[str, int], memoryview]
Fetch = Callable[[Any, list[str], Into, int], object]  # may return {blob: digest} of the blobs it checked
Link = Callable[[Any, str, Path], "tuple[int, str | None] | None"]  # link(holder, name, path): (bytes, digest)

_SLACK = 8192  # bytes of room per tensor beyond its own: alignment, the blob's entry, the index
_WRITER = re.compile(r"__([0-9]+)_[0-9]+\.distcp")  # the rank that wrote a data file
_SMALL_FILES = (RUN_FILE, COMPLETE_FILE, MANIFEST_FILE, METADATA_FILE)  # rank 0's, taken by every rank first
_HASH_READ = 4 << 20  # bytes per read of a file being hashed
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # (Linux)
_BATCH = 1024  # files per request to one holder (a file per parameter: a large model has thousands)
TAKE_STREAMS = 2  # requests to one holder at once, each with its data files (see _take_files)
_MAX_REQUESTS = 8  # requests at once, whatever the number of holders
_MAP_ALIGN = 64  # bytes: a mapped tensor starts where the allocator would have put it (vector loads, cache lines)
_SMALL_LIMIT = 2 * INDEX_LIMIT  # bytes of the small files together: the index's bound and the manifest's
_KEEP_TRAINING = "nothing was handed over; the old configuration still holds the state"
_FALL_BACK = "the live state is as it was; fall back to the last checkpoint in the store"


def by_parameter(fqn: str) -> str | None:
    """The file group of a checkpoint entry in a publish: a parameter with its optimizer state (``model/<key>``,
    ``optim/<key>/<slot>``), or a buffer, each in files of their own; the RNG states in the rank's first file. So
    a new rank of any partition takes exactly the files of its own stage's tensors, not a whole old rank's file."""
    kind, _, rest = fqn.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.rsplit("/", 1)[0]
    if kind == "buffer":
        return fqn
    return None


def blob_name(step: int, file: str) -> str:
    """The shelf's name of a checkpoint file of step ``step``."""
    return f"{step_dir('', step).name}/{file}"


# ----------------------------------------------------------------------------------------------------------
# Publish


def publish(state: CheckpointState, reserve: Reserve, *, step: int | None = None,
            copies: bool = True, final: bool = False, leaving: bool = False, hashed: bool = True) -> dict[str, int]:
    """Put a checkpoint of every rank's state on each rank's own host's shelf (collective).

    Args:
        state: this rank's state; only read.
        reserve: ``reserve(nbytes)``, a context manager giving room on this host's shelf (``Shelf.reserve``): a
            :class:`Space` whose directory this rank writes its files into, each then adopted as a blob.
        step: the checkpoint's number (default: the optimizer steps taken).
        copies: under data parallelism, also keep on this host a copy of the files the stage's replicas on other
            hosts wrote (:func:`_mirror`; every rank must pass the same).
        final: this process changes its state no more (a handover's publish, after which it exits): the files a
            take mapped as its memory, and still whole, become blobs as they are, hashed but not copied
            ([Note: a take maps its files]).
        leaving: this rank's host is not in the next configuration (a handover to hosts without it; each rank
            passes its own). Under data parallelism a file that a replica on a staying host could write is
            written there, and this rank keeps no copies of its replicas' files: so what a staying host needs
            is on it already, and a leaving host writes and hashes nothing the next configuration will not take
            (a preemption's publish was twice the work: each host wrote half and copied the other half).
        hashed: False (with ``final``): the next configuration runs on this rank's host and no other, so the
            files adopted as they are stay unhashed (their manifest entries and blobs carry no digest): the new
            ranks link them in place, and the hash guards what crosses a wire or a disk, which they never do (see
            [Note: a lone host's files are not hashed]). Files written anew are hashed as they are written
            anyway; the copies of replicas' files are hashed (they are compared with their writers').

    Returns:
        On every rank, ``{blob name: rank that put it}``.

    Raises:
        HandoverError, CheckpointError: on every rank, if any rank failed (what it wrote is removed; blobs
            already adopted stay on their shelves until their owner clears them). A shelf without room for the
            state fails as a :class:`~varuna_core.errors.ShelfFullError` on every rank: the caller uses the store.
    """
    step = state.iteration if step is None else integer("step", step, low=0)
    tensors = _state_dict(state, write_model=True)
    need = sum(t.numel() * t.element_size() for t in tensors.values()) + _SLACK * (len(tensors) + 4)
    with contextlib.ExitStack() as stack:
        early: dict[str, Future[str]] = {}
        if final and hashed and (state.dp == 1 or not leaving):  # (a leaving replica's files: mostly elsewhere)
            early = _hash_early(stack)
        space: Space | None = None
        problem: str | tuple[str, str | None, type[VarunaError]] | None = None
        try:
            space = stack.enter_context(reserve(need))
            if state.rank == 0:
                atomic_write(Path(space.directory) / RUN_FILE, f"{state.run_id}\n")
        except VarunaError as exc:
            problem = (f"rank {state.rank}'s state does not fit on its host's shelf: {exc.message}", exc.hint,
                       type(exc))
        except OSError as exc:
            problem = f"rank {state.rank} cannot write on its host's shelf: {_reason(exc)}"
        try:
            _agree(state, problem, _KEEP_TRAINING)
            assert space is not None  # every rank has room, or all raised above
            leavers = {r for r, part in enumerate(_gather(state, [leaving])) if part[0]} if state.dp > 1 else set()
            local = Path(space.directory)
            hashers = stack.enter_context(ThreadPoolExecutor(_hash_threads(), "varuna-hash")) if final else None
            writer = RawWriter(local, sync_files=False, group=by_parameter,  # tmpfs: nothing to sync
                               adopt=functools.partial(_adopt_live, hashers=hashers, early=early, hashed=hashed)
                               if final else None)
            dcp_save(tensors, writer, avoid=leavers)  # a failure anywhere raises everywhere
            if final:
                log.info("rank %d: step %d published, %.1f MB of it as the files it trained in (not copied%s)",
                         state.rank, step, writer.adopted / 1e6, "" if hashed else ", not hashed: linked here alone")
            files = [f.as_dict() for f in writer.files]
            _agree(state, _complete_locally(state, step, local, _gather(state, files)), _KEEP_TRAINING)
            names, failure = _adopt_files(state, space, step, local, files)
            _agree(state, failure, _KEEP_TRAINING)
            if copies and state.dp > 1:
                mine = {"home": space.home, "files": files, "layout": writer.layout}
                gathered = [part[0] for part in _gather(state, [mine])]
                if state.rank not in leavers:  # (a leaving host's copies would serve nobody)
                    _mirror(state, reserve, step, tensors, gathered, final, early)
            owners = _gather(state, names)
        except BaseException as exc:
            if isinstance(exc, (VarunaError, KeyboardInterrupt, SystemExit)):
                raise
            raise HandoverError(f"publishing step {step} failed on rank {state.rank}: {_reason(exc)}",
                                hint=_KEEP_TRAINING) from None
        finally:
            for future in early.values():  # the files that were not adopted as they are: their hash serves nobody
                future.cancel()
    return {name: rank for rank, part in enumerate(owners) for name in part}


def _hash_early(stack: contextlib.ExitStack) -> dict[str, Future[str]]:
    """A final publish's first move: hash, in the background, each file that this process's live state is,
    before the publish's first collective (see [Note: hash while the others finish]). Returns ``{path: future
    digest}``; its threads end with ``stack``."""
    lives = [(path, live, live.mapping()) for path, live in list(_LIVE.items())]
    lives = [(path, live, mapping) for path, live, mapping in lives if mapping is not None]
    if not lives:
        return {}
    pool = stack.enter_context(ThreadPoolExecutor(max(1, _hash_threads() - 1), "varuna-hash-early"))
    return {path: pool.submit(_digest_of, live.path, mapping, live.size) for path, live, mapping in lives}


def _mirror(state: CheckpointState, reserve: Reserve, step: int, tensors: dict[str, Any],
            gathered: list[dict[str, Any]], final: bool = False,
            early: dict[str, Future[str]] | None = None) -> list[str]:
    """Under data parallelism, each rank also puts on its own host's shelf a copy of the data files its stage's
    other replicas wrote (the publish writes each tensor once, on one of the replicas that hold it), byte for byte
    the same, written from its own tensors (the replicas' are the same bits): so a host that dies before the new
    configuration took its files does not take them with it, and a new rank on a replica's host takes its stage
    without the network. The copies a host needs are shared out among its ranks of the stage, each made once.
    Best effort: a copy whose bytes are not the writer's (digest), a file with a rank's own state (its RNG), a
    replica on the same host, or a shelf without room for the copies are left out, and said. Returns the blob
    names copied. ``final``: a copy whose tensors are a file this process trained in, laid out as the writer's,
    is that file, not copied (:func:`_adopt_live`; ``early``: its hash, if begun before the publish)."""
    topology = Topology.parse(state.stage_to_rank_map, state.world_size)
    stage, home = topology.coords(state.rank)[0], gathered[state.rank]["home"]
    mates = [r for r, part in enumerate(gathered) if part["home"] == home and topology.coords(r)[0] == stage]
    todo: list[tuple[int, str, list, int, str]] = []
    j = 0  # the files to copy onto this host, shared out among its ranks of this stage (each copied once)
    for peer, part in enumerate(gathered):
        if topology.coords(peer)[0] != stage or part["home"] == home:
            continue
        records = {f["path"]: f for f in part["files"]}
        for file, chunks in sorted(part["layout"].items()):
            whole = all(_whole(tensors.get(fqn), offsets, length) for fqn, offsets, _, length in chunks)
            if file in records and records[file]["digest"] is not None and whole:  # (None: publish's hashed)
                if mates[j % len(mates)] == state.rank:
                    todo.append((peer, file, chunks, records[file]["bytes"], records[file]["digest"]))
                j += 1
    if not todo:
        return []
    names: list[str] = []
    try:
        with reserve(sum(t[3] for t in todo) + _SLACK * len(todo)) as space:
            buffers = bounce_buffers()  # one pair for every copy, written one after another
            for peer, file, chunks, size, writers in todo:
                path = Path(space.directory) / file
                ordered = sorted(chunks, key=lambda c: c[2])
                adopted = _adopt_live(path, [(fqn, tensors[fqn]) for fqn, *_ in ordered], size=size,
                                      at=[c[2] for c in ordered], early=early) if final else None
                digest = adopted[2] if adopted is not None else _write_like(path, chunks, size, tensors, buffers)
                if digest != writers:
                    log.warning("rank %d: its copy of rank %d's %s differs from it (replicas out of step?): not "
                                "kept", state.rank, peer, file)
                    path.unlink(missing_ok=True)
                    continue
                name = blob_name(step, file)
                space.adopt(name, path, {"bytes": size, "digest": writers, "rank": peer, "copy": state.rank},
                            digest=writers)
                names.append(name)
    except (OSError, VarunaError) as exc:
        log.warning("rank %d keeps no copy of its replicas' files for the handover (%d of %d kept): %s", state.rank,
                    len(names), len(todo), _reason(exc))
    return names


def _whole(tensor: Any, offsets: list[int], length: int) -> bool:
    """Whether a stored chunk is the whole of ``tensor`` (a replica has it), and not a rank's own state. A sharded
    optimizer's box (:class:`~.chunks.Chunk`) is never whole: a replica holds only its own."""
    return (tensor is not None and not isinstance(tensor, Chunk) and not any(offsets)
            and tensor.numel() * tensor.element_size() == length)


def _write_like(path: Path, chunks: list, size: int, tensors: dict[str, Any], buffers: list[memoryview]) -> str:
    """Write ``size`` bytes at ``path``: each chunk's tensor at its offset, zeros between (as the writer's file
    holds them), through the bounce ``buffers``; returns their digest."""
    sink = FileSink(path, durable=False, buffers=buffers)
    staging: _DeviceStaging | None = None

    def pad(to: int) -> None:
        if sink.offset < to:
            sink.write(np.zeros(to - sink.offset, dtype=np.uint8))

    try:
        for fqn, _, offset, _ in sorted(chunks, key=lambda c: c[2]):
            pad(offset)
            tensor = tensors[fqn].detach().contiguous()
            if tensor.device.type == "cuda":
                staging = staging or _DeviceStaging()
                staging.write(tensor, sink, place=False)
            else:
                sink.write(_bytes_view(tensor.cpu()))
        pad(size)
    finally:
        written, digest = sink.close()
    return digest if written == size else ""


def _complete_locally(state: CheckpointState, step: int, local: Path, gathered: list) -> str | None:
    """Rank 0: the manifest (from every rank's reported size and digest: the other ranks' files are on other
    hosts) and ``COMPLETE``, in its own directory. Returns why not, if it failed."""
    if state.rank != 0:
        return None
    try:
        entries = _entries(gathered, local, on_disk={0})
        atomic_write(local / MANIFEST_FILE, _manifest(state, step, entries).model_dump_json(indent=2))
        atomic_write(local / COMPLETE_FILE, f"{step}\n")
    except (OSError, VarunaError) as exc:
        return f"completing step {step} failed on rank 0: {_reason(exc)}"
    return None


def _adopt_files(state: CheckpointState, space: Space, step: int, local: Path,
                 files: list[dict[str, Any]]) -> tuple[list[str], str | tuple | None]:
    """Make every file of ``local`` a blob of the shelf, where it was written (no copy); returns the blob names,
    and why not, if it failed (a :class:`~varuna_core.errors.ShelfFullError` stays one on every rank)."""
    reported = {f["path"]: f for f in files}
    names: list[str] = []
    name = ""
    try:
        for path in sorted(local.iterdir()):
            name = blob_name(step, path.name)
            if path.name in reported:
                size, digest = reported[path.name]["bytes"], reported[path.name]["digest"]
            else:  # rank 0's small files (the run, the manifest, COMPLETE)
                data = path.read_bytes()
                size, digest = len(data), of_bytes(data)
            space.adopt(name, path, {"bytes": size, "digest": digest, "rank": state.rank}, digest=digest)
            names.append(name)
    except (OSError, ValueError, VarunaError) as exc:
        message = f"rank {state.rank} could not put {printable(name)} on its host's shelf: {_reason(exc)}"
        if isinstance(exc, VarunaError):
            return names, (message, exc.hint, type(exc))
        return names, message
    return names, None


# ----------------------------------------------------------------------------------------------------------
# Take


def take(state: CheckpointState, *, step: int, locate: Callable[[str], Any], fetch: Fetch,
         staging: str | os.PathLike, load_optimizer: bool = True, link: Link | None = None,
         in_place: bool = False, holder_of: Callable[[int], Any] | None = None, map_files: bool = False,
         drop: Callable[[list[str]], object] | None = None, keep: str | os.PathLike | None = None,
         claim: Callable[[int, Path], bool] | None = None) -> int:
    """Restore this rank's state from a checkpoint on the hosts' shelves (collective over the new ranks), as
    :func:`~varuna_core.checkpoint.saveload.load` restores it from a store, all or nothing.

    Args:
        state: this rank's state; its live tensors change only if every rank got everything, checked.
        step: the step that was published.
        locate: the holder of a blob, given its name (see the module docstring), or a list of holders to try in
            that order (its writer's, then hosts keeping a copy); raises ``KeyError`` for a blob no host is known
            to hold.
        fetch: ``fetch(holder, names, into, max_bytes)`` (see the module docstring).
        staging: a local directory (a tmpfs) for a private directory of this rank's files, removed afterwards.
        load_optimizer, in_place: as for ``load`` (a warm worker takes in place: its live state is worth nothing
            yet, and on a failure it loads the store or stops).
        link: ``link(holder, name, path)`` puts blob ``name`` at ``path`` without copying it when ``holder`` is
            this host (a hard link to its shelf's file, ``Shelf.link``) and returns ``(bytes, digest)`` of the data
            at the file's start (its entry follows it) as its writer recorded them; None when it cannot (another
            host, another file system): the blob is then fetched. Only data files are linked, and read in place by
            the load. Both numbers must be the manifest's; the bytes are then not hashed again: they never left
            this host's memory since the writer hashed them as it wrote them, in a directory that only the job's
            user can write (what a hash protects against, a disk or a wire, they did not cross).
        holder_of: ``holder_of(rank)``, the holder of old rank ``rank``'s shelf (KeyError: none known). With it, a
            data file may also come from a data-parallel replica of its writer's stage, which keeps a copy of it
            (see :func:`publish`): one on this host is linked first, and when a holder fails (gone, stalled,
            damaged) the file is taken from the next replica that has it; only when none has it does the take
            fail.
        map_files: with ``in_place``, on the CPU, with the optimizer state whole and ``staging`` in memory (a
            tmpfs: a disk's file would be written back as it changes), the taken files become the memory of the
            live parameters and optimizer state rather than being copied into it (see [Note: a take maps its
            files]). Files fetched over the wire are mapped; blobs linked from this host's shelf only with
            ``drop``.
        drop: ``drop(names)`` takes blobs off this host's shelf (``Shelf.remove``): called just before the first
            optimizer step changes the blobs this rank mapped in place, so that no later take finds them changed
            under their old names.
        keep: a directory on ``staging``'s file system where the files mapped whole stay named while they are this
            process's memory (removed with their last view), so that its last publish (``final``) makes them blobs
            without a copy; None: they are removed with the staging directory.
        claim: ``claim(size, path)`` moves a file of memory touched before to ``path`` (which must not exist),
            for a data file of ``size`` bytes about to arrive over the wire, and returns True; False if it has
            none (the file is then made new). Every byte of it is then received and hashed as any other's
            ([Note: receive into touched memory] in :mod:`varuna_core.worker.morph`).

    Returns:
        The step loaded.

    Raises:
        HandoverError: on every rank, naming the blob and its holder: no holder known, a holder that is gone, a
            blob missing, damaged or of another size than the manifest's.
        CheckpointError: on every rank: a checkpoint that does not fit this model or is damaged.
    """
    step = integer("step", step, low=0)
    root, problem = None, None
    try:
        Path(staging).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"varuna-take-r{state.rank}-s{step}-", dir=staging))
        step_dir(root, step).mkdir()
    except OSError as exc:
        problem = f"rank {state.rank} cannot create its staging directory in {staging}: {exc.strerror or exc}"
    try:
        _agree(state, problem, _FALL_BACK)
        assert root is not None
        directory = step_dir(root, step)
        _agree(state, _attempt(lambda: _take_files(_holders(locate, None, None, step, _SMALL_FILES), fetch, step,
                                                    directory, None)), _FALL_BACK)
        present: list[str] = []
        verified: set[str] = set()
        limits: dict[str, int] = {}
        linked: dict[str, int] = {}
        stored: dict[str, Any] = {}

        def take_data() -> None:
            manifest = read_manifest(directory, unhashed=True)  # (a file without a digest is linked, or refused)
            expected = {e.path: (e.bytes, e.digest) for e in manifest.files}
            metadata = read_metadata(directory, expected, check_files=False)
            same_world = manifest.pp * manifest.dp == state.world_size
            present.extend(_data_files(state, metadata.storage_data, same_world, load_optimizer))
            stored.update(metadata.state_dict_metadata, storage=metadata.storage_data)
            holders = _holders(locate, holder_of, manifest, step, present)
            linked.update(_link_files(holders, link, step, directory, expected) if link is not None else {})
            limits.update(linked)
            verified.update(linked)
            rest = {f: h for f, h in holders.items() if f not in linked}
            verified.update(_take_files(rest, fetch, step, directory, expected, claim))

        _agree(state, _attempt(take_data), _FALL_BACK)
        mapped: dict[str, Any] = {}
        if map_files and in_place and state.pieces is None and state.device.type == "cpu":
            here = in_memory(root)  # (may differ between hosts: the gather below does not depend on it)
            owned = verified - set(linked) if here else set()
            if drop is not None and state.optimizer is not None:  # alike on every rank
                owned |= _owned(state, directory, linked if here else {})
            mapped, files, buffers = _map_files(state, directory, stored, sorted(owned), limits, load_optimizer)
            shared = sorted(blob_name(step, f) for f in files if f in linked)
            if shared:
                assert drop is not None  # linked files are owned only with it
                _before_first_update(state, lambda: drop(shared))
        loaded = load(state, root, iteration=step, load_optimizer=load_optimizer, present=present,
                      verified=verified, limits=limits, in_place=in_place, mapped=mapped)
        if mapped and keep is not None:
            _keep(directory, Path(keep), stored, mapped, files, buffers, limits)
        return loaded
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class _Live:
    """A file a take mapped as this process's memory, kept under a name of its own (``keep``), while every tensor
    stored in it is a view of its pages: ``{fqn: (offset, bytes, data_ptr)}``, ``size`` bytes of data;
    ``mapping()``, that shared mapping while it lives (a weak reference), else None."""

    path: Path
    size: int
    entries: dict[str, tuple[int, int, int]]
    mapping: Callable[[], mmap.mmap | None] = lambda: None


_LIVE: dict[str, _Live] = {}  # by path: the files this process's live state is (see [Note: a take maps its files])
_AT: dict[int, str] = {}  # the data_ptr of each of their tensors -> its file's path (a publish looks up thousands)


def _remember(live: _Live) -> None:
    _LIVE[str(live.path)] = live
    _AT.update({ptr: str(live.path) for _, _, ptr in live.entries.values()})


def _unremember(path: str) -> None:
    live = _LIVE.pop(path, None)
    for _, _, ptr in live.entries.values() if live is not None else ():
        if _AT.get(ptr) == path:
            del _AT[ptr]


def _forget(path: str) -> None:
    """The last view of a kept file's mapping is gone: its name goes too (unless a publish made it a blob)."""
    _unremember(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _keep(directory: Path, keep: Path, stored: dict[str, Any], mapped: dict[str, Any], files: set[str],
          buffers: dict[str, mmap.mmap], limits: dict[str, int]) -> None:
    """Move each mapped file whose every stored tensor is mapped from the staging ``directory`` into ``keep``
    (unique names), and remember it, so that a last publish can make it a blob without a copy (:func:`_adopt_live`).
    A file with a tensor that was read into memory of its own is left to the staging directory's removal."""
    storage = stored.get("storage", {})
    for file in sorted(files):
        entries = {index.fqn: loc for index, loc in storage.items() if loc.relative_path == file}
        if not entries or any(fqn not in mapped for fqn in entries):
            continue
        target = keep / f"{secrets.token_hex(8)}.live"
        try:
            keep.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.rename(directory / file, target)
        except OSError as exc:
            log.debug("not keeping %s for a later publish: %s", file, _reason(exc))
            continue
        size = limits.get(file, target.stat().st_size)
        _remember(_Live(target, size, {fqn: (loc.offset, loc.length, mapped[fqn].data_ptr())
                                       for fqn, loc in entries.items()}, weakref.ref(buffers[file])))
        weakref.finalize(buffers[file], _forget, str(target))


def _hash_threads() -> int:
    """Threads that hash adopted files at once (the hash lets go of the GIL): the cores this process may use."""
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


def _digest_of(path: Path, mapping: mmap.mmap | None = None, size: int = 0) -> str:
    """The digest of the file at ``path``; with ``mapping``, this process's shared mapping of it, of its first
    ``size`` bytes, hashed in place: the pages the process trained in, with no copy through a read buffer (on the
    2-core VM of benchmarks/README.md, 4.3 GB/s against 2.7-3.1 read from the tmpfs)."""
    digest = Hasher()
    if mapping is not None:
        with memoryview(mapping) as whole, whole[:size] as data:
            digest.update(data)
        return digest.hexdigest()
    view = memoryview(bytearray(_HASH_READ))
    with open(path, "rb", buffering=0) as stream:
        while n := stream.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()


def _adopt_live(path: Path, tensors: list[tuple[str, Any]], *, hashers: Executor | None = None,
                size: int | None = None, at: list[int] | None = None,
                early: dict[str, Future[str]] | None = None,
                hashed: bool = True) -> tuple[list[int], int, Any] | None:
    """For a final publish's writer: the kept file whose stored tensors are exactly ``tensors``, each still the view
    of its pages it was mapped as, moved to ``path`` (its data only: an old blob's entry after it is cut off), with
    each tensor's offset, the data's size and digest (a future of it, with ``hashers``); None if there is none (the
    writer writes the file). ``size``, ``at``: the file must hold that many bytes of data, the tensors at those
    offsets (a copy of another writer's file). ``early``: hashes of live files submitted earlier, by their paths
    (:func:`_hash_early`); the file's is used if it has begun, else cancelled and the file hashed here.
    ``hashed=False``: the digest is None, the file not hashed (:func:`publish`'s ``hashed``)."""
    first = tensors[0][1] if tensors else None
    if first is None:
        return None
    live = _LIVE.get(_AT.get(first.data_ptr(), ""))
    if live is not None and live.entries.get(tensors[0][0], (0, 0, None))[2] != first.data_ptr():
        live = None
    if live is None or len(live.entries) != len(tensors) or (size is not None and live.size != size):
        return None
    with contextlib.suppress(OSError):
        if os.stat(live.path).st_nlink != 1:  # a blob's name still on the old shelf: cutting it would damage it
            return None
    offsets = []
    for fqn, tensor in tensors:
        entry = live.entries.get(fqn)
        if entry is None or tensor.device.type != "cpu" or not tensor.is_contiguous() \
                or tensor.data_ptr() != entry[2] or tensor.numel() * tensor.element_size() != entry[1]:
            return None
        offsets.append(entry[0])
    if at is not None and offsets != at:
        return None
    try:
        os.truncate(live.path, live.size)  # pages past the data are viewed by no tensor
        os.rename(live.path, path)
    except OSError as exc:
        log.debug("writing %s rather than adopting %s: %s", path.name, live.path, _reason(exc))
        return None
    _unremember(str(live.path))
    if not hashed:
        return offsets, live.size, None
    begun = early.pop(str(live.path), None) if early is not None else None
    if begun is not None and not begun.cancel():  # begun (or done): taken; else hashed here, on every thread
        return offsets, live.size, begun if hashers is not None else begun.result()
    mapping = live.mapping()  # the pages the tensors view: alive as long as they are
    if hashers is not None:
        return offsets, live.size, hashers.submit(_digest_of, path, mapping, live.size)
    return offsets, live.size, _digest_of(path, mapping, live.size)


def reside(state: CheckpointState, keep: str | os.PathLike) -> int:
    """Move this rank's parameters and optimizer state into files of ``keep`` (a tmpfs), a file per parameter as a
    publish groups them, each tensor then a view of its file's pages, so that this process's last publish makes
    them blobs without a copy ([Note: a take maps its files]). Not collective; the values do not change. Returns
    the bytes moved: 0 where it cannot (not the CPU, a sharded optimizer, ``keep`` not in memory); a parameter
    whose state is already such a file, or has a number rather than a tensor in its optimizer state, stays.

    Raises:
        OSError: the tmpfs is full (room is taken with ``fallocate`` before anything is written); what was moved
            stays moved.
    """
    keep = Path(keep)
    if state.pieces is not None or state.device.type != "cpu" or not in_memory(keep.parent):
        return 0
    moved = 0
    for key, p in _keys(state):
        slots = state.optimizer.state.get(p, {}) if state.optimizer is not None else {}
        group: list[tuple[str, Any]] = [(f"model/{key}", p.data)]
        group += [(f"optim/{key}/{name}", value) for name, value in slots.items()]
        if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous() or not t.numel()
               for _, t in group) or any(t.data_ptr() in _AT for _, t in group):
            continue
        offsets, size = [], 0
        for _, t in group:
            size = -(-size // _MAP_ALIGN) * _MAP_ALIGN
            offsets.append(size)
            size += t.numel() * t.element_size()
        keep.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = keep / f"{secrets.token_hex(8)}.live"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not as a SIGBUS in the copy
            except OSError:
                path.unlink(missing_ok=True)
                raise
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        entries = {}
        with torch.no_grad():
            for (fqn, t), at in zip(group, offsets, strict=True):
                view = torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape)
                view.copy_(t)
                if fqn.startswith("model/"):
                    p.data = view
                else:
                    slots[fqn.rsplit("/", 1)[1]] = view
                entries[fqn] = (at, t.numel() * t.element_size(), view.data_ptr())
        _remember(_Live(path, size, entries, weakref.ref(buffer)))
        weakref.finalize(buffer, _forget, str(path))
        del buffer
        moved += size
    return moved


def _owned(state: CheckpointState, directory: Path, linked: Collection[str]) -> set[str]:
    """The files linked from this host's shelf that this rank may make its live memory: those no lower rank on
    this host linked as well (collective). Ranks that linked the same blob see the same file (device and inode);
    the lowest of them owns it, and the others copy it, before anyone trains (the load ends on a barrier)."""
    mine: list[tuple[str, int, int]] = []
    for file in sorted(linked):
        with contextlib.suppress(OSError):
            info = os.stat(directory / file, follow_symlinks=False)
            mine.append((file, info.st_dev, info.st_ino))
    owner: dict[tuple[int, int], int] = {}
    for rank, part in enumerate(_gather(state, mine)):
        for _, dev, ino in part:
            owner.setdefault((dev, ino), rank)
    return {file for file, dev, ino in mine if owner[(dev, ino)] == state.rank}


def _before_first_update(state: CheckpointState, fn: Callable[[], object]) -> None:
    """Call ``fn`` once, just before the optimizer's next step (the first that changes the mapped state)."""
    assert state.optimizer is not None  # mapped optimizer state or parameters: there is an optimizer to step

    def once(*_: Any) -> None:
        handle.remove()
        fn()

    handle = state.optimizer.register_step_pre_hook(once)


def _map_files(state: CheckpointState, directory: Path, stored: dict[str, Any], files: list[str],
               limits: dict[str, int], load_optimizer: bool) -> tuple[dict[str, Any], set[str], dict[str, mmap.mmap]]:
    """Views of ``files`` (this rank's own, checked) as the tensors they hold, the files they view and their
    mappings: ``{fqn: tensor}`` for each
    parameter (of its live dtype and shape) and optimizer slot stored whole in them at an offset aligned to
    ``_MAP_ALIGN`` bytes (a large tensor always is: the writer aligns it); the rest is read by the load as usual.
    See [Note: a take maps its files]."""
    storage = stored.get("storage", {})
    params = {f"model/{key}": p for key, p in _keys(state)}
    optim = tuple(f"optim/{key}/" for key in {k for k, _ in _keys(state)}) \
        if load_optimizer and state.optimizer is not None else ()
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for index, loc in storage.items():
        fqn, meta = index.fqn, stored.get(index.fqn)
        if fqn not in params and not (optim and fqn.startswith(optim)):
            continue
        if meta is None or not _whole_chunk(meta):
            continue
        by_file.setdefault(loc.relative_path, []).append((fqn, loc))
    views: dict[str, Any] = {}
    used: dict[str, mmap.mmap] = {}
    for file in files:
        entries = by_file.get(file)
        if not entries:
            continue
        try:
            fd = os.open(directory / file, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            buffer = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        if buffer is None:
            continue
        end = min(size, limits.get(file, size))
        for fqn, loc in entries:
            meta = stored[fqn]
            dtype, shape = meta.properties.dtype, tuple(meta.size)
            live = params.get(fqn)
            if live is not None and (live.dtype != dtype or tuple(live.shape) != shape):
                continue
            numel, nbytes = math.prod(shape), loc.length
            if not numel or nbytes != numel * dtype.itemsize or loc.offset % _MAP_ALIGN \
                    or loc.offset + nbytes > end:
                continue
            views[fqn] = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=loc.offset).view(shape)
            used[file] = buffer
        del buffer  # the views hold the mapping; it is unmapped with the last of them
    return views, set(used), used


def _data_files(state: CheckpointState, storage: dict, same_world: bool, load_optimizer: bool) -> list[str]:
    """The data files the index places this rank's tensors in (what ``load`` reads for it)."""
    keys = _keys(state)
    wanted = {f"model/{key}" for key, _ in keys} | {f"buffer/{name}" for name in _buffers(state)}
    if same_world:
        wanted |= {f"rng/rank{state.rank}", f"rng_cuda/rank{state.rank}"}
    prefixes = tuple(f"optim/{key}/" for key, _ in keys) if load_optimizer and state.optimizer is not None else ()
    return sorted({loc.relative_path for index, loc in storage.items()
                   if index.fqn in wanted or (prefixes and index.fqn.startswith(prefixes))})


def _holders(locate: Callable[[str], Any], holder_of: Callable[[int], Any] | None, manifest: Any, step: int,
             files: Collection[str]) -> dict[str, list[Any]]:
    """Who may give each file: its writer's holder (``locate`` may name several, in order: the writer's, then a
    host that keeps a copy of its files, such as a snapshot's peer), then (with ``holder_of`` and a manifest) the
    holders of its writer's data-parallel replicas, which keep copies of the stage's files."""
    topology = None
    if holder_of is not None and manifest is not None and manifest.dp > 1:
        topology = Topology.parse(manifest.stage_to_rank_map, manifest.pp * manifest.dp)
    out: dict[str, list[Any]] = {}
    for file in files:
        name = blob_name(step, file)
        try:
            found = locate(name)
            out[file] = list(dict.fromkeys(found)) if isinstance(found, list) else [found]
            if not out[file]:
                raise KeyError(name)
        except KeyError:
            raise HandoverError(f"no host is known to hold blob {printable(name)}", hint=_FALL_BACK) from None
        match = _WRITER.fullmatch(file)
        if topology is None or match is None or not int(match.group(1)) < topology.world_size:
            continue
        assert holder_of is not None
        writer = int(match.group(1))
        stage = topology.coords(writer)[0]
        for peer in range(topology.world_size):
            if peer != writer and topology.coords(peer)[0] == stage:
                with contextlib.suppress(KeyError):
                    holder = holder_of(peer)
                    if holder not in out[file]:
                        out[file].append(holder)
    return out


def _link_files(holders: dict[str, list[Any]], link: Link, step: int, directory: Path,
                expected: dict[str, tuple[int, str | None]]) -> dict[str, int]:
    """Link the blobs of ``holders`` that a holder on this host has (the writer's, else a replica's copy) into
    ``directory``; returns ``{file: bytes of its data}`` for those linked (the others are to be fetched). A holder
    on this host that lacks the blob (a replica keeps no copy of what it cannot write itself: a sharded
    optimizer's box of another replica) is dropped from the file's holders, and the next one tried; the blob
    is refused by name only when no holder is left."""
    linked: dict[str, int] = {}
    for file, candidates in holders.items():
        name = blob_name(step, file)
        for holder in list(candidates):
            try:
                got = link(holder, name, directory / file)
            except VarunaError as exc:
                candidates.remove(holder)
                if candidates:
                    log.info("blob %s is not on this host's shelf (%s): taking it from another holder",
                             printable(name), exc.message)
                    continue
                raise HandoverError(f"taking blob {printable(name)} from this host's shelf failed: {exc.message}",
                                    hint=_FALL_BACK) from None
            if got is None:
                continue
            size, digest = got
            if size != expected[file][0]:
                raise HandoverError(f"blob {printable(name)} on this host's shelf holds {size} bytes; the manifest "
                                    f"says {expected[file][0]}", hint=_FALL_BACK)
            if digest != expected[file][1]:
                raise HandoverError(f"blob {printable(name)} on this host's shelf is not the manifest's {file}: its "
                                    f"writer's digest differs", hint=_FALL_BACK)
            linked[file] = size
            break
    return linked


def _take_files(holders: dict[str, list[Any]], fetch: Fetch, step: int, directory: Path,
                expected: dict[str, tuple[int, str | None]] | None,
                claim: Callable[[int, Path], bool] | None = None) -> set[str]:
    """Take each file of ``holders`` into ``directory`` from the first of its holders, the data files of a holder
    in :data:`TAKE_STREAMS` requests at once (each of at most :data:`_BATCH` files); a file whose holder fails is
    taken from the next one. Returns the files checked on arrival. ``claim``: see :func:`take`.

    Why several requests at once: one connection's receive copies every byte on one core (the hash runs a span
    behind on another); on the 2-core VM of benchmarks/README.md two of them took 1.73-1.82 GB/s where one took
    1.35-1.42 (a shelf server in another process, 1.9 GB in 40 blobs, received into memory touched before)."""
    pending = {file: list(candidates) for file, candidates in holders.items()}
    verified: set[str] = set()
    while pending:
        by_holder: dict[Any, list[str]] = {}
        for file, candidates in pending.items():
            by_holder.setdefault(candidates[0], []).append(file)
        jobs = [(holder, batch) for holder, group in by_holder.items() for batch in _batches(group, expected)]
        with ThreadPoolExecutor(min(len(jobs), _MAX_REQUESTS), "varuna-take") as requests:
            results = [(batch, requests.submit(_take_from, holder, fetch, step, directory, batch, expected, claim))
                       for holder, batch in jobs]
        retry: dict[str, list[Any]] = {}
        failed: HandoverError | None = None
        for batch, result in results:
            try:
                verified |= result.result()
            except HandoverError as exc:
                left = {f: pending[f][1:] for f in batch if pending[f][1:]}
                if len(left) < len(batch):
                    failed = failed or exc
                    continue
                log.warning("%s; taking %s from another copy instead", exc.message,
                            "it" if len(batch) == 1 else f"those {len(batch)} files")
                for file in batch:
                    (directory / file).unlink(missing_ok=True)
                retry.update(left)
        if failed is not None:
            raise failed
        pending = retry
    return verified


def _batches(group: list[str], expected: dict[str, tuple[int, str | None]] | None) -> list[list[str]]:
    """The requests for ``group``, files of one holder: data files (``expected`` known) dealt out, largest first,
    to :data:`TAKE_STREAMS` parts of about equal bytes; each part (or the whole group, for the small files) in
    batches of at most :data:`_BATCH` files (a request's names and its reply's header stay bounded)."""
    parts: list[list[str]] = [list(group)]
    if expected is not None and len(group) > 1:
        parts, load = [[] for _ in range(TAKE_STREAMS)], [0] * TAKE_STREAMS
        for file in sorted(group, key=lambda f: (-expected[f][0], f)):
            lightest = load.index(min(load))
            parts[lightest].append(file)
            load[lightest] += expected[file][0]
    return [part[start:start + _BATCH] for part in parts if part for start in range(0, len(part), _BATCH)]


def _take_from(holder: Any, fetch: Fetch, step: int, directory: Path, files: list[str],
               expected: dict[str, tuple[int, str | None]] | None,
               claim: Callable[[int, Path], bool] | None = None) -> set[str]:
    """Take ``files`` from ``holder``; returns those whose bytes the fetch checked against the manifest's digest
    on arrival (the load need not hash them again)."""
    names = {blob_name(step, f): f for f in files}
    where = printable(str(holder))
    mapped: dict[str, mmap.mmap | None] = {}

    def into(name: str, size: int) -> memoryview:
        file = names.get(name)
        if file is None or file in mapped:
            raise HandoverError(f"holder {where} sent blob {printable(name)}, which was not asked for (or twice)")
        if expected is not None and size != expected[file][0]:
            raise HandoverError(f"blob {printable(name)} on {where} holds {size} bytes; the manifest says "
                                f"{expected[file][0]}", hint=_FALL_BACK)
        path, flags = directory / file, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
        claimed = claim is not None and expected is not None and claim(size, path)  # (data files only)
        if not claimed:
            flags |= os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            # a claimed file's pages exist: map them all at once, not a page fault at a time as the bytes come
            # ([Note: receive into touched memory]); a new file's would be allocated before a byte arrives
            populate = _POPULATE if claimed else 0
            mapped[file] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate) if size else None
        finally:
            os.close(fd)
        buffer = mapped[file]
        return memoryview(buffer) if buffer is not None else memoryview(bytearray(0))

    bound = sum(expected[f][0] for f in files) if expected is not None else _SMALL_LIMIT
    first = printable(next(iter(names)))
    what = f"blob {first}" if len(names) == 1 else f"blobs {first} and {len(names) - 1} more"
    try:
        checked = fetch(holder, list(names), into, bound)
    except VarunaError as exc:
        raise HandoverError(f"taking {what} from {where} failed: {exc.message}", hint=_FALL_BACK) from None
    except OSError as exc:
        raise HandoverError(f"taking {what} from {where} failed: {_reason(exc)}", hint=_FALL_BACK) from None
    finally:
        for buffer in mapped.values():
            if buffer is not None:
                with contextlib.suppress(BufferError):  # a view still held: closed when it is collected
                    buffer.close()
    missing = [name for name, file in names.items() if file not in mapped]
    if missing:
        raise HandoverError(f"holder {where} did not send blob {printable(missing[0])}", hint=_FALL_BACK)
    verified = set()
    for name, digest in (checked.items() if isinstance(checked, dict) else ()):
        file = names.get(name)
        if file is None or expected is None:
            continue
        if expected[file][1] is None and digest is not None:
            verified.add(file)  # left unhashed by its writer, hashed by its holder for the wire, checked on arrival
            continue
        if digest != expected[file][1]:
            raise HandoverError(f"blob {printable(name)} on {where} is not the manifest's {file}: its digest "
                                f"differs", hint=_FALL_BACK)
        verified.add(file)
    return verified


def _attempt(fn: Callable[[], object]) -> tuple[str, str | None, type[VarunaError]] | None:
    """``fn()``; a VarunaError it raises, as (message, hint, class), for :func:`_agree`."""
    try:
        fn()
    except VarunaError as exc:
        return exc.message, exc.hint, type(exc)
    return None


def _agree(state: CheckpointState, problem: str | tuple | None, hint: str) -> None:
    """Every rank learns whether any had a problem; if one did, every rank raises the first (a HandoverError
    unless it was another kind of VarunaError)."""
    problems = [problem]
    if state.world_size > 1:
        problems = [None] * state.world_size
        dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if not bad:
        return
    first = bad[0]
    if isinstance(first, str):
        raise HandoverError(first, hint=hint)
    message, own_hint, kind = first
    raise kind(message, hint=own_hint or hint)
