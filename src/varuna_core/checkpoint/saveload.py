"""Checkpoints that load under any pipeline depth and data-parallel width, are never half-true, and belong to
one run.

Layout of ``<store>/step_<N>/`` (see :class:`varuna_core.checkpoint.manifest.Manifest` and
:mod:`varuna_core.checkpoint.layout`):

* ``RUN``: the id of the run that wrote it, written first, so that even a partial directory says whose it is;
* ``torch.distributed.checkpoint`` entries under the model's own names: ``model/<name>`` (each parameter
  once; a tied weight under its canonical name), ``buffer/<name>``, ``optim/<name>/<state>``, and
  ``rng/rank<R>`` (and ``rng_cuda/rank<R>`` on CUDA; restored when the world size is the same). Because keys
  are names, not ranks or stages, any other partition loads them (DCP also spreads the writes of
  data-parallel replicas over the replicas). The bytes are stored by :mod:`varuna_core.checkpoint.storage`:
  ``__<rank>_0.distcp`` files of raw tensor bytes hashed while written, and a JSON index ``dcp_metadata.json``
  (no pickle anywhere);
* ``manifest.json``: run, step, plan, world, every file with its size and digest, every parameter, loss scaler,
  seed, iteration and data position;
* ``COMPLETE``: written by rank 0 only after every rank reported its files finished. A crash at any point
  before leaves a directory that ``list``/``verify`` report as incomplete and ``load`` refuses; the previous
  checkpoint stays intact.

**Runs.** Retention (``keep``) and ``"latest"`` consider only this run's checkpoints, and a directory of
another run is never overwritten or deleted (see :mod:`varuna_core.checkpoint.layout` for why). A save that fails
(a full disk, a rank that cannot write) removes what it wrote, on every rank, and raises
:class:`~varuna_core.errors.CheckpointError` on every rank; partial directories that a killed process left
behind are removed once a later checkpoint of the same run completes.

**Background saves.** ``background=True`` writes to a private directory under a fast local ``tempdir`` (the
only part that stalls training), then a background thread per rank copies its files into the store (the kernel
copies; the hashes are those taken during the local write); ranks report their files, or their failure,
through the job's key-value store, signed with the job's token when the launcher gave one (the store is
reachable by anyone on the job's network: see the README's trust model), and rank 0's thread checks every
report against the files on disk before it writes the manifest and ``COMPLETE``.

**Without a shared file system.** :mod:`varuna_core.checkpoint.handover` writes the same checkpoint with the
same machinery into a private directory on each rank's own host and puts the files in host memory (a shelf);
rank 0 then completes the manifest from the other ranks' reported sizes and digests, which it cannot see on disk.
A load from such a handover reads a directory of this rank's own holding only the data files of its tensors
(``present``).

**Loads are all or nothing.** Everything is read into new tensors and checked (the model's parameter names,
shapes and dtypes against the manifest, every file's size and digest) before a single live tensor changes: a
refused checkpoint leaves the model, the optimizer and the RNG as they were. The cost is a second copy of this
rank's state while loading.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import hmac
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError

from ..errors import CheckpointError, ConfigError, VarunaError
from ..model.rng import MASK64
from ..util.checks import integer
from ..util.fs import atomic_write, fsync_dir
from .chunks import chunk
from .io import copy_file
from .layout import (
    COMPLETE_FILE,
    MANIFEST_FILE,
    RUN_FILE,
    check_run_id,
    describe_runs,
    latest,
    read_manifest,
    read_run,
    runs,
    scan,
    step_dir,
)
from .manifest import CHECKPOINT_INDEX, FileEntry, Manifest, TensorEntry
from .state import CheckpointState
from .storage import RawReader, RawWriter, dcp_load, dcp_save

__all__ = ["CheckpointState", "save", "load"]

log = logging.getLogger(__name__)

_NEW_PREFIX = ".varuna-new-"  # a step directory being created (see _prepare)
_OLD_PREFIX = ".varuna-old-"  # a step directory being deleted (see _delete)
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_state_lock = threading.Lock()
_writing: set[Path] = set()  # step directories this process is writing (never cleaned up under its feet)
_staging: set[Path] = set()  # staging directories of background saves in flight
_saves = 0  # saves made by this process: every rank makes the same calls, so it names a save across ranks


# ----------------------------------------------------------------------------------------------------------
# What a rank saves


def _keys(state: CheckpointState) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters with their checkpoint names: the canonical name of a parameter's weight group
    (see :func:`varuna_core.model.stage.weight_groups`) depends on the model alone, never on the partition, so
    any layout finds it."""
    canonical = state.canonical_names()
    return [(canonical.get(name, name), p) for name, p in state.params]


def _buffers(state: CheckpointState) -> dict[str, torch.Tensor]:
    """Persistent buffers this rank holds (a buffer replicated on several stages is saved once by DCP)."""
    persistent = set(state.module.state_dict(keep_vars=True))
    return {name: b for name, b in state.module.named_buffers() if name in persistent and b.device.type != "meta"}


def _parameters(state: CheckpointState) -> list[TensorEntry]:
    """Every parameter of the whole model (all stages) under its checkpoint name, each weight once."""
    canonical = state.canonical_names()
    params, keys = [], set()
    for name, p in state.module.named_parameters(remove_duplicate=False):
        key = canonical.get(name, name)
        if key not in keys:
            keys.add(key)
            params.append(TensorEntry(key=f"model/{key}", shape=list(p.shape), dtype=str(p.dtype)))
    return params


