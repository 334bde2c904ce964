"""Checkpoints that load under any pipeline depth and data-parallel width, and are never half-true.

Layout of ``<store>/step_<N>/`` (see :class:`varuna_core.artifacts.Manifest`):

* ``torch.distributed.checkpoint`` entries under the model's own names: ``model/<name>`` (each parameter
  once; a tied weight under its canonical name), ``buffer/<name>``, ``optim/<name>/<state>``, and
  ``rng/rank<R>`` (and ``rng_cuda/rank<R>`` on CUDA; restored when the world size is the same). Because keys are names, not ranks or stages, any other partition loads them (DCP also
  spreads the writes of data-parallel replicas over the replicas). The bytes are stored by
  :mod:`varuna_core.ckpt_storage`: ``__<rank>_0.distcp`` files of raw tensor bytes hashed while written,
  and a JSON index ``dcp_metadata.json`` (no pickle anywhere);
* ``manifest.json``: step, plan, world, every file with its size and sha256, every parameter, loss scaler,
  seed, iteration and data position;
* ``COMPLETE``: written by rank 0 only after every rank reported its files finished. A crash at any point
  before leaves a directory that ``list``/``verify`` report as incomplete and ``load`` refuses; the previous
  checkpoint stays intact.

``background=True`` writes to a fast local ``tempdir`` (the only part that stalls training), then a
background thread per rank copies its files into the store (the kernel copies; the hashes are those taken
during the local write); ranks report completion through the job's key-value store and rank 0's thread
writes the manifest and ``COMPLETE``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .artifacts import FileEntry, Manifest, TensorEntry
from .ckpt_io import copy_file
from .ckpt_storage import RawReader, RawWriter, dcp_load, dcp_save
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .varuna import Varuna

__all__ = ["save", "load", "checkpoint_dirs", "latest_complete", "step_dir"]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
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
    if vm.device.type == "cuda":
        sd[f"rng_cuda/rank{vm.rank}"] = torch.cuda.get_rng_state(vm.device)
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
    # the local staging copy of a background save is deleted after the copy: no need to fsync it
    writer = RawWriter(target, sync_files=tempdir is None)
    dcp_save(_state(vm, write_model=write_model), writer)
    files = [f.as_dict() for f in writer.files]  # hashed while written: no second pass over the bytes
    if tempdir is None:
        gathered = _gather(vm, files)
        if vm.rank == 0:
            _fsync_dir(final)
            _complete(vm, final, step, gathered, keep, store)
        _barrier(vm)
        return None
    # each rank copies its own files (rank 0's include the index) from its local directory into the store
    manifest = _manifest(vm, step, [])  # taken now: training moves on while the copy runs
    kv = _kv_store(vm)
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="varuna-ckpt")
    return _executor.submit(_finish_in_background, vm.rank, vm.world_size, target, final, step, manifest, kv, keep,
                            Path(store), files, vm.timeout)


def _finish_in_background(rank: int, world: int, local: Path, final: Path, step: int, manifest: Manifest, kv,
                          keep: int | None, store: Path, entries: list[dict], timeout: float) -> int:
    try:  # the copy must not take the CPU from training: it only has to finish before the next checkpoint
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    for entry in entries:  # O_DIRECT on both sides: the device copies, this thread barely runs
        size = copy_file(local / entry["path"], final / entry["path"], durable=True)
        if size != entry["bytes"]:
            raise CheckpointError(f"copying {entry['path']} into {final} gave {size} bytes of {entry['bytes']}",
                                  hint="is the checkpoint store full?")
    _fsync_dir(final)  # durable before this rank reports done: COMPLETE and retention rely on it
    shutil.rmtree(local, ignore_errors=True)
    if kv is None:
        gathered = [entries]
    else:
        kv.set(f"varuna/ckpt/{step}/files/{rank}", json.dumps(entries))
        kv.add(f"varuna/ckpt/{step}/done", 1)
        if rank != 0:
            return step
        deadline = time.monotonic() + timeout
        while (done := int(kv.add(f"varuna/ckpt/{step}/done", 0))) < world:
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {final} stays incomplete: {done} of {world} ranks copied their "
                                      f"files within {timeout:g}s", hint="a rank died or its copy is stuck; the "
                                      "previous complete checkpoint is still the latest")
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
    expected = {e.path: (e.bytes, e.sha256) for e in manifest.files} if check_complete else None
    reader = RawReader(directory, expected, rank=vm.rank, world=vm.world_size)
    metadata = _agreed(vm, lambda: reader.read_metadata().state_dict_metadata)
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
    same_world = manifest.pp * manifest.dp == vm.world_size
    rng_keys = [k for k in (f"rng/rank{vm.rank}", f"rng_cuda/rank{vm.rank}") if same_world and k in metadata]
    for key in rng_keys:
        target[key] = torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
    # every file's size and sha256 are checked while it is read (each by one rank); any mismatch fails all
    dcp_load(target, reader)
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
    for key in rng_keys:
        if key.startswith("rng_cuda/"):
            if vm.device.type == "cuda":
                torch.cuda.set_rng_state(target[key], vm.device)
        else:
            torch.set_rng_state(target[key])
    if vm.scaler is not None and manifest.loss_scaler:
        vm.scaler.load_state_dict(manifest.loss_scaler)
    vm.iteration = manifest.iteration
    vm.seed = manifest.seed
    _barrier(vm)
    return step


def _agreed(vm: "Varuna", fn):
    """``fn()`` on every rank; if it raises a :class:`CheckpointError` on any rank, every rank raises the first."""
    value, problem = None, None
    try:
        value = fn()
    except CheckpointError as exc:
        problem = (exc.message, exc.hint)
    problems = [problem]
    if vm.world_size > 1:
        problems = [None] * vm.world_size
        dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if bad:
        raise CheckpointError(bad[0][0], hint=bad[0][1])
    return value
