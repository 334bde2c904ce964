"""A ``torch.distributed.checkpoint`` storage layer that hashes while it writes, verifies while it reads, and
never unpickles.

Why not DCP's own ``FileSystemWriter``/``FileSystemReader``: they store every tensor as a ``torch.save``
record (a zip member with a CRC-32 computed on the CPU, then a second pass here for the manifest's digest),
load each one into a fresh tensor before copying it into its target, and keep the checkpoint's index in a
pickle (``.metadata``) that ``pickle.load`` executes. On the 2-core machines this project targets, those
passes cost more than the disk. Here DCP still plans the save and the load (name-keyed entries, replicas'
writes spread over the replicas, any other layout loads them); only the bytes are handled differently:

* each rank writes one file ``__<rank>_0.distcp``: the raw bytes of its tensors, back to back, hashed
  (:mod:`varuna_core.util.digest`) in the same pass (so the manifest's hash costs no re-read), with ``O_DIRECT``
  where the file system allows it (:mod:`varuna_core.checkpoint.io` says why);
* the index goes to ``dcp_metadata.json`` (dtype, shape, chunks, file, offset, length of every tensor):
  reading it executes nothing;
* the reader reads every stored chunk straight into its target tensor (no intermediate copy when the target
  is contiguous) and, for the files assigned to this rank (file ``i`` to rank ``i % world``), reads the whole
  file in order and checks its size and digest against the manifest in the same pass. A mismatch raises
  :class:`~varuna_core.errors.CheckpointError` naming the file; DCP carries it to every rank.

A checkpoint directory may come from anyone (``varuna ckpt merge`` is run on downloaded ones), so nothing in it is
trusted: the index is bounded in size and validated entry by entry (types, dtypes, chunk boxes inside their
tensor, byte ranges inside their file and disjoint) before anything is allocated from it, so that the tensors it
describes never hold more bytes than the data files; it may name only files of the form ``__<rank>_<i>.distcp``
that the manifest lists, and those are opened without following links and only if they are regular files.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Future as Pending
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CheckpointError, VarunaError
from ..util.digest import ALGORITHM, algorithm_of, of_bytes
from ..util.fs import MiB, describe_mode, read_regular
from .io import BackgroundHasher, FileSink, bounce_buffers, open_source, scatter_file
from .manifest import CHECKPOINT_INDEX

__all__ = ["RawWriter", "RawReader", "read_metadata", "dcp_save", "dcp_load", "METADATA_FILE", "FORMAT",
           "FileRecord", "DATA_FILE", "is_checkpoint_file"]

METADATA_FILE = CHECKPOINT_INDEX
FORMAT = "varuna-raw/1"
DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")  # what RawWriter names its files (fullmatch)
INDEX_LIMIT = 256 * MiB  # a real index holds ~100 bytes per tensor
_MAX_INT = 2**63 - 1  # sizes and offsets are int64 in torch
_PIECE = 64 * MiB  # bytes of a GPU tensor staged in pinned host memory at once
_INDEX_HINT = "the checkpoint is corrupt or was not written by varuna; run `varuna ckpt verify` on it"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


@dataclass(frozen=True)
class Location:
    """Where one stored chunk's bytes are: ``length`` bytes at ``offset`` of ``relative_path``."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class FileRecord:
    """A file this rank wrote: name, bytes and digest (what the manifest records; None: a handover's file left
    unhashed, see [Note: a lone host's files are not hashed] in :mod:`.handover`)."""

    path: str
    bytes: int
    digest: str | None

    def as_dict(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "digest": self.digest}


def is_checkpoint_file(name: object) -> bool:
    """``name`` is a file a checkpoint may hold: the index or a data file, a plain name (no directory)."""
    return isinstance(name, str) and (name == METADATA_FILE or DATA_FILE.fullmatch(name) is not None)


def dcp_save(state: dict[str, torch.Tensor], writer: RawWriter, *, avoid: Collection[int] = ()) -> None:
    """``dcp.save`` over the default process group (or this process alone), quietly; see :func:`_unwrapped`.
    A writer that groups its entries into files has replicated entries written a group at a time, and by a rank
    not in ``avoid`` where one holds them (:class:`_GroupedPlanner`; ``avoid`` is the same on every rank)."""
    planner = _GroupedPlanner(writer.group, avoid) if writer.group is not None else None
    _unwrapped("writing", dcp.save, state, storage_writer=writer, planner=planner)


