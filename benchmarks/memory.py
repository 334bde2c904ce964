"""Peak memory per rank at start-up and during training, ours vs DeepSpeed and torch pipelining, at pp=4; and with
``--dp D`` at pp=2 x dp=D, ours with and without a sharded optimizer (ZeRO-1) vs DeepSpeed with ZeRO stage 0 and 1.

Two parts, in one invocation:

1. **Side by side.** One GPT of the example family (``examples/gpt/model.py``; >= 1 GB of fp32 parameters by
   default), 4 pipeline stages on 4 local processes (gloo, one thread each), built and trained for ``--steps``
   steps by each contender in fresh processes:

       ours-cpu       GPT(cfg) on CPU, then Varuna(model, "0;1;2;3", ...)            (every rank builds it all)
       ours-meta      with varuna_core.meta_init(): GPT(cfg), then the same Varuna(...) (each rank its stage)
       ours-weights   the same as ours-meta + Varuna(..., weights=DIR) (a sharded safetensors directory)
       deepspeed      deepspeed.pipe.PipelineModule of LayerSpecs (each rank builds its layers) + train_batch
       torch-meta     torch.distributed.pipelining: this rank's stage built on meta, to_empty(), initialised

   Each rank records its resident set right after ``import torch`` (the baseline), its peak from process start
   until the model is ready to train (``VmHWM`` after ``Varuna(...)``/engine/schedule and optimizer
   construction: the *start-up* peak), then resets the high-water mark (``/proc/self/clear_refs``) and records
   the peak over the training steps (the *training* peak). Peaks are shown in MB and as a fraction of the whole
   model's fp32 parameter bytes. Target: start-up peak minus baseline <= 0.35x the model at pp=4.

2. **Largest model under a cap.** For each contender, the largest ``n_layer`` (at width ``--search-n-embd``; a
   multiple of 4, so that every stage gets the same number of blocks) that trains ``--steps`` steps with every
   rank under ``--cap-mb``. The cap is cgroup v2 ``memory.max`` on each worker where the machine has a cgroup v2 memory
   controller that root may use; otherwise each rank's measured peak RSS is compared with the cap (and a worker
   stops itself as soon as its RSS passes it). The search starts from an estimate (the side-by-side peaks,
   scaled), gallops with doubling increments until a run does not fit, then bisects to one stage's worth of
   layers. ``--seq`` runs it at a long sequence, where activations dominate and the ``varuna`` schedule's
   recompute should let ours fit more than the peers' 1F1B.

**Data parallelism** (``--dp D``, D > 1): the layout becomes pp=2 x dp=D on 2·D processes, placed as
``Topology.clustered`` places them (stage ``s`` on ranks ``s, s+2, s+4, ...``: ``"0,2;1,3"`` at dp=2), the same
map for every contender (DeepSpeed gets it as a ``ProcessTopology`` with axes ``data, pipe``), and the global
batch is D x (micro-batch x micro-batches), each replica training its slice. Two more contenders shard the
optimizer state over a stage's replicas:

       ours-sharded     ours-meta with Varuna(..., shard_optimizer=True)
       deepspeed-zero1  the deepspeed contender with "zero_optimization": {"stage": 1}

and ``ours-meta`` and ``deepspeed`` (ZeRO stage 0) are their unsharded baselines (the default contenders at
dp > 1; torch-meta runs at dp=1 only). Every rank also reports its optimizer-state bytes (the tensors in
``optimizer.state``, see :func:`state_bytes`). Targets: ours-sharded's state per rank is 1/dp of ours-meta's
(within one 25 MB bucket), its training peak is below deepspeed-zero1's, and under a cap it fits more layers
than ours-meta and at least as many as deepspeed-zero1.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory.py                # ~10 min, tables on stdout
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory.py --quick        # ~2 min, a 200 MB model
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory.py --only search --seq 1024 --search-n-embd 256 --cap-mb 600
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory.py --dp 2 --install-deepspeed   # pp=2 x dp=2, ZeRO-1

The script doubles as its own worker (``--worker SPEC OUT``, internal).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling benchmark whose launch and DeepSpeed helpers this one reuses
    sys.path.insert(0, str(HERE))

from pipeline_vs_peers import (  # noqa: E402 - found through the sys.path entry above
    DS_INSTALL,
    GPT_DIR,
    ROOT,
    install_deepspeed,
    log,
    pip_command,
)

from varuna_core.ir.topology import Topology  # noqa: E402
from varuna_core.util.procs import run_workers  # noqa: E402

PP_ALONE = 4  # pipeline stages without data parallelism (--dp 1)
PP_WITH_DP = 2  # pipeline stages with --dp D > 1: pp=2 x dp=D
DEEPSPEED = "deepspeed"
DEEPSPEED_ZERO1 = "deepspeed-zero1"
ZERO_STAGE = {DEEPSPEED: 0, DEEPSPEED_ZERO1: 1}  # DeepSpeed's pipeline engine allows stages 0 and 1 only
CONTENDERS: dict[str, str] = {
    "ours-cpu": "ours, built on CPU",
    "ours-meta": "ours, built on meta",
    "ours-weights": "ours, meta + weights per stage",
    "ours-sharded": "ours, meta + sharded optimizer",
    DEEPSPEED: "DeepSpeed PipelineModule (LayerSpec)",
    DEEPSPEED_ZERO1: "DeepSpeed PipelineModule, ZeRO-1",
    "torch-meta": "torch pipelining, meta-built stage",
}
OURS = [c for c in CONTENDERS if c.startswith("ours-")]
SHARDED = ("ours-sharded", DEEPSPEED_ZERO1)  # they shard over replicas: --dp > 1 only
DP1_ONLY = ("torch-meta",)  # a pipeline without data parallelism here
DEFAULT_DP1 = [c for c in CONTENDERS if c not in SHARDED]  # --dp 1
DEFAULT_DP = ["ours-meta", "ours-sharded", DEEPSPEED, DEEPSPEED_ZERO1]  # --dp > 1: sharded and unsharded
TARGET_STARTUP = 0.35  # start-up peak above the baseline, as a fraction of the whole model, at pp=4
# Varuna's default bucket_mb: the sharded state may differ from 1/dp of the whole by at most this much, and
# DeepSpeed's reduce and all-gather buckets get the same size (its default is 5e8 elements = 2 GB in fp32). They
# reach ZeRO-1's reduction; the pipeline engine's stage-0 all-reduce passes its own MEMORY_OPT_ALLREDUCE_SIZE (5e8).
BUCKET_MB = 25.0
OVER_CAP_EXIT = 75  # a worker's exit code when its own watch saw its RSS pass the cap (measured mode)
MB = 2**20
SHARD_BYTES = 256 * MB  # shard size of the weights directory written for ours-weights
# (default, --quick) of the flags that --quick changes
PRESETS: dict[str, tuple[Any, Any]] = {
    "n_layer": (24, 16), "n_embd": (1024, 512), "n_head": (16, 8), "search_n_embd": (512, 256),
    "cap_mb": (1000.0, 500.0), "max_probes": (5, 2),
}
SEARCH_DEFAULT = [c for c in CONTENDERS if c != "ours-weights"]  # its training memory is ours-meta's
SEARCH_QUICK = [c for c in SEARCH_DEFAULT if c != "ours-cpu"]  # its answer is the whole model on every rank
# What a rank holds above the baseline whatever the model's size (gloo, the runtimes' own state, libraries
# loaded after torch): a 0.2M-parameter GPT peaks 105-140 MB above the baseline. Only for the search's first guess.
FIXED_MB = 100.0


# ----------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Peak memory per rank at start-up and during training (pp=4; pp=2 x dp=D with --dp D), ours vs "
        "DeepSpeed and torch pipelining, and the largest model each trains under a per-rank memory cap.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="a ~200 MB model (n_layer 16, n_embd 512), a search at width 256 under --cap-mb 500 with at "
                   "most 2 runs per contender, without ours-cpu")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas: 1 = pp=4 on 4 processes; D > 1 = pp=2 x dp=D on 2*D processes "
                   "(stage s on ranks s, s+2, ...), a global batch of D x micro-batch x micro-batches, and the "
                   f"sharded contenders ({', '.join(SHARDED)})")
    p.add_argument("--n-layer", type=int, default=None, help="blocks of the side-by-side GPT (default 24; quick 16)")
    p.add_argument("--n-embd", type=int, default=None, help="width (default 1024; quick 512)")
    p.add_argument("--n-head", type=int, default=None, help="attention heads (default 16; quick 8)")
    p.add_argument("--block-size", type=int, default=32, help="sequence length of the side-by-side runs")
    p.add_argument("--microbatch-size", type=int, default=1, help="examples per micro-batch")
    p.add_argument("--microbatches", type=int, default=4,
                   help="micro-batches per step and replica (>= the stages, torch's 1F1B needs it)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw: 2 state tensors per parameter (created at the first step); sgd: none")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--schedule", choices=("varuna", "1f1b", "gpipe"), default="varuna", help="ours' schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated subset of: {', '.join(CONTENDERS)} (default with --dp 1: "
                   f"{', '.join(DEFAULT_DP1)}; with --dp > 1: {', '.join(DEFAULT_DP)})")
    p.add_argument("--only", choices=("side-by-side", "search"), default=None, help="run one part only")
    p.add_argument("--cap-mb", type=float, default=None, help="per-rank memory cap of the search (default 1000; "
                   "quick 500)")
    p.add_argument("--cap-mode", choices=("auto", "cgroup", "measured"), default="auto",
                   help="cgroup: cgroup v2 memory.max per worker (error if unavailable); measured: compare each "
                   "rank's peak RSS with the cap; auto: cgroup where possible, else measured")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length of the search (default: --block-size); long ones make activations dominate")
    p.add_argument("--search-n-embd", type=int, default=None,
                   help="width of the searched models (default 512; quick 256): one more block per stage costs a "
                   "rank 16 bytes per parameter with AdamW, 12.6 MB x 4 at width 512, so the answer is fine-grained")
    p.add_argument("--search-contenders", default=None,
                   help="contenders of the search (default: --contenders without ours-weights, whose training memory "
                   "is ours-meta's; --quick: without ours-cpu either)")
    p.add_argument("--search-start", type=int, default=None,
                   help="first n_layer probed (default: estimated from the side-by-side peaks, else 8)")
    p.add_argument("--max-probes", type=int, default=None, help="runs per contender in the search (default 5; "
                   "quick 2)")
    p.add_argument("--max-layers", type=int, default=256, help="largest n_layer the search tries")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run (all its processes) may take")
    p.add_argument("--install-deepspeed", action="store_true",
                   help="pip-install DeepSpeed first if it is missing (DS_BUILD_OPS=0, torch pinned as installed)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--keep-logs", metavar="DIR", default=None, help="keep worker specs, logs and results in DIR")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for name, (default, quick) in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    if args.dp < 1:
        p.error(f"--dp must be >= 1, got {args.dp}")
    args.pp = pp_for(args.dp)
    try:
        args.contender_list = _contender_list(args.contenders or ",".join(DEFAULT_DP1 if args.dp == 1 else DEFAULT_DP))
        default = SEARCH_QUICK if args.quick else SEARCH_DEFAULT
        args.search_list = (_contender_list(args.search_contenders) if args.search_contenders else
                            [c for c in args.contender_list if c in default] or args.contender_list)
    except ValueError as e:
        p.error(str(e))
    args.seq = args.block_size if args.seq is None else args.seq
    error = _check_args(args)
    if error:
        p.error(error)
    return args


def _contender_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown or not names:
        raise ValueError(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    return list(dict.fromkeys(names))


def pp_for(dp: int) -> int:
    """The pipeline depth of a run with ``dp`` replicas: 4 alone, 2 with data parallelism."""
    return PP_ALONE if dp == 1 else PP_WITH_DP


def rank_map(pp: int, dp: int) -> str:
    """The stage-to-rank map every contender runs on: ``Topology.clustered`` (``"0,2;1,3;"`` at pp=2 x dp=2)."""
    return Topology.clustered(pp, dp).to_string()


def coords(rank: int, pp: int) -> tuple[int, int]:
    """(stage, replica) of ``rank`` in :func:`rank_map`'s layout (rank = replica * pp + stage)."""
    return rank % pp, rank // pp