def _state_dict(state: CheckpointState, *, write_model: bool) -> dict[str, torch.Tensor]:
    """What this rank writes: its RNG states, and unless another replica writes them, its parameters, their
    optimizer state (numbers as 0-d tensors) and its persistent buffers, under checkpoint keys."""
    sd: dict[str, torch.Tensor] = {f"rng/rank{state.rank}": torch.get_rng_state()}
    if state.device.type == "cuda":
        sd[f"rng_cuda/rank{state.rank}"] = torch.cuda.get_rng_state(state.device)
    for key, p in _keys(state):
        if write_model:
            sd[f"model/{key}"] = p.detach()
        if write_model or state.pieces is not None:  # a sharded optimizer's box is on this replica only
            for name, value in _optim_slots(state, p):
                sd[f"optim/{key}/{name}"] = value
    if write_model:
        for name, b in _buffers(state).items():
            sd[f"buffer/{name}"] = b
    return sd


def _optim_slots(state: CheckpointState, p: torch.nn.Parameter) -> list[tuple[str, torch.Tensor]]:
    """The optimizer state of ``p`` this rank writes, as ``(slot, tensor)``: numbers as 0-d tensors; under a
    sharded optimizer, a slot of the box's shape as that box of the parameter's shape (:mod:`.chunks`)."""
    if state.optimizer is None:
        return []
    held, piece = p, None
    if state.pieces is not None:
        piece = state.pieces.get(id(p))
        if piece is None or not piece.save:
            return []
        held = piece.param
    out = []
    for name, value in state.optimizer.state.get(held, {}).items():
        if isinstance(value, torch.Tensor):
            if piece is not None and value.dim() > 0:
                if value.shape != held.shape:
                    raise CheckpointError(f"the sharded optimizer's state {name!r} of {list(p.shape)} parameter has "
                                          f"shape {list(value.shape)}, not its piece's {list(held.shape)}",
                                          hint="shard only optimizers whose state is element-wise")
                value = chunk(value, piece.offsets, p.shape)
            out.append((name, value))
        elif isinstance(value, (int, float)):
            out.append((name, torch.tensor(value)))
    return out


def _optimizer_info(state: CheckpointState) -> dict | None:
    if state.optimizer is None:
        return None
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple,
                                                                              type(None)))}
              for g in state.optimizer.param_groups]
    return {"class": type(state.optimizer).__name__, "param_groups": groups}


def _manifest(state: CheckpointState, step: int, files: list[FileEntry]) -> Manifest:
    return Manifest(
        step=step, run_id=state.run_id,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=type(state.module).__name__, structure_hash=state.structure_hash, num_segments=state.num_segments,
        pp=state.pp, dp=state.dp, stage_to_rank_map=state.stage_to_rank_map, partition=list(state.partition),
        precision=state.precision, iteration=state.iteration, samples_seen=state.samples_seen, seed=state.seed,
        loss_scaler=state.loss_scaler, optimizer=_optimizer_info(state),
        tied=[[canonical, *[n for n in names if n != canonical]] for canonical, names in state.weight_groups],
        parameters=_parameters(state), plan=state.plan, files=files)


# ----------------------------------------------------------------------------------------------------------
# Save


def save(state: CheckpointState, store: str | os.PathLike, *, step: int | None = None,
         tempdir: str | os.PathLike | None = None, shard: bool = True, background: bool = False,
         keep: int | None = None):
    """Write a checkpoint of every rank's state (collective: every rank calls it).

    Args:
        state: this rank's state; only read (a background save keeps what it needs as plain values).
        store: the global checkpoint directory (shared by all hosts).
        step: the checkpoint's number (default: the optimizer steps taken).
        tempdir: a fast local directory to write to first (needed for ``background``); each rank writes into a
            private directory of its own there, removed once copied.
        shard: spread the tensors of data-parallel replicas over the replicas (else replica 0 writes them).
        background: return after the local write; copying to ``store`` and completing happen in a thread.
        keep: after completing, delete all but the newest ``keep`` complete checkpoints of this run.

    Returns:
        ``None``, or with ``background`` a ``Future`` that resolves once this rank's part (and, on rank 0, the
        ``COMPLETE`` marker) is written, and raises :class:`CheckpointError` if the save failed.

    Raises:
        CheckpointError: on every rank, if the save failed anywhere (what was written is removed), or
            ``step_<step>`` holds another run's checkpoint.
    """
    global _saves
    if background and tempdir is None:
        raise ConfigError("background=True needs a tempdir (a fast local directory)",
                          hint="pass tempdir=/local/disk/path, or background=False")
    step = state.iteration if step is None else integer("step", step, low=0)
    keep = None if keep is None else integer("keep", keep, low=1)
    store = Path(store)
    final = step_dir(store, step)
    _saves += 1
    created, problem = False, None
    if state.rank == 0:
        problem = _prepare(final, state.run_id)
        created = problem is None
    staging = None
    if problem is None and tempdir is not None:
        try:
            staging = _make_staging(Path(tempdir), state.run_id, state.rank, step)
        except OSError as exc:
            problem = f"rank {state.rank} cannot create its staging directory in {tempdir}: {exc.strerror or exc}"
    try:
        _agree(state, problem, hint="the previous complete checkpoint is still the latest")
        writer = RawWriter(staging or final, sync_files=staging is None)
        # a failure anywhere raises everywhere
        dcp_save(_state_dict(state, write_model=shard or state.replica == 0), writer)
    except BaseException as exc:
        _discard(staging)
        if created:
            _remove_own(final)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _removed(_kv_store(state), f"varuna/ckpt/{state.run_id}/{_saves}/removed", state.rank, state.timeout)
        if isinstance(exc, (VarunaError, KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing checkpoint {final} failed on rank {state.rank}: {_reason(exc)}",
                              hint="what this save wrote was removed; the previous complete checkpoint is still "
                                   "the latest") from None
    files = [f.as_dict() for f in writer.files]  # hashed while written: no second pass over the bytes
    if staging is None:
        gathered = _gather(state, files)
        problem = None
        if state.rank == 0:
            try:
                entries = _entries(gathered, final)
                _complete(final, _manifest(state, step, entries), state.run_id, keep)
            except (OSError, VarunaError) as exc:
                problem = f"completing {final} failed: {_reason(exc)}"
                _remove_own(final)
        with _state_lock:
            _writing.discard(final)
        _agree(state, problem, hint="the previous complete checkpoint is still the latest")
        return None
    job = _Background(rank=state.rank, world=state.world_size, local=staging, final=final, step=step, run=state.run_id,
                      manifest=_manifest(state, step, []), kv=_kv_store(state), keep=keep, entries=files,
                      timeout=state.timeout, save=_saves, token=state.job_token)
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="varuna-ckpt")
    return _executor.submit(_finish_in_background, job)