class _GroupedPlanner(DefaultSavePlanner):
    """DCP's planner, but an entry that several ranks hold (data-parallel replicas) is written by the rank that
    writes the rest of its group (a parameter with its optimizer state): one file on one replica, rather than a
    parameter on one and its moments on another. Groups go, largest first, to the rank with the fewest bytes so
    far among those that hold all of the group's replicated entries (DCP balances single entries the same way),
    leaving out the ranks of ``avoid`` where another holds them (a handover's ranks on hosts that leave: what they
    wrote would have to cross to a host that stays, or be copied there)."""

    def __init__(self, group: Callable[[str], str | None], avoid: Collection[int] = ()) -> None:
        super().__init__()
        self.group = group
        self.avoid = frozenset(avoid)

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return dedup_by_group(all_plans, self.group, self.avoid)


def dedup_by_group(all_plans: list[SavePlan], group: Callable[[str], str | None],
                   avoid: Collection[int] = ()) -> list[SavePlan]:
    """Each entry held by several plans kept in one only, a group's replicated entries together (see
    :class:`_GroupedPlanner`); an entry of no group, or of a group no rank holds whole, alone. A rank of ``avoid``
    keeps an entry only when every holder is in ``avoid``."""
    import dataclasses

    holders: dict[MetadataIndex, set[int]] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, set()).add(rank)
            items[item.index] = item
    groups: dict[Any, list[MetadataIndex]] = {}
    for index, ranks in holders.items():
        if len(ranks) > 1:
            key = group(index.fqn)
            groups.setdefault(("group", key) if key is not None else ("entry", index.fqn, str(index.offset)),
                              []).append(index)
    size = [0] * len(all_plans)
    keep = [{item.index for item in plan.items} for plan in all_plans]

    def nbytes(index: MetadataIndex) -> int:
        return items[index].tensor_storage_size() or 1

    shunned = frozenset(avoid)

    def give(indices: list[MetadataIndex], ranks: set[int]) -> None:
        chosen = min(ranks - shunned or ranks, key=lambda r: (size[r], r))
        for index in indices:
            size[chosen] += nbytes(index)
            for other in holders[index] - {chosen}:
                keep[other].discard(index)

    for _, indices in sorted(groups.items(), key=lambda kv: (-sum(map(nbytes, kv[1])), str(kv[0]))):
        whole = set.intersection(*(holders[i] for i in indices))
        if whole:
            give(indices, whole)
        else:
            for index in indices:
                give([index], holders[index])
    return [dataclasses.replace(plan, items=[item for item in plan.items if item.index in kept])
            for plan, kept in zip(all_plans, keep, strict=True)]


def dcp_load(target: dict[str, torch.Tensor], reader: RawReader, *, no_dist: bool = False) -> None:
    """``dcp.load`` into ``target`` (collective over the default process group if there is one and not
    ``no_dist``), quietly; see :func:`_unwrapped`. The index is read first, so that a bad one is reported as
    itself rather than as DCP's "metadata is None"."""
    reader.read_metadata()
    _unwrapped("reading", dcp.load, target, storage_reader=reader, no_dist=no_dist)


def _unwrapped(verb: str, fn, *args, **kwargs) -> None:
    """Run a DCP entry point (``verb``: "writing" or "reading"), DCP's single-process warning silenced.

    DCP wraps each rank's failure in a ``CheckpointException``, a ``BaseException``: it would pass every
    ``except Exception`` and end as dozens of lines of traceback. It never leaves here: a :class:`VarunaError`
    raised on any rank is re-raised as itself on every rank, anything else becomes a :class:`CheckpointError`
    with the first failing rank's message (an interrupt stays an interrupt).
    """
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... single process"
            fn(*args, **kwargs)
    except CheckpointException as exc:
        failures = _failures(exc, CheckpointException)
        for _, inner in failures:
            if not isinstance(inner, Exception):  # KeyboardInterrupt, SystemExit
                raise inner.with_traceback(None) from None
        for _, inner in failures:
            if isinstance(inner, VarunaError):
                raise inner.with_traceback(None) from None
        if not failures:
            raise CheckpointError(f"{verb} the checkpoint failed: {_first_line(exc)}") from None
        rank, inner = failures[0]
        raise _failure(verb, rank, inner) from inner


def _failures(exc, kind: type, depth: int = 0) -> list[tuple[int, BaseException]]:
    """``(rank, exception)`` of every failure in a ``CheckpointException`` (nested ones opened), by rank."""
    out = []
    for rank in sorted(exc.failures):
        failure = exc.failures[rank]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, kind) and depth < 8:
            out.extend(_failures(inner, kind, depth + 1))
        elif isinstance(inner, BaseException):
            out.append((rank, inner))
    return out


