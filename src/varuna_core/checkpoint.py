"""Checkpoints that load under any pipeline depth and data-parallel width, and are never half-true.

Layout of ``<store>/step_<N>/`` (see :class:`varuna_core.artifacts.Manifest`):

* ``torch.distributed.checkpoint`` files holding tensors under the model's own names: ``model/<name>`` (each
  parameter once; a tied weight under its canonical name), ``buffer/<name>``, ``optim/<name>/<state>``,
  and ``rng/rank<R>``. Because keys are names, not ranks or stages, any other partition loads them
  (DCP also spreads the writes of data-parallel replicas over the replicas);
* ``manifest.json``: step, plan, world, every file with its size and sha256, every parameter, loss scaler,
  seed, iteration and data position;
* ``COMPLETE``: written by rank 0 only after every rank reported its files finished. A crash at any point
  before leaves a directory that ``list``/``verify`` report as incomplete and ``load`` refuses; the previous
  checkpoint stays intact.

``background=True`` writes to a fast local ``tempdir`` (the only part that stalls training), then a
background thread per rank copies and hashes its files into the store; ranks report completion through the
job's key-value store and rank 0's thread writes the manifest and ``COMPLETE``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .artifacts import FileEntry, Manifest, TensorEntry
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .varuna import Varuna

__all__ = ["save", "load", "checkpoint_dirs", "latest_complete", "step_dir"]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 * 2**20
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def step_dir(store: str | os.PathLike, step: int) -> Path:
    return Path(store) / f"step_{step}"


def checkpoint_dirs(store: str | os.PathLike) -> list[tuple[int, Path, bool]]:
    """``(step, path, complete)`` of every checkpoint directory in ``store``, by step."""
    root = Path(store)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            out.append((int(match.group(1)), child, (child / "COMPLETE").is_file()))
    return sorted(out)


def latest_complete(store: str | os.PathLike) -> int | None:
    steps = [step for step, _, complete in checkpoint_dirs(store) if complete]
    return steps[-1] if steps else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------------------
# What a rank saves


def _keys(vm: "Varuna") -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters with their checkpoint names: the tied canonical name, or the first name of the
    parameter in the model (independent of the partition, so any layout finds it)."""
    canonical = {}
    for tie in vm.ties:
        for name in tie.names:
            canonical[name] = tie.canonical
    first: dict[int, str] = {}
    for name, p in vm.module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    out = []
    for name, p in vm.stage_module.param_names:
        out.append((canonical.get(name, first[id(p)]), p))
    return out


def _buffers(vm: "Varuna") -> dict[str, torch.Tensor]:
    """Persistent buffers this rank holds (a buffer replicated on several stages is saved once by DCP)."""
    persistent = set(vm.module.state_dict(keep_vars=True))
    return {name: b for name, b in vm.module.named_buffers() if name in persistent and b.device.type != "meta"}


def _state(vm: "Varuna", *, write_model: bool) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {f"rng/rank{vm.rank}": torch.get_rng_state()}
    if not write_model:
        return sd
    for key, p in _keys(vm):
        sd[f"model/{key}"] = p.detach()
        state = vm.optimizer.state.get(p, {}) if vm.optimizer is not None else {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                sd[f"optim/{key}/{name}"] = value
            elif isinstance(value, (int, float)):
                sd[f"optim/{key}/{name}"] = torch.tensor(value)
    for name, b in _buffers(vm).items():
        sd[f"buffer/{name}"] = b
    return sd


def _optimizer_info(vm: "Varuna") -> dict | None:
    if vm.optimizer is None:
        return None
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple,
                                                                              type(None)))}
              for g in vm.optimizer.param_groups]
    return {"class": type(vm.optimizer).__name__, "param_groups": groups}


def _manifest(vm: "Varuna", step: int, files: list[FileEntry]) -> Manifest:
    tied = {n: t.canonical for t in vm.ties for n in t.names}
    params, keys, objects = [], set(), set()
    for name, p in vm.module.named_parameters(remove_duplicate=False):
        key = tied.get(name)
        if key is None:
            if id(p) in objects:
                continue
            key = name
        objects.add(id(p))
        if key not in keys:
            keys.add(key)
            params.append(TensorEntry(key=f"model/{key}", shape=list(p.shape), dtype=str(p.dtype)))
    return Manifest(
        step=step, created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=type(vm.module).__name__, structure_hash=vm.structure.key, num_segments=vm.structure.num_segments,
        pp=vm.pp, dp=vm.dp, stage_to_rank_map=vm.topology.to_string(), partition=list(vm.partition.ranges),
        precision=vm.precision, iteration=vm.iteration, samples_seen=vm.iteration * vm.batch_size, seed=vm.seed,
        loss_scaler=vm.scaler.state_dict() if vm.scaler is not None else None, optimizer=_optimizer_info(vm),
        tied=[[t.canonical, *[n for n in t.names if n != t.canonical]] for t in vm.ties],
        parameters=params, plan=vm.plan.model_dump(mode="json") if vm.plan is not None else None, files=files)


