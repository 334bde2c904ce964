"""Offline tools for checkpoint stores: list, inspect, verify, and merge into one ``safetensors`` file.

They read what :mod:`varuna_core.checkpoint.saveload` writes (see :class:`varuna_core.checkpoint.manifest.Manifest`)::

    <store>/step_<N>/dcp_metadata.json, __<rank>_<i>.distcp   torch.distributed.checkpoint index and data
                    /manifest.json                     step, world, plan, every file with size and digest
                    /COMPLETE                          written last

and need no process group, no GPU and no model code. Nothing here prints: every function returns a report
(pydantic models, so the CLI's ``--json`` is ``model_dump_json``) or raises a
:class:`~varuna_core.errors.VarunaError` with a hint.

The checkpoints looked at may come from anyone, so every file is read bounded, without blocking (a FIFO is
reported, not waited on) and without following a link; the index may name only files the manifest lists, and
:mod:`varuna_core.checkpoint.storage` validates it before anything is allocated from it.

Conventions:

* A path is either a *store* (the directory holding ``step_<N>/``; the latest **complete** checkpoint is
  used) or one ``step_<N>/`` directory (used as is, complete or not); see :func:`resolve`.
* :func:`merge` writes the model's own names (``model/`` and ``buffer/`` stripped) and every name of a tied
  group, so ``model.load_state_dict(load_file(out), strict=True)`` works on the unpartitioned model. With
  ``optimizer=True`` the optimizer state goes to a second file ``<stem>.optim.safetensors`` beside it, keyed
  ``<parameter name>/<state name>`` (e.g. ``fc.weight/exp_avg``), tied weights under their canonical name only.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field

from ..errors import CheckpointError, ConfigError, VarunaError
from ..util.digest import Hasher, algorithm_of
from ..util.fs import MiB, describe_mode, open_regular, read_regular
from .layout import RUN_FILE, describe_runs, latest, read_run, runs, scan
from .manifest import CHECKPOINT_INDEX as METADATA_FILE

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .manifest import Manifest

__all__ = [
    "CheckpointInfo", "TensorInfo", "KindTotal", "GroupBytes", "InspectReport", "VerifyReport", "MergeReport",
    "list_checkpoints", "resolve", "inspect", "verify", "merge", "optimizer_output_path", "KINDS",
]

_STEP_RE = re.compile(r"^step_(\d+)$")
_DIST_RE = re.compile(r"__([0-9]+)_([0-9]+)\.distcp")  # ckpt_storage.DATA_FILE (imported, it would import torch)
_HASH_CHUNK = 8 * 2**20
_MANIFEST_LIMIT = 256 * MiB  # a real manifest is a few KB plus ~100 bytes per parameter
_MARKER_LIMIT = 64  # COMPLETE holds the step number
_LOAD_CHUNK = 256 * 2**20  # bytes of tensors loaded at once by the finite check
_MARKERS = ("manifest.json", "COMPLETE", RUN_FILE)
KINDS = ("model", "buffer", "optim", "other")


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------------------------------------
# Reports


class CheckpointInfo(_Report):
    """One ``step_<N>/`` directory of a store."""

    step: int
    path: str
    complete: bool = Field(description="the COMPLETE marker exists")
    run: str | None = Field(None, description="the run that wrote it (its RUN file; None: not recorded)")
    bytes: int = Field(description="size of every file in the directory")
    files: int
    model: str | None = None
    pp: int | None = None
    dp: int | None = None
    stage_to_rank_map: str | None = None
    created: str | None = Field(None, description="from the manifest (None without a readable manifest)")
    plan: bool = Field(False, description="the manifest records the plan the run used")
    manifest_error: str | None = Field(None, description="why manifest.json could not be read (None: read)")


class TensorInfo(_Report):
    key: str
    kind: str = Field(description="model, buffer, optim or other (rng states and anything else)")
    shape: list[int]
    dtype: str
    bytes: int


class KindTotal(_Report):
    tensors: int = 0
    bytes: int = 0


class GroupBytes(_Report):
    """Bytes of one group of tensors (a pipeline stage or a top-level module), split by kind."""

    name: str
    tensors: int = 0
    model: int = 0
    buffer: int = 0
    optim: int = 0
    other: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def bytes(self) -> int:
        return self.model + self.buffer + self.optim + self.other


class InspectReport(_Report):
    path: str
    step: int | None
    complete: bool
    manifest_error: str | None = None
    model: str | None = None
    structure_hash: str | None = None
    pp: int | None = None
    dp: int | None = None
    stage_to_rank_map: str | None = None
    partition: list[tuple[int, int]] | None = None
    tied: list[list[str]] = Field(default_factory=list)
    file_bytes: int = Field(description="bytes on disk of the directory's files")
    tensors: list[TensorInfo]
    totals: dict[str, KindTotal] = Field(description="by kind: model, buffer, optim, other")
    total_bytes: int
    by_stage: list[GroupBytes] | None = Field(
        None, description="bytes written by each stage's ranks (None when the layout does not tell)")
    by_prefix: list[GroupBytes] = Field(description="bytes per top-level module (first component of the name)")
    notes: list[str] = Field(default_factory=list)


class VerifyReport(_Report):
    path: str
    step: int | None
    finite_checked: bool = False
    problems: list[str] = Field(default_factory=list, description="in the order found")
    notes: list[str] = Field(default_factory=list, description="observations that are not problems")
    files_checked: int = 0
    bytes_hashed: int = 0
    parameters_checked: int = 0
    tied_groups_checked: int = 0
    tensors_checked_finite: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        return not self.problems

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_problem(self) -> str | None:
        return self.problems[0] if self.problems else None


class MergeReport(_Report):
    source: str
    step: int | None
    output: str
    optimizer_output: str | None = None
    tensors: int = Field(description="tensors in the model file (tied copies included)")
    bytes: int = Field(description="tensor bytes in the model file")
    optimizer_tensors: int = 0
    optimizer_bytes: int = 0
    tied_copies: list[str] = Field(default_factory=list, description="'name <- canonical' for each tied copy written")
    forced: bool = False
    problems: list[str] = Field(default_factory=list, description="verification problems ignored with force=True")


# ----------------------------------------------------------------------------------------------------------
# Store layout


def _step_of(path: Path) -> int | None:
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def _looks_like_checkpoint(path: Path) -> bool:
    return _step_of(path) is not None or any((path / name).exists() for name in (*_MARKERS, METADATA_FILE))


def _files(directory: Path) -> list[tuple[Path, int]]:
    """Every entry below ``directory`` that is not a directory, with its ``lstat`` size: a link counts as itself
    (never followed, so neither a loop nor a link to elsewhere is entered), a FIFO is listed, not opened."""
    out, pending = [], [directory]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                else:
                    out.append((Path(entry.path), entry.stat(follow_symlinks=False).st_size))
            except OSError:
                continue
    return sorted(out)


def _is_checkpoint_file(name: str) -> bool:
    return name == METADATA_FILE or _DIST_RE.fullmatch(name) is not None


def _listed(manifest: Manifest | None) -> set[str] | None:
    """The files the manifest lists (None without a manifest): the only ones the index may name."""
    return None if manifest is None else {entry.path for entry in manifest.files}


def _read_manifest(directory: Path) -> tuple[Manifest | None, str | None]:
    """The manifest, or why there is none (as text: a bad manifest is a problem to report, not a crash)."""
    from .manifest import Manifest

    path = directory / "manifest.json"
    if not os.path.lexists(path):
        return None, "missing"
    try:
        text = read_regular(path, _MANIFEST_LIMIT, what="manifest", follow=False, error=CheckpointError).decode()
    except CheckpointError as exc:
        return None, f"unreadable: {exc.message}"
    except UnicodeDecodeError as exc:
        return None, f"invalid: not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        return Manifest.model_validate_json(text), None
    except ValidationError as exc:
        lines = str(exc).splitlines()
        return None, "invalid: " + " ".join(line.strip() for line in lines[:3])
    except ValueError as exc:
        return None, f"invalid: {str(exc).splitlines()[0]}"


def _existing_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} {p} does not exist",
                          hint="pass a checkpoint store (the directory holding step_N/) or one step_N directory")
    if not p.is_dir():
        raise ConfigError(f"{what} {p} is not a directory",
                          hint="pass a checkpoint store (the directory holding step_N/) or one step_N directory")
    return p


def list_checkpoints(store: str | os.PathLike) -> list[CheckpointInfo]:
    """Every ``step_<N>/`` of ``store`` by step, incomplete ones included (``complete=False``).

    Raises:
        ConfigError: ``store`` does not exist, is not a directory, or is itself one checkpoint directory.
    """
    root = _existing_dir(store, "checkpoint store")
    if _looks_like_checkpoint(root) and not scan(root):
        raise ConfigError(f"{root} is one checkpoint, not a store", hint=f"list its store: {root.parent}")
    out = []
    for entry in scan(root):
        files = _files(entry.path)
        manifest, error = _read_manifest(entry.path)
        info = CheckpointInfo(step=entry.step, path=str(entry.path), complete=entry.complete, run=entry.run,
                              bytes=sum(size for _, size in files), files=len(files), manifest_error=error)
        if manifest is not None:
            info.model, info.pp, info.dp = manifest.model, manifest.pp, manifest.dp
            info.stage_to_rank_map, info.created, info.plan = manifest.stage_to_rank_map, manifest.created, \
                manifest.plan is not None
        out.append(info)
    return out


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: ``path`` itself if it is a ``step_<N>`` directory (or holds
    checkpoint files), else the latest complete ``step_<N>`` of the store ``path``.

    Raises:
        ConfigError: the path does not exist, the store holds no checkpoint, or none of them is complete.
    """
    p = _existing_dir(path, "checkpoint path")
    if _looks_like_checkpoint(p):
        return p
    entries = scan(p)
    if not entries:
        raise ConfigError(f"{p} holds no checkpoints (no step_N directories)",
                          hint="pass the directory given to the run's checkpoint store, or one step_N directory")
    newest = latest(entries)  # of any run: refused below if the store holds several
    if newest is None:
        names = ", ".join(e.path.name for e in entries)
        raise ConfigError(f"{p} holds no complete checkpoint (incomplete: {names})",
                          hint=f"name one explicitly to look at it anyway, e.g. {entries[-1].path}")
    groups = runs([e for e in entries if e.complete])
    if len(groups) > 1:
        raise ConfigError(f"{p} holds checkpoints of {len(groups)} runs ({describe_runs(entries)}): which "
                          "one is meant is ambiguous", hint=f"name one step_N directory, e.g. {newest.path}")
    return newest.path