def _check_args(args: argparse.Namespace) -> str | None:
    """Why the flags cannot describe a balanced run of ``args.pp`` stages x ``args.dp`` replicas, or None."""
    pp, chosen = args.pp, dict.fromkeys(args.contender_list + args.search_list)
    if args.dp == 1 and any(c in SHARDED for c in chosen):
        return f"{', '.join(c for c in chosen if c in SHARDED)} shard over replicas: give --dp 2 or more"
    if args.dp > 1 and any(c in DP1_ONLY for c in chosen):
        return f"{', '.join(c for c in chosen if c in DP1_ONLY)} runs without data parallelism here: drop it or --dp"
    if args.n_layer < pp or args.n_layer % pp:
        return f"--n-layer must be a positive multiple of {pp} (the same number of blocks on every stage)"
    for flag, width in (("--n-embd", args.n_embd), ("--search-n-embd", args.search_n_embd)):
        if width < 1 or width % args.n_head:
            return f"{flag} ({width}) must be a positive multiple of --n-head ({args.n_head})"
    if args.microbatches < pp:
        return f"--microbatches must be at least {pp} (torch's Schedule1F1B requires M >= stages)"
    if min(args.steps, args.microbatch_size, args.block_size, args.seq, args.max_probes) < 1:
        return "--steps, --microbatch-size, --block-size, --seq and --max-probes must be >= 1"
    if args.cap_mb <= 0:
        return "--cap-mb must be positive"
    if args.search_start is not None and args.search_start < 1:
        return "--search-start must be >= 1"
    if args.max_layers < pp:
        return f"--max-layers must be at least {pp}"
    return None


# ----------------------------------------------------------------------------------------------------------
# Resident set: /proc/self/status, the high-water mark and a watch thread


def parse_status(text: str) -> dict[str, int]:
    """``/proc/<pid>/status`` -> ``{field: kB}`` for its ``kB`` lines (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+):\s+(\d+)\s+kB\s*", line)
        if m:
            out[m[1]] = int(m[2])
    return out


def read_status() -> dict[str, int]:
    try:
        with open("/proc/self/status") as f:
            return parse_status(f.read())
    except OSError:
        return {}


def status_mb(fields: str | tuple[str, ...], status: dict[str, int] | None = None) -> float | None:
    """The sum of ``fields`` of this process's status in MB (None where /proc lacks one)."""
    status = read_status() if status is None else status
    names = (fields,) if isinstance(fields, str) else fields
    if any(n not in status for n in names):
        return None
    return sum(status[n] for n in names) / 1024