def _my_files(directory: Path, rank: int) -> list[Path]:
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (directory / ".metadata").exists():
        files.append(directory / ".metadata")
    return files


def _entries(directory: Path, files: list[Path]) -> list[dict]:
    return [{"path": f.name, "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files]


# ----------------------------------------------------------------------------------------------------------
# Save


def save(vm: "Varuna", store: str | os.PathLike, *, step: int | None = None, tempdir: str | os.PathLike | None = None,
         shard: bool = True, background: bool = False, keep: int | None = None):
    """Write a checkpoint of every rank's state (collective: every rank calls it).

    Args:
        store: the global checkpoint directory (shared by all hosts).
        step: the checkpoint's number (default: the optimizer steps taken).
        tempdir: a fast local directory to write to first (needed for ``background``).
        shard: spread the tensors of data-parallel replicas over the replicas (else replica 0 writes them).
        background: return after the local write; copying to ``store`` and completing happen in a thread.
        keep: after completing, delete all but the newest ``keep`` complete checkpoints.

    Returns:
        ``None``, or with ``background`` a ``Future`` that resolves once this rank's part (and, on rank 0, the
        ``COMPLETE`` marker) is written.
    """
    if background and tempdir is None:
        raise ConfigError("background=True needs a tempdir (a fast local directory)",
                          hint="pass tempdir=/local/disk/path, or background=False")
    step = vm.iteration if step is None else int(step)
    final = step_dir(store, step)
    if vm.rank == 0:
        if final.exists():
            shutil.rmtree(final)  # a leftover of a crashed save of the same step: never mix two writes
        final.mkdir(parents=True, exist_ok=True)
    _barrier(vm)
    target = final if tempdir is None else Path(tempdir) / f"varuna_step_{step}_rank{vm.rank}"
    if tempdir is not None:
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True, exist_ok=True)
    write_model = shard or vm.replica == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the local staging copy of a background save is deleted after the copy: no need to fsync it
        writer = dcp.FileSystemWriter(target, single_file_per_rank=True, sync_files=tempdir is None)
        dcp.save(_state(vm, write_model=write_model), storage_writer=writer, process_group=None)
    if tempdir is None:
        files = _entries(final, _my_files(final, vm.rank))
        gathered = _gather(vm, files)
        if vm.rank == 0:
            _fsync_dir(final)
            _complete(vm, final, step, gathered, keep, store)
        _barrier(vm)
        return None
    # dcp.save wrote rank 0's .metadata into rank 0's local directory; each rank copies its own files
    manifest = _manifest(vm, step, [])  # taken now: training moves on while the copy runs
    kv = _kv_store(vm)
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="varuna-ckpt")
    return _executor.submit(_finish_in_background, vm.rank, vm.world_size, target, final, step, manifest, kv, keep,
                            Path(store))


def _finish_in_background(rank: int, world: int, local: Path, final: Path, step: int, manifest: Manifest, kv,
                          keep: int | None, store: Path) -> int:
    try:  # the copy must not take the CPU from training: it only has to finish before the next checkpoint
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    entries = []
    for f in _my_files(local, rank):
        shutil.copyfile(f, final / f.name)
        _fsync_file(final / f.name)
        entries.extend(_entries(final, [final / f.name]))
    _fsync_dir(final)  # durable before this rank reports done: COMPLETE and retention rely on it
    shutil.rmtree(local, ignore_errors=True)
    if kv is None:
        gathered = [entries]
    else:
        kv.set(f"varuna/ckpt/{step}/files/{rank}", json.dumps(entries))
        kv.add(f"varuna/ckpt/{step}/done", 1)
        if rank != 0:
            return step
        while int(kv.add(f"varuna/ckpt/{step}/done", 0)) < world:
            time.sleep(0.05)
        gathered = [json.loads(kv.get(f"varuna/ckpt/{step}/files/{r}").decode()) for r in range(world)]
    if rank == 0:
        files = [FileEntry(**e) for part in gathered for e in part]
        manifest.files = sorted(files, key=lambda e: e.path)
        _fsync_write(final / "manifest.json", manifest.model_dump_json(indent=2))
        _fsync_write(final / "COMPLETE", f"{step}\n")
        _fsync_dir(final)
        _retain(store, keep)
    return step


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(vm: "Varuna", final: Path, step: int, gathered: list[list[dict]], keep: int | None, store) -> None:
    files = sorted((FileEntry(**e) for part in gathered for e in part), key=lambda e: e.path)
    _fsync_write(final / "manifest.json", _manifest(vm, step, files).model_dump_json(indent=2))
    _fsync_write(final / "COMPLETE", f"{step}\n")
    _fsync_dir(final)
    _retain(Path(store), keep)