def _prepare(final: Path, run: str) -> str | None:
    """Rank 0: make ``final`` an empty directory of this run (``RUN`` written). A leftover of this run is
    replaced; anything else is refused (None: done, else why not)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.is_symlink() or (final.exists() and not final.is_dir()):
            return f"{final} exists and is not a checkpoint directory; refusing to replace it"
        if final.exists() and not any(final.iterdir()):
            final.rmdir()  # an empty directory holds nothing of anyone's
        if final.exists():
            owner = read_run(final)
            if owner != run:
                whose = f"run {owner}" if owner else "a run that recorded no id (an older release, or another tool)"
                state = "complete" if (final / COMPLETE_FILE).exists() else "partial"
                return (f"{final} holds a {state} checkpoint of {whose}, not of this run ({run}); refusing to "
                        f"overwrite it")
            with _state_lock:
                if final in _writing:
                    return f"{final} is still being written by an earlier save of this process"
            _delete(final)  # a leftover of a crashed save of this run: never mix two writes
        # made complete with its RUN file under a temporary name, then renamed: a step directory is never
        # seen without its owner, however the process dies
        fresh = Path(tempfile.mkdtemp(prefix=f"{_NEW_PREFIX}{final.name}.", dir=final.parent))
        atomic_write(fresh / RUN_FILE, f"{run}\n", durable=True)
        with _state_lock:
            _writing.add(final)
        os.rename(fresh, final)
    except OSError as exc:
        return f"cannot create {final}: {exc.strerror or exc}"
    return None


def _make_staging(tempdir: Path, run: str, rank: int, step: int) -> Path:
    """A new private directory for this rank's local copy; stale ones of this run and rank (left by a killed
    predecessor) are removed first."""
    tempdir.mkdir(parents=True, exist_ok=True)
    prefix = f"varuna-{run}-r{rank}-"
    with _state_lock:
        live = set(_staging)
    for old in tempdir.glob(f"{prefix}*"):
        if old not in live and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}s{step}-", dir=tempdir))
    with _state_lock:
        _staging.add(path)
    return path


def _discard(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
        with _state_lock:
            _staging.discard(staging)


def _remove_own(final: Path) -> None:
    """Remove a step directory this process created (a failed save)."""
    _delete(final)
    with _state_lock:
        _writing.discard(final)


def _delete(directory: Path) -> None:
    """Remove a step directory at once and for good: it is renamed out of the way first, so a process killed
    while deleting leaves a hidden ``.varuna-old-*`` directory (removed by the next retention), never a
    ``step_<N>`` that has lost its ``RUN`` file or part of its data."""
    doomed = directory.with_name(f"{_OLD_PREFIX}{directory.name}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(directory, doomed)
    except FileNotFoundError:
        return
    except OSError:
        doomed = directory
    shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class _Background:
    """What a background save's thread needs (plain values: training moves on meanwhile)."""

    rank: int
    world: int
    local: Path
    final: Path
    step: int
    run: str
    manifest: Manifest
    kv: Any
    keep: int | None
    entries: list[dict[str, Any]]
    timeout: float
    save: int
    token: str | None


def _finish_in_background(job: _Background) -> int:
    try:
        return _copy_and_complete(job)
    except VarunaError:
        raise
    except BaseException as exc:  # noqa: BLE001 - a store that went away, an OSError: one clear error
        raise CheckpointError(f"background checkpoint {job.final} failed on rank {job.rank}: {_reason(exc)}",
                              hint="the previous complete checkpoint is still the latest") from None
    finally:
        _discard(job.local)
        with _state_lock:
            _writing.discard(job.final)


