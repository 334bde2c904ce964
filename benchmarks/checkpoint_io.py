"""How fast are our checkpoints, measured against the disk they are written to?

In one invocation this script measures

1. **the disk**: in the checkpoint directory, a sequential write of a file as large as the checkpoint (32 MiB
   ``os.write`` chunks, ``os.fsync`` at the end, timed from open to after the fsync), then a sequential read of it
   after dropping its pages from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` after the fsync, no
   privileges needed; ``mincore`` confirms the pages are gone, so the output can say whether the read was cold),
   then the same read again from the page cache (hot). Also the same write repeated at once, ``--nproc`` streams
   at once, and O_DIRECT (the device without the page cache) with one and with ``--nproc`` streams. The
   reference for the verdicts is the fastest of these figures (the hot read excepted);
2. **our save and load** (``Varuna.checkpoint(store)``, synchronous, and ``Varuna.load_checkpoint(store)``) of a
   model of ``--size-mb`` MB of fp32 parameters (a stack of ``nn.Linear(4096, 4096)`` blocks with a
   ``CutPoint`` between any two and a tiny loss at the end) trained with AdamW, so that the checkpoint holds the
   parameters and both moments (3x the parameters). It runs as a ``--nproc``-stage pipeline on as many local
   processes (gloo), takes one optimizer step so that optimizer state exists, then, ``--repeats`` times, times
   the save on every rank after a barrier (the slowest rank counts) and, after dropping the page cache of every
   checkpoint file, the load, checking that the load restored every parameter and optimizer state exactly.
   Throughput = bytes of the checkpoint directory on disk / median time, reported as a % of (1);
3. **background checkpointing**: a smaller model (``--bg-size-mb``, ``nn.Linear(2048, 2048)`` blocks)
   runs ``--bg-steps`` steps without checkpoints and as many with ``checkpoint(store, tempdir=<local dir>,
   background=True)``, in alternating blocks of ``--bg-every`` steps (a checkpoint at the start of each block
   with one, after waiting for the previous checkpoint's Future; interleaving cancels the machine's drift).
   It reports the median step time without checkpoints, the time of the local write (the blocking part of the
   call), the median time of the steps that start while a background copy is in flight on some rank, and
   overhead = (steps while copying - steps without) / steps without.

Targets (from the issue): save and load throughput >= 50% of the disk's rate; background overhead <= 5% beyond
the local write. On 2 cores the overhead is within the step-to-step noise, so it is printed with a 95%
bootstrap interval and next to the CPU time the copy threads used.

    python benchmarks/checkpoint_io.py [--size-mb 600] [--nproc 2] [--dir DIR] [--json]

Everything is written to a fresh temporary directory inside ``--dir`` (default: ``runs/`` of this project, on
the project's disk; a tmpfs is refused) and removed at the end. Progress goes to stderr, the table (or with
``--json`` one JSON document) to stdout. Exit code 0 when every phase ran (whether or not a target was met),
1 when a phase failed.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from devtools.cpu import Load, wait_idle  # noqa: E402
from varuna_core import CutPoint  # noqa: E402

MB = 1e6
MIB = 2**20
TARGET_THROUGHPUT = 0.50  # of the disk's rate
TARGET_OVERHEAD = 0.05  # of the step time, beyond the local write
NOISY_CORES = 0.2  # other processes' average busy cores above which a run is flagged NOISY
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


# ----------------------------------------------------------------------------------------------------------
# The models


class LinearStack(nn.Module):
    """``n`` blocks ``x -> tanh(Linear(w, w)(x))`` with a ``CutPoint`` between any two; loss = mean(x^2)."""

    def __init__(self, n_blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n_blocks))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n_blocks - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x.pow(2).mean()


def block_bytes(width: int) -> int:
    return (width * width + width) * 4


def n_blocks_for(size_mb: float, width: int, nproc: int) -> int:
    """At least ``size_mb`` MB of parameters, a multiple of ``nproc`` blocks (equal stages)."""
    n = max(2, math.ceil(size_mb * MB / block_bytes(width)))  # at least one CutPoint
    return math.ceil(n / nproc) * nproc


def adamw_checkpoint_bytes(n_blocks: int, width: int) -> int:
    """Parameters + exp_avg + exp_avg_sq (the per-parameter ``step`` scalars and the metadata are small)."""
    return 3 * n_blocks * block_bytes(width)


# ----------------------------------------------------------------------------------------------------------
# Page cache: drop a file's pages, and count how many are resident (mincore)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(resident, total)`` pages of a file in the page cache, or None if ``mincore`` is unavailable."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    if pages == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return None
            flags = bytes(vec)
            return pages - flags.count(0), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cache(paths: list[Path]) -> dict:
    """fsync + ``POSIX_FADV_DONTNEED`` every file; returns the resident fraction before and after."""
    before = after = total = 0
    known = True
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            r = resident_pages(path)
            if r is None:
                known = False
            else:
                before += r[0]
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            r = resident_pages(path)
            if r is None:
                known = False
            else:
                after += r[0]
                total += r[1]
        finally:
            os.close(fd)
    if not known or total == 0:
        return {"resident_before": None, "resident_after": None}
    return {"resident_before": before / total, "resident_after": after / total}


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in files_under(directory))


# ----------------------------------------------------------------------------------------------------------
# Phase 1: the disk's own sequential rates


def _chunk_buffer(chunk_bytes: int) -> mmap.mmap:
    """A page-aligned buffer (usable with O_DIRECT) of incompressible bytes."""
    buf = mmap.mmap(-1, chunk_bytes)
    buf.write(os.urandom(chunk_bytes))
    return buf


def write_file(path: Path, size: int, buf: mmap.mmap, direct: bool = False) -> tuple[float, float]:
    """Write ``size`` bytes (a multiple of ``len(buf)``) sequentially, fsync; returns (seconds, fsync seconds)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(buf)
        for _ in range(size // len(buf)):
            written = 0
            while written < len(buf):
                written += os.write(fd, view[written:])
        view.release()
        t_fsync = time.perf_counter()
        os.fsync(fd)
        t1 = time.perf_counter()
    finally:
        os.close(fd)
    return t1 - t0, t1 - t_fsync


def read_file(path: Path, chunk_bytes: int, direct: bool = False) -> float:
    """Read a file sequentially into one reused buffer; returns seconds."""
    buf = mmap.mmap(-1, chunk_bytes)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    if total != os.path.getsize(path):
        raise RuntimeError(f"read {total} of {os.path.getsize(path)} bytes of {path}")
    return dt


def _parallel(fn, arg_lists: list[tuple]) -> tuple[float, list]:
    """Run ``fn(*args)`` for every args in its own thread (the I/O calls release the GIL); wall seconds."""
    results: list = [None] * len(arg_lists)
    errors: list = []

    def run(i: int) -> None:
        try:
            results[i] = fn(*arg_lists[i])
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(arg_lists))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, results