def peak_mb() -> float:
    """Peak resident set since start or the last :func:`reset_peak` (VmHWM; ru_maxrss where /proc is missing)."""
    value = status_mb("VmHWM")
    if value is None:
        import resource

        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return value


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (``5`` into ``/proc/self/clear_refs``, Linux >= 4.0): the training peak
    is then the training's own, not the start-up's. False where not permitted (the watch's peaks stand in)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssWatch(threading.Thread):
    """Samples this process's RSS every ``interval`` s: the peak of the anonymous part (VmHWM has only the
    total, which counts mapped files such as safetensors shards too) and, with a ``cap_mb``, stops the process
    with :data:`OVER_CAP_EXIT` as soon as its RSS passes the cap, after writing why to ``marker``: without a
    cgroup to enforce the cap, a run that cannot fit should not run on to its end (or take the machine's memory).
    """

    def __init__(self, cap_mb: float | None = None, marker: str | None = None, interval: float = 0.01) -> None:
        super().__init__(daemon=True, name="rss-watch")
        self.cap_mb, self.marker, self.interval = cap_mb, marker, interval
        self.phase = "start-up"
        self.peak_anon_mb = 0.0
        self.peak_rss_mb = 0.0

    def run(self) -> None:
        while True:
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        status = read_status()
        rss, anon = status_mb("VmRSS", status), status_mb(("RssAnon", "RssShmem"), status)
        if rss is None:
            return
        self.peak_rss_mb = max(self.peak_rss_mb, rss)
        self.peak_anon_mb = max(self.peak_anon_mb, anon or 0.0)
        if self.cap_mb is not None and rss > self.cap_mb:
            if self.marker:  # written whole or not at all: the launcher may kill this rank as another one stops
                tmp = f"{self.marker}.tmp"
                Path(tmp).write_text(json.dumps({"rss_mb": rss, "cap_mb": self.cap_mb, "phase": self.phase}))
                os.replace(tmp, self.marker)
            os._exit(OVER_CAP_EXIT)

    def reset(self, phase: str) -> None:
        """Start the peaks of a new phase from the current values."""
        self.phase = phase
        self.peak_anon_mb = self.peak_rss_mb = 0.0
        self.sample()


# ----------------------------------------------------------------------------------------------------------
# Worker: one rank of one contender


@dataclass
class Job:
    """What every contender's set-up needs: the spec, this rank, the data and the model config."""

    spec: dict
    rank: int
    ds: Any
    cfg: Any

    @property
    def pp(self) -> int:
        return self.spec["pp"]

    @property
    def dp(self) -> int:
        return self.spec["dp"]

    @property
    def stage(self) -> int:
        return coords(self.rank, self.pp)[0]

    @property
    def replica(self) -> int:
        return coords(self.rank, self.pp)[1]

    @property
    def k(self) -> int:
        """Blocks per stage."""
        return self.spec["n_layer"] // self.pp

    @property
    def replica_batch(self) -> int:
        """Examples per step and replica (micro-batches x micro-batch size)."""
        return self.spec["microbatches"] * self.spec["microbatch_size"]

    @property
    def batch_size(self) -> int:
        """The global batch: every replica's examples."""
        return self.dp * self.replica_batch

    def make_optimizer(self, params: list):
        import torch

        if self.spec["optimizer"] == "sgd":
            return torch.optim.SGD(params, lr=self.spec["lr"])
        return torch.optim.AdamW(params, lr=self.spec["lr"])


def worker(spec_path: str, out_path: str) -> None:
    """One rank: baseline after ``import torch``, build (start-up peak), train ``steps`` steps (training peak).

    Any error is written to ``out_path`` as ``{"error": ...}`` (one line) before the process exits with 1, so
    that the launcher can show why a contender failed.
    """
    spec = json.loads(Path(spec_path).read_text())
    import torch

    baseline_mb = status_mb("VmRSS") or peak_mb()
    watch = RssWatch(spec.get("watch_cap_mb"), out_path + ".overcap")
    watch.start()
    try:
        result = _worker_run(spec, watch, torch)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then the process ends
        lines = str(e).strip().splitlines()
        Path(out_path).write_text(json.dumps({"error": f"{type(e).__name__}: {lines[0] if lines else ''}".strip()}))
        sys.stderr.write(f"rank {os.environ.get('RANK')}: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: the other ranks may hold this one in a collective at teardown
    result["baseline_mb"] = baseline_mb
    Path(out_path).write_text(json.dumps(result))
    import torch.distributed as dist

    dist.destroy_process_group()


def _worker_run(spec: dict, watch: RssWatch, torch) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPTConfig

    rank = int(os.environ["RANK"])
    _init_process_group(spec["contender"], rank, spec["pp"] * spec["dp"], float(spec["timeout"]))
    ds = CharDataset.load()
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=spec["block_size"], n_layer=spec["n_layer"],
                    n_head=spec["n_head"], n_embd=spec["n_embd"], dropout=0.0)
    job = Job(spec=spec, rank=rank, ds=ds, cfg=cfg)
    t0 = time.perf_counter()
    step, stage_params, optimizer_state = SETUPS[spec["contender"]](job)
    setup_s = time.perf_counter() - t0
    dist.barrier()
    startup = {"startup_peak_mb": peak_mb(), "startup_anon_peak_mb": watch.peak_anon_mb,
               "ready_rss_mb": status_mb("VmRSS")}
    hwm_reset = reset_peak()
    watch.reset("training")
    losses, t1 = [], time.perf_counter()
    for i in range(spec["steps"]):  # every rank draws the global batch; a contender's step trains its replica's slice
        gen = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + i)
        losses.append(step(ds.get_batch("train", job.batch_size, spec["block_size"], gen)))
    dist.barrier()
    train_peak = peak_mb() if hwm_reset else max(watch.peak_rss_mb, status_mb("VmRSS") or 0.0)
    return {
        "rank": rank, "stage": job.stage, "replica": job.replica, "contender": spec["contender"], **startup,
        "optimizer_state_bytes": optimizer_state(),
        "train_peak_mb": train_peak, "train_anon_peak_mb": watch.peak_anon_mb, "hwm_reset": hwm_reset,
        "stage_params": stage_params, "losses": losses, "setup_s": setup_s, "train_s": time.perf_counter() - t1,
        "torch": torch.__version__,
    }


def _init_process_group(contender: str, rank: int, world: int, timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    if contender in ZERO_STAGE:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported; without it, it looks for a GPU
        import deepspeed

        deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=timeout), verbose=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))


def ours_partition(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Our segments per stage for the split every contender uses: stage 0 = embeddings + blocks[:k], stage s =
    blocks[s*k:(s+1)*k], the last stage also ln_f + head (segment 0 is the embedding, segment i block i-1, the
    last segment the last block + ln_f + lm_head; see examples/gpt/model.py)."""
    k = n_layer // pp
    return [(0, k + 1)] + [(s * k + 1, (s + 1) * k + 1) for s in range(1, pp)]


def deepspeed_parts(n_layer: int, pp: int) -> list[int]:
    """DeepSpeed's ``PipelineModule.parts`` for the same split, over its layers [embeddings, blocks..., head]."""
    k = n_layer // pp
    return [0] + [s * k + 1 for s in range(1, pp)] + [n_layer + 2]


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state: every tensor of more than 0 dimensions in ``optimizer.state``'s values
    (AdamW's ``exp_avg`` and ``exp_avg_sq``; not the 0-d ``step``)."""
    import torch

    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _setup_ours(job: Job, how: str):
    """(step, stage parameters, optimizer-state bytes) of ours: the GPT built on CPU or on meta (+ weights), then
    Varuna(...); ``how`` "sharded" is "meta" with the optimizer state sharded over the stage's replicas."""
    import torch
    from model import GPT, SHARED_WEIGHTS

    import varuna_core
    from varuna_core import Varuna

    spec = job.spec
    torch.manual_seed(spec["seed"])
    if how == "cpu":
        gpt = GPT(job.cfg)
    else:
        with varuna_core.meta_init():
            gpt = GPT(job.cfg)
    extra: dict[str, Any] = {"weights": spec["weights"]} if how == "weights" else {}
    if how == "sharded":
        extra["shard_optimizer"] = True
    if how != "cpu" and hasattr(GPT, "init_module"):
        extra["init"] = GPT.init_module  # GPT's own distributions, per module (its qv_bias has no reset_parameters)
    dummy = job.ds.get_batch("train", spec["microbatch_size"], spec["block_size"],
                             torch.Generator().manual_seed(spec["seed"]))
    model = Varuna(gpt, rank_map(job.pp, job.dp), dummy, batch_size=job.batch_size,
                   chunk_size=spec["microbatch_size"], shared_weights=SHARED_WEIGHTS, seed=spec["seed"],
                   schedule=spec["schedule"], partition=ours_partition(spec["n_layer"], job.pp), from_cache=False,
                   timeout=spec["timeout"], bucket_mb=BUCKET_MB, **extra)
    if (model.stage, model.replica) != (job.stage, job.replica):
        raise RuntimeError(f"Varuna placed rank {job.rank} at stage {model.stage}, replica {model.replica}, not at "
                           f"{job.stage}, {job.replica}")
    if how == "sharded" and not model.shard_optimizer:
        raise RuntimeError("Varuna(..., shard_optimizer=True) did not turn sharding on")
    del gpt
    named = list(model.named_parameters())
    on_meta = [n for n, p in named if p.is_meta]
    if on_meta:
        raise RuntimeError(f"Varuna(...) left {len(on_meta)} parameter(s) of stage {model.stage} on meta "
                           f"(e.g. {on_meta[0]!r}): the meta-built path is not wired in")
    params = [p for _, p in named]
    optimizer = job.make_optimizer(params)
    model.set_optimizer(optimizer)

    def step(batch: dict) -> float:
        loss, overflow = model.step(model.replica_slice(batch))
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    # With shard_optimizer, the optimizer's param_groups hold this replica's pieces, and so does its state.
    return step, sum(p.numel() for p in params), lambda: state_bytes(optimizer)


def init_gpt_(module, n_layer: int) -> None:
    """GPT's initialisation (examples/gpt/model.py) on any part of it, in place: the peers' layers are built
    from their classes (DeepSpeed) or on meta (torch), so they get it here rather than from ``GPT.__init__``."""
    import torch
    from torch import nn

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            if getattr(m, "qv_bias", None) is not None:
                nn.init.zeros_(m.qv_bias)
        for name, p in module.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def peer_layers():
    """(Embeddings, Block, Head, loss_fn): the GPT as layers ``x = layer(x)``, each built from the config alone
    (what a LayerSpec or a meta-built stage needs). The head has its own weight: neither peer ties weights
    across stages here (ours ties them; same memory, as the two copies live on different ranks anyway)."""
    import torch
    import torch.nn.functional as F
    from model import Block as GPTBlock
    from torch import nn

    class Embeddings(nn.Module):
        def __init__(self, cfg) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            init_gpt_(self, cfg.n_layer)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))

    class Block(GPTBlock):  # named "Block": DeepSpeed's partition_method "type:^block$" counts these
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            init_gpt_(self, cfg.n_layer)

    class Head(nn.Module):
        def __init__(self, cfg) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            init_gpt_(self, cfg.n_layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.ln_f(x))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Embeddings, Block, Head, loss_fn