def _copy_and_complete(job: _Background) -> int:
    try:  # the copy must not take the CPU from training: it only has to finish before the next checkpoint
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    failure: str | None = None
    try:
        for entry in job.entries:  # O_DIRECT on both sides: the device copies, this thread barely runs
            size = copy_file(job.local / entry["path"], job.final / entry["path"], durable=True)
            if size != entry["bytes"]:
                raise CheckpointError(f"copying {entry['path']} gave {size} bytes of {entry['bytes']}")
        fsync_dir(job.final)  # durable before this rank reports done: COMPLETE and retention rely on it
    except (OSError, VarunaError) as exc:
        failure = f"rank {job.rank}: {_reason(exc)}"
    finally:
        _discard(job.local)
    gathered: list[list[dict[str, Any]] | str]  # per rank, its file entries or why it failed
    if job.kv is None:
        gathered = [job.entries]
    else:
        record = json.dumps({"files": job.entries, "error": failure}, separators=(",", ":"))
        job.kv.set(_kv_key(job, f"rank{job.rank}"), _sign(job, job.rank, record))
        job.kv.add(_kv_key(job, "done"), 1)
        if job.rank != 0:
            if failure:
                _removed(job.kv, _kv_key(job, "removed"), job.rank, job.timeout)
                raise CheckpointError(f"checkpoint {job.final} failed: {failure}",
                                      hint="the previous complete checkpoint is still the latest")
            return job.step
        gathered = _await_ranks(job)
    if failure is None and job.rank == 0 and job.kv is not None:
        failure = next((g for g in gathered if isinstance(g, str)), None)
    if failure is not None:
        if job.rank == 0:
            _remove_own(job.final)
            _removed(job.kv, _kv_key(job, "removed"), job.rank, job.timeout)
        raise CheckpointError(f"checkpoint {job.final} failed: {failure}",
                              hint="what it wrote was removed; the previous complete checkpoint is still the latest")
    reports = [g for g in gathered if not isinstance(g, str)]  # every rank's files: no rank failed
    job.manifest.files = _entries(reports, job.final)
    _complete(job.final, job.manifest, job.run, job.keep)
    return job.step


def _removed(kv: Any, key: str, rank: int, timeout: float) -> None:
    """After a failed save, a rank raises only once rank 0 has removed what the save wrote: a rank that raised
    first would end its process, its launcher would stop the job, and rank 0, killed while deleting, would leave
    a half-deleted directory behind. Rank 0 says so (``key``); the others wait for it, at most ``timeout`` (capped:
    a rank 0 that died says nothing, and the error must still come)."""
    if kv is None:
        return
    try:
        if rank == 0:
            kv.set(key, b"1")
        else:
            kv.wait([key], datetime.timedelta(seconds=min(timeout, 30.0)))
    except Exception:  # noqa: BLE001 - best effort: the save's own error is the one to raise
        pass


def _await_ranks(job: _Background) -> list[list[dict[str, Any]] | str]:
    """Rank 0: every rank's report (its file entries, or why it failed, as a string)."""
    deadline = time.monotonic() + job.timeout
    while (done := int(job.kv.add(_kv_key(job, "done"), 0))) < job.world:
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint {job.final} stays incomplete: {done} of {job.world} ranks copied "
                                  f"their files within {job.timeout:g}s", hint="a rank died or its copy is stuck; "
                                  "the previous complete checkpoint is still the latest")
        time.sleep(0.05)
    out: list[list[dict[str, Any]] | str] = []
    for rank in range(job.world):
        record = _verified(job, rank, job.kv.get(_kv_key(job, f"rank{rank}")))
        out.append(record["error"] if record.get("error") else record["files"])
    return out


def _kv_key(job: _Background, name: str) -> str:
    return f"varuna/ckpt/{job.run}/{job.save}/{name}"


def _sign(job: _Background, rank: int, record: str) -> str:
    """The record, with an HMAC of (save, step, rank, record) keyed by the job's token when there is one."""
    mac = ""
    if job.token:
        message = f"varuna-ckpt|{job.run}|{job.save}|{job.step}|{rank}|{record}".encode()
        mac = hmac.new(job.token.encode(), message, hashlib.sha256).hexdigest()
    return json.dumps({"record": record, "mac": mac}, separators=(",", ":"))


def _verified(job: _Background, rank: int, raw: bytes) -> dict:
    """Rank ``rank``'s report, checked: signed with the job's token (when there is one) for this save."""
    try:
        outer = json.loads(raw)
        record, mac = outer["record"], outer["mac"]
        if job.token:
            want = json.loads(_sign(job, rank, record))["mac"]
            if not isinstance(mac, str) or not hmac.compare_digest(want, mac):
                raise ValueError("its signature does not match the job's token")
        body = json.loads(record)
        if not isinstance(body, dict) or not isinstance(body.get("files"), list):
            raise ValueError("not a report")
        if body.get("error") is not None and not isinstance(body["error"], str):
            raise ValueError("not a report")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {job.final}: rank {rank}'s report in the job's store is invalid ({exc})",
                              hint="something other than this job wrote to its key-value store; see the README's "
                                   "trust model") from None
    return body


