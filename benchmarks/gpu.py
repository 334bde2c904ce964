"""Step time and throughput on one GPU: ours (``Varuna(...)`` at pp=1, dp=1, in this process) against plain PyTorch,
side by side in one run, and the profile's predicted step time against the measured one.

Two models of the example family (``examples/gpt/model.py``):

* **the example GPT** (``examples/gpt/spec.py``: 4 blocks of width 64, sequence 64, built on CPU with seed 0), batch
  32 in micro-batches of 4 as ``examples/gpt/train.py`` trains it: a model this small is bound by per-kernel and
  per-action overheads, so its ratio measures the runtime's overhead;
* **a GPT of >= 1 B parameters** (``--big``, default on: 24 blocks of width 2048, 16 heads, sequence 1024; 1.21 B
  parameters), built on meta; ours allocates and initialises it on the device (``Varuna(seed=, init=)``), plain
  PyTorch with ``varuna_core.materialize(..., device=)`` (the same values). Batch 32 in micro-batches of 8. It is
  skipped, with the reason printed, when its estimated memory does not fit the free device memory:
  ``params x (4 master + 4 grad + 8 AdamW) bytes`` + activations of one micro-batch (``L x b x T x C x 34`` bytes in
  bf16/fp16, ``x 68`` in fp32: Korthikanti et al. 2022 without the attention-score term, as SDPA keeps no T x T
  matrix) + the half-precision weight copies autocast caches (2 bytes per parameter) + 10% margin.

For each model, three phases, each guarded (one that fails prints one error line and the others still run):

1. **profile + plan**: ``varuna_core.profiling.run.profile`` of the model's ``ModelSpec`` on the device at the
   micro-batch size (what ``varuna profile`` runs, one process), then
   ``varuna_core.planning.planner.plan_for(pp=1, dp=1)`` (what ``varuna plan`` scores): the predicted step time
   (``plan.prediction.step_time``, optimizer step included) and peak memory (``stages[0].memory_bytes``, no
   headroom);
2. **ours**: ``Varuna(model, "0", spec.batch, batch_size=B, chunk_size=b, precision=, device=, schedule=)``, AdamW
   over its parameters, ``set_optimizer``; a step is ``loss, overflow = vm.step(cpu_batch)``, ``opt.step()`` unless
   it overflowed, ``opt.zero_grad()``;
3. **plain**: the same model (same values) moved to the device, the same AdamW; a step moves the CPU batch to the
   device and, per micro-batch of ``b`` examples, runs the forward under ``torch.autocast`` (bf16/fp16), weights the
   loss by ``b / B`` and calls ``backward()`` (fp16: through ``torch.amp.GradScaler``, whose initial scale 2**16
   ours gets too), then ``opt.step()`` (fp16: ``scaler.step``/``update``), ``opt.zero_grad()``, and reads the loss
   as a float (as ``vm.step`` returns it). Neither clips; ours also computes the global gradient norm every step.

The optimizer is ``torch.optim.AdamW(lr=1e-4)``, ``fused=True`` on CUDA (the profile times the same one). Every
step of both runs the same CPU batches (``CharDataset.get_batch`` with seeds ``1000 + i``). Timing: ``--warmup``
untimed steps, then each timed step between two ``torch.cuda.synchronize()`` with ``time.perf_counter()``; the
median is reported. The example GPT runs ``--rounds`` rounds (ours then plain, then plain then ours) and each
contender's best round median counts.

FLOPs per step (the MFU convention of PaLM, Chowdhery et al. 2022, appendix B):
``tokens x (6 N + 12 L C T)``, ``N`` = parameters that multiply (all but the position-embedding table; the tied
embedding counted once, as the head's matmul), ``L`` blocks, ``C`` width, ``T`` sequence length; the attention term
counts the full ``T x T`` scores (no causal halving) and nothing is counted for recompute (none at pp=1). TFLOP/s =
FLOPs per step / median step time; MFU = that / the device's dense peak for the precision (``PEAKS``, from NVIDIA's
datasheets, or ``--peak-tflops``; fp32 is the non-tensor-core rate, torch's default for fp32 matmuls).

    .venv/bin/python benchmarks/gpu.py                      # on a GPU: both models, bf16 (sized for < 4 minutes)
    .venv/bin/python benchmarks/gpu.py --json               # one JSON document on stdout instead of the tables
    .venv/bin/python benchmarks/gpu.py --device cpu --small --steps 2 --no-big   # a smoke run without a GPU

Progress goes to stderr, the tables (Markdown) to stdout. Exit code 0 when every phase ran (a big model that does
not fit is skipped, not failed), 1 when one failed, 2 for bad flags or a device this machine does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPT_DIR = ROOT / "examples" / "gpt"
if str(GPT_DIR) not in sys.path:  # model.py and data.py of the example GPT
    sys.path.insert(0, str(GPT_DIR))

import torch  # noqa: E402

# Dense peak TFLOP/s by device name (the first entry whose key the name contains) and precision; NVIDIA datasheets,
# without sparsity. fp32 is the CUDA-core rate: torch does not use TF32 for fp32 matmuls unless told to.
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
]
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("varuna", "1f1b", "gpipe")
LR = 1e-4
INIT_LOSS_SCALE = 2.0**16  # torch.amp.GradScaler's default, given to ours too
MEMORY_MARGIN = 0.10


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Pure helpers: peak, FLOPs, memory estimate


def peak_tflops(device_name: str, precision: str, override: float | None) -> tuple[float | None, str]:
    """``(TFLOP/s, where it comes from)``: ``override`` if given, else the table's entry for the device name."""
    if override is not None:
        return override, "--peak-tflops"
    for key, peaks in PEAKS:
        if key.lower() in device_name.lower():
            return peaks[precision], f"table: {key} {precision} dense"
    return None, "unknown (pass --peak-tflops)"


