"""Step time of our pipeline runtime vs ``torch.distributed.pipelining`` and DeepSpeed on the example char GPT.

One invocation measures every contender, side by side, on the same model, split and data:

    ours 1f1b, varuna, gpipe, zb, varuna-zb       Varuna(model, "0;1", ..., schedule=..., partition=...)
    torch Schedule1F1B, ScheduleGPipe,            PipelineStage (manual frontend) + the torch schedule
      ScheduleInterleavedZeroBubble               (zero-bubble: one stage per rank, its split backward)
    DeepSpeed 1F1B                                deepspeed.pipe.PipelineModule + engine.train_batch()

Each contender runs in a fresh pair of worker processes (2 pipeline stages, 1 replica, gloo, one thread
each), so the peak RSS of a process belongs to that contender alone. A worker builds the model from the same
seed, runs ``--warmup`` steps, then ``--steps`` measured steps; a step is forward + backward of
``--microbatches`` micro-batches + ``optimizer.step()`` (SGD) + ``zero_grad()``, timed with
``time.perf_counter()`` on each rank after a barrier. The reported step time of a run is the median over
steps of the slowest rank's time for that step (max over ranks per step, then median over steps).

With ``--rounds N`` every contender is measured N times, in alternating order (forward, reversed, forward,
...); the table shows the round with the lowest median, and the medians of all rounds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_vs_peers.py            # table on stdout
    .venv/bin/python benchmarks/pipeline_vs_peers.py --json                      # one JSON document
    .venv/bin/python benchmarks/pipeline_vs_peers.py --contenders ours-1f1b,torch-1f1b --rounds 5
    .venv/bin/python benchmarks/pipeline_vs_peers.py --network slow --rate 200mbit  # rate-limited link (root)

With ``--dp 2`` each contender runs two replicas of the pipeline (4 processes: ours with the map ``"0,2;1,3"``,
DeepSpeed in its own rank order, torch's ``Schedule1F1B`` over ``DistributedDataParallel`` stage modules), each
replica on its own slice of a global batch twice as large; with ``--network slow`` each replica is a namespace of
its own, so its stages talk inside it and the data-parallel all-reduce crosses the limited link.

The network is the loopback (127.0.0.1) by default. ``--network slow`` puts each rank in a network namespace
of its own, the two joined by a veth pair whose both directions are limited to ``--rate`` by ``tc``'s token
bucket (and delayed by ``--delay`` with netem, where the kernel has it): the varuna schedule's point is to
hold fewer activations and to overlap its recompute with communication, which matters only where
communication costs something. Without root or tc the variant is skipped with one line saying why.

torch pipelining has no tied weights across stages: for the torch contenders the head gets its own weight
(a copy of the embedding at start, same shape and compute). DeepSpeed gets the same untied copy: its
``TiedLayerSpec`` would build the whole embedding layer (token and position tables) on both stages, from a
spec rather than from the GPT's own modules, so the ranks would hold different parameters than the other
contenders'. Ours keeps the tie and all-reduces its gradient between the two stages every step.

DeepSpeed is optional, for this benchmark only: when it is not installed its contender is skipped (one line
says how to install it), unless ``--install-deepspeed`` installs it first, with ``DS_BUILD_OPS=0`` (no native
ops are needed on CPU) and pip constrained to the installed torch so that pip can never replace it. It runs
with ``DS_ACCELERATOR=cpu``, ``deepspeed.init_distributed("gloo")``, a config with the same micro-batch size
and micro-batches (gradient_accumulation_steps), fp32, no ZeRO, no gradient clipping (DeepSpeed's default
clips), and the same SGD optimizer.

The script doubles as its own worker (``--worker SPEC OUT``, internal).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # for devtools.testhosts
    sys.path.insert(0, str(ROOT))
GPT_DIR = ROOT / "examples" / "gpt"

from devtools.cpu import Load  # noqa: E402
from devtools.emucluster import parse_delay, parse_rate, tc_commands  # noqa: E402  (moved there, shared)
from devtools.testhosts import kill_namespace_processes  # noqa: E402
from varuna_core.util.procs import JobOutcome, run_workers  # noqa: E402

DEEPSPEED = "deepspeed-1f1b"
CONTENDERS: dict[str, str] = {
    "ours-1f1b": "ours 1f1b",
    "ours-varuna": "ours varuna",
    "ours-gpipe": "ours gpipe",
    "ours-zb": "ours zb",
    "ours-varuna-zb": "ours varuna-zb",
    "ours-varuna-bf16": "ours varuna, bf16 wire",  # Varuna(..., wire_dtype="bf16"): half the bytes between stages
    "ours-1f1b-bf16": "ours 1f1b, bf16 wire",
    "torch-1f1b": "torch Schedule1F1B",
    "torch-gpipe": "torch ScheduleGPipe",
    "torch-zb": "torch ScheduleInterleavedZeroBubble",
    DEEPSPEED: "DeepSpeed 1F1B",
}
BASELINE = "torch-1f1b"
# (ours, peer) pairs whose ratio is printed at the end: the varuna schedule against the others' schedules on
# our runtime, then like for like against each peer; the last one is the headline.
PAIRS = [
    ("ours-varuna", "ours-1f1b"), ("ours-varuna", "ours-gpipe"),
    ("ours-gpipe", "torch-gpipe"), ("ours-varuna", DEEPSPEED), ("ours-1f1b", DEEPSPEED),
    ("ours-zb", "ours-1f1b"), ("ours-varuna-zb", "ours-varuna"), ("ours-zb", "torch-zb"),
    ("ours-varuna-bf16", "ours-varuna"), ("ours-varuna-bf16", "torch-1f1b"),
    ("ours-varuna", "torch-1f1b"), ("ours-1f1b", "torch-1f1b"),
]
WORLD = 2  # pipeline stages (the ranks of one replica)
DP_CONTENDERS = ("ours-", DEEPSPEED, "torch-1f1b")  # prefixes of those that run with --dp 2
DS_INSTALL = "DS_BUILD_OPS=0 {pip} install deepspeed"


# ----------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Compare the step time of our pipeline runtime with torch.distributed.pipelining "
        "(2 stages on 2 local processes, gloo, CPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64, help="sequence length of every example")
    p.add_argument("--microbatch-size", type=int, default=4, help="examples per micro-batch")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (M)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps before the measured ones")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs per contender, in alternating order; the best round is reported")
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated subset of: {', '.join(CONTENDERS)} (default: all; with --dp 2, all that run "
                   "with replicas)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (same for all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds one run (a pair of worker processes) may take before both are killed")
    p.add_argument("--dp", type=int, choices=(1, 2), default=1,
                   help="data-parallel replicas of the 2-stage pipeline (2: 4 processes; each replica runs "
                   "--microbatches micro-batches, so the global batch doubles). With --network slow each replica "
                   "is a host (a namespace) of its own, so the pipeline's messages stay inside a host and the "
                   "data-parallel all-reduce crosses the rate-limited link")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="ours: size of the data-parallel all-reduce's buckets (Varuna's bucket_mb; with --dp 2)")
    p.add_argument("--network", choices=("loopback", "slow"), default="loopback",
                   help="loopback: both ranks on 127.0.0.1; slow: each rank in its own network namespace, "
                   "joined by a veth pair limited to --rate (and --delay) with tc (needs root)")
    p.add_argument("--rate", default="200mbit",
                   help="--network slow: rate of each direction of the link (tc units: kbit, mbit, gbit)")
    p.add_argument("--delay", default="0ms",
                   help="--network slow: added one-way delay (us, ms, s) with tc netem; needs the kernel's "
                   "netem qdisc")
    p.add_argument("--install-deepspeed", action="store_true",
                   help="pip-install DeepSpeed first if it is missing (DS_BUILD_OPS=0, torch pinned as installed)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="cProfile the measured steps of every rank into DIR/<contender>-round<r>-rank<k>.prof "
                   "(profiling inflates the timings: use it to see where time goes, not to compare)")
    p.add_argument("--keep-logs", metavar="DIR", default=None, help="keep worker specs, logs and results in DIR")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    given = args.contenders is not None
    names = [c.strip() for c in (args.contenders or ",".join(CONTENDERS)).split(",") if c.strip()]
    if not given and args.dp > 1:
        names = [c for c in names if c.startswith(DP_CONTENDERS)]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown or not names:
        p.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    args.contender_list = list(dict.fromkeys(names))
    if args.dp > 1:
        single = [c for c in args.contender_list if not c.startswith(DP_CONTENDERS)]
        if single:
            p.error(f"--dp {args.dp} runs {', '.join(c for c in CONTENDERS if c.startswith(DP_CONTENDERS))}; not "
                    f"{', '.join(single)} (torch's GPipe and zero-bubble schedules fail under DDP in torch 2.13: "
                    "its reducer asserts)")
    if args.n_layer < 2:
        p.error("--n-layer must be at least 2 (one block per stage at least)")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    if args.microbatches < WORLD:
        p.error(f"--microbatches must be at least {WORLD} (torch's Schedule1F1B requires M >= stages)")
    if not args.bucket_mb > 0:
        p.error("--bucket-mb must be > 0")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.microbatch_size < 1:
        p.error("--steps, --rounds and --microbatch-size must be >= 1, --warmup >= 0")
    try:
        args.rate_bps, args.delay_s = parse_rate(args.rate), parse_delay(args.delay)
    except ValueError as e:
        p.error(str(e))
    return args


# ----------------------------------------------------------------------------------------------------------
# Worker: one rank of one contender


def _vm_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ru_maxrss where /proc is missing), in MB."""
    kb = _vm_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def place(contender: str, rank: int, dp: int) -> tuple[int, int]:
    """(stage, replica) of ``rank``: ours and torch number a replica's stages consecutively (ours' map
    ``"0,2;1,3"`` at dp=2), DeepSpeed's topology a stage's replicas (``rank = stage·dp + replica``)."""
    if contender == DEEPSPEED:
        return rank // dp, rank % dp
    return rank % WORLD, rank // WORLD


def worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, GPTConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init_process_group(spec["contender"], rank, world, float(spec["timeout"]))
    rss_after_import = peak_rss_mb()

    M, mbs, T, L = spec["microbatches"], spec["microbatch_size"], spec["block_size"], spec["n_layer"]
    ds = CharDataset.load()
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=T, n_layer=L, n_head=spec["n_head"],
                    n_embd=spec["n_embd"], dropout=0.0)
    torch.manual_seed(spec["seed"])
    job = _Job(spec=spec, rank=rank, world=world, ds=ds, cfg=cfg, gpt=GPT(cfg))
    total_params = job.gpt.num_parameters()
    # Every step's global batch, drawn up front from a generator seeded by (seed, step): same data for all.
    batches = [ds.get_batch("train", M * mbs * spec.get("dp", 1), T,
                            torch.Generator().manual_seed(spec["seed"] * 1_000_003 + i))
               for i in range(spec["warmup"] + spec["steps"])]

    t_setup = time.perf_counter()
    if spec["contender"].startswith("ours-"):
        step, params, param_names = _setup_ours(job)
    elif spec["contender"] == DEEPSPEED:
        step, params, param_names = _setup_deepspeed(job)
    else:
        step, params, param_names = _setup_torch(job)
    setup_s = time.perf_counter() - t_setup
    rss_after_setup = peak_rss_mb()

    times, cpu_times, losses = _run_steps(step, batches, spec, rank)
    result = {
        "rank": rank,
        "contender": spec["contender"],
        "times_s": times,
        "cpu_s": cpu_times,  # process CPU time (all threads) during each measured step
        "losses": losses,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_after_import_mb": rss_after_import,
        "peak_rss_after_setup_mb": rss_after_setup,
        "setup_s": setup_s,
        "stage_params": sum(p.numel() for p in params),
        "stage_param_names": param_names,
        "total_params": total_params,
        "torch": torch.__version__,
        # ours: median compute per action kind (ms) over the measured steps
        "action_compute_ms": {op: statistics.median(v) for op, v in job.action_compute.items() if v},
    }
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


class _Job:
    """What every contender's set-up needs: the spec, this rank, the data, the GPT and its config."""

    def __init__(self, *, spec: dict, rank: int, world: int, ds, cfg, gpt) -> None:
        self.spec, self.rank, self.world, self.ds, self.cfg = spec, rank, world, ds, cfg
        self.dp = int(spec.get("dp", 1))
        self.stage, self.replica = place(spec["contender"], rank, self.dp)
        self.gpt = gpt  # the whole model (torch's contenders drop it once their stage is built)
        self.k = spec["n_layer"] // 2  # blocks on stage 0
        self.M, self.mbs, self.T, self.L = (spec["microbatches"], spec["microbatch_size"], spec["block_size"],
                                            spec["n_layer"])
        self.batch_size = self.M * self.mbs  # one replica's
        self.timeout = float(spec["timeout"])
        self.action_compute: dict[str, list[float]] = {}  # ours: per op, the compute ms of each measured action


def _init_process_group(contender: str, rank: int, world: int, timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    if contender == DEEPSPEED:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is imported; without it, it looks for a GPU
        import deepspeed

        deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=timeout), verbose=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))