def _entries(gathered: list[list[dict[str, Any]]], final: Path, *,
             on_disk: Collection[int] | None = None) -> list[FileEntry]:
    """The manifest's file list from every rank's report: rank ``r`` may only report its own data files
    (``__r_<i>.distcp``, each once; several when a publish groups its entries) and rank 0 also the index, with a
    digest, and each file must be on disk with the reported size. ``on_disk``: the
    ranks whose files are in ``final`` when the others' are not (a publish into host memory: each rank writes
    on its own host, and rank 0 relies on the others' reported size and digest); None: every rank's."""
    out = []
    for rank, part in enumerate(gathered):
        seen: set[str] = set()
        for entry in part:
            try:
                item = FileEntry(**entry)
            except (TypeError, ValidationError):
                raise CheckpointError(f"checkpoint {final}: rank {rank} reported a malformed file entry") from None
            own = (re.fullmatch(rf"__{rank}_(0|[1-9][0-9]{{0,6}})\.distcp", item.path) is not None
                   or (rank == 0 and item.path == CHECKPOINT_INDEX))
            if not own or item.path in seen or item.bytes < 0:
                raise CheckpointError(f"checkpoint {final}: rank {rank} reported a file it cannot have written: "
                                      f"{item.path!r}", hint="see the README's trust model")
            seen.add(item.path)
            if on_disk is not None and rank not in on_disk:
                out.append(item)
                continue
            try:
                size = os.lstat(final / item.path).st_size
            except OSError as exc:
                raise CheckpointError(f"checkpoint {final}: {item.path} reported by rank {rank} is not there: "
                                      f"{exc.strerror or exc}") from None
            if size != item.bytes:
                raise CheckpointError(f"checkpoint {final}: {item.path} holds {size} bytes, rank {rank} reported "
                                      f"{item.bytes}")
            out.append(item)
    return sorted(out, key=lambda e: e.path)


def _complete(final: Path, manifest: Manifest, run: str, keep: int | None) -> None:
    """Rank 0: write the manifest, then ``COMPLETE``, durably; then apply retention to this run."""
    atomic_write(final / MANIFEST_FILE, manifest.model_dump_json(indent=2), durable=True)
    atomic_write(final / COMPLETE_FILE, f"{manifest.step}\n", durable=True)
    fsync_dir(final)
    with _state_lock:
        _writing.discard(final)
    _retain(final.parent, run, keep, manifest.step)


def _retain(store: Path, run: str, keep: int | None, completed: int) -> None:
    """Delete this run's partial directories older than the checkpoint just completed (left by a killed save)
    and, with ``keep``, all but its newest ``keep`` complete checkpoints. Other runs' directories stay."""
    mine = [e for e in scan(store) if e.run == run]
    with _state_lock:
        busy = set(_writing)
    doomed = [e for e in mine if not e.complete and e.step < completed and e.path not in busy]
    if keep:
        doomed += [e for e in mine if e.complete][:-keep]
    for entry in doomed:
        _delete(entry.path)
    for fresh in store.glob(f"{_NEW_PREFIX}step_*"):  # a creation that a killed process left unfinished
        if read_run(fresh) == run and fresh.is_dir() and not fresh.is_symlink():
            shutil.rmtree(fresh, ignore_errors=True)
    for old in store.glob(f"{_OLD_PREFIX}step_*"):  # a deletion that a killed process left unfinished
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)



def _reason(exc: BaseException) -> str:
    if isinstance(exc, VarunaError):
        return exc.message
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _gather(state: CheckpointState, files: list[Any]) -> list[list[Any]]:
    if state.world_size == 1:
        return [files]
    out: list[Any] = [None] * state.world_size
    dist.all_gather_object(out, files)
    return out


def _agree(state: CheckpointState, problem: str | None, hint: str | None = None) -> None:
    """Every rank learns whether any rank had a problem; if one did, every rank raises the first."""
    problems = [problem]
    if state.world_size > 1:
        problems = [None] * state.world_size
        dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if bad:
        raise CheckpointError(bad[0], hint=hint)


def _barrier(state: CheckpointState) -> None:
    if state.world_size > 1:
        dist.barrier()


def _kv_store(state: CheckpointState):
    if state.world_size == 1:
        return None
    return dist.distributed_c10d._get_default_store()


# ----------------------------------------------------------------------------------------------------------
# Load