def disk_rates(directory: Path, nbytes: int, chunk_mib: int, streams: int) -> dict:
    """The disk's sequential rates for ``nbytes`` in ``directory``: through the page cache with 1 stream (write
    + fsync, then a cold read after dropping the pages, then a hot read), the same write again at once (into
    the page-cache pages the first file just freed), ``streams`` streams at once (files of ``nbytes / streams``
    written and read by as many threads), and O_DIRECT (the device without the page cache; skipped where the
    file system refuses it)."""
    out: dict = {}
    buf = _chunk_buffer(chunk_mib * MIB)
    chunk = len(buf)
    per_stream = max(1, math.ceil(nbytes / chunk / streams))
    size = per_stream * streams * chunk
    out.update(bytes=size, chunk_bytes=chunk, streams=streams)
    paths = [directory / f"disk_rate_{i}.bin" for i in range(streams)]
    try:
        # one stream through the page cache, as specified: this is what a checkpoint meets on a quiet machine
        out["write_s"], out["write_fsync_s"] = write_file(paths[0], size, buf)
        out["read_resident_before"] = drop_cache([paths[0]])["resident_after"]
        out["read_cold"] = out["read_resident_before"] is not None and out["read_resident_before"] < 0.01
        out["read_s"] = read_file(paths[0], chunk)
        out["hot_read_s"] = read_file(paths[0], chunk)
        paths[0].unlink()
        # again at once: the page cache reuses the pages just freed (no first-touch faults)
        out["rewrite_s"], _ = write_file(paths[0], size, buf)
        paths[0].unlink()
        # ``streams`` streams at once, as the ranks of a checkpoint write and read
        if streams > 1:
            out["par_write_s"], _ = _parallel(write_file, [(p, per_stream * chunk, buf) for p in paths])
            drop = drop_cache(paths)["resident_after"]
            out["par_read_cold"] = drop is not None and drop < 0.01
            out["par_read_s"], _ = _parallel(read_file, [(p, chunk) for p in paths])
            for p in paths:
                p.unlink()
        # the device without the page cache
        try:
            out["direct_write_s"], _ = write_file(paths[0], size, buf, direct=True)
            out["direct_read_s"] = read_file(paths[0], chunk, direct=True)
            paths[0].unlink()
            if streams > 1:
                out["par_direct_write_s"], _ = _parallel(write_file, [(p, per_stream * chunk, buf, True)
                                                                       for p in paths])
                out["par_direct_read_s"], _ = _parallel(read_file, [(p, chunk, True) for p in paths])
        except OSError as exc:
            out["direct_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        buf.close()
    for key in ("write", "read", "hot_read", "rewrite", "par_write", "par_read", "direct_write", "direct_read",
                "par_direct_write", "par_direct_read"):
        out[f"{key}_Bps"] = size / out[f"{key}_s"] if f"{key}_s" in out else None
    # The reference for the verdicts: the fastest figure of any method, buffered or O_DIRECT, one stream or one per
    # rank (the hot read from the page cache excepted: it does not touch the disk).
    out["ref_write_Bps"] = max(out[f"{k}_Bps"] or 0 for k in ("write", "rewrite", "par_write", "direct_write",
                                                               "par_direct_write"))
    out["ref_read_Bps"] = max(out[f"{k}_Bps"] or 0 for k in ("read", "par_read", "direct_read", "par_direct_read"))
    return out


# ----------------------------------------------------------------------------------------------------------
# Worker: python benchmarks/checkpoint_io.py --worker JOB OUT_DIR


class Timers:
    """Wall time spent inside a few library functions (wrapped in the worker process only); in helper threads
    also their CPU time (key ``thread <name> cpu``)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def reset(self) -> None:
        self.t = {}

    def wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                where = "" if threading.current_thread() is threading.main_thread() else "thread "
                self.t[where + key] = self.t.get(where + key, 0.0) + time.perf_counter() - t0
                if where:
                    cpu_key = f"{where}{key} cpu"
                    self.t[cpu_key] = self.t.get(cpu_key, 0.0) + time.thread_time() - c0

        setattr(owner, name, timed)


def worker(job_path: str, out_dir: str) -> None:
    import gc

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import varuna_core.checkpoint.saveload as ckpt
    from varuna_core import Varuna

    job = json.loads(Path(job_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    stage_map = ";".join(str(r) for r in range(world))
    work = Path(job["work"])

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    def gather(obj) -> list:
        if world == 1:
            return [obj]
        out: list = [None] * world
        dist.all_gather_object(out, obj)
        return out

    # The library's own functions, timed from outside (this process only; the library is unchanged).
    timers = Timers()
    timers.wrap(dcp, "save", "dcp_save")  # checkpoint.py calls dcp.save / dcp.load through the module
    timers.wrap(dcp, "load", "dcp_load")
    timers.wrap(ckpt, "copy_file", "copy")
    result: dict = {"rank": rank}

    # ---- phase 2: synchronous save and load of the big model
    big = job["big"]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = LinearStack(big["n_blocks"], big["width"])
    vm = Varuna(model, stage_map, {"x": torch.randn(2, big["width"])}, batch_size=big["batch"],
                chunk_size=big["chunk"], timeout=job["timeout"])
    opt = torch.optim.AdamW(vm.parameters(), lr=1e-4)
    vm.set_optimizer(opt)
    x = torch.randn(big["batch"], big["width"], generator=torch.Generator().manual_seed(1))
    vm.step(vm.replica_slice({"x": x}))
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = list(vm.parameters())
    state_bytes = sum(v.numel() * v.element_size() for p in params for v in opt.state[p].values()
                      if isinstance(v, torch.Tensor))
    result["big"] = {"setup_s": time.perf_counter() - t0, "stage": vm.stage,
                     "param_bytes": sum(p.numel() * p.element_size() for p in params), "optim_bytes": state_bytes}
    store = work / "store"
    checksum = [float(p.detach().sum()) for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    for key in ("save_s", "save_parts", "load_s", "load_parts", "drop", "restored"):
        result["big"][key] = []
    for rep in range(big["repeats"]):
        barrier()
        timers.reset()
        t0 = time.perf_counter()
        vm.checkpoint(store, step=rep)
        result["big"]["save_s"].append(time.perf_counter() - t0)
        result["big"]["save_parts"].append(dict(timers.t))
        step_path = ckpt.step_dir(store, rep)
        barrier()
        if rank == 0:  # every rank's files are in the shared store: drop them all from the page cache once
            result["big"]["ckpt_bytes"] = dir_bytes(step_path)
            result["big"]["ckpt_files"] = [[p.name, p.stat().st_size] for p in files_under(step_path)]
            result["big"]["drop"].append(drop_cache(files_under(step_path)))
        # wipe what the load must restore, so that a load that restores nothing is caught
        with torch.no_grad():
            for p in params:
                p.zero_()
        opt.state.clear()
        barrier()
        timers.reset()
        t0 = time.perf_counter()
        vm.load_checkpoint(store, iteration=rep)
        result["big"]["load_s"].append(time.perf_counter() - t0)
        result["big"]["load_parts"].append(dict(timers.t))
        after = [float(p.detach().sum()) for p in params]
        restored = after == checksum and all(
            set(opt.state.get(p, {})) == set(state[id(p)])
            and all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items()) for p in params)
        result["big"]["restored"].append(restored)
        barrier()
        if rank == 0:
            shutil.rmtree(step_path, ignore_errors=True)
    del vm, model, opt, params, x, state
    gc.collect()

    # ---- phase 3: step time with background checkpoints
    bg = job["bg"]
    torch.manual_seed(0)
    model = LinearStack(bg["n_blocks"], bg["width"])
    vm = Varuna(model, stage_map, {"x": torch.randn(2, bg["width"])}, batch_size=bg["batch"],
                chunk_size=bg["chunk"], timeout=job["timeout"])
    opt = torch.optim.AdamW(vm.parameters(), lr=1e-4)
    vm.set_optimizer(opt)
    gen = torch.Generator().manual_seed(2)
    total_steps = bg["warmup"] + 2 * bg["steps"]
    batches = [vm.replica_slice({"x": torch.randn(bg["batch"], bg["width"], generator=gen)})
               for _ in range(min(total_steps, 4))]
    bg_store, local = work / "bg_store", work / "local"
    local.mkdir(parents=True, exist_ok=True)

    def one_step(i: int) -> float:
        barrier()
        t0 = time.perf_counter()
        vm.step(batches[i % len(batches)])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for i in range(bg["warmup"]):
        one_step(i)
    # Blocks of ``every`` steps alternate: without checkpoints, then with a background checkpoint started at the
    # block's first step. Interleaving cancels the machine's drift, which is as large as the effect measured.
    base, timed, in_flight, calls = [], [], [], []
    pending = None
    timers.reset()
    for block in range(bg["steps"] // bg["every"]):
        base.extend(one_step(block * bg["every"] + j) for j in range(bg["every"]))
        for j in range(bg["every"]):
            i = block * bg["every"] + j
            if j == 0:
                wait = 0.0
                if pending is not None:
                    t0 = time.perf_counter()
                    pending.result()
                    wait = time.perf_counter() - t0
                barrier()
                t0 = time.perf_counter()
                pending = vm.checkpoint(bg_store, step=i, tempdir=local, background=True, keep=1)
                returned = time.perf_counter()
                call = {"step": i, "local_write_s": returned - t0, "wait_before_s": wait, "done_after_s": None}
                pending.add_done_callback(lambda f, c=call, r=returned: c.__setitem__("done_after_s",
                                                                                       time.perf_counter() - r))
                calls.append(call)
            in_flight.append(pending is not None and not pending.done())
            timed.append(one_step(i))
    t0 = time.perf_counter()
    if pending is not None:
        pending.result()
    final_wait = time.perf_counter() - t0
    barrier()
    result["bg"] = {"base_s": base, "timed_s": timed, "in_flight": in_flight, "calls": calls,
                    "final_wait_s": final_wait, "thread_parts": dict(timers.t),
                    "param_bytes": sum(p.numel() * p.element_size() for p in vm.parameters())}
    if rank == 0:
        done = ckpt.checkpoint_dirs(bg_store)
        result["bg"]["ckpt_bytes"] = dir_bytes(done[-1][1]) if done else 0
        result["bg"]["complete"] = [s for s, _, ok in done if ok]
    everything = gather(result)
    if rank == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps(everything))
    barrier()
    if world > 1:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Launcher


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def launch(job: dict, world: int, tmp: Path, timeout: float) -> dict:
    """Start ``world`` workers on ``job``; kill all of them if one fails or the deadline passes."""
    from varuna_core.util.procs import run_local_workers

    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    failure = run_local_workers(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path), str(tmp)], world,
        log_dir=tmp, timeout=timeout, cwd=ROOT,
        env=dict(VARUNA_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=pythonpath))
    result_path = tmp / "result.json"
    if failure is None and not result_path.exists():
        failure = "rank 0 wrote no result"
    if failure is not None:
        logs = "\n".join(f"--- rank {r} ---\n" + (tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        return {"error": failure, "logs": logs}
    return {"ranks": json.loads(result_path.read_text())}


# ----------------------------------------------------------------------------------------------------------
# Where to write


def mount_of(path: Path) -> dict:
    """The mount point, device and file-system type holding ``path`` (longest matching /proc/self/mountinfo)."""
    path = path.resolve()
    best = {"mount": "/", "device": "?", "fstype": "?"}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mnt = fields[4].replace("\\040", " ")
        if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) > best_len:
            best, best_len = {"mount": mnt, "device": rfields[1], "fstype": rfields[0]}, len(mnt)
    return best


def choose_base(requested: str | None) -> Path:
    if requested:
        base = Path(requested)
        fstype = mount_of(base)["fstype"]
        if fstype in MEMORY_FS:
            raise SystemExit(f"error: {base} is on a {fstype} (memory, not a disk); pass --dir on a real disk")
        base.mkdir(parents=True, exist_ok=True)
        return base
    for base in (ROOT / "runs", Path(tempfile.gettempdir())):
        base.mkdir(parents=True, exist_ok=True)
        if mount_of(base)["fstype"] not in MEMORY_FS:
            return base
    raise SystemExit("error: runs/ and the temp directory are both in memory (tmpfs); pass --dir on a real disk")


# ----------------------------------------------------------------------------------------------------------
# Report


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _bootstrap_overhead(base: list[float], copying: list[float], rounds: int = 2000) -> list[float] | None:
    """95% interval of (median(copying) - median(base)) / median(base), resampling both lists."""
    if len(base) < 4 or len(copying) < 4:
        return None
    import random

    rng = random.Random(0)
    draws = sorted(
        (statistics.median(rng.choices(copying, k=len(copying)))
         - (m := statistics.median(rng.choices(base, k=len(base))))) / m
        for _ in range(rounds))
    return [draws[int(0.025 * rounds)], draws[int(0.975 * rounds) - 1]]


def _median_parts(parts: list[dict]) -> dict:
    """Per key, the median over the repeats."""
    keys = sorted({k for p in parts for k in p})
    return {k: statistics.median(p.get(k, 0.0) for p in parts) for k in keys}


def build_report(args, disk: dict, mount: dict, job: dict, ranks: list[dict], elapsed: dict, other: dict) -> dict:
    big = [r["big"] for r in ranks]
    r0 = big[0]
    ckpt_bytes = r0["ckpt_bytes"]
    reps = len(r0["save_s"])
    saves = [max(b["save_s"][i] for b in big) for i in range(reps)]  # the slowest rank of each cycle counts
    loads = [max(b["load_s"][i] for b in big) for i in range(reps)]
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    save_Bps, load_Bps = ckpt_bytes / save_s, ckpt_bytes / load_s
    report = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "dir": str(args.base), **mount,
                    "other_cores": other,
                    "noisy": any(v is not None and v > NOISY_CORES for v in other.values())},
        "disk": disk,
        "checkpoint": {
            "model": {"blocks": job["big"]["n_blocks"], "width": job["big"]["width"],
                      "param_bytes": sum(b["param_bytes"] for b in big), "optimizer": "AdamW",
                      "optim_bytes": sum(b["optim_bytes"] for b in big), "nproc": len(ranks),
                      "stage_param_bytes": [b["param_bytes"] for b in big]},
            "bytes": ckpt_bytes, "files": r0["ckpt_files"],
            "repeats": reps, "save_s": save_s, "save_s_each": saves,
            "save_s_by_rank": [b["save_s"] for b in big],
            "save_Bps": save_Bps, "save_vs_disk": save_Bps / disk["ref_write_Bps"],
            "save_parts_by_rank": [_median_parts(b["save_parts"]) for b in big],
            "page_cache_before_load": r0["drop"][-1],
            "load_s": load_s, "load_s_each": loads, "load_s_by_rank": [b["load_s"] for b in big],
            "load_Bps": load_Bps, "load_vs_disk": load_Bps / disk["ref_read_Bps"],
            "load_parts_by_rank": [_median_parts(b["load_parts"]) for b in big],
            "restored": all(all(b["restored"]) for b in big),
            "setup_s_by_rank": [b["setup_s"] for b in big],
        },
    }
    bgs = [r["bg"] for r in ranks]
    n = len(bgs[0]["base_s"])
    base = [max(b["base_s"][i] for b in bgs) for i in range(n)]
    timed = [max(b["timed_s"][i] for b in bgs) for i in range(n)]
    flying = [any(b["in_flight"][i] for b in bgs) for i in range(n)]
    copying = [t for t, f in zip(timed, flying, strict=True) if f]
    quiet = [t for t, f in zip(timed, flying, strict=True) if not f]
    calls = []
    for c in range(len(bgs[0]["calls"])):
        per_rank = [b["calls"][c] for b in bgs]
        calls.append({"step": per_rank[0]["step"],
                      "local_write_s": max(p["local_write_s"] for p in per_rank),
                      "wait_before_s": max(p["wait_before_s"] for p in per_rank),
                      "copy_s_by_rank": [p["done_after_s"] for p in per_rank]})
    base_med, copy_med = _median(base), _median(copying)
    overhead = None if copy_med is None else (copy_med - base_med) / base_med
    interval = _bootstrap_overhead(base, copying)
    copy_cpu = [b["thread_parts"].get("thread copy cpu", 0.0) for b in bgs]
    local_write = _median([c["local_write_s"] for c in calls])
    waits = sum(c["wait_before_s"] for c in calls) + max(b["final_wait_s"] for b in bgs)
    report["background"] = {
        "model": {"blocks": job["bg"]["n_blocks"], "width": job["bg"]["width"],
                  "param_bytes": sum(b["param_bytes"] for b in bgs), "batch": job["bg"]["batch"],
                  "chunk": job["bg"]["chunk"]},
        "ckpt_bytes": bgs[0].get("ckpt_bytes"), "complete_steps": bgs[0].get("complete"),
        "steps": n, "every": job["bg"]["every"],
        "base_step_s": base, "ckpt_step_s": timed, "in_flight": flying,
        "base_median_s": base_med, "copying_median_s": copy_med, "quiet_median_s": _median(quiet),
        "steps_while_copying": len(copying),
        "local_write_median_s": local_write, "local_write_in_steps": local_write / base_med,
        "calls": calls, "waits_s": waits,
        "overhead": overhead, "overhead_95ci": interval,
        "copy_cpu_s_by_rank": copy_cpu,
        "copy_cpu_vs_steps": (max(copy_cpu) / (len(copying) * base_med)) if copying else None,
        "thread_parts_by_rank": [b["thread_parts"] for b in bgs],
    }
    report["verdicts"] = {
        "save": save_Bps / disk["ref_write_Bps"] >= TARGET_THROUGHPUT,
        "load": load_Bps / disk["ref_read_Bps"] >= TARGET_THROUGHPUT,
        "background": overhead is not None and overhead <= TARGET_OVERHEAD,
    }
    report["elapsed_s"] = elapsed
    return report


def _mbps(bps: float) -> str:
    return f"{bps / MB:,.0f} MB/s"


def _parts(parts: list[dict]) -> str:
    keys = sorted({k for p in parts for k in p})
    return ", ".join(f"{k} " + "/".join(f"{p.get(k, 0.0):.2f}" for p in parts) + " s" for k in keys)


def print_report(rep: dict) -> None:
    m, d, c, b = rep["machine"], rep["disk"], rep["checkpoint"], rep["background"]
    ok = {True: "PASS", False: "FAIL"}
    print(f"machine: {m['cpus']} CPUs, torch {m['torch']}; directory {m['dir']} on {m['device']} "
          f"({m['fstype']}, mounted at {m['mount']})")
    oc = m["other_cores"]
    fmt = {k: "?" if v is None else f"{v:.2f}" for k, v in oc.items()}
    print(f"other processes kept {fmt['disk']} cores busy during the disk measurement and {fmt['workers']} during "
          f"the workers' run{'  NOISY: the numbers below are not comparable' if m['noisy'] else ''}")
    cold = d["read_resident_before"]
    cold_txt = ("unknown whether cold (mincore unavailable)" if cold is None else
                f"{'cold' if d['read_cold'] else 'NOT cold'}: {cold:.1%} of its pages were in the page cache")
    print(f"\n1. disk: {d['bytes'] / MB:,.0f} MB written sequentially in {d['chunk_bytes'] // MIB} MiB chunks, "
          f"fsync at the end; read back after dropping the file's pages (posix_fadvise DONTNEED)")
    print(f"   {'':<44}{'write + fsync':>16}  {'read':>16}")

    def cell(key: str) -> str:
        s, bps = d.get(f"{key}_s"), d.get(f"{key}_Bps")
        return f"{'-':>16}" if s is None else f"{_mbps(bps):>11} {s:>4.1f}s"

    n = d["streams"]
    print(f"   {'1 stream, through the page cache':<44}{cell('write')}  {cell('read')}")
    print(f"   {'1 stream again (read: hot, from the cache)':<44}{cell('rewrite')}  {cell('hot_read')}")
    if n > 1:
        print(f"   {f'{n} streams at once (as {n} ranks write/read)':<44}{cell('par_write')}  {cell('par_read')}")
    if "direct_error" in d:
        print(f"   {'O_DIRECT (the device without the page cache)':<44}  not supported here: {d['direct_error']}")
    else:
        print(f"   {'O_DIRECT (the device without the page cache)':<44}{cell('direct_write')}  {cell('direct_read')}")
        if n > 1:
            print(f"   {f'O_DIRECT, {n} streams at once':<44}{cell('par_direct_write')}  {cell('par_direct_read')}")
    cold = d["read_resident_before"]
    cold_txt = ("unknown whether the read was cold (mincore unavailable)" if cold is None else
                f"the read was {'cold' if d['read_cold'] else 'NOT cold'}: {cold:.1%} of the file's pages were "
                f"in the page cache when it started")
    print(f"   {cold_txt}; the final fsync took {d['write_fsync_s']:.2f} s of the 1-stream write")
    if d["rewrite_Bps"] > 2 * d["write_Bps"]:
        print(f"   the same write into the pages the first file just freed is {d['rewrite_Bps'] / d['write_Bps']:.1f}x "
              f"faster: writing into never-touched memory is bound by first-touch page faults (a VM that returns free "
              f"memory to its host), not by the disk")
    print(f"   reference for the verdicts (the fastest figure above but the hot read): "
          f"write {_mbps(d['ref_write_Bps'])}, read {_mbps(d['ref_read_Bps'])}")
    md = c["model"]
    print(f"\n2. checkpoint of {md['blocks']} x Linear({md['width']}, {md['width']}) = "
          f"{md['param_bytes'] / MB:,.0f} MB fp32 parameters + AdamW state {md['optim_bytes'] / MB:,.0f} MB, "
          f"{md['nproc']}-stage pipeline on {md['nproc']} processes")
    print(f"   on disk: {c['bytes'] / MB:,.0f} MB in {len(c['files'])} files "
          f"({', '.join(f'{n} {s / MB:,.0f} MB' for n, s in c['files'] if s > MB)})")
    rows = [
        ("save  checkpoint(store)", c["save_s"], c["save_s_each"], c["save_Bps"], c["save_vs_disk"], "write",
         _parts(c["save_parts_by_rank"])),
        ("load  load_checkpoint(store)", c["load_s"], c["load_s_each"], c["load_Bps"], c["load_vs_disk"], "read",
         _parts(c["load_parts_by_rank"])),
    ]
    print(f"   {c['repeats']} save/load cycles; time = the slowest rank's, median over the cycles")
    print(f"   {'':<30}{'median':>9}  {'each cycle':>18}  {'throughput':>12}  {'vs disk':>14}")
    nranks = len(c["save_s_by_rank"])
    for name, t, each, bps, frac, kind, parts in rows:
        print(f"   {name:<30}{t:>7.2f} s  {'/'.join(f'{x:.2f}' for x in each):>16} s  {_mbps(bps):>12}  "
              f"{frac:>7.0%} {kind:<6}")
        print(f"   {'':<30}inside (rank " + "/".join(str(i) for i in range(nranks)) + f", medians): {parts}")
    pc = c["page_cache_before_load"]
    if pc["resident_after"] is not None:
        print(f"   page cache before the load: {pc['resident_before']:.0%} of the checkpoint's pages resident after "
              f"the save, {pc['resident_after']:.1%} after dropping them")
    print(f"   restored parameters and optimizer state: {'yes' if c['restored'] else 'NO'}")
    bm = b["model"]
    print(f"\n3. background checkpoints: {bm['blocks']} x Linear({bm['width']}, {bm['width']}) = "
          f"{bm['param_bytes'] / MB:,.0f} MB parameters, checkpoint {(b['ckpt_bytes'] or 0) / MB:,.0f} MB, "
          f"batch {bm['batch']} in micro-batches of {bm['chunk']}; {b['steps']} steps without and {b['steps']} with "
          f"checkpoints, in alternating blocks of {b['every']} steps (checkpoint(background=True) at the start of "
          f"each block with)")
    print(f"   median step without checkpoints         {b['base_median_s'] * 1e3:8.0f} ms")
    writes = ", ".join(f"{x['local_write_s'] * 1e3:.0f}" for x in b["calls"])
    print(f"   local write (blocking part of the call) {b['local_write_median_s'] * 1e3:8.0f} ms  "
          f"(= {b['local_write_in_steps']:.1f} steps; per call: {writes} ms)")
    copies = ", ".join("/".join("?" if s is None else f"{s:.2f}" for s in x["copy_s_by_rank"]) for x in b["calls"])
    print(f"   background copy until the Future resolved, per call (rank 0/1/..): {copies} s")
    if b["copying_median_s"] is None:
        print("   no step started while a copy was in flight (the copies finished during the blocking call)")
    else:
        print(f"   median step while a copy is in flight   {b['copying_median_s'] * 1e3:8.0f} ms  "
              f"({b['steps_while_copying']} of {b['steps']} steps)")
        if b["quiet_median_s"] is not None:
            print(f"   median of the other checkpointed steps  {b['quiet_median_s'] * 1e3:8.0f} ms")
        ci = b["overhead_95ci"]
        print(f"   overhead beyond the local write         {b['overhead']:+8.1%}"
              + (f"  (95% interval {ci[0]:+.1%} .. {ci[1]:+.1%}: the machine's step-to-step noise)" if ci else ""))
        if b["copy_cpu_vs_steps"] is not None:
            print(f"   CPU the copy threads used: {', '.join(f'{c:.2f}' for c in b['copy_cpu_s_by_rank'])} s in all "
                  f"(rank 0/1/..) = {b['copy_cpu_vs_steps']:.1%} of one core over the steps they overlapped")
    print(f"   waits for the previous checkpoint (and the last one at the end): {b['waits_s']:.2f} s in total")
    ranks = "/".join(str(i) for i in range(len(b["thread_parts_by_rank"])))
    print(f"   inside the calls and the copy threads (rank {ranks}): {_parts(b['thread_parts_by_rank'])}")
    print(f"   step times without (ms): {' '.join(f'{t * 1e3:.0f}' for t in b['base_step_s'])}")
    print("   step times with    (ms): "
          + " ".join(f"{t * 1e3:.0f}{'*' if f else ''}" for t, f in zip(b["ckpt_step_s"], b["in_flight"], strict=True))
          + "   (* = a copy was in flight when the step started)")
    v = rep["verdicts"]
    print("\nverdicts (targets from the issue):")
    print(f"   save throughput >= {TARGET_THROUGHPUT:.0%} of the disk's write rate: {ok[v['save']]} "
          f"({c['save_vs_disk']:.0%})")
    print(f"   load throughput >= {TARGET_THROUGHPUT:.0%} of the disk's read rate:  {ok[v['load']]} "
          f"({c['load_vs_disk']:.0%}{'' if d['read_cold'] else '; the reference read was not cold'})")
    ov = "n/a" if b["overhead"] is None else f"{b['overhead']:+.1%}"
    waited = (f"; training also waited {b['waits_s']:.2f} s for copies still running at the next checkpoint"
              if b["waits_s"] > 0.01 else "")
    print(f"   background overhead <= {TARGET_OVERHEAD:.0%} beyond the local write:  "
          f"{ok[v['background']]} ({ov}{waited})")
    e = rep["elapsed_s"]
    idle = f"waiting for an idle machine {e['waited_idle']:.0f} s, " if e["waited_idle"] else ""
    print(f"\nelapsed: {idle}"
          f"disk {e['disk']:.0f} s, workers {e['workers']:.0f} s, total {e['total']:.0f} s")


# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=float, default=600, help="MB of fp32 parameters of the save/load model "
                   "(rounded up to whole Linear(4096, 4096) blocks, a multiple of --nproc)")
    p.add_argument("--nproc", type=int, default=2, help="pipeline stages = local processes")
    p.add_argument("--dir", default=None, help="where to create the temporary directory (default: runs/ of this "
                   "project, or the system temp dir; never a tmpfs)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--chunk-mib", type=int, default=32, help="write/read chunk of the disk measurement (8-64)")
    p.add_argument("--repeats", type=int, default=3, help="save/load cycles of the big model (the median counts)")
    p.add_argument("--bg-size-mb", type=float, default=200, help="MB of parameters of the background-checkpoint "
                   "model (Linear(2048, 2048) blocks)")
    p.add_argument("--bg-steps", type=int, default=48, help="steps without, and as many with, checkpoints")
    p.add_argument("--bg-every", type=int, default=6, help="background checkpoint every this many steps")
    p.add_argument("--bg-batch", type=int, default=64, help="global batch of the background model")
    p.add_argument("--bg-chunk", type=int, default=16, help="micro-batch size of the background model")
    p.add_argument("--timeout", type=float, default=300, help="seconds the workers may take")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS", help="first wait up to this long "
                   "until other processes keep fewer than 0.2 cores busy")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="copy the workers' logs and results here")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if not 8 <= args.chunk_mib <= 64:
        raise SystemExit("error: --chunk-mib must be between 8 and 64")
    t_start = time.perf_counter()
    args.base = choose_base(args.dir)
    mount = mount_of(args.base)
    width, bg_width = 4096, 2048
    job = {
        "timeout": args.timeout,
        "big": {"n_blocks": n_blocks_for(args.size_mb, width, args.nproc), "width": width,
                "batch": 4 * args.nproc, "chunk": 1, "repeats": args.repeats},
        "bg": {"n_blocks": n_blocks_for(args.bg_size_mb, bg_width, args.nproc), "width": bg_width,
               "batch": args.bg_batch, "chunk": args.bg_chunk, "steps": args.bg_steps, "every": args.bg_every,
               "warmup": 2},
    }
    expect = adamw_checkpoint_bytes(job["big"]["n_blocks"], width)
    free = shutil.disk_usage(args.base).free
    if free < 1.5 * expect:
        raise SystemExit(f"error: {args.base} has {free / MB:,.0f} MB free; the run needs about "
                         f"{1.5 * expect / MB:,.0f} MB (a smaller --size-mb, or --dir elsewhere)")
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.base))
    job["work"] = str(work)
    try:
        log(f"[checkpoint_io] working in {work} ({mount['fstype']} on {mount['device']})")
        waited = wait_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
        log(f"[checkpoint_io] 1/3 disk: write + read {expect / MB:,.0f} MB")
        t0, load = time.perf_counter(), Load()
        disk = disk_rates(work, expect, args.chunk_mib, args.nproc)
        t_disk, load_disk = time.perf_counter() - t0, load.other_cores()
        log(f"[checkpoint_io]     write {_mbps(disk['ref_write_Bps'])}, read {_mbps(disk['ref_read_Bps'])} "
            f"({'cold' if disk['read_cold'] else 'not cold'})")
        log(f"[checkpoint_io] 2/3 + 3/3 on {args.nproc} processes: save/load of "
            f"{job['big']['n_blocks']} x Linear({width}, {width}) with AdamW, then background checkpoints")
        t0, load = time.perf_counter(), Load()
        out = launch(job, args.nproc, work, args.timeout)
        t_workers, load_workers = time.perf_counter() - t0, load.other_cores()
        if args.keep_logs:
            keep = Path(args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            for f in list(work.glob("rank*.log")) + list(work.glob("*.json")):
                shutil.copy(f, keep / f.name)
        if "error" in out:
            log(f"[checkpoint_io] the workers failed: {out['error']}\n{out['logs']}")
            return 1
        elapsed = {"waited_idle": waited, "disk": t_disk, "workers": t_workers,
                   "total": time.perf_counter() - t_start}
        other = {"disk": load_disk, "workers": load_workers}
        report = build_report(args, disk, mount, job, out["ranks"], elapsed, other)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_report(report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