def _peer_parts(cfg):
    """(Embeddings, untied_head, loss_fn): the pieces torch's and DeepSpeed's contenders build the GPT from."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Embeddings(nn.Module):
        """Token + position embeddings (ours: segment 0): the first layer of stage 0 for torch and DeepSpeed."""

        def __init__(self, g) -> None:
            super().__init__()
            self.wte, self.wpe, self.drop = g.wte, g.wpe, g.drop

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
            return self.drop(self.wte(idx) + self.wpe(pos))

    def untied_head(g) -> nn.Linear:
        """The head with a weight of its own, starting equal to the embedding (no cross-stage ties for peers)."""
        head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        with torch.no_grad():
            head.weight.copy_(g.wte.weight)
        return head

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The peers' loss on the last stage's logits: the GPT's own (mean cross-entropy)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Embeddings, untied_head, loss_fn


def _setup_ours(job: _Job):
    """(step, params, param names) of ours: Varuna with the contender's schedule and the same split."""
    import torch
    from model import SHARED_WEIGHTS

    from varuna_core import Varuna

    # Segments (model.py): 0 = wte+wpe, i = blocks[i-1] for 1 <= i < L, L = blocks[L-1] + ln_f + lm_head.
    # Stage 0 = segments [0, k+1) = embeddings + blocks[:k]; stage 1 = blocks[k:] + ln_f + head + loss.
    k, L, spec = job.k, job.L, job.spec
    partition = [(0, k + 1), (k + 1, L + 1)]
    dummy = job.ds.get_batch("train", job.mbs, job.T, torch.Generator().manual_seed(spec["seed"]))
    name = spec["contender"].removeprefix("ours-")
    schedule, wire = (name.removesuffix("-bf16"), "bf16") if name.endswith("-bf16") else (name, None)
    stages = ";".join(",".join(str(r * WORLD + s) for r in range(job.dp)) for s in range(WORLD))  # "0;1", "0,2;1,3"
    model = Varuna(job.gpt, stages, dummy, batch_size=job.batch_size * job.dp, chunk_size=job.mbs,
                   shared_weights=SHARED_WEIGHTS, schedule=schedule, partition=partition, from_cache=False,
                   timeout=job.timeout, wire_dtype=wire, bucket_mb=float(spec.get("bucket_mb", 25.0)))
    params = list(model.parameters())
    param_names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.SGD(params, lr=spec["lr"])
    model.set_optimizer(optimizer)
    steps_run = [0]
    model.executor.add_observer(_compute_recorder(job.action_compute, lambda: steps_run[0] > spec["warmup"]))

    def step(batch: dict) -> float | None:
        steps_run[0] += 1
        loss, overflow = model.step(model.replica_slice(batch))  # the whole batch at dp=1
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return step, params, param_names


def _compute_recorder(into: dict[str, list[float]], measuring):
    """An executor observer that appends each measured action's compute (its waits for messages excluded), in ms,
    to ``into[op]``: what the critical-path limit (:func:`critical_path_bound`) is computed from."""
    from varuna_core.pipeline.tracing import ActionObserver

    class Recorder(ActionObserver):
        def on_action(self, timing) -> None:
            if measuring():
                into.setdefault(timing.action.op.value, []).append(timing.compute * 1e3)

    return Recorder()