def load(state: CheckpointState, store: str | os.PathLike, *, iteration: int | str = "latest",
         check_complete: bool = True, run: str | None = None, load_optimizer: bool = True,
         present: Collection[str] | None = None, verified: Collection[str] = (),
         limits: dict[str, int] | None = None, in_place: bool = False,
         mapped: dict[str, torch.Tensor] | None = None) -> int:
    """Restore parameters, buffers, optimizer state, loss scaler, iteration, seed and RNG from a checkpoint
    written under any partition (collective), all or nothing. Returns the step loaded; the run continues under
    the checkpoint's run id.

    The live parameters, buffers, optimizer and RNG change in place; the iteration, seed, run id and loss
    scaler state are set in ``state`` (and ``state.restored``) for the caller to adopt.

    ``iteration="latest"`` takes the newest complete checkpoint of this run (``run``, if given), else of the
    only run the store holds; a store of several runs needs ``run`` or a step.

    ``present``: the data files this rank's ``store`` holds when it is a directory of its own holding only some
    (see :mod:`varuna_core.checkpoint.handover`): this rank checks each of them whole and reads from no other;
    its manifest may list files without a digest, which only ``verified`` may hold.
    ``limits``: files whose data is only their first so many bytes (a shelf's blob, linked in place: its entry
    follows the data); size and digest are checked on those bytes.
    ``in_place``: read the parameters and buffers straight into the live tensors, without a copy of them to check
    first: for a process whose live state is worth nothing yet (a warm worker of a morph, which on a failure
    loads the store or stops), it spares allocating and copying the model once more. The rest is still all or
    nothing (optimizer state, RNG, step).
    ``mapped``: ``{fqn: tensor}``, entries already in memory of this rank's own that holds the stored bytes, checked
    (a handover's take maps its files: [Note: a take maps its files] in :mod:`.handover`): a parameter's becomes
    its memory, an optimizer slot's its state; they are not read.

    Raises:
        CheckpointError: on every rank, with the model untouched: no such checkpoint, incomplete, a file
            whose size or digest differs, a checkpoint of another model, or another optimizer (pass
            ``load_optimizer=False`` to load the model alone).
        ConfigError: ``run`` is not a run id (every rank is given the same, and refuses it alike).
    """
    if run is not None:
        check_run_id(run, "run")
    store = Path(store)
    step = _agreed(state, lambda: _choose(state, store, iteration, check_complete, run), decided_by_rank0=True)
    directory = step_dir(store, step)
    manifest = _agreed(state, lambda: _manifest_of(directory, step, unhashed=present is not None))
    expected = {e.path: (e.bytes, e.digest) for e in manifest.files} if check_complete else None
    reader = _agreed(state, lambda: RawReader(directory, expected, rank=state.rank, world=state.world_size,
                                              listed=[e.path for e in manifest.files], present=present,
                                              verified=verified, limits=limits))
    metadata = _agreed(state, lambda: reader.read_metadata().state_dict_metadata)
    groups = _agreed(state, lambda: _check_fits(state, directory, manifest, metadata, load_optimizer))
    plan = _Targets.build(state, metadata, manifest, load_optimizer, in_place, mapped or {})
    # every file's size and digest checked on the way; a failure raises everywhere
    dcp_load({k: v for k, v in plan.target.items() if k not in plan.mapped}, reader)
    plan.commit(state, manifest, groups)
    _barrier(state)
    return step


def _choose(state: CheckpointState, store: Path, iteration: int | str, check_complete: bool, run: str | None) -> int:
    if not store.is_dir():
        raise CheckpointError(f"checkpoint store {store} does not exist or is not a directory")
    if iteration != "latest":
        if isinstance(iteration, str) and iteration.strip().isdigit():
            iteration = int(iteration)
        step = integer("iteration", iteration, low=0)
        directory = step_dir(store, step)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint {directory} does not exist",
                                  hint=f"available: {[e.step for e in scan(store)] or 'none'}")
        if check_complete and not (directory / COMPLETE_FILE).is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete (no COMPLETE marker: its writer stopped)",
                                  hint="load the previous one, or pass check_complete=False at your own risk")
        if run is not None and read_run(directory) != run:
            raise CheckpointError(f"checkpoint {directory} belongs to run {read_run(directory)}, not {run}")
        return step
    if run is not None:
        found = latest(store, of_runs={run}, complete=check_complete)
        if found is None:
            raise CheckpointError(f"no {'complete ' if check_complete else ''}checkpoint of run {run} in {store}",
                                  hint=f"the store holds: {describe_runs(scan(store))}")
        return found.step
    own = latest(store, of_runs={state.run_id}, complete=check_complete)
    if own is not None:
        return own.step
    entries = [e for e in scan(store) if e.complete or not check_complete]
    groups = runs(entries)
    if not groups:
        raise CheckpointError(f"no complete checkpoint in {store}",
                              hint="checkpoints are complete once their COMPLETE marker is written")
    if len(groups) > 1:
        raise CheckpointError(f"{store} holds checkpoints of {len(groups)} runs ({describe_runs(entries)}): which "
                              f"one to resume is ambiguous", hint="name the run (load_checkpoint(..., run=ID), or "
                              "VARUNA_RUN_ID) or the step (iteration=N)")
    found = latest(entries, complete=check_complete)
    assert found is not None  # the entries hold checkpoints of one run
    return found.step


def _manifest_of(directory: Path, step: int, unhashed: bool = False) -> Manifest:
    manifest = read_manifest(directory, unhashed=unhashed)
    if manifest.step != step:
        raise CheckpointError(f"{directory}/{MANIFEST_FILE} records step {manifest.step}, but the directory is "
                              f"{directory.name}", hint="the checkpoint was moved or tampered with; load another one")
    return manifest