def _setup_deepspeed(job: Job):
    """(step, stage parameters, optimizer-state bytes) of DeepSpeed's PipelineModule over LayerSpecs +
    engine.train_batch(), with ZeRO stage 0 or 1 (by the contender's name) on the map every contender uses."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    Embeddings, Block, Head, loss_fn = peer_layers()
    cfg, L, mbs = job.cfg, job.spec["n_layer"], job.spec["microbatch_size"]
    zero = ZERO_STAGE[job.spec["contender"]]
    specs = [LayerSpec(Embeddings, cfg), *(LayerSpec(Block, cfg) for _ in range(L)), LayerSpec(Head, cfg)]
    # rank = replica * pp + stage, as rank_map(): the last axis varies fastest. DeepSpeed's own default
    # (num_stages=pp) would put a stage's replicas on consecutive ranks instead; the memory is the same.
    topology = ProcessTopology(axes=["data", "pipe"], dims=[job.dp, job.pp])
    # "type:^block$" balances the blocks: k per stage, the embeddings on the first, the head on the last stage.
    module = PipelineModule(specs, topology=topology, loss_fn=loss_fn, partition_method="type:^block$")
    expected = deepspeed_parts(L, job.pp)
    if list(module.parts) != expected:
        raise RuntimeError(f"DeepSpeed split the layers at {module.parts}, not {expected}")
    params = list(module.parameters())
    bucket = int(BUCKET_MB * MB) // 4  # elements of fp32: the same buckets as ours
    config = {
        "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": job.spec["microbatches"],
        "train_batch_size": job.batch_size, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # torch's SGD under ZeRO (AdamW is on DeepSpeed's list)
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=job.make_optimizer(params), config=config)
    placed = (engine.stage_id, engine.grid.get_data_parallel_rank())
    if placed != (job.stage, job.replica):
        raise RuntimeError(f"DeepSpeed placed rank {job.rank} at stage, replica {placed}, not at "
                           f"{(job.stage, job.replica)}")
    first = job.replica * job.replica_batch

    def step(batch: dict) -> float:
        idx, targets = (batch[k][first:first + job.replica_batch] for k in ("idx", "targets"))
        micro = zip(idx.split(mbs), targets.split(mbs), strict=True)
        return float(engine.train_batch(iter(micro)))

    def optimizer_state() -> int:
        # ZeRO-1: engine.optimizer is DeepSpeedZeroOptimizer; the user's AdamW inside it (.optimizer) steps this
        # replica's flat fp32 partition of each parameter group, and its .state holds that partition's exp_avg
        # and exp_avg_sq: what is counted. Not counted: the fp32 copy of the partition ZeRO steps
        # (single_partition_of_fp32_groups, 1/dp of the stage's parameters, kept even when training in fp32).
        # Stage 0 in fp32: engine.optimizer is the user's optimizer itself.
        inner = engine.optimizer.optimizer if zero else engine.optimizer
        return state_bytes(inner)

    return step, sum(p.numel() for p in params), optimizer_state


def _setup_torch(job: Job):
    """(step, stage parameters, optimizer-state bytes) of torch.distributed.pipelining: the stage built on meta,
    allocated with ``to_empty`` and initialised, in a PipelineStage with Schedule1F1B."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    Embeddings, Block, Head, loss_fn = peer_layers()
    rank, cfg, pp = job.rank, job.cfg, job.pp

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Embeddings(cfg) if rank == 0 else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(job.k))
            self.head = Head(cfg) if rank == pp - 1 else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x) if self.embed is not None else x
            for block in self.blocks:
                x = block(x)
            return self.head(x) if self.head is not None else x

    with torch.device("meta"):
        stage_slice = Stage()
    stage_slice.to_empty(device="cpu")
    init_gpt_(stage_slice, cfg.n_layer)
    params = list(stage_slice.parameters())
    stage = PipelineStage(stage_slice, rank, pp, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=job.spec["microbatches"], loss_fn=loss_fn)
    optimizer = job.make_optimizer(params)

    def step(batch: dict) -> float | None:
        loss = None
        if rank == 0:
            schedule.step(batch["idx"])
        elif rank == pp - 1:
            losses: list = []
            schedule.step(target=batch["targets"], losses=losses, return_outputs=False)
            loss = float(torch.stack([x.detach() for x in losses]).mean())
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, sum(p.numel() for p in params), lambda: state_bytes(optimizer)


SETUPS: dict[str, Callable] = {
    "ours-cpu": lambda job: _setup_ours(job, "cpu"),
    "ours-meta": lambda job: _setup_ours(job, "meta"),
    "ours-weights": lambda job: _setup_ours(job, "weights"),
    "ours-sharded": lambda job: _setup_ours(job, "sharded"),
    DEEPSPEED: _setup_deepspeed,
    DEEPSPEED_ZERO1: _setup_deepspeed,
    "torch-meta": _setup_torch,
}


# ----------------------------------------------------------------------------------------------------------
# The model's size, and its weights on disk (ours-weights)


def gpt_config(n_layer: int, n_embd: int, n_head: int, block_size: int) -> dict:
    """The GPTConfig fields of one run (the vocabulary is the shipped text's)."""
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": block_size}