def _setup_deepspeed(job: _Job):
    """(step, params, param names) of DeepSpeed's PipelineModule + engine.train_batch()."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    Embeddings, untied_head, loss_fn = _peer_parts(job.cfg)
    k, L, mbs = job.k, job.L, job.mbs
    # The GPT as a sequence of layers: DeepSpeed runs a stage as ``x = layer(x)`` over its layers.
    gpt = job.gpt
    layers = [Embeddings(gpt), *gpt.blocks, gpt.ln_f, untied_head(gpt)]
    # DeepSpeed has no explicit split: "type:REGEX" balances the number of layers whose class matches.
    # Counting the blocks (and, for an odd n_layer, the embeddings too) has exactly one balanced split:
    # stage 0 = embeddings + blocks[:k], stage 1 = the rest, as for the other contenders (checked below).
    counted = "^block$" if L % 2 == 0 else "^(embeddings|block)$"
    module = PipelineModule(layers, num_stages=WORLD, loss_fn=loss_fn, partition_method=f"type:{counted}")
    if module.parts != [0, k + 1, len(layers)]:
        raise RuntimeError(f"DeepSpeed split the layers at {module.parts}, not [0, {k + 1}, {len(layers)}]")
    # The module keeps the whole list, so the other stage's layers stay in memory (0.4 MB here; every
    # contender's peak RSS includes the whole GPT anyway, built before the split).
    param_names = [n for n, _ in module.named_parameters()]
    params = list(module.parameters())
    config = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": job.M,
        "train_batch_size": job.batch_size * job.dp,  # the replicas' together
        "steps_per_print": job.spec["warmup"] + job.spec["steps"] + 1,  # no progress lines (nor timer reads)
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told not to; the others do not clip
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(params, lr=job.spec["lr"]),
                                      config=config)

    def step(batch: dict) -> float | None:
        # train_batch pulls M (inputs, targets) micro-batches, runs the 1F1B schedule, the optimizer step and
        # zero_grad, and returns the mean loss on every stage.
        mine = _replica_slice(batch, job)
        micro = zip(mine["idx"].split(mbs), mine["targets"].split(mbs), strict=True)
        return float(engine.train_batch(iter(micro)))

    return step, params, param_names


def _replica_slice(batch: dict, job: _Job) -> dict:
    """This rank's replica's contiguous part of the global batch (as ours' ``replica_slice`` takes it)."""
    n = job.batch_size
    return {k: v[job.replica * n:(job.replica + 1) * n] for k, v in batch.items()}


def _torch_stages(job: _Job, gpt):
    """This rank's stage of the GPT as a plain module for torch.distributed.pipelining, and the loss."""
    import torch
    import torch.nn as nn

    Embeddings, untied_head, loss_fn = _peer_parts(job.cfg)
    k = job.k

    class Stage0(nn.Module):
        """Embeddings + the first k blocks (what ours runs as segments [0, k+1))."""

        def __init__(self, g) -> None:
            super().__init__()
            self.embed = Embeddings(g)
            self.blocks = nn.ModuleList(g.blocks[:k])

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return x

    class Stage1(nn.Module):
        """The other blocks + final LayerNorm + head; the loss is the schedule's loss_fn."""

        def __init__(self, g) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(g.blocks[k:])
            self.ln_f = g.ln_f
            self.lm_head = untied_head(g)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return (Stage0(gpt) if job.stage == 0 else Stage1(gpt)), loss_fn


def _setup_torch(job: _Job):
    """(step, params, param names) of torch.distributed.pipelining's PipelineStage + Schedule1F1B, ScheduleGPipe
    or ScheduleInterleavedZeroBubble (a multi-stage schedule, here with one stage per rank: ZB-H1's order, its
    backward split by walking the autograd graph)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
    )

    submodule, loss_fn = _torch_stages(job, job.gpt)
    job.gpt = None
    param_names = [n for n, _ in submodule.named_parameters()]
    pipe_group = dp_group = None
    if job.dp > 1:  # every rank makes every group, in one order: each replica's pipeline, each stage's replicas
        pipes = [dist.new_group([r * WORLD + s for s in range(WORLD)]) for r in range(job.dp)]
        stages = [dist.new_group([r * WORLD + s for r in range(job.dp)]) for s in range(WORLD)]
        pipe_group, dp_group = pipes[job.replica], stages[job.stage]
        # the schedule's last backward lets DDP reduce the gradients, the others run under no_sync
        submodule = torch.nn.parallel.DistributedDataParallel(submodule, process_group=dp_group)
    stage = PipelineStage(submodule, job.stage, WORLD, torch.device("cpu"), group=pipe_group)
    contender = job.spec["contender"]
    if contender == "torch-zb":
        schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=job.M, loss_fn=loss_fn)
    else:
        schedule_cls = Schedule1F1B if contender == "torch-1f1b" else ScheduleGPipe
        schedule = schedule_cls(stage, n_microbatches=job.M, loss_fn=loss_fn)
    params = list(submodule.parameters())
    optimizer = torch.optim.SGD(params, lr=job.spec["lr"])

    def step(batch: dict) -> float | None:
        batch = _replica_slice(batch, job)
        if job.stage == 0:
            schedule.step(batch["idx"])
            loss = None
        else:
            losses: list = []
            schedule.step(target=batch["targets"], losses=losses, return_outputs=False)
            mean = torch.stack([x.detach() for x in losses]).mean()
            if dp_group is not None:  # the global batch's loss, as ours and DeepSpeed return it
                dist.all_reduce(mean, group=dp_group)
                mean /= job.dp
            loss = float(mean)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, params, param_names


def _run_steps(step, batches: list, spec: dict, rank: int) -> tuple[list[float], list[float], list[float | None]]:
    """Every step after a barrier: wall and CPU times of the measured ones, every step's loss (cProfile on
    request)."""
    import torch.distributed as dist

    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float | None] = []
    profiler = None
    for i, batch in enumerate(batches):
        if i == spec["warmup"] and spec.get("profile"):
            import cProfile

            profiler = cProfile.Profile()
        dist.barrier()
        if profiler is not None:
            profiler.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = step(batch)
        t1, c1 = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.disable()
        losses.append(loss)
        if i >= spec["warmup"]:
            times.append(t1 - t0)
            cpu_times.append(c1 - c0)
    dist.barrier()
    if profiler is not None:
        profiler.dump_stats(spec["profile"].replace("{rank}", str(rank)))  # one file per rank
    return times, cpu_times, losses


# ----------------------------------------------------------------------------------------------------------
# Slow network: two network namespaces joined by a rate-limited veth pair

NS_PREFIX = "pvp"  # namespaces are named pvp<launcher pid>-r<rank>
IFNAME = "eth0"  # the veth end in each namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.98.0"  # the pair links only its two namespaces, so no address of the machine can clash with it


class NetworkUnavailable(Exception):
    """The slow network cannot be set up on this machine; the message says why."""


def namespace_owner(name: str) -> int | None:
    """The pid of the launcher that created namespace ``name``, or None if it is not one of ours."""
    m = re.fullmatch(rf"{NS_PREFIX}(\d+)-r\d+", name)
    return int(m[1]) if m else None


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def ensure_iproute2() -> None:
    """Install iproute2 (``ip``, ``tc``) with apt-get if either is missing."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    if not shutil.which("apt-get"):
        raise NetworkUnavailable("ip or tc is missing and there is no apt-get to install iproute2")
    log("installing iproute2 (ip, tc) with apt-get ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "iproute2"]):
        proc = subprocess.run(argv, check=False, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode:
            raise NetworkUnavailable(f"ip or tc is missing and `{' '.join(argv)}` failed: {_last_line(proc.stderr)}")
    if not (shutil.which("ip") and shutil.which("tc")):
        raise NetworkUnavailable("ip or tc is still missing after installing iproute2")


def _kill_namespace(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns``, then delete it (with its end of the veth pair, so the pair)."""
    kill_namespace_processes(ns)
    _run(["ip", "netns", "delete", ns])


def remove_stale_namespaces() -> None:
    """Remove the namespaces that runs killed before their clean-up (their launcher's pid is gone) left."""
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = namespace_owner(name)
        if owner is None or owner == os.getpid():
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            _kill_namespace(name)
        except PermissionError:  # alive, someone else's
            pass


class SlowNetwork:
    """One network namespace per rank, the two joined by a veth pair whose ends each send at most ``rate_bps``.

    The pair connects only these two namespaces: no bridge, no route to the rest of the machine (whose firewall
    never sees the traffic) and no address of the machine to clash with. Rank 0's address is MASTER_ADDR and
    gloo is bound to the veth end (GLOO_SOCKET_IFNAME), so all traffic between the ranks crosses the limited
    link. ``close()`` (also at exit) kills what still runs in the namespaces and deletes them.
    """

    def __init__(self, rate_bps: int, delay_s: float) -> None:
        self.rate_bps, self.delay_s = rate_bps, delay_s
        self.namespaces = [f"{NS_PREFIX}{os.getpid()}-r{r}" for r in range(WORLD)]
        self.addresses = [f"{SUBNET}.{r + 1}" for r in range(WORLD)]
        self._created: list[str] = []

    def open(self) -> None:
        """Create the namespaces and the link; NetworkUnavailable (with the reason) when this machine cannot."""
        ensure_iproute2()
        remove_stale_namespaces()
        atexit.register(self.close)
        try:
            for ns in self.namespaces:
                self._must("cannot create network namespaces", ["ip", "netns", "add", ns])
                self._created.append(ns)
            a, b = self.namespaces
            self._must("cannot create a veth pair", ["ip", "link", "add", "name", IFNAME, "netns", a, "type", "veth",
                                                     "peer", "name", IFNAME, "netns", b])
            for ns, address in zip(self.namespaces, self.addresses, strict=True):
                self._must("cannot configure the link", ["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME])
                self._must("cannot configure the link", ["ip", "-n", ns, "link", "set", IFNAME, "up"])
                self._must("cannot configure the link", ["ip", "-n", ns, "link", "set", "lo", "up"])
                for argv in tc_commands(IFNAME, self.rate_bps, self.delay_s):
                    what = ("cannot delay the link with netem (--delay 0ms runs without it)" if "netem" in argv
                            else "cannot rate-limit the link with tbf")
                    self._must(f"tc {what}", ["tc", "-n", ns, *argv])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        atexit.unregister(self.close)
        for ns in self._created:
            _kill_namespace(ns)
        self._created = []

    def command(self, rank: int) -> list[str]:
        """The prefix that runs a command in ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def env(self) -> dict[str, str]:
        """What the workers of both ranks add to their environment."""
        return {"MASTER_ADDR": self.addresses[0], "GLOO_SOCKET_IFNAME": IFNAME}

    def describe(self) -> str:
        delay = f", {self.delay_s * 1e3:g} ms delay (netem)" if self.delay_s > 0 else ", no added delay"
        return (f"slow: one network namespace per rank, joined by a veth pair; each direction limited to "
                f"{self.rate_bps / 1e6:g} Mbit/s (tc tbf){delay}; gloo on {IFNAME}")

    @staticmethod
    def _must(what: str, argv: list[str]) -> None:
        proc = _run(argv)
        if proc.returncode:
            raise NetworkUnavailable(f"{what} ({' '.join(argv)}: {_last_line(proc.stderr)})")


# ----------------------------------------------------------------------------------------------------------
# Launcher


def loadavg() -> float | None:
    """1-minute load average (other work on the machine distorts the timings)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_pair(spec: dict, workdir: Path, tag: str, timeout: float,
             network: SlowNetwork | None) -> tuple[list[dict] | None, str | None, float | None]:
    """Run both ranks of one contender in fresh processes (each in its namespace on a slow ``network``); kill
    both on timeout or when one fails.

    Returns the ranks' results (or None and an error), and the average number of cores other processes on the
    machine kept busy meanwhile (machine-wide busy CPU time minus this launcher's and its workers').
    """
    load = Load()
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    dp = int(spec.get("dp", 1))
    world = WORLD * dp
    outs = [workdir / f"{tag}.rank{rank}.json" for rank in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    env = {"MKL_NUM_THREADS": "1", "VARUNA_TIMEOUT": str(int(timeout)), **(network.env() if network else {})}

    def argv(rank: int) -> list[str]:
        # one namespace per rank; with replicas, one per replica (its stages talk inside it, the replicas across)
        host = rank if dp == 1 else place(spec["contender"], rank, dp)[1]
        prefix = network.command(host) if network is not None else []
        return [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(outs[rank])]

    # rank 0 hosts the store (no agent store): on a slow network the workers cannot reach this namespace
    outcome = run_workers(argv, world, log_dir=workdir, log_name=f"{tag}.rank{{rank}}.log", timeout=timeout,
                          env=env, cwd=ROOT, agent_store=False, die_with_parent=True, poll=0.05)
    others = load.other_cores()
    error = _pair_error(outcome, outs)
    if error is not None:
        for rank in range(world):
            text = (workdir / f"{tag}.rank{rank}.log").read_text()
            log(f"--- {tag} rank {rank} log (last 3000 chars) ---\n{text[-3000:]}")
        return None, error, others
    return [json.loads(o.read_text()) for o in outs], None, others


def _pair_error(outcome: JobOutcome, outs: list[Path]) -> str | None:
    if outcome.failed is not None:
        return f"a worker exited with code {outcome.failed[1]}"
    if outcome.timed_out:
        return f"timed out after {outcome.timeout:g}s"
    if any(outcome.returncodes):
        return f"worker exit codes {outcome.returncodes}"
    if not all(o.exists() for o in outs):
        return "a worker finished without writing its result"
    return None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_run(ranks: list[dict]) -> dict:
    per_step = [max(r["times_s"][i] for r in ranks) * 1e3 for i in range(len(ranks[0]["times_s"]))]
    last = ranks[-1]
    return {
        "median_ms": statistics.median(per_step),
        "p10_ms": percentile(per_step, 10),
        "p90_ms": percentile(per_step, 90),
        "step_ms": per_step,
        "rank_median_ms": [statistics.median(r["times_s"]) * 1e3 for r in ranks],
        "rank_cpu_fraction": [sum(r["cpu_s"]) / max(sum(r["times_s"]), 1e-12) for r in ranks],
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "peak_rss_after_setup_mb": [r["peak_rss_after_setup_mb"] for r in ranks],
        "peak_rss_after_import_mb": [r["peak_rss_after_import_mb"] for r in ranks],
        "setup_s": [r["setup_s"] for r in ranks],
        "stage_params": [r["stage_params"] for r in ranks],
        "action_compute_ms": [r.get("action_compute_ms") or {} for r in ranks],
        "losses": last["losses"],  # the last stage always reports the loss
    }


def pip_command() -> str:
    """How to call this interpreter's pip, for messages."""
    return str(Path(sys.executable).with_name("pip"))


def install_deepspeed() -> str | None:
    """pip-install DeepSpeed next to this interpreter's torch; returns an error message, or None.

    ``DS_BUILD_OPS=0``: no native ops are built (none is needed on CPU). pip is constrained to the installed
    torch, so a DeepSpeed that wants another torch fails to install instead of replacing it.
    """
    torch_version = importlib.metadata.version("torch")
    log(f"installing DeepSpeed: {DS_INSTALL.format(pip=pip_command())}, torch kept at {torch_version} ...")
    with tempfile.NamedTemporaryFile("w", prefix="torch-pin.", suffix=".txt") as pin:
        pin.write(f"torch=={torch_version}\n")
        pin.flush()
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-c", pin.name, "deepspeed"],
                              check=False, env=dict(os.environ, DS_BUILD_OPS="0"), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True)
    if proc.returncode:
        return f"installing DeepSpeed failed (pip exit {proc.returncode}): {_last_line(proc.stderr)}"
    if importlib.metadata.version("torch") != torch_version:
        return f"installing DeepSpeed changed torch from {torch_version} to {importlib.metadata.version('torch')}"
    log(f"installed DeepSpeed {importlib.metadata.version('deepspeed')}")
    return None


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    # A terminated launcher still kills its workers and removes its namespaces (the finally blocks and atexit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = _contenders(args)
    if not names:
        return 1 if names is None else 0
    network = None
    if args.network == "slow":
        network = SlowNetwork(args.rate_bps, args.delay_s)
        try:
            network.open()
        except NetworkUnavailable as e:
            log(f"--network slow skipped: {e}")
            return 0
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        log("note: --profile is on; cProfile inflates the step times, do not compare them with unprofiled runs")
    tmp = None
    if args.keep_logs:
        workdir = Path(args.keep_logs)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline_vs_peers.")
        workdir = Path(tmp.name)

    runs: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    meta: dict[str, Any] = {}
    t_all = time.perf_counter()
    meta["loadavg_before"] = loadavg()
    meta["cpus"] = os.cpu_count()
    meta["network"] = network.describe() if network else "loopback (127.0.0.1)"
    if DEEPSPEED in names:
        meta["deepspeed"] = importlib.metadata.version("deepspeed")
    try:
        for rnd in range(args.rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                _run_round(args, name, rnd, workdir, network, t_all, runs, errors, meta)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if network is not None:
            network.close()
        if tmp is not None:
            tmp.cleanup()
    elapsed = time.perf_counter() - t_all

    report = build_report(args, names, runs, errors, meta, elapsed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if not any(errors.values()) else 1


def _contenders(args) -> list[str] | None:
    """The contenders to run (DeepSpeed dropped, or installed, when missing); None when installing failed."""
    names = args.contender_list
    if DEEPSPEED in names and importlib.util.find_spec("deepspeed") is None:
        if args.install_deepspeed:
            error = install_deepspeed()
            if error:
                log(f"error: {error}")
                return None
        else:
            log(f"{DEEPSPEED} skipped: DeepSpeed is not installed (install it with "
                f"`{DS_INSTALL.format(pip=pip_command())}`, or pass --install-deepspeed)")
            names = [n for n in names if n != DEEPSPEED]
    return names


def _run_round(args, name: str, rnd: int, workdir: Path, network: SlowNetwork | None, t_all: float,
               runs: dict[str, list[dict]], errors: dict[str, list[str]], meta: dict[str, Any]) -> None:
    """One contender's run of round ``rnd``: its summary goes to ``runs``, or its error to ``errors``."""
    spec_base = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "block_size", "microbatch_size",
                                              "microbatches", "steps", "warmup", "lr", "seed", "timeout", "dp",
                                              "bucket_mb")}
    tag = f"{name}-round{rnd}"
    spec = dict(spec_base, contender=name)
    if args.profile:
        spec["profile"] = str(Path(args.profile).resolve() / f"{tag}-rank{{rank}}.prof")
    log(f"[{time.perf_counter() - t_all:6.1f}s] round {rnd + 1}/{args.rounds}: {CONTENDERS[name]} ...")
    ranks, err, others = run_pair(spec, workdir, tag, args.timeout, network)
    if others is not None:
        meta.setdefault("other_cores", []).append(others)
        if others > 0.2:
            log(f"  warning: other processes kept {others:.2f} cores busy during this run")
    if err is not None:
        log(f"  {CONTENDERS[name]} failed: {err}")
        errors[name].append(err)
        return
    summary = summarize_run(ranks)
    summary["round"] = rnd
    summary["other_cores"] = others
    runs[name].append(summary)
    meta.setdefault("total_params", ranks[0]["total_params"])
    meta.setdefault("torch", ranks[0]["torch"])
    meta.setdefault("stage_param_names", {})[name] = [r["stage_param_names"] for r in ranks]
    log(f"  median {summary['median_ms']:.2f} ms/step, loss(step 1) {summary['losses'][0]:.5f}")


def build_report(args, names, runs, errors, meta, elapsed) -> dict:
    base = None
    best: dict[str, dict] = {}
    for name in names:
        if runs[name]:
            best[name] = min(runs[name], key=lambda r: r["median_ms"])
    if BASELINE in best:
        base = best[BASELINE]["median_ms"]
    ref_losses = best.get("ours-1f1b", next(iter(best.values()), None))
    ref_losses = ref_losses["losses"] if ref_losses else None
    contenders = [_contender_entry(name, runs[name], errors[name], best.get(name), base, ref_losses)
                  for name in names]
    ratios = []
    for ours, theirs in PAIRS:
        if ours in best and theirs in best:
            ratios.append({"ours": CONTENDERS[ours], "peer": CONTENDERS[theirs],
                           "ratio": best[ours]["median_ms"] / best[theirs]["median_ms"]})
    # Same split check: the number of parameters each rank holds must agree between all contenders.
    split = {n: best[n]["stage_params"] for n in best}
    same_split = len({tuple(sorted(v)) for v in split.values()}) <= 1  # DeepSpeed numbers its ranks otherwise
    slow = getattr(args, "network", "slow") == "slow" and getattr(args, "rate_bps", None)
    limit = link_bound(args, _replica_params(split)) if slow else None  # the loopback has no link to be bound by
    if limit is not None:
        for entry in contenders:
            bound = limit["ms"].get(_limit_kind(entry["key"]))
            if "median_ms" in entry and bound is not None:
                entry["of_link_limit"] = bound / entry["median_ms"]
                # the peers' compute is not observed action by action: ours 1f1b's (same model and split) stands in
                source = best.get(entry["key"] if entry["key"].startswith("ours-") else "ours-1f1b")
                compute = source["action_compute_ms"] if source else None
                if compute and all(compute):
                    entry["critical_path"] = critical_path_bound(args, compute, _limit_kind(entry["key"]),
                                                                 limit)
                    entry["of_critical_path"] = entry["critical_path"]["ms"] / entry["median_ms"]
    return {
        "link_bound": limit,
        "config": _report_config(args, meta),
        "machine_load": {"loadavg_1min_before": meta.get("loadavg_before"),
                         "other_cores_max": max(meta.get("other_cores") or [0.0]),
                         "other_cores_mean": statistics.mean(meta.get("other_cores") or [0.0])},
        "method": "per step: max over ranks of perf_counter() around step+optimizer.step+zero_grad (after a "
                  "barrier); median/p10/p90 over measured steps; best round by median; peak RSS = VmHWM per rank, "
                  "max over rounds",
        "notes": [
            ("torch contenders: lm_head has its own weight (initialised to a copy of wte), because torch "
             "pipelining has no cross-stage tied weights; same compute. Ours keeps the tie and all-reduces "
             "its gradient between the stages every step (and all-reduces the loss so every rank returns it)."),
            ("DeepSpeed: PipelineModule over [embeddings, blocks..., ln_f, head] with the same untied head; "
             "engine.train_batch() = its 1F1B schedule + optimizer step; fp32, no ZeRO; it broadcasts the loss "
             "to every stage."),
            ("step-1 losses should match (same initial values); later losses differ for torch and DeepSpeed "
             "because the untied head and embedding get different updates, but torch's and DeepSpeed's agree "
             "with each other (the same untied model and updates)."),
        ],
        "same_split": same_split,
        "stage_params": split,
        "contenders": contenders,
        "ratios": ratios,
        "elapsed_s": elapsed,
    }


def _contender_entry(name: str, runs: list[dict], errors: list[str], b: dict | None, base: float | None,
                     ref_losses: list[float] | None) -> dict:
    """One contender in the report: its best round ``b`` (by median), the other rounds, its errors."""
    entry: dict[str, Any] = {"key": name, "contender": CONTENDERS[name], "errors": errors}
    if b is not None:
        entry.update(
            median_ms=b["median_ms"], p10_ms=b["p10_ms"], p90_ms=b["p90_ms"],
            ratio_vs_torch_1f1b=(b["median_ms"] / base) if base else None,
            round_medians_ms=[r["median_ms"] for r in runs],
            best_round=b["round"],
            rank_median_ms=b["rank_median_ms"],
            rank_cpu_fraction=b["rank_cpu_fraction"],
            other_cores_by_round=[r["other_cores"] for r in runs],
            peak_rss_mb=[max(r["peak_rss_mb"][k] for r in runs) for k in range(len(b["peak_rss_mb"]))],
            peak_rss_after_setup_mb=b["peak_rss_after_setup_mb"],
            peak_rss_after_import_mb=b["peak_rss_after_import_mb"],
            setup_s=b["setup_s"],
            stage_params=b["stage_params"],
            loss_first_step=b["losses"][0],
            loss_last_step=b["losses"][-1],
            loss_first_step_diff_vs_ours_1f1b=(b["losses"][0] - ref_losses[0]) if ref_losses else None,
            loss_last_step_diff_vs_ours_1f1b=(b["losses"][-1] - ref_losses[-1]) if ref_losses else None,
            step_ms=b["step_ms"],
        )
    return entry


def _limit_kind(name: str) -> str:
    """Which link-bound limit a contender is held to: ours keep the tied embedding and all-reduce it (the peers
    untie it), and a bf16 wire halves the activations and gradients."""
    if name.endswith("-bf16"):
        return "ours-bf16"
    return "ours" if name.startswith("ours-") else "peers"


def _replica_params(split: dict[str, list[int]]) -> dict[str, float]:
    """Parameters one replica holds (its stages' together; ours counts the tied weight on both stages, as both
    all-reduce it), per kind of contender, from the parameter counts each rank reported."""
    out: dict[str, float] = {}
    for name, per_rank in split.items():
        kind = "ours" if name.startswith("ours-") else "peers"
        out.setdefault(kind, sum(per_rank) * WORLD / len(per_rank))
    if "ours" in out:
        out["ours-bf16"] = out["ours"]  # the wire dtype narrows the messages between stages, not the all-reduce
    return out


def link_bound(args, replica_params: dict[str, float] | None = None) -> dict[str, Any]:
    """The step time the rate-limited link alone allows (the link is full duplex: each direction carries its own
    bytes). One replica (``--dp 1``, the two stages on either side of the link): every micro-batch's activation
    (``microbatch_size × block_size × n_embd`` fp32) one way and its gradient the other, plus, for ours, the tied
    embedding's all-reduce between the two stages (a ring of two: each side sends the whole gradient once). Two
    replicas (``--dp 2``, a replica on either side): each stage's data-parallel all-reduce, a ring of two, sends
    the stage's whole gradient each way, so each direction carries a replica's parameters (``replica_params``, by
    kind of contender; fp32) and the messages between stages stay inside the hosts. A perfect overlap of compute
    with the link reaches it when the link takes longer than the compute (which it cannot quite: see
    :func:`critical_path_bound`)."""
    if args.dp > 1:
        per_direction = {k: int(v) * 4 for k, v in (replica_params or {}).items()}
    else:
        sys.path.insert(0, str(GPT_DIR))
        from data import CharDataset

        activations = args.microbatches * args.microbatch_size * args.block_size * args.n_embd * 4
        tie = CharDataset.load().vocab_size * args.n_embd * 4
        per_direction = {"peers": activations, "ours": activations + tie, "ours-bf16": activations // 2 + tie}
    return {"rate_bps": args.rate_bps, "bytes_per_direction": per_direction,
            "ms": {k: v * 8 / args.rate_bps * 1e3 for k, v in per_direction.items()}}


def critical_path_bound(args, compute: list[dict[str, float]], kind: str,
                        link: dict[str, Any] | None = None) -> dict[str, Any]:
    """The least step time any schedule can reach on this link with this compute: the link-bound limit with the
    part that no overlap can hide, from each rank's median compute per action (``compute[rank][op]``, ms).

    ``a`` and ``g`` are one micro-batch's activation and gradient on the link (bytes ÷ rate, the wire dtype's
    bytes), ``tie`` ours' tied-embedding all-reduce (it needs both stages' last backward), ``M`` the
    micro-batches; ``F0 R0 B0 W0`` and ``F1 B1 W1`` the stages' actions (a missing kind counts 0). Each term is a
    chain of work that must happen one after another in every schedule, so the step takes at least the longest:

    * activations: the first forward, then ``M`` activations one after another on the link; the last one to
      arrive still needs its forward and backward on stage 1, its gradient's crossing and its backward on
      stage 0: ``F0 + M·a + F1 + B1 + g + B0 + tie``;
    * gradients: the first gradient leaves after ``F0 + a + F1 + B1``, then ``M`` gradients cross one after
      another, and the last needs its backward on stage 0: ``F0 + a + F1 + B1 + M·g + B0 + tie``;
    * stage 0's compute: ``M·(F0 + R0 + B0 + W0) + tie``;
    * stage 1's compute: it cannot start before ``F0 + a``; ``+ M·(F1 + B1 + W1)``, then (when its last action is
      a backward) the gradient's crossing and stage 0's backward ``g + B0``; ``+ tie``.

    The optimizer step and ``zero_grad`` are left out, which keeps it a lower bound. The bytes-÷-rate limit
    (:func:`link_bound`) is what this becomes when the compute takes no time.

    With two replicas (``--dp 2``, ``compute`` per rank in ours' order, ``rank = replica·2 + stage``) the messages
    between stages stay inside a host and the link carries the data-parallel all-reduces (``link``, from
    :func:`link_bound`), whose bytes are final only once the stages' last backwards run: no byte of them can
    cross before stage 1's last backward starts, after the first forward and stage 1's other work
    (``F0 + M·F1 + (M-1)·B1 + all-reduce bytes ÷ rate``); the stages' own chains are as above with free messages.
    Each chain is taken at the replica where it is longest.
    """
    if args.dp > 1:
        return _replicas_bound(args, compute, kind, link if link is not None else link_bound(args))
    link = link_bound(args)
    per_mb = args.microbatch_size * args.block_size * args.n_embd * 4 * (0.5 if kind == "ours-bf16" else 1.0)
    a = g = per_mb * 8 / args.rate_bps * 1e3
    tie = (link["bytes_per_direction"][kind] - args.microbatches * per_mb) * 8 / args.rate_bps * 1e3
    c0, c1 = compute
    F0, R0, B0, W0 = (c0.get(op, 0.0) for op in "FRBW")
    F1, B1, W1 = (c1.get(op, 0.0) for op in "FBW")
    M = args.microbatches
    terms = {
        "activations on the link": F0 + M * a + F1 + B1 + g + B0 + tie,
        "gradients on the link": F0 + a + F1 + B1 + M * g + B0 + tie,
        "stage 0 compute": M * (F0 + R0 + B0 + W0) + tie,
        "stage 1 compute": F0 + a + M * (F1 + B1 + W1) + (0.0 if W1 else g + B0) + tie,
    }
    binding = max(terms, key=lambda k: terms[k])
    return {"ms": terms[binding], "binding": binding, "terms_ms": terms, "message_ms": a, "tie_ms": tie,
            "compute_ms": compute}


def _replicas_bound(args, compute: list[dict[str, float]], kind: str, link: dict[str, Any]) -> dict[str, Any]:
    """:func:`critical_path_bound` with replicas on either side of the link (see there)."""
    M = args.microbatches
    nbytes = link["bytes_per_direction"].get(kind)
    if nbytes is None:
        raise KeyError(kind)
    crossing = nbytes * 8 / args.rate_bps * 1e3
    terms = dict.fromkeys(("all-reduce on the link", "stage 0 compute", "stage 1 compute"), 0.0)
    for r in range(len(compute) // WORLD):
        c0, c1 = compute[r * WORLD], compute[r * WORLD + 1]
        F0, R0, B0, W0 = (c0.get(op, 0.0) for op in "FRBW")
        F1, B1, W1 = (c1.get(op, 0.0) for op in "FBW")
        for name, value in (("all-reduce on the link", F0 + M * F1 + (M - 1) * B1 + crossing),
                            ("stage 0 compute", M * (F0 + R0 + B0 + W0)),
                            ("stage 1 compute", F0 + M * (F1 + B1 + W1) + (0.0 if W1 else B0))):
            terms[name] = max(terms[name], value)
    binding = max(terms, key=lambda k: terms[k])
    return {"ms": terms[binding], "binding": binding, "terms_ms": terms, "message_ms": 0.0, "tie_ms": 0.0,
            "all_reduce_ms": crossing, "compute_ms": compute}


def _report_config(args, meta: dict) -> dict:
    """The report's ``config``: the model, the run and the machine."""
    return {
        "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size,
        "microbatch_size": args.microbatch_size, "microbatches": args.microbatches,
        "batch_size": args.microbatch_size * args.microbatches * args.dp, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "lr": args.lr, "seed": args.seed, "optimizer": "SGD",
        "stages": WORLD, "replicas": args.dp, "backend": "gloo", "threads_per_process": 1,
        "network": meta["network"], "deepspeed": meta.get("deepspeed"),
        "split": f"stage 0 = embeddings + blocks[0:{args.n_layer // 2}], "
                 f"stage 1 = blocks[{args.n_layer // 2}:{args.n_layer}] + ln_f + head + loss; "
                 f"ours partition [(0, {args.n_layer // 2 + 1}), ({args.n_layer // 2 + 1}, {args.n_layer + 1})]",
        "total_params": meta.get("total_params"), "torch": meta.get("torch"),
        "profiled": bool(args.profile),
        "cpus": meta.get("cpus"),
    }


def _report_header(report: dict) -> list[str]:
    """The lines above the tables: model, network, pipeline, split, timing method, machine load, warnings."""
    cfg = report["config"]
    lines_before = [
        f"model: char GPT, n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}, n_head {cfg['n_head']}, "
        f"block_size {cfg['block_size']}, {cfg['total_params'] or 0:,} params (tied), torch {cfg['torch']}"
        + (f", DeepSpeed {cfg['deepspeed']}" if cfg["deepspeed"] else ""),
        f"network: {cfg['network']}",
        (f"pipeline: {cfg['stages']} stages x {cfg['replicas']} replica(s), gloo, 1 thread/process; "
         f"{cfg['microbatches']} micro-batches "
         f"of {cfg['microbatch_size']} (batch {cfg['batch_size']}); SGD lr {cfg['lr']}; "
         f"{cfg['warmup']} warm-up + {cfg['steps']} measured steps, {cfg['rounds']} round(s)"),
        f"split: {cfg['split']}",
        f"timing: {report['method']}",
    ]
    load = report["machine_load"]
    lines_before.append(f"machine: {cfg['cpus']} CPUs; other processes kept {load['other_cores_mean']:.2f} cores busy "
                        f"on average during the runs (worst run {load['other_cores_max']:.2f})"
                        + ("  <-- NOISY: numbers are not reliable" if load["other_cores_max"] > 0.2 else ""))
    limit = report.get("link_bound")
    if limit:
        ms, nbytes = limit["ms"], limit["bytes_per_direction"]
        shares = ", ".join(f"{c['contender']} {c['of_link_limit']:.0%}" for c in report["contenders"]
                           if "of_link_limit" in c)
        if cfg["replicas"] > 1:
            kinds = ", ".join(f"{name} {ms[k]:.1f} ms ({nbytes[k] / 1e6:.2f} MB)" for k, name in
                              (("ours", "ours"), ("peers", "torch and DeepSpeed (untied)")) if k in ms)
            lines_before.append(f"link-bound limit (bytes each way ÷ rate: each stage's data-parallel all-reduce, "
                                f"a ring of two, sends its whole gradient): {kinds}; each contender's step against "
                                f"its limit: {shares}")
        else:
            lines_before.append(
                f"link-bound limit (bytes each way ÷ rate): ours {ms['ours']:.1f} ms ({nbytes['ours'] / 1e6:.2f} MB: "
                f"activations or gradients {nbytes['peers'] / 1e6:.2f} MB + the tied embedding's all-reduce), ours "
                f"with a bf16 wire {ms['ours-bf16']:.1f} ms, torch and DeepSpeed (untied) {ms['peers']:.1f} ms; "
                f"each contender's step against its limit: {shares}")
        paths = [c for c in report["contenders"] if "critical_path" in c]
        if paths:
            lines_before.append(
                "critical-path limit (the least step any schedule reaches on this link with the measured compute: "
                "the link-bound limit plus what no overlap hides, see critical_path_bound): " + ", ".join(
                    f"{c['contender']} {c['critical_path']['ms']:.1f} ms ({c['critical_path']['binding']}; its "
                    f"step {c['of_critical_path']:.0%} of it)" for c in paths))
    if cfg["profiled"]:
        lines_before.append("WARNING: profiled run, timings are inflated by cProfile")
    if not report["same_split"]:
        lines_before.append(f"WARNING: parameters per rank differ between contenders: {report['stage_params']}")
    else:
        some = next(iter(report["stage_params"].values()), None)
        if some:
            lines_before.append(f"parameters per rank (all contenders): {some}")
    return lines_before


def print_report(report: dict) -> None:
    cfg = report["config"]
    lines_before = _report_header(report)

    rows = []
    for c in report["contenders"]:
        if "median_ms" not in c:
            rows.append([c["contender"], "failed: " + "; ".join(c["errors"])] + [""] * 7)
            continue
        ratio = f"{c['ratio_vs_torch_1f1b']:.2f}" if c["ratio_vs_torch_1f1b"] is not None else "-"
        rows.append([
            c["contender"], f"{c['median_ms']:.2f}", f"{c['p10_ms']:.2f}", f"{c['p90_ms']:.2f}", ratio,
            " / ".join(f"{m:.2f}" for m in c["round_medians_ms"]),
            f"{c['peak_rss_mb'][0]:.0f}", f"{c['peak_rss_mb'][1]:.0f}",
            f"{c['loss_first_step']:.6f}",
        ])
    headers = ["contender", "median ms", "p10 ms", "p90 ms", "vs torch 1F1B", "medians by round",
               "RSS r0 MB", "RSS r1 MB", "loss step 1"]
    loss_rows = []
    for c in report["contenders"]:
        if "median_ms" in c:
            d1, dl = c["loss_first_step_diff_vs_ours_1f1b"], c["loss_last_step_diff_vs_ours_1f1b"]
            loss_rows.append([c["contender"], f"{c['loss_first_step']:.6f}", f"{d1:+.2e}" if d1 is not None else "-",
                              f"{c['loss_last_step']:.6f}", f"{dl:+.2e}" if dl is not None else "-"])
    loss_headers = ["contender", "loss step 1", "diff vs ours 1f1b", f"loss step {cfg['warmup'] + cfg['steps']}",
                    "diff vs ours 1f1b"]

    try:
        from rich.console import Console
        from rich.table import Table

        console = Console(width=max(140, Console().width))
        for line in lines_before:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        table = Table(title="step time (forward+backward of all micro-batches + SGD step + zero_grad)")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
        lt = Table(title="correctness: loss returned by the first and the last step")
        for i, h in enumerate(loss_headers):
            lt.add_column(h, justify="left" if i == 0 else "right")
        for r in loss_rows:
            lt.add_row(*r)
        console.print(lt)
        for note in report["notes"]:
            console.print("note: " + note, highlight=False, markup=False, soft_wrap=True)
    except ImportError:
        for line in lines_before:
            print(line)
        _plain_table(headers, rows)
        print()
        _plain_table(loss_headers, loss_rows)
        for note in report["notes"]:
            print("note: " + note)
    print(f"total time {report['elapsed_s']:.0f}s")
    for r in report["ratios"]:
        print(f"{r['ours']} / {r['peer']} = {r['ratio']:.2f}")
    sys.stdout.flush()


def _plain_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


if __name__ == "__main__":
    sys.exit(main())