def _check_fits(state: CheckpointState, directory: Path, manifest: Manifest, metadata: dict,
                load_optimizer: bool) -> list:
    """Refuse a checkpoint that is not of this model (names, shapes, dtypes), whose index disagrees with its
    manifest, or whose optimizer or loss scaler cannot be restored into this run's. Returns the optimizer's
    hyper-parameters to restore, per group."""
    mine = {e.key: (list(e.shape), e.dtype) for e in _parameters(state)}
    saved = {e.key: (list(e.shape), e.dtype) for e in manifest.parameters}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} parameter(s) of this model, e.g. {_names(missing)}")
        if extra:
            parts.append(f"has {len(extra)} parameter(s) this model does not, e.g. {_names(extra)}")
        raise CheckpointError(f"{directory} is a checkpoint of another model: it {' and '.join(parts)}",
                              hint="load a checkpoint of this model (`varuna ckpt inspect` lists its tensors)")
    for key, (shape, dtype) in mine.items():
        if saved[key] != (shape, dtype):
            raise CheckpointError(f"{directory}: {key} is {saved[key][1]} {saved[key][0]} in the checkpoint, "
                                  f"{dtype} {shape} in this model", hint="load a checkpoint of this model")
    if manifest.structure_hash != state.structure_hash:
        log.warning("%s was written from a model whose structure hash differs (%s, this one %s: the model's code, "
                    "its inputs or torch changed); its parameters match by name, shape and dtype", directory,
                    manifest.structure_hash, state.structure_hash)
    wanted = [(f"model/{key}", p) for key, p in _keys(state)] + [(f"buffer/{n}", b) for n, b in _buffers(state).items()]
    for key, tensor in wanted:
        meta = metadata.get(key)
        if meta is None:
            raise CheckpointError(f"{directory}: {key} is missing from the tensors ({CHECKPOINT_INDEX})",
                                  hint="the checkpoint is incomplete or of another model")
        if tuple(meta.size) != tuple(tensor.shape) or meta.properties.dtype != tensor.dtype:
            raise CheckpointError(f"{directory}: {key} is {meta.properties.dtype} {list(meta.size)} in the tensors, "
                                  f"{tensor.dtype} {list(tensor.shape)} in this model")
    if state.loss_scaler is not None and manifest.loss_scaler:
        _check_scaler(directory, manifest.loss_scaler)
    if not load_optimizer or state.optimizer is None or not manifest.optimizer:
        return []
    return _optimizer_groups(state.optimizer, directory, manifest.optimizer)


def _names(keys: list[str]) -> str:
    return ", ".join(k.removeprefix("model/") for k in keys[:3])


def _check_scaler(directory: Path, saved: dict) -> None:
    scale, tracker = saved.get("scale"), saved.get("growth_tracker")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0 \
            or not isinstance(tracker, int) or isinstance(tracker, bool) or tracker < 0:
        raise CheckpointError(f"{directory}/{MANIFEST_FILE}: invalid loss scaler state {saved!r}")