def _gpt(cfg: dict, device: str):
    import torch

    if str(GPT_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, GPTConfig

    config = GPTConfig(vocab_size=CharDataset.load().vocab_size, dropout=0.0, **cfg)
    with torch.device(device):
        return GPT(config)


def model_params(cfg: dict) -> int:
    """Distinct parameters of the whole GPT (the tied embedding once), counted on meta (no memory)."""
    return _gpt(cfg, "meta").num_parameters()


def write_weights(cfg: dict, seed: int, directory: Path) -> Path:
    """The GPT's parameters as a sharded safetensors directory (``model.safetensors.index.json`` + shards of
    about 256 MB), only ``named_parameters()`` names (the tied head once, as ``wte.weight``): each stage of
    ours-weights then opens only the shards of its own tensors."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    gpt = _gpt(cfg, "cpu")
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[dict] = [{}]
    for name, p in gpt.named_parameters():
        if groups[-1] and sum(t.numel() * t.element_size() for t in groups[-1].values()) >= SHARD_BYTES:
            groups.append({})
        groups[-1][name] = p.detach().contiguous()
    weight_map = {}
    for i, tensors in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(directory / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    total = sum(p.numel() * p.element_size() for p in gpt.parameters())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return directory


# ----------------------------------------------------------------------------------------------------------
# The cap: cgroup v2 memory.max per worker, or measured peaks


class CapUnavailable(Exception):
    """This machine cannot enforce the cap with cgroup v2; the message says why."""


def cgroup2_root(mounts_text: str) -> Path | None:
    """The mount point of the cgroup v2 hierarchy in ``/proc/self/mounts`` text, or None."""
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def parse_events(text: str) -> dict[str, int]:
    """A cgroup's ``memory.events`` (``oom_kill 1`` lines) -> ``{name: count}``."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def cgroup_owner(name: str) -> int | None:
    """The pid of the launcher that created cgroup ``name`` (``varuna-bench-<pid>``), or None if not ours."""
    m = re.fullmatch(r"varuna-bench-(\d+)", name)
    return int(m[1]) if m else None


class CgroupCap:
    """Each worker in a cgroup of its own, ``<root>/varuna-bench-<pid>/<run>-rank<k>``, with ``memory.max`` = the
    cap and ``memory.swap.max`` = 0 (so that passing the cap is an OOM kill, not a slow swap). A worker joins its
    cgroup before Python starts (a shell writes its pid into ``cgroup.procs`` and execs the worker), so the
    start-up counts too. A run does not fit when a rank's ``memory.events`` shows an ``oom_kill``.
    """

    def __init__(self, cap_mb: float, root: Path) -> None:
        self.cap_bytes = int(cap_mb * MB)
        self.root = root
        self.parent = root / f"varuna-bench-{os.getpid()}"
        self.mode = "cgroup"

    @classmethod
    def detect(cls, cap_mb: float, mounts: str = "/proc/self/mounts") -> CgroupCap:
        """A usable cap, or CapUnavailable with the reason (no cgroup v2, no memory controller, not permitted)."""
        try:
            root = cgroup2_root(Path(mounts).read_text())
        except OSError as e:
            raise CapUnavailable(f"cannot read {mounts}: {e.strerror}") from None
        if root is None:
            raise CapUnavailable("no cgroup v2 hierarchy is mounted")
        controllers = _read(root / "cgroup.controllers").split()
        if "memory" not in controllers:
            raise CapUnavailable(f"the cgroup v2 hierarchy at {root} has no memory controller (its controllers: "
                                 f"{' '.join(controllers) or 'none'}; the memory controller is on cgroup v1 here)")
        cap = cls(cap_mb, root)
        cap.open()
        return cap

    def open(self) -> None:
        """Create the parent cgroup with the memory controller for its children; CapUnavailable if refused."""
        self.remove_stale()
        try:
            if "memory" not in _read(self.root / "cgroup.subtree_control").split():
                (self.root / "cgroup.subtree_control").write_text("+memory")
            self.parent.mkdir(exist_ok=True)
            atexit.register(self.close)
            (self.parent / "cgroup.subtree_control").write_text("+memory")
            probe = self.parent / "probe"
            probe.mkdir(exist_ok=True)
            (probe / "memory.max").write_text(str(self.cap_bytes))
            probe.rmdir()
        except OSError as e:
            self.close()
            raise CapUnavailable(f"cannot set memory.max in {self.parent} ({e.strerror or e})") from None

    def prepare(self, tag: str, world: int) -> list[Path]:
        """Fresh cgroups for the ranks of run ``tag``, each with the cap."""
        dirs = []
        for rank in range(world):
            d = self.parent / f"{tag}-rank{rank}"
            d.mkdir()
            (d / "memory.max").write_text(str(self.cap_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            dirs.append(d)
        return dirs

    @staticmethod
    def argv_prefix(d: Path) -> list[str]:
        """Run the command in cgroup ``d``: the shell moves itself there, then execs the command."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(d)]

    def collect(self, dirs: list[Path]) -> list[dict]:
        """Per rank: OOM kills and peak bytes (``memory.peak``, kernel >= 5.19), then the cgroups are removed."""
        out = []
        for d in dirs:
            events = parse_events(_read(d / "memory.events"))
            peak = _read(d / "memory.peak").strip()
            out.append({"oom_kill": events.get("oom_kill", 0), "peak_mb": int(peak) / MB if peak.isdigit() else None})
            _rmdir(d)
        return out

    def remove_stale(self) -> None:
        """Remove the cgroups that killed runs left behind (their launcher's pid is gone, no process inside)."""
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return
        for d in entries:
            owner = cgroup_owner(d.name)
            if owner is None or owner == os.getpid() or _alive(owner):
                continue
            for child in d.iterdir():
                if child.is_dir():
                    _rmdir(child)
            _rmdir(d)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.parent.exists():
            for child in self.parent.iterdir():
                if child.is_dir():
                    _rmdir(child)
            _rmdir(self.parent)

    def describe(self) -> str:
        return (f"cgroup v2 memory.max = {self.cap_bytes / MB:.0f} MB per worker (memory.swap.max 0), in "
                f"{self.parent}; a run does not fit when a worker is OOM-killed")


class MeasuredCap:
    """No cgroup: each rank's measured peak RSS (VmHWM over start-up and training) is compared with the cap; a
    worker whose RSS passes the cap stops itself (:class:`RssWatch`), so a run that cannot fit ends early."""

    mode = "measured"

    def __init__(self, cap_mb: float, reason: str) -> None:
        self.cap_mb, self.reason = cap_mb, reason

    def describe(self) -> str:
        return (f"measured: {self.reason}; a run fits when every rank's peak RSS (VmHWM, start-up and training) "
                f"is <= {self.cap_mb:.0f} MB, and a worker stops itself when its RSS passes that")

    def close(self) -> None:
        pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _rmdir(d: Path, tries: int = 50) -> None:
    """rmdir a cgroup, waiting a little for its last processes to be reaped."""
    for _ in range(tries):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_cap(args: argparse.Namespace) -> CgroupCap | MeasuredCap:
    """The cap of the search, by ``--cap-mode`` (auto: cgroup where possible, else measured)."""
    if args.cap_mode == "measured":
        return MeasuredCap(args.cap_mb, "--cap-mode measured")
    try:
        return CgroupCap.detect(args.cap_mb)
    except CapUnavailable as e:
        if args.cap_mode == "cgroup":
            raise
        return MeasuredCap(args.cap_mb, f"no cgroup v2 cap: {e}")


# ----------------------------------------------------------------------------------------------------------
# Launcher: one run of one contender on 4 processes


@dataclass
class Run:
    """How one run of a contender ended: the ranks' results, or an error; ``over_cap`` when it did not fit."""

    ranks: list[dict] | None = None
    error: str | None = None
    over_cap: bool = False
    detail: str = ""
    phase: str | None = None  # where it passed the cap: "start-up" or "training" (None: unknown, or it fit)
    seconds: float = 0.0
    cgroup: list[dict] = field(default_factory=list)

    @property
    def peak_mb(self) -> float | None:
        """The largest peak RSS of any rank over start-up and training."""
        if not self.ranks:
            return None
        return max(max(r["startup_peak_mb"], r["train_peak_mb"]) for r in self.ranks)


def run_ranks(spec: dict, workdir: Path, tag: str, timeout: float, cap: CgroupCap | MeasuredCap | None) -> Run:
    """Run the pp x dp ranks of one contender in fresh processes (in capped cgroups, or watched, with a ``cap``)."""
    t0 = time.perf_counter()
    world = spec["pp"] * spec["dp"]
    if isinstance(cap, MeasuredCap):
        spec = dict(spec, watch_cap_mb=cap.cap_mb)
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    outs = [workdir / f"{tag}.rank{rank}.json" for rank in range(world)]
    for out in outs:
        for path in (out, Path(f"{out}.overcap"), Path(f"{out}.overcap.tmp")):
            path.unlink(missing_ok=True)
    dirs = cap.prepare(tag, world) if isinstance(cap, CgroupCap) else []

    def argv(rank: int) -> list[str]:
        prefix = CgroupCap.argv_prefix(dirs[rank]) if dirs else []
        return [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(outs[rank])]

    try:
        outcome = run_workers(argv, world, log_dir=workdir, log_name=f"{tag}.rank{{rank}}.log", timeout=timeout,
                              env={"MKL_NUM_THREADS": "1", "VARUNA_TIMEOUT": str(int(timeout))}, cwd=ROOT,
                              agent_store=False, die_with_parent=True, poll=0.1)
    finally:
        cgroup = cap.collect(dirs) if isinstance(cap, CgroupCap) else []
    run = _judge(outcome, outs, cgroup, cap)
    run.seconds, run.cgroup = time.perf_counter() - t0, cgroup
    if run.error:
        for rank in range(world):
            text = _read(workdir / f"{tag}.rank{rank}.log")
            log(f"--- {tag} rank {rank} log (last 2000 chars) ---\n{text[-2000:]}")
    return run


def _judge(outcome, outs: list[Path], cgroup: list[dict], cap) -> Run:
    """A run's :class:`Run` from how its processes ended, their result files and the cgroups' OOM kills."""
    results = [_read_json(o) for o in outs]
    errors = [r["error"] for r in results if r and "error" in r]
    overcap = [m for m in (_read_json(Path(f"{o}.overcap")) for o in outs) if m]
    ooms = [rank for rank, c in enumerate(cgroup) if c["oom_kill"]]
    if ooms:
        return Run(over_cap=True, detail=f"rank(s) {ooms} OOM-killed at the cap")
    if overcap:
        o = overcap[0]
        return Run(over_cap=True, detail=f"RSS {o['rss_mb']:.0f} MB > cap during {o['phase']}", phase=o["phase"])
    if errors:
        return Run(error=errors[0])
    if not outcome.ok:
        return Run(error=outcome.first_error() or f"exit codes {outcome.returncodes}")
    if not all(results):
        return Run(error="a worker finished without writing its result")
    run = Run(ranks=sorted(results, key=lambda r: r["rank"]))
    if isinstance(cap, MeasuredCap) and run.peak_mb > cap.cap_mb:
        startup = max(r["startup_peak_mb"] for r in run.ranks)
        run.over_cap, run.phase = True, "start-up" if startup > cap.cap_mb else "training"
        run.detail = f"peak RSS {run.peak_mb:.0f} MB > cap during {run.phase}"
    return run


def _read_json(path: Path) -> dict | None:
    """A worker's JSON file, or None where it wrote none (or was killed while writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def base_spec(args: argparse.Namespace) -> dict:
    """What every run shares (the model size and sequence length are added per run)."""
    return {"pp": args.pp, "dp": args.dp, "n_head": args.n_head, "microbatch_size": args.microbatch_size,
            "microbatches": args.microbatches, "steps": args.steps, "optimizer": args.optimizer, "lr": args.lr,
            "schedule": args.schedule, "seed": args.seed, "timeout": args.timeout}


def run_contender(args, name: str, cfg: dict, workdir: Path, tag: str, cap=None) -> Run:
    """One run of ``name`` on the GPT ``cfg`` (writing, then deleting, the weights ours-weights loads)."""
    spec = dict(base_spec(args), **cfg, contender=name)
    weights = None
    if name == "ours-weights":
        weights = workdir / f"{tag}.weights"
        write_weights(cfg, args.seed, weights)
        spec["weights"] = str(weights)
    try:
        return run_ranks(spec, workdir, tag, args.timeout, cap)
    finally:
        if weights is not None:
            shutil.rmtree(weights, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Part 1: side by side


def side_by_side(args, names: list[str], workdir: Path, t0: float) -> dict:
    cfg = gpt_config(args.n_layer, args.n_embd, args.n_head, args.block_size)
    params = model_params(cfg)
    model_mb = params * 4 / MB
    log(f"side by side: GPT {cfg}, {params / 1e6:.1f}M parameters = {model_mb:.0f} MB fp32, pp={args.pp} x "
        f"dp={args.dp}")
    rows = []
    for name in names:
        log(f"[{time.perf_counter() - t0:6.1f}s] {CONTENDERS[name]} ...")
        run = run_contender(args, name, cfg, workdir, f"side-{name}")
        row = summarize(name, run, model_mb)
        rows.append(row)
        if run.error:
            log(f"  failed: {run.error}")
        else:
            log(f"  start-up peak {max(row['startup_peak_mb']):.0f} MB ({row['startup_above_baseline_x']:.2f}x above "
                f"baseline), training peak {max(row['train_peak_mb']):.0f} MB, optimizer state "
                f"{max(row['optimizer_state_mb']):.0f} MB, {run.seconds:.0f}s")
    return {"config": cfg, "params": params, "model_mb": model_mb, "contenders": rows}


def summarize(name: str, run: Run, model_mb: float) -> dict:
    """One contender's row: per-rank peaks in MB, and the worst rank's as fractions of the whole model."""
    row: dict[str, Any] = {"key": name, "contender": CONTENDERS[name], "error": run.error, "seconds": run.seconds}
    if not run.ranks:
        return row
    ranks = run.ranks
    per = {k: [r[k] for r in ranks] for k in ("baseline_mb", "startup_peak_mb", "startup_anon_peak_mb",
                                               "train_peak_mb", "train_anon_peak_mb", "stage_params", "setup_s",
                                               "stage", "replica")}
    above = [r["startup_peak_mb"] - r["baseline_mb"] for r in ranks]
    row.update(per)
    row["optimizer_state_mb"] = [r["optimizer_state_bytes"] / MB for r in ranks]
    row.update(
        startup_x=max(per["startup_peak_mb"]) / model_mb,
        startup_above_baseline_x=max(above) / model_mb,
        train_x=max(per["train_peak_mb"]) / model_mb,
        train_above_baseline_x=max(r["train_peak_mb"] - r["baseline_mb"] for r in ranks) / model_mb,
        losses=ranks[-1]["losses"],  # the last rank runs a last stage (rank = replica * pp + stage)
        hwm_reset=all(r["hwm_reset"] for r in ranks),
        torch=ranks[0]["torch"],
    )
    return row


# ----------------------------------------------------------------------------------------------------------
# Part 2: the largest model under the cap


class ProbeError(Exception):
    """A probe failed for another reason than memory: the search cannot go on."""


def align_down(value: float, step: int) -> int:
    return int(value // step) * step


def search_largest(fits: Callable[[int], bool], *, start: int, step: int, low: int, high: int,
                   max_probes: int) -> dict:
    """The largest multiple of ``step`` in ``[low, high]`` for which ``fits`` holds (assumed monotone: a larger
    model never fits where a smaller one does not), with few calls of ``fits`` (each is a run of 4 processes).

    From ``start`` it gallops: up by ``step``, ``2*step``, ``4*step``... from the last fit until a call fails (or
    down likewise from the last failure until one fits), then bisects the bracket down to ``step``. A good
    ``start`` (an estimate) makes it 2-4 calls. Returns ``largest`` (None: not even ``low`` fits),
    ``smallest_over`` (None: ``high`` fits or was never reached), the calls in order (``probes``: ``[(n, fits)]``)
    and ``resolved`` (whether the answer is exact to ``step`` rather than cut short by ``max_probes``).
    """
    low, high = -(-low // step) * step, align_down(high, step)
    lo: int | None = None  # largest known to fit
    hi: int | None = None  # smallest known not to fit
    probes: list[tuple[int, bool]] = []

    def probe(n: int) -> bool:
        ok = fits(n)
        probes.append((n, ok))
        return ok

    x = min(max(align_down(start, step), low), high)
    if probe(x):
        lo, inc = x, step
        while lo < high and len(probes) < max_probes:
            x = min(lo + inc, high)
            if not probe(x):
                hi = x
                break
            lo, inc = x, inc * 2
    else:
        hi, inc = x, step
        while hi > low and len(probes) < max_probes:
            x = max(hi - inc, low)
            if probe(x):
                lo = x
                break
            hi, inc = x, inc * 2
    while lo is not None and hi is not None and hi - lo > step and len(probes) < max_probes:
        x = align_down((lo + hi) / 2, step)
        if probe(x):
            lo = x
        else:
            hi = x
    resolved = ((lo is None and hi == low) or (lo == high) or (lo is not None and hi is not None and hi - lo <= step))
    return {"largest": lo, "smallest_over": hi, "probes": probes, "resolved": resolved}


def estimate_layers(peak_mb: float, baseline_mb: float, n_layer: int, cap_mb: float, step: int,
                    scale: float = 1.0, fixed_mb: float = FIXED_MB) -> int:
    """The n_layer whose peak would just reach ``cap_mb``, from one run of ``n_layer`` layers that peaked at
    ``peak_mb``: what lies above the baseline and a fixed part grows with the layers, by ``scale`` times as much
    per layer in the searched model (the ratio of parameters per layer, for another width). Aligned down to
    ``step``; only the search's first guess (activations, which the width does not scale alike, make it rough)."""
    per_layer = max(peak_mb - baseline_mb - fixed_mb, 1.0) / n_layer * scale
    return max(step, align_down((cap_mb - baseline_mb - fixed_mb) / per_layer, step))


def search(args, names: list[str], cap, workdir: Path, t0: float, side: dict | None) -> dict:
    """For each contender, the largest n_layer that trains under the cap."""
    cfg0 = gpt_config(args.n_layer, args.search_n_embd, args.n_head, args.seq)
    log(f"search: width {args.search_n_embd}, sequence {args.seq}, cap {cap.describe()}")
    scale = None
    if side is not None and args.seq == side["config"]["block_size"]:
        scale = _layer_params(cfg0) / _layer_params(side["config"])
    rows = []
    for name in names:
        start = args.search_start or (_estimate_from_side(side, name, args, scale) if scale else 8)
        rows.append(_search_one(args, name, cfg0, cap, workdir, t0, start))
    return {"config": {k: v for k, v in cfg0.items() if k != "n_layer"}, "pp": args.pp, "dp": args.dp,
            "cap_mb": args.cap_mb, "cap_mode": cap.mode, "cap": cap.describe(), "contenders": rows}


def _layer_params(cfg: dict) -> int:
    """Parameters of one block of the GPT ``cfg``."""
    return model_params(dict(cfg, n_layer=2)) - model_params(dict(cfg, n_layer=1))


def _estimate_from_side(side: dict, name: str, args, scale: float) -> int:
    """The search's first guess for ``name`` from its side-by-side run (8 if it has none)."""
    row = next((r for r in side["contenders"] if r["key"] == name and not r["error"]), None)
    if row is None:
        return 8
    worst = max(range(len(row["train_peak_mb"])), key=lambda k: max(row["startup_peak_mb"][k],
                                                                     row["train_peak_mb"][k]))
    peak = max(row["startup_peak_mb"][worst], row["train_peak_mb"][worst])
    return estimate_layers(peak, row["baseline_mb"][worst], side["config"]["n_layer"], args.cap_mb, args.pp, scale)


def _search_one(args, name: str, cfg0: dict, cap, workdir: Path, t0: float, start: int) -> dict:
    details: list[dict] = []

    def fits(n_layer: int) -> bool:
        cfg = dict(cfg0, n_layer=n_layer)
        log(f"[{time.perf_counter() - t0:6.1f}s] {CONTENDERS[name]}: n_layer {n_layer} ...")
        run = run_contender(args, name, cfg, workdir, f"search-{name}-L{n_layer}", cap)
        details.append({"n_layer": n_layer, "fits": not run.over_cap and not run.error, "peak_mb": run.peak_mb,
                        "phase": run.phase, "detail": run.detail, "error": run.error, "seconds": run.seconds,
                        "cgroup": run.cgroup})
        if run.error:
            raise ProbeError(run.error)
        verdict = "does not fit: " + run.detail if run.over_cap else f"fits (peak {run.peak_mb:.0f} MB)"
        log(f"  {verdict}, {run.seconds:.0f}s")
        return not run.over_cap

    row: dict[str, Any] = {"key": name, "contender": CONTENDERS[name], "start": start, "error": None}
    try:
        row.update(search_largest(fits, start=start, step=args.pp, low=args.pp, high=args.max_layers,
                                  max_probes=args.max_probes))
    except ProbeError as e:
        row["error"] = str(e)
        log(f"  failed: {e}")
    row["runs"] = details
    if row.get("largest"):
        params = model_params(dict(cfg0, n_layer=row["largest"]))
        row.update(params=params, model_mb=params * 4 / MB)
    return row


# ----------------------------------------------------------------------------------------------------------
# Report


def build_report(args, side: dict | None, found: dict | None, elapsed: float, meta: dict) -> dict:
    return {
        "config": {"pp": args.pp, "dp": args.dp, "stage_to_rank_map": rank_map(args.pp, args.dp), "backend": "gloo",
                   "threads_per_process": 1, "steps": args.steps,
                   "microbatch_size": args.microbatch_size, "microbatches": args.microbatches,
                   "optimizer": args.optimizer, "schedule_ours": args.schedule, "seed": args.seed,
                   "quick": args.quick, **meta},
        "method": "baseline = VmRSS right after `import torch`; start-up peak = VmHWM when the model, pipeline and "
                  "optimizer are built (after a barrier); training peak = VmHWM over the training steps after "
                  "resetting it (/proc/self/clear_refs 5); anon = the sampled peak of RssAnon+RssShmem; "
                  "x model = MB / the whole model's fp32 parameter MB; the worst rank is shown; optimizer state = "
                  "the bytes of the tensors in optimizer.state after the last step",
        "side_by_side": side,
        "search": found,
        "targets": targets(side, found, args.pp, args.dp),
        "elapsed_s": elapsed,
    }


def targets(side: dict | None, found: dict | None, pp: int = PP_ALONE, dp: int = 1) -> dict:
    """The targets: start-up above baseline <= 0.35x at pp=4; ours fits at least as large a model; with
    replicas, those of the sharded optimizer (:func:`sharding_targets`)."""
    out: dict[str, Any] = {}
    if side and pp == PP_ALONE:
        out["startup_above_baseline_x"] = {r["key"]: r.get("startup_above_baseline_x") for r in side["contenders"]}
        out["startup_target_x"] = TARGET_STARTUP
        out["model_mb"] = side["model_mb"]
    if found:
        largest = {r["key"]: r.get("largest") for r in found["contenders"]}
        ours = [v for k, v in largest.items() if k in OURS and v is not None]
        peers = {k: v for k, v in largest.items() if k not in OURS}
        best = max(ours) if ours else None
        out["largest_n_layer"] = largest
        out["ours_fits_at_least_every_peer"] = (best is not None and all(v is None or best >= v
                                                                           for v in peers.values()))
    if dp > 1:
        out.update(sharding_targets(side, found, dp))
    return out


def sharding_targets(side: dict | None, found: dict | None, dp: int) -> dict:
    """The sharded optimizer's targets, where both sides of a comparison ran: ours-sharded's optimizer state on
    every rank is 1/dp of ours-meta's on that rank (the same stage) within one bucket; its training peak (the
    worst rank) is below deepspeed-zero1's; under the cap it fits more layers than ours-meta and at least as
    many as deepspeed-zero1."""
    out: dict[str, Any] = {}
    rows = {r["key"]: r for r in (side["contenders"] if side else []) if not r["error"]}
    sharded, whole, zero1 = rows.get("ours-sharded"), rows.get("ours-meta"), rows.get(DEEPSPEED_ZERO1)
    if sharded and whole:
        off = max(abs(s - w / dp) for s, w in zip(sharded["optimizer_state_mb"], whole["optimizer_state_mb"],
                                                 strict=True))
        out["sharded_state_off_mb"] = off
        out["sharded_state_is_1_over_dp"] = off <= BUCKET_MB
    if sharded and zero1:
        out["train_peak_mb"] = {k: max(rows[k]["train_peak_mb"]) for k in ("ours-sharded", DEEPSPEED_ZERO1)}
        out["sharded_peak_below_zero1"] = max(sharded["train_peak_mb"]) < max(zero1["train_peak_mb"])
    largest = {r["key"]: r.get("largest") for r in (found["contenders"] if found else []) if not r["error"]}
    if largest.get("ours-sharded") is not None:
        if "ours-meta" in largest:
            out["sharded_fits_more_than_unsharded"] = largest["ours-sharded"] > (largest["ours-meta"] or 0)
        if DEEPSPEED_ZERO1 in largest:
            out["sharded_fits_at_least_zero1"] = largest["ours-sharded"] >= (largest[DEEPSPEED_ZERO1] or 0)
    return out


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table (readable as text, and pasted as is into benchmarks/README.md)."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(headers) - 1)) + " |"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _ranks(values: list[float], spec: str = ".0f") -> str:
    """Per-rank values as ``r0 / r1 / r2 / r3``."""
    return " / ".join(format(v, spec) for v in values)


def _rank_names(world: int) -> str:
    """``r0 / r1 / ... `` for a column header."""
    return " / ".join(f"r{k}" for k in range(world))


def state_lines(side: dict) -> list[str]:
    """Optimizer state per rank next to the training peak, each also as a ratio to the unsharded ours-meta's
    (the worst rank of each)."""
    rows = [r for r in side["contenders"] if not r["error"]]
    if not rows:
        return []
    base = next((r for r in rows if r["key"] == "ours-meta"), None)

    def ratio(r: dict, key: str) -> str:
        return f"{max(r[key]) / max(base[key]):.2f}" if base and max(base[key]) > 0 else "-"

    table = [[r["contender"], _ranks(r["optimizer_state_mb"]), f"**{max(r['optimizer_state_mb']):.0f}**",
              ratio(r, "optimizer_state_mb"), f"**{max(r['train_peak_mb']):.0f}**", ratio(r, "train_peak_mb")]
             for r in rows]
    world = len(rows[0]["optimizer_state_mb"])
    note = ("optimizer state (tensors in optimizer.state after the last step) and training peak, worst rank; "
            "'x ours-meta' divides by the unsharded ours':")
    return [note, ""] + md_table(
        ["contender", f"optimizer state MB {_rank_names(world)}", "max state MB", "state x ours-meta",
         "training peak MB (max)", "peak x ours-meta"], table)


def side_lines(side: dict, steps: int) -> list[str]:
    """The side-by-side tables: peaks per rank, fractions of the whole model, the optimizer state, then the
    anonymous peaks."""
    cfg = side["config"]
    head = (f"side by side: GPT n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}, n_head {cfg['n_head']}, sequence "
            f"{cfg['block_size']}: {side['params'] / 1e6:.1f}M parameters = {side['model_mb']:.0f} MB fp32 (the "
            f"'x model' columns divide by this)")
    rows, anon = [], []
    for r in side["contenders"]:
        if r["error"]:
            rows.append([r["contender"], "failed: " + r["error"].replace("|", "/")] + [""] * 7)
            continue
        rows.append([r["contender"], f"{max(r['baseline_mb']):.0f}", _ranks(r["startup_peak_mb"]),
                     f"{r['startup_x']:.2f}", f"**{r['startup_above_baseline_x']:.2f}**", _ranks(r["train_peak_mb"]),
                     f"{r['train_x']:.2f}", _ranks([v / 1e6 for v in r["stage_params"]]),
                     f"{_fmt(r['losses'][0], '.3f')} / {_fmt(r['losses'][-1], '.3f')}"])
        anon.append([r["contender"], _ranks(r["startup_anon_peak_mb"]), _ranks(r["train_anon_peak_mb"]),
                     _ranks(r["setup_s"], ".1f")])
    world = next((len(r["train_peak_mb"]) for r in side["contenders"] if not r["error"]), 0)
    lines = [head, ""] + md_table(
        ["contender", "baseline MB", f"start-up peak MB {_rank_names(world)}", "start-up x model",
         "above baseline x model", f"training peak MB {_rank_names(world)}", "training x model", "params/rank (M)",
         f"loss step 1 / {steps}"], rows)
    lines += [""] + state_lines(side)
    if anon:
        note = ("anonymous memory only (RssAnon + RssShmem sampled every 10 ms: without mapped files such as weight "
                "shards), and the time to build:")
        lines += ["", note, ""]
        lines += md_table(["contender", "start-up anon peak MB", "training anon peak MB",
                           f"build s {_rank_names(world)}"], anon)
    return lines


def _probe_text(p: dict) -> str:
    """``44: fits 940`` (its peak MB), ``48: over in start-up`` or ``48: error``."""
    over = "over" + (f" in {p['phase']}" if p.get("phase") else "")
    verdict = "error" if p["error"] else f"fits {_fmt(p['peak_mb'])}" if p["fits"] else over
    return f"{p['n_layer']}: {verdict}"


def search_lines(found: dict) -> list[str]:
    """The search's table: each contender's largest n_layer under the cap and the runs that found it."""
    cfg = found["config"]
    head = (f"largest model under the cap: n_embd {cfg['n_embd']}, n_head {cfg['n_head']}, sequence "
            f"{cfg['block_size']}; cap: {found['cap']}")
    rows = []
    for r in found["contenders"]:
        largest, params = r.get("largest"), r.get("params")
        if r["error"]:
            answer = "failed: " + r["error"].replace("|", "/")
        elif largest is None:
            answer = (f"none (even {found['pp']} layers exceed the cap)" if r.get("resolved") else
                      f"< {r['smallest_over']} (out of runs)")
        else:
            answer = f"**{largest}**" + ("" if r.get("resolved") else " (at least; out of runs)")
        rows.append([r["contender"], answer, _fmt(r.get("model_mb")), _fmt(params and params / 1e6),
                     ", ".join(_probe_text(p) for p in r["runs"]) or "-"])
    return [head, ""] + md_table(["contender", "largest n_layer", "model MB", "params (M)",
                                  "runs (n_layer: verdict, peak MB or where it passed the cap)"], rows)


def print_report(report: dict) -> None:
    cfg = report["config"]
    out = [f"pp={cfg['pp']} x dp={cfg['dp']} (stage-to-rank map {cfg['stage_to_rank_map']!r}) on {cfg.get('cpus')} "
           f"CPUs, gloo, 1 thread/process; {cfg['steps']} steps of {cfg['microbatches']} micro-batches of "
           f"{cfg['microbatch_size']} per replica; {cfg['optimizer']}; ours' schedule "
           f"{cfg['schedule_ours']}; torch {cfg.get('torch')}" + (f", DeepSpeed {cfg['deepspeed']}"
                                                                    if cfg.get("deepspeed") else ""),
           f"method: {report['method']}", ""]
    if report["side_by_side"]:
        out += side_lines(report["side_by_side"], cfg["steps"]) + [""]
    if report["search"]:
        out += search_lines(report["search"]) + [""]
    out += target_lines(report["targets"])
    out.append(f"total time {report['elapsed_s']:.0f}s")
    print("\n".join(out), flush=True)


def target_lines(t: dict) -> list[str]:
    lines = []
    if "startup_above_baseline_x" in t:
        parts = [f"{CONTENDERS[k]} " + ("failed" if v is None else f"{v:.2f} {'ok' if v <= TARGET_STARTUP else 'MISS'}")
                 for k, v in t["startup_above_baseline_x"].items()]
        small = ("  (the target is for a model of >= 1 GB: what a rank holds whatever the model's size, ~100 MB, "
                 "weighs more in a smaller one)" if t["model_mb"] < 1000 else "")
        lines.append(f"target start-up peak above baseline <= {TARGET_STARTUP}x model: " + "; ".join(parts) + small)
    if "largest_n_layer" in t:
        parts = [f"{CONTENDERS[k]} {'-' if v is None else v}" for k, v in t["largest_n_layer"].items()]
        verdict = "ok" if t["ours_fits_at_least_every_peer"] else "MISS"
        lines.append(f"target ours fits at least as many layers as every peer: {verdict} ({'; '.join(parts)})")
    return lines + sharding_target_lines(t)


def sharding_target_lines(t: dict) -> list[str]:
    """The sharded optimizer's targets that were measured (see :func:`sharding_targets`)."""
    def ok(key: str) -> str:
        return "ok" if t[key] else "MISS"

    lines = []
    if "sharded_state_is_1_over_dp" in t:
        lines.append(f"target ours-sharded optimizer state per rank = 1/dp of ours-meta's (+- {BUCKET_MB:.0f} MB): "
                     f"{ok('sharded_state_is_1_over_dp')} (worst rank off by {t['sharded_state_off_mb']:.1f} MB)")
    if "sharded_peak_below_zero1" in t:
        peaks = t["train_peak_mb"]
        lines.append(f"target ours-sharded training peak < deepspeed-zero1's: {ok('sharded_peak_below_zero1')} "
                     f"({peaks['ours-sharded']:.0f} vs {peaks[DEEPSPEED_ZERO1]:.0f} MB)")
    if "sharded_fits_more_than_unsharded" in t:
        lines.append(f"target ours-sharded fits more layers than ours-meta: {ok('sharded_fits_more_than_unsharded')}")
    if "sharded_fits_at_least_zero1" in t:
        lines.append(f"target ours-sharded fits at least as many layers as deepspeed-zero1: "
                     f"{ok('sharded_fits_at_least_zero1')}")
    return lines


# ----------------------------------------------------------------------------------------------------------
# Main


def available(names: list[str], install: bool) -> list[str] | None:
    """``names`` without the DeepSpeed contenders when it is missing (one line says how to install it), or with it
    installed first with ``install``; None when installing failed."""
    if not any(n in ZERO_STAGE for n in names) or importlib.util.find_spec("deepspeed") is not None:
        return names
    if install:
        error = install_deepspeed()
        if error is None:
            return names
        log(f"error: {error}")
        return None
    skipped = ", ".join(n for n in names if n in ZERO_STAGE)
    log(f"{skipped} skipped: DeepSpeed is not installed (install it with `{DS_INSTALL.format(pip=pip_command())}`, "
        f"or pass --install-deepspeed)")
    return [n for n in names if n not in ZERO_STAGE]


@contextlib.contextmanager
def workdir_for(keep: str | None) -> Iterator[Path]:
    """Where the runs' specs, logs, results and weights go: ``keep`` (kept), else a temporary directory."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="bench-memory.") as tmp:
        yield Path(tmp)


def run_parts(args, usable: list[str], workdir: Path) -> dict:
    """The side-by-side part, then the search (as ``--only`` says), and the report of both."""
    meta = {"cpus": os.cpu_count(), "torch": importlib.metadata.version("torch"),
            "deepspeed": (importlib.metadata.version("deepspeed") if any(n in ZERO_STAGE for n in usable)
                          else None)}
    t0 = time.perf_counter()
    side = found = cap = None
    try:
        if args.only != "search":
            side = side_by_side(args, [n for n in args.contender_list if n in usable], workdir, t0)
        if args.only != "side-by-side":
            cap = make_cap(args)
            found = search(args, [n for n in args.search_list if n in usable], cap, workdir, t0, side)
    finally:
        if cap is not None:
            cap.close()
    return build_report(args, side, found, time.perf_counter() - t0, meta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks and atexit still clean up
    usable = available(list(dict.fromkeys(args.contender_list + args.search_list)), args.install_deepspeed)
    if usable is None:
        return 1
    try:
        with workdir_for(args.keep_logs) as workdir:
            report = run_parts(args, usable, workdir)
    except CapUnavailable as e:
        log(f"error: --cap-mode cgroup: {e}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        print_report(report)
    failed = [r for part in ("side_by_side", "search") if report[part] for r in report[part]["contenders"]
              if r["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