def flops_per_token(matmul_params: int, n_layer: int, n_embd: int, seq: int) -> int:
    """Training FLOPs per token: ``6 N + 12 L C T`` (see the module docstring)."""
    return 6 * matmul_params + 12 * n_layer * n_embd * seq


def estimate_bytes(params: int, n_layer: int, n_embd: int, seq: int, vocab: int, microbatch: int,
                   precision: str) -> int:
    """Device memory to train the GPT at pp=1 with AdamW (see the module docstring for the terms), margin
    included."""
    half = precision in ("bf16", "fp16")
    static = params * (4 + 4 + 8)
    activations = n_layer * microbatch * seq * n_embd * (34 if half else 68)
    logits = microbatch * seq * vocab * 4 * 3  # the logits, their softmax and their gradient, in fp32
    cast = params * 2 if half else 0
    return int((static + activations + logits + cast) * (1 + MEMORY_MARGIN))


def microbatches(batch: int, size: int) -> list[tuple[int, int]]:
    """``(start, examples)`` of each micro-batch, as ``Varuna`` splits a batch (the last one may be smaller)."""
    return [(start, min(size, batch - start)) for start in range(0, batch, size)]


def fmt_count(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


# ----------------------------------------------------------------------------------------------------------
# Workloads


@dataclasses.dataclass
class Workload:
    """One model to measure: its configuration, how it is built, its batches."""

    key: str
    label: str
    n_layer: int
    n_head: int
    n_embd: int
    seq: int
    batch_size: int
    microbatch_size: int
    warmup: int
    steps: int
    rounds: int
    on_meta: bool
    seed: int = 0

    def config(self):
        from data import default_dataset  # examples/gpt/data.py and model.py, found through GPT_DIR
        from model import GPTConfig

        return GPTConfig(vocab_size=default_dataset().vocab_size, block_size=self.seq, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    def build(self) -> torch.nn.Module:
        """The model: on meta (values made by whoever allocates it, from ``seed``), or on CPU after
        ``torch.manual_seed(seed)`` (the same values at every call)."""
        from model import GPT

        from varuna_core import meta_init

        if self.on_meta:
            with meta_init():
                return GPT(self.config())
        torch.manual_seed(self.seed)
        return GPT(self.config())

    def batch(self, n: int, seed: int | None = None) -> dict:
        """``n`` examples of ``seq`` characters (the spec's batch function: seed ``n``, as examples/gpt/spec.py)."""
        from data import default_dataset

        g = torch.Generator().manual_seed(n if seed is None else seed)
        return default_dataset().get_batch("train", n, self.seq, g)

    def init(self):
        from model import GPT

        return GPT.init_module if self.on_meta else None

    def spec(self, make_optimizer: Callable):
        """The ``ModelSpec`` the profile measures (the optimizer of the runs)."""
        from model import GPT, SHARED_WEIGHTS

        from varuna_core import ModelSpec

        return ModelSpec(build=self.build, batch=self.batch, shared_weights=SHARED_WEIGHTS, optimizer=make_optimizer,
                         name=self.label, init=GPT.init_module if self.on_meta else None)

    def describe(self) -> dict:
        """Sizes of the model, counted on a meta build (no memory)."""
        from model import GPT

        from varuna_core import meta_init

        with meta_init():
            model = GPT(self.config())
        params = model.num_parameters()
        matmul = params - model.wpe.weight.numel()
        tokens = self.batch_size * self.seq
        per_token = flops_per_token(matmul, self.n_layer, self.n_embd, self.seq)
        return {"params": params, "matmul_params": matmul, "tokens_per_step": tokens,
                "flops_per_token": per_token, "flops_per_step": per_token * tokens,
                "num_microbatches": len(microbatches(self.batch_size, self.microbatch_size)),
                "vocab_size": model.config.vocab_size}


def workloads(args) -> list[Workload]:
    example_rounds = 1 if args.small else args.rounds
    example = Workload("example", "example GPT", 4, 4, 64, 64, args.batch_size, args.microbatch_size,
                       args.warmup, args.steps, example_rounds, on_meta=False)
    if args.small:
        example = dataclasses.replace(example, batch_size=min(args.batch_size, 8),
                                      microbatch_size=min(args.microbatch_size, 4), warmup=min(args.warmup, 1))
    out = [example]
    if args.big:
        big = Workload("big", "GPT >= 1B", args.big_layers, args.big_heads, args.big_embd, args.big_seq,
                       args.big_batch_size, args.big_microbatch_size, args.big_warmup, args.big_steps, 1,
                       on_meta=True)
        if args.small:  # the same path (built on meta, allocated on the device) at a size a CPU trains in seconds
            big = dataclasses.replace(big, label="GPT (big path, --small)", n_layer=2, n_head=2, n_embd=32, seq=32,
                                      batch_size=4, microbatch_size=2, warmup=1, steps=min(args.big_steps, args.steps))
        out.append(big)
    return out


# ----------------------------------------------------------------------------------------------------------
# The device


def resolve_device(name: str) -> torch.device | None:
    """The device to measure on, ``None`` if this machine has no such device."""
    if name == "cuda":
        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def available_bytes(dev: torch.device) -> int | None:
    """Free device memory (CUDA), or the kernel's MemAvailable (CPU)."""
    if dev.type == "cuda":
        free_memory(dev)
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_info(dev: torch.device, precision: str, override: float | None) -> dict:
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, total = props.name, int(props.total_memory)
        capability = f"{props.major}.{props.minor}"
    else:
        name, total, capability = platform.processor() or platform.machine() or "cpu", None, None
    peak, source = peak_tflops(name, precision, override)
    return {"type": dev.type, "index": dev.index, "name": name, "total_memory_bytes": total,
            "capability": capability, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "peak_tflops": peak, "peak_source": source}


def reset_peak(dev: torch.device) -> int | None:
    """Start a contender's memory accounting; returns what is allocated already (a previous contender's leftovers
    would show here)."""
    if dev.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(dev)
    return int(torch.cuda.memory_allocated(dev))


def peak_bytes(dev: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None


# ----------------------------------------------------------------------------------------------------------
# The contenders


def make_optimizer_for(dev: torch.device) -> Callable:
    fused = dev.type == "cuda"

    def make(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=LR, fused=fused)

    return make


def timed_steps(step: Callable[[dict], tuple[float, bool]], batches: list[dict], warmup: int,
                dev: torch.device) -> dict:
    """Run ``step`` on every batch; the first ``warmup`` are not timed."""
    times, losses, overflows = [], [], 0
    for i, batch in enumerate(batches):
        sync(dev)
        t0 = time.perf_counter()
        loss, overflow = step(batch)
        sync(dev)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if i >= warmup:
            times.append(elapsed)
            overflows += int(overflow)
    return {"step_s": times, "median_s": statistics.median(times), "losses": losses, "overflows": overflows}


def run_ours(w: Workload, dev: torch.device, precision: str, schedule: str, batches: list[dict]) -> dict:
    """``Varuna(...)`` at pp=1 on ``dev``: build, then the timed steps."""
    from model import SHARED_WEIGHTS

    from varuna_core import Varuna

    baseline = reset_peak(dev)
    t0 = time.perf_counter()
    vm = Varuna(w.build(), "0", w.batch, batch_size=w.batch_size, chunk_size=w.microbatch_size,
                shared_weights=SHARED_WEIGHTS, precision=precision, device=str(dev), schedule=schedule,
                seed=w.seed, init=w.init())
    opt = make_optimizer_for(dev)(list(vm.parameters()))
    vm.set_optimizer(opt, loss_scale="dynamic", init_loss_scale=INIT_LOSS_SCALE)
    sync(dev)
    build_s = time.perf_counter() - t0

    def step(batch: dict) -> tuple[float, bool]:
        loss, overflow = vm.step(batch)
        if not overflow:
            opt.step()
        opt.zero_grad()
        return float(loss), bool(overflow)

    result = timed_steps(step, batches, w.warmup, dev)
    result.update(build_s=build_s, peak_memory_bytes=peak_bytes(dev), baseline_memory_bytes=baseline)
    return result


def run_plain(w: Workload, dev: torch.device, precision: str, batches: list[dict]) -> dict:
    """The same model and optimizer in plain PyTorch: micro-batches accumulated into ``.grad``."""
    from varuna_core import materialize

    baseline = reset_peak(dev)
    t0 = time.perf_counter()
    model = w.build()
    model = materialize(model, seed=w.seed, init=w.init(), device=dev) if w.on_meta else model.to(dev)
    model.train()
    opt = make_optimizer_for(dev)(list(model.parameters()))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(dev.type, init_scale=INIT_LOSS_SCALE) if precision == "fp16" else None
    sync(dev)
    build_s = time.perf_counter() - t0
    parts = microbatches(w.batch_size, w.microbatch_size)

    def step(batch: dict) -> tuple[float, bool]:
        inputs = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for start, n in parts:
            chunk = {k: v.narrow(0, start, n) for k, v in inputs.items()}
            with torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = model(**chunk)
            weighted = loss.float() * (n / w.batch_size)
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
            total += weighted.detach()
        overflow = False
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            overflow = scaler.get_scale() < before
        else:
            opt.step()
        opt.zero_grad()
        return float(total), overflow

    result = timed_steps(step, batches, w.warmup, dev)
    result.update(build_s=build_s, peak_memory_bytes=peak_bytes(dev), baseline_memory_bytes=baseline)
    return result


def run_profile(w: Workload, dev: torch.device, precision: str, schedule: str, repeats: int, warmup: int) -> dict:
    """``varuna profile`` of the workload at its micro-batch size (one process), then ``plan_for(pp=1, dp=1)``."""
    from varuna_core.planning.planner import PlanRequest, plan_for
    from varuna_core.profiling.run import profile

    t0 = time.perf_counter()
    prof = profile(w.spec(make_optimizer_for(dev)), microbatch_sizes=[w.microbatch_size], nproc=1,
                   precision=precision, device=dev.type, repeats=repeats, warmup=warmup)
    profile_s = time.perf_counter() - t0
    req = PlanRequest(gpus=1, batch_size=w.batch_size, headroom=0.0, schedules=(schedule,),
                      microbatch_sizes=(w.microbatch_size,))
    plan = plan_for(prof, req, pp=1, dp=1, microbatch_size=w.microbatch_size, schedule=schedule)
    stage = plan.stages[0]
    return {"profile_s": profile_s, "step_s": plan.prediction.step_time,
            "pipeline_s": plan.prediction.pipeline_time, "forward_s": stage.forward, "backward_s": stage.backward,
            "recompute_s": stage.recompute, "optimizer_s": stage.optimizer, "memory_bytes": stage.memory_bytes,
            "num_segments": prof.num_segments}


# ----------------------------------------------------------------------------------------------------------
# Running the phases


class Phases:
    """Runs each phase under a guard: a failure is logged in one line and recorded, and the run goes on."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.failed: list[dict] = []

    def run(self, model: str, phase: str, fn: Callable[[], Any]) -> Any:
        log(f"[{model}] {phase} ...")
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - one failed phase must not cost the others
            text = str(exc).splitlines()[0] if str(exc) else ""
            hint = getattr(exc, "hint", None)
            error = f"{type(exc).__name__}: {text}" + (f" (hint: {hint})" if hint else "")
            log(traceback.format_exc().rstrip())  # for whoever reads the log; the report keeps one line
            log(f"[{model}] {phase} FAILED: {error}")
            self.failed.append({"model": model, "phase": phase, "error": error})
            out = None
        finally:
            free_memory(self.dev)
        log(f"[{model}] {phase} done in {time.perf_counter() - t0:.1f}s")
        return out


def throughput(result: dict | None, info: dict, peak: float | None) -> dict | None:
    if result is None:
        return None
    median = result["median_s"]
    tflops = info["flops_per_step"] / median / 1e12
    return {**result, "tokens_per_s": info["tokens_per_step"] / median, "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "loss_first": result["losses"][0], "loss_last": result["losses"][-1]}


def measure(w: Workload, args, dev: torch.device, phases: Phases, peak: float | None) -> dict:
    info = w.describe()
    entry: dict[str, Any] = {"key": w.key, "model": w.label,
                             "config": {"n_layer": w.n_layer, "n_head": w.n_head, "n_embd": w.n_embd, "seq": w.seq,
                                        "batch_size": w.batch_size, "microbatch_size": w.microbatch_size,
                                        "warmup": w.warmup, "steps": w.steps, "rounds": w.rounds,
                                        "built_on": "meta" if w.on_meta else "cpu"},
                             **info, "skipped": None, "ours": None, "plain": None, "prediction": None,
                             "ratio_ours_over_plain": None, "ratio_predicted_over_measured": None}
    log(f"[{w.label}] {fmt_count(info['params'])} parameters, {info['tokens_per_step']} tokens/step, "
        f"{info['num_microbatches']} micro-batches of {w.microbatch_size}")
    if w.on_meta:
        need = estimate_bytes(info["params"], w.n_layer, w.n_embd, w.seq, info["vocab_size"], w.microbatch_size,
                              args.precision)
        have = available_bytes(dev)
        entry.update(estimated_memory_bytes=need, available_memory_bytes=have)
        if have is not None and need > have:
            entry["skipped"] = (f"needs about {need / 2**30:.1f} GiB (estimate), {have / 2**30:.1f} GiB free on "
                                f"{dev}")
            log(f"[{w.label}] skipped: {entry['skipped']}")
            return entry
    batches = [w.batch(w.batch_size, seed=1000 + i) for i in range(w.warmup + w.steps)]
    if not args.no_profile:
        repeats, pwarm = (2, 1) if args.small else (5, 2)
        entry["prediction"] = phases.run(w.label, "profile + plan", lambda: run_profile(
            w, dev, args.precision, args.schedule, repeats, pwarm))
    rounds: dict[str, list[dict]] = {"ours": [], "plain": []}
    for r in range(w.rounds):
        order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
        for name in order:
            fn = ((lambda: run_ours(w, dev, args.precision, args.schedule, batches)) if name == "ours"
                  else (lambda: run_plain(w, dev, args.precision, batches)))
            out = phases.run(w.label, f"{name} (round {r + 1}/{w.rounds})", fn)
            if out is not None:
                rounds[name].append(out)
                log(f"[{w.label}] {name}: median {out['median_s'] * 1e3:.2f} ms/step, loss {out['losses'][0]:.4f} "
                    f"-> {out['losses'][-1]:.4f}, build {out['build_s']:.1f}s")
    for name, runs in rounds.items():
        if runs:
            best = min(runs, key=lambda x: x["median_s"])
            entry[name] = throughput(best, info, peak)
            entry[name]["round_medians_s"] = [x["median_s"] for x in runs]
    if entry["ours"] and entry["plain"]:
        entry["ratio_ours_over_plain"] = entry["ours"]["median_s"] / entry["plain"]["median_s"]
    if entry["ours"] and entry["prediction"]:
        entry["ratio_predicted_over_measured"] = entry["prediction"]["step_s"] / entry["ours"]["median_s"]
    return entry


# ----------------------------------------------------------------------------------------------------------
# Output


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(report: dict) -> None:
    d = report["device"]
    cuda = f", CUDA {d['cuda']}" if d["cuda"] else ""
    peak = f"{d['peak_tflops']:g} TFLOP/s ({d['peak_source']})" if d["peak_tflops"] else d["peak_source"]
    print(f"device: {d['name']} ({d['type']}), torch {d['torch']}{cuda}, Python {d['python']}")
    print(f"precision {report['precision']}, schedule {report['schedule']}, optimizer {report['optimizer']}; "
          f"peak assumed: {peak}")
    print(f"FLOPs per step: {report['flops_formula']}")
    print()
    print("| model | params | tokens/step | contender | step ms (median) | tokens/s | TFLOP/s | MFU | peak MiB | "
          "build s | loss first / last |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in report["models"]:
        head = f"| {m['model']} | {fmt_count(m['params'])} | {m['tokens_per_step']}"
        if m["skipped"]:
            print(f"{head} | skipped: {m['skipped']} | | | | | | | |")
            continue
        for name, label in (("ours", "ours (Varuna pp=1)"), ("plain", "plain PyTorch")):
            r = m[name]
            if r is None:
                print(f"{head} | {label} | failed | | | | | | |")
                continue
            print(f"{head} | {label} | {_ms(r['median_s'])} | {r['tokens_per_s']:,.0f} | {r['tflops']:.2f} | "
                  f"{_num(r['mfu'], '.1%')} | {_mib(r['peak_memory_bytes'])} | {r['build_s']:.1f} | "
                  f"{r['loss_first']:.4f} / {r['loss_last']:.4f} |")
    print()
    print("| model | ours / plain (step time) | predicted ms | measured ms (ours) | predicted / measured | "
          "predicted peak MiB | profile s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in report["models"]:
        if m["skipped"]:
            continue
        p, ours = m["prediction"], m["ours"]
        print(f"| {m['model']} | {_num(m['ratio_ours_over_plain'], '.3f')} | {_ms(p['step_s'] if p else None)} | "
              f"{_ms(ours['median_s'] if ours else None)} | {_num(m['ratio_predicted_over_measured'], '.3f')} | "
              f"{_mib(p['memory_bytes'] if p else None)} | {_num(p['profile_s'] if p else None, '.1f')} |")
    for f in report["failed"]:
        print(f"FAILED: {f['model']}, {f['phase']}: {f['error']}")
    print(f"total time {report['elapsed_s']:.0f}s")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the first visible GPU (choose another with CUDA_VISIBLE_DEVICES)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--schedule", choices=SCHEDULES, default="varuna", help="ours' schedule (at pp=1 all run F, B "
                   "per micro-batch without recompute; gpipe runs every F first)")
    p.add_argument("--steps", type=int, default=20, help="timed steps of the example GPT")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the example GPT (alternating order)")
    p.add_argument("--batch-size", type=int, default=32, help="example GPT: global batch")
    p.add_argument("--microbatch-size", type=int, default=4, help="example GPT: micro-batch size")
    p.add_argument("--big", action=argparse.BooleanOptionalAction, default=True, help="also the >= 1B GPT")
    p.add_argument("--big-layers", type=int, default=24)
    p.add_argument("--big-embd", type=int, default=2048)
    p.add_argument("--big-heads", type=int, default=16)
    p.add_argument("--big-seq", type=int, default=1024)
    p.add_argument("--big-batch-size", type=int, default=32)
    p.add_argument("--big-microbatch-size", type=int, default=8)
    p.add_argument("--big-steps", type=int, default=5, help="timed steps of the big GPT")
    p.add_argument("--big-warmup", type=int, default=2)
    p.add_argument("--small", action="store_true", help="tiny sizes, one round, a short profile: a smoke run "
                   "(with --big, a 2-block GPT takes the big model's path)")
    p.add_argument("--no-profile", action="store_true", help="skip the profile and the prediction")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default: by device name)")
    p.add_argument("--deadline", type=float, default=540.0,
                   help="seconds after which the run dumps its threads' stacks to stderr and exits 1 (a hang)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the tables")
    p.add_argument("--json-out", type=Path, default=None, metavar="FILE",
                   help="also write the JSON document to FILE (the tables still go to stdout)")
    args = p.parse_args(argv)
    for name in ("steps", "rounds", "batch_size", "microbatch_size", "big_layers", "big_embd", "big_heads",
                 "big_seq", "big_batch_size", "big_microbatch_size", "big_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "big_warmup"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.big_embd % args.big_heads:
        p.error(f"--big-embd {args.big_embd} is not divisible by --big-heads {args.big_heads}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.deadline <= 0:
        p.error(f"--deadline must be > 0, got {args.deadline}")
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.deadline, exit=True, file=sys.__stderr__)  # the real stderr
    try:
        return run(args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    dev = resolve_device(args.device)
    if dev is None:
        log("error: --device cuda, but CUDA is not available here (use --device cpu)")
        return 2
    info = device_info(dev, args.precision, args.peak_tflops)
    log(f"device {info['name']} ({dev}), torch {info['torch']}, CUDA {info['cuda']}, precision {args.precision}, "
        f"peak {info['peak_tflops']} TFLOP/s ({info['peak_source']})")
    phases = Phases(dev)
    models = []
    for w in workloads(args):
        entry = phases.run(w.label, "all phases", lambda w=w: measure(w, args, dev, phases, info["peak_tflops"]))
        if entry is not None:
            models.append(entry)
    report = {
        "benchmark": "gpu", "device": info, "precision": args.precision, "schedule": args.schedule,
        "optimizer": f"AdamW(lr={LR}, fused={dev.type == 'cuda'})",
        "flops_formula": "tokens x (6 N + 12 L C T): N = parameters but the position embedding, L blocks, "
                         "C width, T sequence (PaLM's MFU convention)",
        "timing": "median over timed steps of perf_counter() between torch.cuda.synchronize() calls; step = "
                  "forward+backward of every micro-batch + optimizer step + zero_grad; best round",
        "small": args.small, "models": models, "failed": phases.failed,
        "elapsed_s": time.perf_counter() - start,
    }
    if args.json_out is not None:
        try:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            log(f"error: --json-out {args.json_out}: {exc.strerror or exc}")
            phases.failed.append({"model": "-", "phase": "write --json-out", "error": str(exc)})
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        print_report(report)
    return 1 if phases.failed else 0


if __name__ == "__main__":
    sys.exit(main())