def _optimizer_groups(optimizer: torch.optim.Optimizer, directory: Path, info: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved hyper-parameters of each optimizer group, checked against this run's optimizer: same class,
    same groups, each value of the type the optimizer holds."""
    saved_class = info.get("class")
    if saved_class != type(optimizer).__name__:
        raise CheckpointError(f"{directory} holds the state of a {saved_class} optimizer; this run's is "
                              f"{type(optimizer).__name__}", hint="load_checkpoint(..., load_optimizer=False) "
                              "loads the model and leaves the optimizer as it is")
    groups = info.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{directory}: the optimizer had {len(groups) if isinstance(groups, list) else '?'} "
                              f"parameter groups; this run's has {len(optimizer.param_groups)}",
                              hint="load_checkpoint(..., load_optimizer=False) loads the model alone")
    out = []
    for group, values in zip(optimizer.param_groups, groups, strict=True):
        if not isinstance(values, dict):
            raise CheckpointError(f"{directory}/{MANIFEST_FILE}: an optimizer group is not an object")
        updates = {}
        for key, value in values.items():
            if key not in group or key == "params":
                continue
            current = group[key]
            if not _same_kind(current, value):
                raise CheckpointError(f"{directory}/{MANIFEST_FILE}: optimizer setting {key}={value!r} does not fit "
                                      f"this optimizer's {current!r}")
            updates[key] = tuple(value) if isinstance(current, tuple) else value
        out.append(updates)
    return out


def _same_kind(current: Any, value: Any) -> bool:
    if isinstance(current, bool) or current is None:
        return type(value) is type(current)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(current, str):
        return isinstance(value, str)
    if isinstance(current, (list, tuple)):
        return isinstance(value, list) and len(value) == len(current) and all(
            _same_kind(c, v) for c, v in zip(current, value, strict=True))
    return False


def _whole_chunk(meta: Any) -> bool:
    """Whether a tensor's index entry is one chunk that covers all of it (a load then writes every byte of its
    target; a target read from several chunks, which other ranks wrote, is cleared first)."""
    chunks: list[Any] = list(getattr(meta, "chunks", None) or [])
    return (len(chunks) == 1 and not any(chunks[0].offsets)
            and tuple(chunks[0].sizes) == tuple(meta.size))


@dataclass
class _Targets:
    """New tensors that DCP fills, and where each goes once every check has passed."""

    target: dict[str, torch.Tensor]
    params: list[tuple[str, torch.nn.Parameter]]
    buffers: dict[str, torch.Tensor]
    optim: dict[int, dict[str, torch.Tensor]] | None
    rng_keys: list[str]
    mapped: set[str]  # targets that already hold their bytes (not read; a parameter's becomes its memory)

    @classmethod
    def build(cls, state: CheckpointState, metadata: dict, manifest: Manifest, load_optimizer: bool,
              in_place: bool = False, mapped: dict[str, torch.Tensor] | None = None) -> _Targets:
        target: dict[str, torch.Tensor] = {}
        mapped = mapped or {}

        def fresh(live: torch.Tensor, key: str) -> torch.Tensor:
            if key in mapped:
                return mapped[key]
            if in_place and live.is_contiguous():
                return live.detach()
            if _whole_chunk(metadata.get(key)):  # every byte is read: no need to clear it first
                return torch.empty_like(live, memory_format=torch.contiguous_format).detach()
            return torch.zeros_like(live, memory_format=torch.contiguous_format).detach()

        params, buffers = _keys(state), _buffers(state)
        optim: dict[int, dict[str, torch.Tensor]] | None = {} if load_optimizer and state.optimizer is not None \
            else None
        for key, p in params:
            target[f"model/{key}"] = fresh(p, f"model/{key}")
            piece = state.pieces.get(id(p)) if state.pieces is not None else None
            if optim is not None and (state.pieces is None or piece is not None):
                prefix = f"optim/{key}/"
                slots: dict[str, torch.Tensor] = {}
                for name, meta in metadata.items():
                    if name.startswith(prefix):
                        if piece is not None and len(meta.size) > 0:  # the box this replica's optimizer holds
                            tensor = torch.zeros(piece.param.shape, dtype=meta.properties.dtype, device=p.device)
                            target[name] = chunk(tensor, piece.offsets, meta.size)
                        elif name in mapped:
                            tensor = target[name] = mapped[name]
                        else:  # read whole from one chunk: no need to clear it (a GB of Adam moments: ~0.5 s)
                            make = torch.empty if _whole_chunk(meta) else torch.zeros
                            tensor = make(tuple(meta.size), dtype=meta.properties.dtype, device=p.device)
                            target[name] = tensor
                        slots[name[len(prefix):]] = tensor
                optim[id(p)] = slots
        for name, b in buffers.items():
            target[f"buffer/{name}"] = fresh(b, f"buffer/{name}")
        same_world = manifest.pp * manifest.dp == state.world_size
        rng_keys = [k for k in (f"rng/rank{state.rank}", f"rng_cuda/rank{state.rank}") if same_world and k in metadata]
        for key in rng_keys:
            target[key] = torch.zeros(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
        return cls(target, params, buffers, optim, rng_keys, set(mapped) & set(target))

    def commit(self, state: CheckpointState, manifest: Manifest, groups: list[dict]) -> None:
        """Move the loaded state into the live model, optimizer and RNG, and the checkpoint's iteration, seed,
        run id and loss scaler state into ``state`` for the caller to adopt (nothing here can fail on the
        checkpoint's account: it was all checked)."""
        with torch.no_grad():  # a target that is the live tensor (in_place) already holds its value
            for key, p in self.params:
                if f"model/{key}" in self.mapped:
                    p.data = self.target[f"model/{key}"]
                elif self.target[f"model/{key}"].data_ptr() != p.data_ptr():
                    p.copy_(self.target[f"model/{key}"])
            for name, b in self.buffers.items():
                if self.target[f"buffer/{name}"].data_ptr() != b.data_ptr():
                    b.copy_(self.target[f"buffer/{name}"])
        if self.optim is not None and state.optimizer is not None:  # optim: built for this run's optimizer
            for _, p in self.params:
                if state.pieces is None:
                    state.optimizer.state[p] = dict(self.optim.get(id(p), {}))
                elif id(p) in state.pieces:
                    state.optimizer.state[state.pieces[id(p)].param] = dict(self.optim.get(id(p), {}))
            for group, updates in zip(state.optimizer.param_groups, groups, strict=True):
                group.update(updates)
        for key in self.rng_keys:
            if key.startswith("rng_cuda/"):
                if state.device.type == "cuda":
                    torch.cuda.set_rng_state(self.target[key], state.device)
            else:
                torch.set_rng_state(self.target[key])
        if state.loss_scaler is not None and manifest.loss_scaler:
            state.loss_scaler = dict(manifest.loss_scaler)
        state.iteration = manifest.iteration
        state.seed = manifest.seed & MASK64
        if manifest.run_id:
            state.run_id = manifest.run_id
        state.restored = True


def _agreed(state: CheckpointState, fn: Callable[[], Any], decided_by_rank0: bool = False):
    """``fn()`` on every rank (or on rank 0 only, its value given to all, with ``decided_by_rank0``); if it
    raises a :class:`VarunaError` on any rank, every rank raises the first as a CheckpointError."""
    value, problem = None, None
    if not decided_by_rank0 or state.rank == 0:
        try:
            value = fn()
        except VarunaError as exc:
            problem = (exc.message, exc.hint)
    if state.world_size > 1:
        if decided_by_rank0:
            box = [value, problem]
            dist.broadcast_object_list(box, src=0)
            value, problem = box
            problems = [problem]
        else:
            problems = [None] * state.world_size
            dist.all_gather_object(problems, problem)
    else:
        problems = [problem]
    bad = [p for p in problems if p]
    if bad:
        raise CheckpointError(bad[0][0], hint=bad[0][1])
    return value