def _retain(store: Path, keep: int | None) -> None:
    if not keep:
        return
    complete = [(s, p) for s, p, ok in checkpoint_dirs(store) if ok]
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _gather(vm: "Varuna", files: list[dict]) -> list[list[dict]]:
    if vm.world_size == 1:
        return [files]
    out: list = [None] * vm.world_size
    dist.all_gather_object(out, files)
    return out


def _barrier(vm: "Varuna") -> None:
    if vm.world_size > 1:
        dist.barrier()


def _kv_store(vm: "Varuna"):
    if vm.world_size == 1:
        return None
    return dist.distributed_c10d._get_default_store()


# ----------------------------------------------------------------------------------------------------------
# Load


def load(vm: "Varuna", store: str | os.PathLike, *, iteration: int | str = "latest", check_complete: bool = True) -> int:
    """Restore parameters, buffers, optimizer state, loss scaler, iteration and RNG from a checkpoint written
    under any partition (collective). Returns the step loaded.

    Raises:
        CheckpointError: no (complete) checkpoint, a file whose size or sha256 differs, or missing tensors.
    """
    if iteration == "latest":
        step = latest_complete(store) if check_complete else max((s for s, _, _ in checkpoint_dirs(store)), default=None)
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {store}",
                                  hint="checkpoints are complete once their COMPLETE marker is written")
    else:
        step = int(iteration)
    directory = step_dir(store, step)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist",
                              hint=f"available: {[s for s, _, _ in checkpoint_dirs(store)]}")
    if check_complete and not (directory / "COMPLETE").is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete (no COMPLETE marker: its writer stopped)",
                              hint="load the previous one, or pass check_complete=False at your own risk")
    try:
        manifest = Manifest.model_validate_json((directory / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}/manifest.json is missing or invalid: {str(exc).splitlines()[0]}") from None
    if check_complete:
        _verify_files(vm, directory, manifest)
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    target: dict[str, torch.Tensor] = {}
    optim_targets: dict[int, dict[str, torch.Tensor]] = {}
    params = _keys(vm)
    missing = [f"model/{k}" for k, _ in params if f"model/{k}" not in metadata]
    if missing:
        raise CheckpointError(f"{directory} lacks {len(missing)} parameter(s) of this model, e.g. {missing[:3]}",
                              hint="it was written from another model")
    for key, p in params:
        target[f"model/{key}"] = p.detach()
        if vm.optimizer is not None:
            prefix = f"optim/{key}/"
            state = {}
            for name, meta in metadata.items():
                if name.startswith(prefix):
                    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=p.device)
                    target[name] = tensor
                    state[name[len(prefix):]] = tensor
            optim_targets[id(p)] = state
    for name, b in _buffers(vm).items():
        if f"buffer/{name}" in metadata:
            target[f"buffer/{name}"] = b
    rng_key = f"rng/rank{vm.rank}"
    same_world = manifest.pp * manifest.dp == vm.world_size
    if same_world and rng_key in metadata:
        target[rng_key] = torch.empty(tuple(metadata[rng_key].size), dtype=metadata[rng_key].properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(directory))
    if vm.optimizer is not None:
        for key, p in params:
            state = optim_targets.get(id(p))
            if state:
                vm.optimizer.state[p] = {n: (t if t.dim() or n == "step" else t) for n, t in state.items()}
        if manifest.optimizer:
            saved = manifest.optimizer.get("param_groups", [])
            for group, values in zip(vm.optimizer.param_groups, saved):
                for k, v in values.items():
                    if k in group:
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v
    if same_world and rng_key in target:
        torch.set_rng_state(target[rng_key])
    if vm.scaler is not None and manifest.loss_scaler:
        vm.scaler.load_state_dict(manifest.loss_scaler)
    vm.iteration = manifest.iteration
    vm.seed = manifest.seed
    _barrier(vm)
    return step


def _verify_files(vm: "Varuna", directory: Path, manifest: Manifest) -> None:
    """Each rank checks every ``world``-th file's size and sha256; any failure stops every rank."""
    problem = ""
    for i, entry in enumerate(manifest.files):
        if i % vm.world_size != vm.rank:
            continue
        path = directory / entry.path
        if not path.is_file():
            problem = f"{directory.name}/{entry.path}: missing"
        elif path.stat().st_size != entry.bytes:
            problem = f"{directory.name}/{entry.path}: size {path.stat().st_size} != {entry.bytes}"
        elif _sha256(path) != entry.sha256:
            problem = f"{directory.name}/{entry.path}: sha256 mismatch (file changed or corrupt)"
        if problem:
            break
    problems = [problem] if vm.world_size == 1 else [None] * vm.world_size
    if vm.world_size > 1:
        dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if bad:
        raise CheckpointError(f"refusing to load {directory}: {bad[0]}",
                              hint="run `varuna ckpt verify` on it; load an earlier checkpoint")