def _failure(verb: str, rank: int, exc: BaseException) -> CheckpointError:
    where = f"{verb} the checkpoint failed on rank {rank}"
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = "free space where the checkpoint is written, or keep fewer checkpoints (keep=...)"
        else:
            hint = "check the file system of the checkpoint store"
        name = f" ({exc.filename})" if exc.filename else ""
        return CheckpointError(f"{where}: {exc.strerror or _first_line(exc)}{name}", hint=hint)
    return CheckpointError(f"{where}: {type(exc).__name__}: {_first_line(exc)}",
                           hint="this is unexpected; set VARUNA_DEBUG=1 for a traceback")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _bytes_view(tensor: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes (0-dim included)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The box ``[offsets, offsets + lengths)`` of ``tensor`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"checkpoint index names an unsupported dtype {name!r}") from None


# ----------------------------------------------------------------------------------------------------------
# Writer


class _DeviceStaging:
    """Two pinned host buffers through which a GPU tensor's bytes reach a file, :data:`_PIECE` bytes at a time:
    the copy of piece k+1 from the device runs while piece k is written (and hashed), and no host memory is
    allocated per tensor (``.cpu()`` would allocate a pageable copy of each tensor's size, touched for the first
    time, and copy into it at the pageable rate)."""

    def __init__(self) -> None:
        self._buffers = [torch.empty(_PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def write(self, tensor: torch.Tensor, sink: FileSink, *, place: bool = True) -> tuple[int, int]:
        """Place (unless ``place`` is false: where the caller's offset is) and write the contiguous GPU
        ``tensor``'s bytes in ``sink``; returns (file offset, bytes)."""
        flat = tensor.reshape(-1).view(torch.uint8)
        n = flat.numel()
        starts = list(range(0, n, _PIECE)) or [0]
        stream = torch.cuda.current_stream(tensor.device)

        def fetch(k: int) -> None:
            start = starts[k]
            self._buffers[k % 2][:min(n - start, _PIECE)].copy_(flat[start:start + _PIECE], non_blocking=True)
            self._events[k % 2].record(stream)

        fetch(0)
        at = -1
        for k, start in enumerate(starts):
            self._events[k % 2].synchronize()
            if k + 1 < len(starts):
                fetch(k + 1)  # into the other buffer, whose piece was written already
            piece = self._buffers[k % 2][:min(n - start, _PIECE)].numpy()
            if k == 0:  # pinned buffers are page-aligned: a large tensor lands at an aligned offset
                at = sink.place(piece) if place else sink.offset
            sink.write(piece)  # returns once the piece is written and hashed
        return at, n


Adopt = Callable[[Path, "list[tuple[str, torch.Tensor]]"], "tuple[list[int], int, str | Pending[str]] | None"]


class RawWriter(StorageWriter):
    """Writes each rank's tensors as raw bytes into ``<path>/__<rank>_0.distcp`` (see the module docstring).

    After ``dcp.save``, :attr:`files` lists the file(s) this rank wrote with size and digest (rank 0's include
    ``dcp_metadata.json``), and :attr:`layout` each data file's chunks in order: ``(fqn, chunk offsets, file
    offset, bytes)`` (what a replica needs to write the same file from its own tensors).

    ``group``: ``group(fqn)`` names the file group of an entry (None: the rank's first file). Each group then gets
    a file of its own, ``__<rank>_<i>.distcp`` in the order the groups first appear: a handover groups entries by
    parameter, so that a stage of any other partition takes exactly the files of its own tensors.

    ``adopt``: ``adopt(path, [(fqn, tensor), ...])`` may put a file that already holds a group's tensors at
    ``path`` instead of the writer writing it (a handover's last publish, whose tensors are a mapped file's pages:
    :mod:`.handover`); it returns each tensor's offset in it, the file's size and its digest (or a future of it,
    resolved before ``write_data`` returns: files hashed at once; or None, a file left unhashed), or None (the
    writer writes it).
    :attr:`adopted` counts the bytes so put.
    """

    def __init__(self, path: str | os.PathLike, sync_files: bool = True,
                 group: Callable[[str], str | None] | None = None, adopt: Adopt | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.sync_files = sync_files
        self.group = group
        self.adopt = adopt
        self.adopted = 0
        self.files: list[FileRecord] = []
        self.layout: dict[str, list[tuple[str, list[int], int, int]]] = {}  # file -> (fqn, chunk offsets, at, bytes)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.files = []
        self.layout = {}
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(f"checkpoint entry {item.index.fqn!r} is not a tensor",
                                      hint="only tensors are stored (numbers go in as 0-dim tensors)")
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        import dataclasses

        return [dataclasses.replace(plan, storage_data=f"__{i}_0.distcp") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        files = self._files(plan.storage_data, plan.items)
        buffers = bounce_buffers() if len(files) > 1 else None  # one pair for every file, written one by one
        staging: _DeviceStaging | None = None
        hashing: list[tuple[int, Pending[str]]] = []
        for name, items in files:
            if self.adopt is not None and items:
                tensors = [(item.index.fqn, self._tensor(item, planner)) for item in items]
                adopted = self.adopt(self.path / name, tensors)
                if adopted is not None:
                    offsets, size, digest = adopted
                    for item, (fqn, tensor), at in zip(items, tensors, offsets, strict=True):
                        nbytes = tensor.numel() * tensor.element_size()
                        results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                                   storage_data=Location(name, at, nbytes)))
                        self.layout.setdefault(name, []).append((fqn, list(item.index.offset or ()), at, nbytes))
                    if isinstance(digest, Pending):
                        hashing.append((len(self.files), digest))
                        digest = ""
                    self.files.append(FileRecord(name, size, digest))
                    self.adopted += size
                    continue
            sink = FileSink(self.path / name, durable=self.sync_files, buffers=buffers)
            try:
                for item in items:
                    tensor = self._tensor(item, planner)
                    if tensor.device.type == "cuda":
                        staging = staging or _DeviceStaging()
                        at, nbytes = staging.write(tensor, sink)
                    else:
                        data = _bytes_view(tensor)
                        at, nbytes = sink.place(data), data.nbytes
                        sink.write(data)
                    results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                               storage_data=Location(name, at, nbytes)))
                    self.layout.setdefault(name, []).append((item.index.fqn, list(item.index.offset or ()), at,
                                                             nbytes))
            finally:
                size, digest = sink.close()
            self.files.append(FileRecord(name, size, digest))
        for i, pending in hashing:
            record = self.files[i]
            self.files[i] = FileRecord(record.path, record.bytes, pending.result())
        future: Future = Future()
        future.set_result(results)
        return future

    def _files(self, first: str, items: list[WriteItem]) -> list[tuple[str, list[WriteItem]]]:
        """The files of this rank (``first``: ``__<rank>_0.distcp``) and the entries each holds, in order."""
        if self.group is None:
            return [(first, list(items))]
        stem = first.removesuffix("_0.distcp")
        groups: dict[str | None, list[WriteItem]] = {None: []}
        for item in items:
            groups.setdefault(self.group(item.index.fqn), []).append(item)
        return [(f"{stem}_{i}.distcp", part) for i, part in enumerate(groups.values()) if part or i == 0]

    @staticmethod
    def _tensor(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise CheckpointError(f"checkpoint entry {item.index.fqn!r} is not a tensor")
        data = data.detach()
        if data.device.type not in ("cpu", "cuda"):
            data = data.cpu()
        return data if data.is_contiguous() else data.contiguous()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: write the index (JSON) of every tensor's chunks and where their bytes are."""
        where = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for part in results for r in part}
        tensors = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint entry {fqn!r} is not a tensor")
            chunks = []
            for chunk in meta.chunks:
                loc = where[(fqn, tuple(chunk.offsets))]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                               "file": loc.relative_path, "offset": loc.offset, "length": loc.length})
            tensors[fqn] = {"dtype": str(meta.properties.dtype).removeprefix("torch."), "size": list(meta.size),
                            "chunks": chunks}
        text = json.dumps({"format": FORMAT, "save_id": self.save_id, "tensors": tensors}, separators=(",", ":"))
        data = text.encode()
        path = self.path / METADATA_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
        self.files.append(FileRecord(METADATA_FILE, len(data), of_bytes(data)))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


# ----------------------------------------------------------------------------------------------------------
# Reading the index


def read_metadata(directory: str | os.PathLike, expected: dict[str, tuple[int, str | None]] | None = None, *,
                  listed: Collection[str] | None = None, check_files: bool = True,
                  present: Collection[str] | None = None) -> Metadata:
    """The DCP :class:`Metadata` of a checkpoint directory, from ``dcp_metadata.json`` (JSON only), validated
    entry by entry (see the module docstring).

    Args:
        expected: ``file -> (bytes, digest)`` from the manifest: the index's own size and hash are checked, and
            it may name no other data file.
        listed: without ``expected``, the file names the manifest lists (the offline tools, which hash the
            files themselves): the index may name no other data file.
        check_files: every data file the index names is a regular file (not a link) holding every byte range
            the index places in it. Only a caller that allocates nothing from the result and reports bad files
            itself (``varuna ckpt verify``) turns this off.
        present: the data files the directory holds when it holds only some (a handover takes only the files of
            its stage's tensors): only those are checked; None: every file the index names.

    Raises:
        CheckpointError: naming the index (or the data file) and what is wrong with it.
    """
    directory = Path(directory)
    path = directory / METADATA_FILE
    allowed = _allowed(directory, expected, listed)
    try:
        data = read_regular(path, INDEX_LIMIT, what="checkpoint index", follow=False, error=CheckpointError)
    except CheckpointError as exc:
        raise CheckpointError(exc.message, hint=exc.hint or "is this a checkpoint directory written by varuna?") \
            from None
    if expected is not None and METADATA_FILE in expected:
        _check(path, len(data), _digest_like(data, expected[METADATA_FILE][1]), expected[METADATA_FILE])
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _invalid(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise _invalid(path, "JSON nested too deeply") from None
    except ValueError as exc:
        raise _invalid(path, f"not JSON ({exc})") from None
    return _Index(directory, path, allowed, check_files, present).parse(doc)


def _allowed(directory: Path, expected: dict | None, listed: Collection[str] | None) -> set[str] | None:
    """The names the manifest lists (None without one), every one of them a checkpoint file's name."""
    names = set(expected) if expected is not None else None if listed is None else set(listed)
    for name in sorted(names or (), key=str):
        if not is_checkpoint_file(name):
            raise CheckpointError(f"refusing to load {directory}: its manifest lists {_show(name)}, not a checkpoint "
                                  f"file ({METADATA_FILE} or __<rank>_<i>.distcp in the directory itself)",
                                  hint=_INDEX_HINT)
    return names


def _invalid(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid checkpoint index: {problem}", hint=_INDEX_HINT)


def _show(value: object) -> str:
    """A short rendering of a value read from a file, for a message (never a whole list or a huge string)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        text = repr(value[:80] if isinstance(value, str) else value)
        return text if len(text) <= 80 else text[:77] + "..."
    names: dict[type, str] = {dict: "an object", list: "a list"}
    return names.get(type(value), type(value).__name__)


class _Index:
    """One pass over a parsed index: every field checked where it is read, every error naming the index and
    the field (``tensors['model/w'].chunks[0].offset``)."""

    def __init__(self, directory: Path, path: Path, allowed: set[str] | None, check_files: bool,
                 present: Collection[str] | None = None) -> None:
        self.directory, self.path, self.allowed, self.check_files = directory, path, allowed, check_files
        self.present = None if present is None else set(present)
        self.ranges: dict[str, list[tuple[int, int, str]]] = {}  # file -> (offset, length, field) of each chunk

    def parse(self, doc: object) -> Metadata:
        doc = self._get(doc, None, "the index", dict)
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: format {_show(doc.get('format'))}, expected {FORMAT!r}",
                                  hint="written by another version of varuna")
        save_id = doc.get("save_id", "")
        if not isinstance(save_id, str):
            raise _invalid(self.path, f"save_id: expected a string, got {_show(save_id)}")
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}  # Metadata's type; tensors only
        storage: dict[MetadataIndex, Location] = {}
        for fqn, entry in self._get(doc, "tensors", "tensors", dict).items():
            state[fqn] = self._tensor(fqn, entry, storage)
        self._check_ranges()
        return Metadata(state_dict_metadata=state, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(self.directory), save_id=save_id))

    def _tensor(self, fqn: str, entry: object, storage: dict[MetadataIndex, Location]) -> TensorStorageMetadata:
        field = f"tensors[{_show(fqn)}]"
        entry = self._get(entry, None, field, dict)
        name = self._get(entry, "dtype", f"{field}.dtype", str)
        if name not in _DTYPES:
            raise _invalid(self.path, f"{field}.dtype: unsupported dtype {_show(name)}")
        dtype = _DTYPES[name]
        size = self._ints(entry, "size", f"{field}.size")
        chunks, volume = [], 0
        for i, chunk in enumerate(self._get(entry, "chunks", f"{field}.chunks", list)):
            where = f"{field}.chunks[{i}]"
            chunk = self._get(chunk, None, where, dict)
            offsets = self._ints(chunk, "offsets", f"{where}.offsets")
            sizes = self._ints(chunk, "sizes", f"{where}.sizes")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise _invalid(self.path, f"{where}: offsets {offsets} and sizes {sizes} do not have the "
                                          f"{len(size)} dimension(s) of the tensor")
            if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
                raise _invalid(self.path, f"{where}: the box at {offsets} of size {sizes} reaches outside the "
                                          f"tensor's size {size}")
            chunk_volume = _product(sizes)
            volume += chunk_volume
            location = self._location(chunk, where, chunk_volume * dtype.itemsize)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(fqn, torch.Size(offsets), i)] = location
        if volume != _product(size):
            raise _invalid(self.path, f"{field}: its chunks hold {volume:,} elements, its size {size} "
                                      f"{_product(size):,}")
        _check_boxes(self.path, field, chunks)
        return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks)

    def _location(self, chunk: dict[str, Any], where: str, nbytes: int) -> Location:
        name = self._get(chunk, "file", f"{where}.file", str)
        if not DATA_FILE.fullmatch(name):
            raise _invalid(self.path, f"{where}.file: {_show(name)} is not a checkpoint data file (__<rank>_<i>.distcp "
                                      "in the directory itself)")
        if self.allowed is not None and name not in self.allowed:
            raise CheckpointError(f"refusing to load {self.directory}: {self.path.name} names {name}, which is not "
                                  "in the manifest", hint=_INDEX_HINT)
        offset = self._int(chunk, "offset", f"{where}.offset")
        length = self._int(chunk, "length", f"{where}.length")
        if length != nbytes:
            raise _invalid(self.path, f"{where}.length: {length} bytes for a chunk of {nbytes}")
        self.ranges.setdefault(name, []).append((offset, length, where))
        return Location(name, offset, length)

    def _check_ranges(self) -> None:
        """Chunks do not share bytes, and (``check_files``) lie inside their regular file: so the tensors never
        hold more bytes than the files."""
        for name, ranges in sorted(self.ranges.items()):
            ranges.sort()
            end, last = 0, None
            for offset, length, where in ranges:
                if length and offset < end:
                    raise _invalid(self.path, f"{where} shares bytes of {name} with {last}")
                if length and offset + length > end:
                    end, last = offset + length, where
            if self.check_files and (self.present is None or name in self.present):
                size = _data_file_size(self.directory, name)
                if end > size:
                    raise CheckpointError(f"refusing to load {self.directory}: {self.directory.name}/{name}: truncated "
                                          f"({size} bytes; the index needs {end})",
                                          hint="run `varuna ckpt verify` on it; load an earlier checkpoint")

    def _get(self, doc: Any, key: str | None, field: str, kind: type[_T]) -> _T:
        """``doc[key]`` (``doc`` itself with key None), which must be a ``kind`` (``doc``: parsed JSON)."""
        if key is not None:
            if key not in doc:
                raise _invalid(self.path, f"{field}: missing")
            doc = doc[key]
        if not isinstance(doc, kind):
            raise _invalid(self.path, f"{field}: expected {_KINDS[kind]}, got {_show(doc)}")
        return doc

    def _int(self, doc: dict[str, Any], key: str, field: str) -> int:
        return self._count(self._get(doc, key, field, object), field)

    def _ints(self, doc: dict[str, Any], key: str, field: str) -> list[int]:
        return [self._count(v, f"{field}[{i}]") for i, v in enumerate(self._get(doc, key, field, list))]

    def _count(self, value: object, field: str) -> int:
        if type(value) is not int or not 0 <= value <= _MAX_INT:  # type(): JSON's true is no size
            raise _invalid(self.path, f"{field}: expected a non-negative integer, got {_show(value)}")
        return value


MAX_CHUNKS = 1024  # boxes of one tensor: one per data-parallel replica that holds a piece of it, at most


def _check_boxes(path: Path, field: str, chunks: list[ChunkStorageMetadata]) -> None:
    """No two chunks of a tensor cover the same element: with their volumes adding up to the tensor's, they then
    cover each element once (two overlapping boxes would load one region twice and leave another at zero)."""
    if len(chunks) > MAX_CHUNKS:
        raise _invalid(path, f"{field}: {len(chunks):,} chunks, more than the {MAX_CHUNKS} any layout writes")
    boxes = sorted((tuple(c.offsets), tuple(c.sizes), i) for i, c in enumerate(chunks))
    for j, (start, sizes, i) in enumerate(boxes):
        if not all(sizes):
            continue
        for other, other_sizes, k in boxes[j + 1:]:
            if start and other[0] >= start[0] + sizes[0]:
                break  # sorted by the first dimension's start: no later box meets this one
            if all(other_sizes) and all(o < s + n and s < o + m for s, n, o, m in
                                        zip(start, sizes, other, other_sizes, strict=True)):
                raise _invalid(path, f"{field}.chunks[{i}] and chunks[{k}] cover the same elements")


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string", object: "a value"}
_T = TypeVar("_T")


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _data_file_size(directory: Path, name: str) -> int:
    """The size of the data file ``name`` (``lstat``: a link is refused, not followed)."""
    path = directory / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"refusing to load {directory}: {directory.name}/{name} does not exist (the index "
                              "places tensors in it)", hint="run `varuna ckpt verify` on it; load an earlier "
                              "checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"refusing to load {directory}: {directory.name}/{name}: "
                              f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"refusing to load {directory}: {directory.name}/{name} is "
                              f"{describe_mode(info.st_mode)}, not a regular file",
                              hint="a checkpoint's data files are plain files written by varuna")
    return info.st_size


def _algorithm(expected: str | None) -> str:
    """The algorithm to check bytes against the recorded digest ``expected`` with (a malformed or missing record,
    which no digest equals: the default)."""
    try:
        return algorithm_of(expected) if isinstance(expected, str) else ALGORITHM
    except ValueError:
        return ALGORITHM


def _digest_like(data: bytes, expected: str | None) -> str:
    """The digest of ``data`` by the algorithm of the recorded ``expected``."""
    return of_bytes(data, _algorithm(expected))


def _check(path: Path, size: int, digest: str, want: tuple[int, str | None]) -> None:
    if want[1] is None:
        raise _unhashed(path)
    if size != want[0]:
        raise CheckpointError(f"refusing to load {path.parent}: {path.parent.name}/{path.name}: size {size} != "
                              f"{want[0]} in the manifest",
                              hint="run `varuna ckpt verify` on it; load an earlier checkpoint")
    if digest != want[1]:
        raise CheckpointError(f"refusing to load {path.parent}: {path.parent.name}/{path.name}: digest mismatch "
                              f"(file changed or corrupt)",
                              hint="run `varuna ckpt verify` on it; load an earlier checkpoint")


def _unhashed(path: Path) -> CheckpointError:
    """The refusal of a file that its manifest lists without a digest (a handover's file left unhashed, see [Note:
    a lone host's files are not hashed] in :mod:`.handover`), which this reader did not get from its writer's host."""
    return CheckpointError(f"refusing to load {path.parent}: {path.parent.name}/{path.name} has no digest in the "
                           f"manifest, so its bytes cannot be checked here",
                           hint="such a file is only linked on the host that published it")


# ----------------------------------------------------------------------------------------------------------
# Reader


class RawReader(StorageReader):
    """Reads what :class:`RawWriter` wrote, straight into the target tensors.

    Args:
        path: the checkpoint directory.
        expected: ``file -> (bytes, digest)`` from the manifest; ``None`` reads without checking.
        listed: without ``expected``, the names the manifest lists: the index may name no other file, and
            nothing is hashed (the offline tools hash the files themselves).
        rank, world: this process's place among the loading ranks; file ``i`` (in name order) is checked by
            rank ``i % world``, which reads it whole, so every file is hashed exactly once per load.
        present: the data files this rank's directory holds, when it holds only some (a handover takes only the
            files of its stage's tensors into a directory of its own): this rank then checks every one of them
            (no other rank sees them), and a read from any other file is refused. None: the directory holds
            every file, shared by the loading ranks.
        verified: files whose bytes were already checked against the manifest's digest as they arrived (a
            handover's take over the wire), or linked from their writer's own host: not hashed again. Only such a
            file may have no digest in ``expected``; any other is refused.
        limits: ``file -> bytes``: files of which only the first bytes are the checkpoint's (a shelf's blob, read
            in place: its entry follows the data); the rest is never read, and size and digest are of those bytes.
    """

    def __init__(self, path: str | os.PathLike, expected: dict[str, tuple[int, str | None]] | None = None,
                 rank: int = 0, world: int = 1, *, listed: Collection[str] | None = None,
                 present: Collection[str] | None = None, verified: Collection[str] = (),
                 limits: dict[str, int] | None = None) -> None:
        super().__init__()
        self.verified = set(verified)
        self.limits = dict(limits or {})
        self.path = Path(path)
        self.expected = expected
        self.listed = listed
        self.present = None if present is None else set(present)
        self.allowed = _allowed(self.path, expected, listed)
        self.rank, self.world = rank, world
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self.metadata = read_metadata(self.path, self.expected, listed=self.listed, present=self.present)
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        storage: dict[MetadataIndex, Location] = self.metadata.storage_data
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                raise CheckpointError(f"checkpoint entry {req.storage_index.fqn!r} is not a tensor")
            loc = storage[req.storage_index]
            per_file.setdefault(loc.relative_path, {}).setdefault(req.storage_index, []).append(req)
        mine: set[str] = set()
        if self.expected is not None:
            data_files = sorted(f for f in self.expected if f != METADATA_FILE)
            mine = {f for i, f in enumerate(data_files) if i % self.world == self.rank}
            if self.present is not None:
                mine = {f for f in data_files if f in self.present}
            mine -= self.verified
            unchecked = sorted(f for f in mine if self.expected[f][1] is None)
            if unchecked:
                raise _unhashed(self.path / unchecked[0])
        unknown = sorted(set(per_file) - self.allowed) if self.allowed is not None else []
        if unknown:
            raise CheckpointError(f"refusing to load {self.path}: {unknown[0]} is not in the manifest")
        absent = sorted(set(per_file) - self.present) if self.present is not None else []
        if absent:
            raise CheckpointError(f"cannot load {self.path}: this rank's tensors are in {absent[0]}, which was not "
                                  "taken into it", hint="take every data file the index places this rank's "
                                  "tensors in")
        for name in sorted(set(per_file) | mine):
            chunks = sorted(per_file.get(name, {}).items(), key=lambda kv: storage[kv[0]].offset)
            self._read_file(name, [(storage[index], reqs) for index, reqs in chunks], planner, check=name in mine)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_file(self, name: str, chunks: list[tuple[Location, list[ReadItem]]], planner: LoadPlanner,
                   check: bool) -> None:
        """Read the stored chunks of one file into their targets; with ``check``, read all of it in order and
        compare its size and digest with the manifest's."""
        if not DATA_FILE.fullmatch(name):
            raise CheckpointError(f"refusing to load {self.path}: {_show(name)} is not a checkpoint data file")
        path = self.path / name
        fd = open_source(path)
        digest = BackgroundHasher(_algorithm(self.expected[name][1])) if check and self.expected else None
        try:
            size = os.fstat(fd).st_size
            limit = self.limits.get(name)
            if limit is not None:
                if size < limit:
                    raise CheckpointError(f"refusing to load {self.path}: {self.path.name}/{name}: truncated ({size} "
                                          f"bytes; its data is {limit})")
                size = limit
            end = max((loc.offset + loc.length for loc, _ in chunks), default=0)
            if end > size:
                raise CheckpointError(f"refusing to load {self.path}: {self.path.name}/{name}: truncated ({size} "
                                      f"bytes; the index needs {end})",
                                      hint="run `varuna ckpt verify` on it; load an earlier checkpoint")
            pieces, staged = [], []
            for loc, reqs in chunks:
                direct = self._direct_target(loc, reqs, planner)
                if direct is None:
                    meta = self.tensor_meta(reqs[0].storage_index.fqn)
                    stored = torch.empty(tuple(self._chunk_meta(meta, reqs[0].storage_index).sizes),
                                         dtype=meta.properties.dtype)
                    staged.append((stored, reqs))
                    direct = stored
                data = _bytes_view(direct)
                if data.nbytes != loc.length:
                    raise CheckpointError(f"refusing to load {self.path}: {name}: the index gives {loc.length} bytes "
                                          f"for a chunk of {data.nbytes}", hint="the checkpoint index is corrupt")
                pieces.append((loc.offset, data))
            scatter_file(fd, pieces, digest, size=size)
            if digest is not None and self.expected is not None:  # check: a file the manifest lists
                _check(path, size, digest.hexdigest(), self.expected[name])
        finally:
            os.close(fd)
            if digest is not None:
                digest.close()
        for stored, reqs in staged:
            for req in reqs:
                planner.resolve_tensor(req).detach().copy_(_narrow(stored, req.storage_offsets, req.lengths))
        for _, reqs in chunks:
            for req in reqs:
                planner.commit_tensor(req, planner.resolve_tensor(req).detach())

    def _direct_target(self, loc: Location, reqs: list[ReadItem], planner: LoadPlanner) -> torch.Tensor | None:
        """The target tensor a stored chunk can be read into as is (one request covering the whole chunk, a
        contiguous CPU target of the same dtype), else None."""
        if len(reqs) != 1:
            return None
        req = reqs[0]
        meta = self.tensor_meta(req.storage_index.fqn)
        sizes = tuple(self._chunk_meta(meta, req.storage_index).sizes)
        dest = planner.resolve_tensor(req).detach()
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == sizes
        if whole and dest.is_contiguous() and dest.dtype == meta.properties.dtype and dest.device.type == "cpu":
            return dest
        return None

    def tensor_meta(self, fqn: str) -> TensorStorageMetadata:
        """The stored tensor ``fqn`` (of the metadata ``read_data`` runs with)."""
        assert self.metadata is not None
        meta = self.metadata.state_dict_metadata[fqn]
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry {fqn!r} is not a tensor")
        return meta

    @staticmethod
    def _chunk_meta(meta: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata:
        if index.index is not None and index.index < len(meta.chunks) and \
                tuple(meta.chunks[index.index].offsets) == tuple(index.offset or ()):
            return meta.chunks[index.index]
        return next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset or ()))