# ----------------------------------------------------------------------------------------------------------
# Tensors


def _metadata(directory: Path, listed: set[str] | None, check_files: bool = True) -> dict[str, Any]:
    """DCP tensor entries ``key -> TensorStorageMetadata`` (non-tensor entries dropped)."""
    return _index(directory, listed, check_files)[0]


def _index(directory: Path, listed: set[str] | None,
           check_files: bool = True) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """The DCP tensor entries, and ``key -> files holding (chunks of) it`` from the storage index, which may
    name only ``listed`` files (any data file without a manifest); see :func:`ckpt_storage.read_metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .storage import read_metadata

    meta = read_metadata(directory, listed=listed, check_files=check_files)
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    where: dict[str, set[str]] = {}
    for index, info in (getattr(meta, "storage_data", None) or {}).items():
        fqn, rel = getattr(index, "fqn", None), getattr(info, "relative_path", None)
        if fqn is not None and rel is not None:
            where.setdefault(fqn, set()).add(str(rel))
    return tensors, where


def _nbytes(meta: Any) -> int:
    n = 1
    for d in meta.size:
        n *= int(d)
    return n * meta.properties.dtype.itemsize


def _kind(key: str) -> str:
    head = key.split("/", 1)[0]
    return head if head in ("model", "buffer", "optim") and "/" in key else "other"


def _owner(key: str) -> str | None:
    """The parameter or buffer name a key belongs to (None for rng and unknown keys)."""
    kind = _kind(key)
    if kind in ("model", "buffer"):
        return key.split("/", 1)[1]
    if kind == "optim":
        rest = key.split("/", 1)[1]
        return rest.rsplit("/", 1)[0] if "/" in rest else rest
    return None


def _load(directory: Path, keys: Iterable[str], listed: set[str] | None) -> dict[str, torch.Tensor]:
    """Load ``keys`` without a process group, from files the manifest lists (``listed``).

    The targets are sized from the index as the reader validates it against the files (not from an earlier
    read, which the files may have changed since), and zeroed: no byte of memory that no chunk covers reaches
    the caller, whatever the index says."""
    import torch

    from .storage import RawReader, dcp_load

    keys = list(keys)
    if not keys:
        return {}
    reader = RawReader(directory, listed=listed)
    index = reader.read_metadata().state_dict_metadata
    missing = [k for k in keys if k not in index]
    if missing:
        raise CheckpointError(f"{directory}: {missing[0]} is no longer in the tensor index (changed meanwhile?)")
    metas = {k: reader.tensor_meta(k) for k in keys}
    target = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in metas.items()}
    dcp_load(target, reader, no_dist=True)
    return target


def _chunks(keys: list[str], metas: dict[str, Any], budget: int) -> list[list[str]]:
    out: list[list[str]] = []
    size = 0
    for key in keys:
        n = _nbytes(metas[key])
        if not out or size + n > budget:
            out.append([])
            size = 0
        out[-1].append(key)
        size += n
    return out


def _stage_by_rank(stage_to_rank_map: str | None) -> dict[int, int] | None:
    if not stage_to_rank_map:
        return None
    from ..ir.topology import Topology

    try:
        topo = Topology.parse(stage_to_rank_map)
    except VarunaError:
        return None
    return {rank: s for s, ranks in enumerate(topo.stage_ranks) for rank in ranks}


# ----------------------------------------------------------------------------------------------------------
# inspect


def inspect(path: str | os.PathLike) -> InspectReport:
    """Every tensor of a checkpoint with shape, dtype and bytes; totals by kind, by stage and by module.

    Bytes per stage come from which rank's file holds each tensor (the DCP storage index) and the manifest's
    ``stage_to_rank_map``: the manifest's ``partition`` is in segments, which do not name parameters, so it
    cannot map names to stages by itself. A tensor several stages hold (a tied weight, a buffer used on two
    stages) counts once, for the stage whose rank wrote it. Bytes per top-level module are always reported.

    Raises:
        ConfigError: the path is not a checkpoint or a store with one.
        CheckpointError: the tensor index (``dcp_metadata.json``) is missing, unreadable or invalid, or names a
            data file the manifest does not list or that is not a plain file holding its chunks.
    """
    directory = resolve(path)
    manifest, error = _read_manifest(directory)
    try:
        metas, where = _index(directory, _listed(manifest))
    except Exception as exc:  # noqa: BLE001 - missing file, bad JSON, ...
        raise CheckpointError(f"{directory}: cannot read the tensor index ({METADATA_FILE}): {_short(exc)}",
                          hint="the checkpoint is incomplete or corrupt; `varuna ckpt verify` says more") from None
    tensors = [TensorInfo(key=k, kind=_kind(k), shape=[int(d) for d in m.size], dtype=_dtype(m.properties.dtype),
                          bytes=_nbytes(m)) for k, m in sorted(metas.items())]
    totals = {kind: KindTotal() for kind in KINDS}
    prefixes: dict[str, GroupBytes] = {}
    for t in tensors:
        totals[t.kind].tensors += 1
        totals[t.kind].bytes += t.bytes
        owner = _owner(t.key)
        name = owner.split(".", 1)[0] if owner else "(other)"
        group = prefixes.setdefault(name, GroupBytes(name=name))
        group.tensors += 1
        setattr(group, t.kind, getattr(group, t.kind) + t.bytes)
    notes = []
    step = _step_of(directory)
    if manifest is None:
        notes.append(f"manifest.json {error}: no world, partition or tied groups to report")
    elif step is None:
        step = manifest.step
    by_stage, why = _by_stage(tensors, where, manifest)
    if why:
        notes.append(why)
    files = _files(directory)
    return InspectReport(
        path=str(directory), step=step, complete=(directory / "COMPLETE").is_file(), manifest_error=error,
        model=manifest.model if manifest else None, structure_hash=manifest.structure_hash if manifest else None,
        pp=manifest.pp if manifest else None, dp=manifest.dp if manifest else None,
        stage_to_rank_map=manifest.stage_to_rank_map if manifest else None,
        partition=manifest.partition if manifest else None, tied=manifest.tied if manifest else [],
        file_bytes=sum(size for _, size in files), tensors=tensors, totals=totals,
        total_bytes=sum(t.bytes for t in tensors), by_stage=by_stage,
        by_prefix=sorted(prefixes.values(), key=lambda g: (g.name == "(other)", -g.bytes, g.name)), notes=notes)


def _by_stage(tensors: list[TensorInfo], where: dict[str, set[str]],
              manifest: Manifest | None) -> tuple[list[GroupBytes] | None, str | None]:
    if manifest is None:
        return None, None
    stage_of_rank = _stage_by_rank(manifest.stage_to_rank_map)
    if stage_of_rank is None:
        return None, (f"bytes per stage not shown: stage_to_rank_map {manifest.stage_to_rank_map!r} does not parse; "
                      "bytes per top-level module instead")
    stages = [GroupBytes(name=f"stage {s}") for s in range(max(stage_of_rank.values()) + 1)]
    for t in tensors:
        if t.kind == "other":  # rng states: per rank, not model state
            continue
        owners = set()
        for rel in where.get(t.key, ()):
            match = _DIST_RE.fullmatch(Path(rel).name)
            owners.add(stage_of_rank.get(int(match.group(1))) if match else None)
        stage = owners.pop() if len(owners) == 1 else None
        if stage is None:
            return None, (f"bytes per stage not shown: {t.key} is not in exactly one stage's files; the manifest's "
                          "partition is in segments, which do not name parameters: bytes per top-level module instead")
        group = stages[stage]
        group.tensors += 1
        setattr(group, t.kind, getattr(group, t.kind) + t.bytes)
    note = None
    if len(stages) > 1:
        note = ("bytes per stage: what each stage's ranks wrote (from the DCP file of each tensor and the "
                "stage_to_rank_map); a tensor several stages hold, e.g. a tied weight, counts for one of them")
    return stages, note


def _dtype(dtype: Any) -> str:
    return str(dtype)


def _short(exc: BaseException) -> str:
    if isinstance(exc, VarunaError):
        return exc.message
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------------------
# verify


def _hash(path: Path, algorithm: str) -> tuple[int, str]:
    """Size and digest (by ``algorithm``) of the regular file ``path`` (not a link), as read from one
    descriptor."""
    fd = open_regular(path, what="checkpoint file", follow=False, error=CheckpointError)
    h = Hasher(algorithm)
    size = 0
    try:
        while chunk := os.read(fd, _HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return size, h.hexdigest()


def _check_marker(directory: Path, step: int | None) -> str | None:
    """What is wrong with the COMPLETE marker (None: nothing). Read at most a few bytes, never waited on."""
    name = directory.name
    path = directory / "COMPLETE"
    if not os.path.lexists(path):
        return f"{name}: incomplete (no COMPLETE marker: its writer stopped before finishing)"
    try:
        data = read_regular(path, _MARKER_LIMIT, what="COMPLETE marker", follow=False, error=CheckpointError)
    except CheckpointError as exc:
        return f"{name}/COMPLETE: {exc.message}"
    text = data.decode(errors="replace").strip()
    if step is not None and text and text != str(step):
        return f"{name}/COMPLETE: says step {text!r}, but the directory is {name}"
    return None


def verify(path: str | os.PathLike, *, finite: bool = False, chunk_bytes: int = _LOAD_CHUNK) -> VerifyReport:
    """Check a checkpoint; every problem found is listed, in this order:

    1. the ``COMPLETE`` marker exists (and names the directory's step);
    2. ``manifest.json`` exists and is a valid manifest (without it the checks stop here);
    3. every file of the manifest is named ``dcp_metadata.json`` or ``__<rank>_<i>.distcp`` and is a plain file
       (not a link, FIFO or directory) with its recorded size and digest;
    4. no unlisted DCP data file (``*.distcp``, ``dcp_metadata.json``) is present (other unlisted files are noted);
    5. the DCP index is valid and names only files the manifest lists, and every ``Manifest.parameters`` key is
       in it with the recorded shape and dtype;
    6. in each tied group, any non-canonical name stored as ``model/<name>`` equals the canonical exactly;
    7. with ``finite=True``: every floating ``model/*`` and ``optim/*`` tensor is finite (loaded
       ``chunk_bytes`` at a time; buffers are skipped, as masks legitimately hold ``-inf``).

    Never raises for a bad checkpoint (only for a path that is not one: ConfigError).
    """
    directory = resolve(path)
    step = _step_of(directory)
    report = VerifyReport(path=str(directory), step=step, finite_checked=finite)
    marker = _check_marker(directory, step)
    if marker:
        report.problems.append(marker)
    manifest, error = _read_manifest(directory)
    if manifest is None:
        report.problems.append(f"{directory.name}/manifest.json: {error}")
        return report
    _check_identity(directory, manifest, report)
    found = len(report.problems)
    listed = _check_listed_files(directory, manifest, report)
    _check_unlisted_files(directory, listed, report)
    files_ok = len(report.problems) == found
    try:  # a file already reported bad is not reported again as the index's problem
        metas = _metadata(directory, listed, check_files=files_ok)
    except Exception as exc:  # noqa: BLE001
        report.problems.append(f"{directory.name}/{METADATA_FILE}: cannot read the tensor index: {_short(exc)}")
        return report
    _check_parameters(directory.name, manifest, metas, report)
    _check_tied(directory, manifest, metas, listed, report)
    if finite:
        _check_finite(directory, metas, listed, chunk_bytes, report)
    return report


def _check_identity(directory: Path, manifest: Manifest, report: VerifyReport) -> None:
    """Step 2: the manifest's step is the directory's (a directory without a step takes the manifest's), and
    its run is the one ``RUN`` names."""
    name = directory.name
    if report.step is None:
        report.step = manifest.step
    elif manifest.step != report.step:
        report.problems.append(f"{name}/manifest.json: records step {manifest.step}, but the directory is {name}")
    recorded = read_run(directory)
    if manifest.run_id is not None and recorded != manifest.run_id:
        report.problems.append(f"{name}/{RUN_FILE}: says run {recorded}, the manifest run {manifest.run_id}")


def _check_listed_files(directory: Path, manifest: Manifest, report: VerifyReport) -> set[str]:
    """Step 3: every file the manifest lists. Returns the listed names that are checkpoint file names (the only
    files the index may name)."""
    name = directory.name
    listed: set[str] = set()
    for entry in manifest.files:
        if not _is_checkpoint_file(entry.path):
            report.problems.append(f"{name}/manifest.json: lists {entry.path!r}, not a checkpoint file "
                                   f"({METADATA_FILE} or __<rank>_<i>.distcp in the directory itself)")
            continue
        listed.add(entry.path)
        problem = _check_file(directory / entry.path, entry, report)
        if problem:
            report.problems.append(f"{name}/{entry.path}: {problem}")
    return listed


def _check_unlisted_files(directory: Path, listed: set[str], report: VerifyReport) -> None:
    """Step 4: an unlisted data file is a problem (another write's leftover would be read as this one's);
    any other unlisted file is noted."""
    name = directory.name
    for file, _ in _files(directory):
        rel = file.relative_to(directory).as_posix()
        if rel in listed or rel in _MARKERS:
            continue
        if _DIST_RE.fullmatch(file.name) or file.name == METADATA_FILE or file.suffix == ".distcp":
            report.problems.append(f"{name}/{rel}: data file not listed in the manifest (left by another write?)")
        else:
            report.notes.append(f"{name}/{rel}: not listed in the manifest (not a checkpoint data file; ignored)")


def _check_parameters(name: str, manifest: Manifest, metas: dict[str, Any], report: VerifyReport) -> None:
    """Step 5: every parameter of the manifest is in the tensor index with its recorded shape and dtype."""
    problems = report.problems
    for entry in manifest.parameters:
        report.parameters_checked += 1
        meta = metas.get(entry.key)
        if meta is None:
            problems.append(f"{name}: parameter {entry.key} is missing from the tensors")
            continue
        shape = [int(d) for d in meta.size]
        if shape != list(entry.shape):
            problems.append(f"{name}: {entry.key} has shape {shape} in the tensors, {list(entry.shape)} in the "
                            "manifest")
        dtype = _dtype(meta.properties.dtype)
        if dtype != entry.dtype:
            problems.append(f"{name}: {entry.key} has dtype {dtype} in the tensors, {entry.dtype} in the manifest")


def _check_tied(directory: Path, manifest: Manifest, metas: dict[str, Any], listed: set[str],
                report: VerifyReport) -> None:
    """Step 6: a copy of a tied weight stored under another name equals the canonical one exactly (a merge
    writes the canonical under every name, so a differing copy would be lost silently)."""
    name = directory.name
    for group in manifest.tied:
        if len(group) < 2:
            continue
        report.tied_groups_checked += 1
        canonical = f"model/{group[0]}"
        copies = [f"model/{n}" for n in group[1:] if f"model/{n}" in metas]
        if canonical not in metas:
            report.problems.append(f"{name}: tied group {group}: the canonical {canonical} is missing from the "
                                   "tensors")
            continue
        if not copies:
            continue
        try:
            loaded = _load(directory, (canonical, *copies), listed)
        except Exception as exc:  # noqa: BLE001
            report.problems.append(f"{name}: cannot load tied group {group}: {_short(exc)}")
            continue
        for key in copies:
            problem = _differs(loaded[canonical], loaded[key])
            if problem:
                report.problems.append(f"{name}: tied {key} differs from {canonical}: {problem}")


def _check_finite(directory: Path, metas: dict[str, Any], listed: set[str], chunk_bytes: int,
                  report: VerifyReport) -> None:
    """Step 7: every floating ``model/*`` and ``optim/*`` tensor is finite, loaded ``chunk_bytes`` at a time
    (the checkpoint may be larger than memory)."""
    import torch

    name = directory.name
    keys = [k for k, m in sorted(metas.items()) if _kind(k) in ("model", "optim")
            and (m.properties.dtype.is_floating_point or m.properties.dtype.is_complex)]
    for chunk in _chunks(keys, metas, chunk_bytes):
        try:
            loaded = _load(directory, chunk, listed)
        except Exception as exc:  # noqa: BLE001
            report.problems.append(f"{name}: cannot load {len(chunk)} tensor(s) from {chunk[0]}: {_short(exc)}")
            continue
        for key in chunk:
            bad = int((~torch.isfinite(loaded[key])).sum())
            report.tensors_checked_finite += 1
            if bad:
                report.problems.append(f"{name}: {key} has {bad} non-finite value(s) (nan or inf) of "
                                       f"{loaded[key].numel()}")
        del loaded


def _check_file(path: Path, entry: Any, report: VerifyReport) -> str | None:
    """What is wrong with one file the manifest lists (None: it has the recorded size and digest). ``lstat``
    first: a link or a FIFO is reported as what it is, never followed or opened."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return f"{describe_mode(info.st_mode)}, not a plain file"
    report.files_checked += 1
    size = info.st_size
    if size != entry.bytes:
        return f"size {size} bytes, the manifest records {entry.bytes} (truncated or changed)"
    try:
        size, digest = _hash(path, algorithm_of(entry.digest))
    except CheckpointError as exc:
        return exc.message
    report.bytes_hashed += size
    if size != entry.bytes or digest != entry.digest:
        return "digest mismatch (file changed or corrupt)"
    return None


def _differs(a: torch.Tensor, b: torch.Tensor) -> str | None:
    import torch

    if a.shape != b.shape:
        return f"shape {list(b.shape)} vs {list(a.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {b.dtype} vs {a.dtype}"
    if torch.equal(a, b):
        return None
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a != b
    if not bool(diff.any()):
        return None  # equal but for NaNs in the same places
    count = int(diff.sum())
    if a.is_floating_point():
        gap = float((a.double() - b.double()).abs()[diff].max())
        return f"{count} of {a.numel()} values differ (max abs difference {gap:.3g})"
    return f"{count} of {a.numel()} values differ"


# ----------------------------------------------------------------------------------------------------------
# merge


def optimizer_output_path(output: str | os.PathLike) -> Path:
    """Where :func:`merge` writes the optimizer state: ``<stem>.optim.safetensors`` beside ``output``."""
    out = Path(output)
    return out.with_name(f"{out.stem}.optim.safetensors")


def merge(path: str | os.PathLike, output: str | os.PathLike, *, optimizer: bool = False,
          force: bool = False) -> MergeReport:
    """Write a checkpoint's model as one ``safetensors`` file loadable by the unpartitioned model.

    Keys are the model's own names: ``model/<name>`` and ``buffer/<name>`` without the prefix, plus a copy
    (a clone: safetensors refuses shared storage) under every other name of each tied group. ``rng/*`` is
    dropped. Metadata (strings): ``format`` ("pt"), ``step``, ``model``, ``structure_hash``, ``source``,
    ``tied`` (JSON). With ``optimizer=True`` the ``optim/<name>/<state>`` tensors are written to
    :func:`optimizer_output_path` as ``<name>/<state>``, with the optimizer's class and groups in its
    metadata (``optimizer``, JSON). Each file is written to a temporary name and renamed.

    Raises:
        ConfigError: the checkpoint is incomplete or fails :func:`verify` (the first problem is named) and
            ``force`` is false; the output directory does not exist.
        CheckpointError: the tensors cannot be read (only possible with ``force``).
    """
    directory = resolve(path)
    out = Path(output)
    _check_output(directory, out)
    report = _verified_for_merge(directory, force)
    manifest, _ = _read_manifest(directory)
    listed = _listed(manifest)
    metas, state = _read_model(directory, listed)
    copies = _add_tied_copies(state, manifest)
    step = _step_of(directory)
    if step is None and manifest is not None:
        step = manifest.step
    meta = {"format": "pt", "step": "" if step is None else str(step), "source": str(directory),
            "model": manifest.model if manifest else "", "structure_hash": manifest.structure_hash if manifest else "",
            "tied": json.dumps(manifest.tied if manifest else [])}
    opt_path, opt_state = None, {}
    if optimizer:
        opt_state = _read_optimizer(directory, metas, listed)
        opt_path = optimizer_output_path(out)
        if opt_path.resolve() == out.resolve():
            raise ConfigError(f"output {out} collides with the optimizer file name",
                              hint="name the model file e.g. model.safetensors")
    opt_meta = dict(meta, optimizer=json.dumps(manifest.optimizer if manifest else None))
    _write_merged([(out, state, meta), *([(opt_path, opt_state, opt_meta)] if opt_path is not None else [])])
    return MergeReport(
        source=str(directory), step=step, output=str(out), optimizer_output=str(opt_path) if opt_path else None,
        tensors=len(state), bytes=_tensor_bytes(state), optimizer_tensors=len(opt_state),
        optimizer_bytes=_tensor_bytes(opt_state), tied_copies=copies, forced=bool(report.problems),
        problems=list(report.problems))


def _check_output(directory: Path, out: Path) -> None:
    if not out.parent.is_dir():
        raise ConfigError(f"output directory {out.parent} does not exist", hint="create it first")
    if out.resolve().is_relative_to(directory.resolve()):
        raise ConfigError(f"output {out} is inside the checkpoint {directory}",
                          hint="write it elsewhere: a file added to a checkpoint fails its verification")


def _verified_for_merge(directory: Path, force: bool) -> VerifyReport:
    """The checkpoint's :func:`verify` report; a ConfigError naming the first problem unless ``force``."""
    report = verify(directory)
    if report.problems and not force:
        more = len(report.problems) - 1
        first = report.problems[0].removeprefix(f"{directory.name}: ")
        raise ConfigError(f"refusing to merge {directory}: {first}"
                          + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""),
                          hint="`varuna ckpt verify` lists every problem; merge an earlier checkpoint "
                               "(`varuna ckpt list`), or pass --force to merge what is there")
    return report


def _read_model(directory: Path, listed: set[str] | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The tensor index, and the ``model/`` and ``buffer/`` tensors under the model's own names (contiguous:
    safetensors writes them as they are laid out)."""
    try:
        metas = _metadata(directory, listed)
        tensors = _load(directory, [k for k in metas if _kind(k) in ("model", "buffer")], listed)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read the tensors of {directory}: {_short(exc)}",
                              hint="`varuna ckpt verify` says what is wrong with it") from None
    state = {k.split("/", 1)[1]: t.contiguous() for k, t in sorted(tensors.items())}
    if not state:
        raise CheckpointError(f"{directory} holds no model/ or buffer/ tensors", hint="is it a varuna checkpoint?")
    return metas, state


def _add_tied_copies(state: dict[str, torch.Tensor], manifest: Manifest | None) -> list[str]:
    """Add every missing name of each tied group as a clone of one it has (safetensors refuses shared storage,
    and ``load_state_dict(strict=True)`` wants every name). Returns ``'name <- source'`` per copy."""
    copies = []
    for group in (manifest.tied if manifest else []):
        source = next((n for n in group if n in state), None)
        if source is None:
            continue
        for other in group:
            if other not in state:
                state[other] = state[source].clone()
                copies.append(f"{other} <- {source}")
    return copies


def _read_optimizer(directory: Path, metas: dict[str, Any], listed: set[str] | None) -> dict[str, torch.Tensor]:
    """The ``optim/<name>/<state>`` tensors as ``<name>/<state>``."""
    try:
        loaded = _load(directory, [k for k in metas if _kind(k) == "optim"], listed)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read the optimizer state of {directory}: {_short(exc)}",
                              hint="`varuna ckpt verify` says what is wrong with it") from None
    return {k.split("/", 1)[1]: t.contiguous() for k, t in sorted(loaded.items())}


def _write_merged(files: list[tuple[Path, dict[str, torch.Tensor], dict[str, str]]]) -> None:
    """Write each ``(path, tensors, metadata)`` to a temporary name, then rename them all, the first (the model
    file) last: its presence means every file is written. A failure leaves no temporary file."""
    from safetensors.torch import save_file

    pending = []
    try:
        for final, tensors, meta in files:
            tmp = final.with_name(f".{final.name}.tmp")
            save_file(tensors, str(tmp), metadata=meta)
            pending.append((tmp, final))
        for tmp_path, final in reversed(pending):
            os.replace(tmp_path, final)
        pending = []
    finally:
        for tmp_path, _ in pending:
            tmp_path.unlink(missing_ok=True)


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
