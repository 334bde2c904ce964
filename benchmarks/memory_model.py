"""How well does the planner's memory model predict the memory a pipeline stage really uses?

For a set of configurations (pipeline depth ``pp`` 1-4, schedule ``varuna`` / ``1f1b`` / ``gpipe``, two
micro-batch sizes; ``dp = 1``, global batch 32) this script

1. profiles the example GPT (``examples/gpt/``: its model and data, sized by the flags below, by default 4 blocks
   of width 512, about 50 MB of parameters, gradients and AdamW state per block; AdamW, the optimizer the
   example trains with) once, in this process (``varuna_core.profiling.run.profile``: only its memory numbers
   matter here, not its times),
2. makes the plan of exactly that configuration (``plan_for``) and keeps each stage's predicted ``memory_bytes``
   (the memory model plus the planner's headroom, 10% by default; the model alone is reported too),
3. runs it on ``pp`` fresh local processes (gloo on 127.0.0.1, ``OMP_NUM_THREADS=1``, a hard timeout, all
   killed when one fails), each wrapping the GPT with ``Varuna(..., plan=plan_path)`` and AdamW, and
4. compares each stage's prediction with the measured peak growth of its rank (below); the criterion: every
   stage's prediction within 20% of the measurement and never more than 10% below it (predicted / measured
   in 0.9-1.2).

What is measured, per rank: the peak of the process's *anonymous* resident memory during the measured training
step(s) (``step()`` + ``optimizer.step()`` + ``zero_grad()``) minus its anonymous resident memory at a baseline
taken before the model exists but after what any training process holds whatever its model: torch, the library,
the process group, the data set, and the modules torch imports on first use (its optimizers import
``torch._dynamo``: about 70 MB; the JSON output has it as ``before_baseline``). Anonymous memory is tensors and
Python objects; file-backed pages (the code of torch's libraries, which the first forward and backward page in)
are left out. The peak comes from the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``): it is reset
(``echo 5 > /proc/self/clear_refs``) after the start-up and one warm-up step, so it covers the measured steps
only, and the file-backed part, which the measured steps leave unchanged (``file_drift`` in the JSON; a warning
says otherwise), is subtracted. Where the reset is refused, a thread samples ``RssAnon`` every millisecond. On
CUDA the measurement is ``max_memory_allocated()`` over the steps minus ``memory_allocated()`` at the baseline
(not tried: this machine has no GPU).

The model predicts allocated bytes, as a GPU's allocator counts them: parameters, gradients (the runtime's flat
buckets) and optimizer state of the stage's segments, plus what a step holds (saved activations, stashed inputs,
posted receive buffers, the values sent and not yet waited for). The warm-up step creates the optimizer
state; all of it lives in the measured step, and none of it before the baseline. So that resident memory equals
allocated memory, the workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor above 64 KiB gets its own
mapping, returned to the kernel when freed, so that a start-up that builds more than the stage leaves nothing
behind), ``MALLOC_PERTURB_`` (glibc fills every allocation, so a posted receive buffer is resident before its
message arrives, as it is allocated on a GPU) and ``MKL_DISABLE_FAST_MM=1`` (MKL does not keep its matmul
buffers in a pool of its own, as PyTorch's CUDA caching allocator keeps blocks that ``max_memory_allocated`` does
not count). ``--malloc default`` measures under the libraries' defaults instead: what ``top`` shows a user.

    python benchmarks/memory_model.py            # 24 configurations (about 4 minutes on an idle 2-core machine)
    python benchmarks/memory_model.py --quick    # 6 configurations (about 1 minute)
    python benchmarks/memory_model.py --json     # one JSON document on stdout instead of the table

Progress goes to stderr. Exit code 0 when every run succeeded (whether or not the criterion was met; the last
line says), 1 when a run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT_DIR = ROOT / "examples" / "gpt"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEDULES = ("varuna", "1f1b", "gpipe")
LOW, HIGH = 0.9, 1.2  # predicted / measured must lie in [LOW, HIGH]: within 20%, never more than 10% below
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class GptSize:
    """The example GPT's shape (its vocabulary is the shipped text's, 72 characters)."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int


def gpt_spec(size: GptSize):
    """The example GPT (``examples/gpt/model.py`` and its data) at ``size``, with AdamW, as a ``ModelSpec``."""
    import torch

    if str(GPT_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, SHARED_WEIGHTS, GPTConfig

    from varuna_core import ModelSpec

    data = CharDataset.load()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=size.block_size, n_layer=size.n_layer,
                    n_head=size.n_head, n_embd=size.n_embd)

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    def batch(n: int) -> dict:
        return data.get_batch("train", n, size.block_size, torch.Generator().manual_seed(n))

    return ModelSpec(build=build, batch=batch, shared_weights=SHARED_WEIGHTS,
                     optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), name="examples/gpt (memory)")


@dataclasses.dataclass(frozen=True)
class Config:
    pp: int
    schedule: str
    mbs: int

    def label(self, batch: int) -> str:
        return f"pp={self.pp} {self.schedule:<6} mbs={self.mbs} M={-(-batch // self.mbs)}"


def configs(quick: bool, sizes: tuple[int, int]) -> list[Config]:
    """Every (pp 1–4, schedule, micro-batch size); ``quick``: six that cover each pp, schedule and size."""
    if quick:
        small, large = sizes
        return [Config(1, "gpipe", large), Config(2, "varuna", small), Config(2, "1f1b", large),
                Config(3, "gpipe", small), Config(4, "varuna", large), Config(4, "1f1b", small)]
    return [Config(pp, schedule, mbs) for pp, schedule, mbs in itertools.product((1, 2, 3, 4), SCHEDULES, sizes)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Reading the process's memory


def read_status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current resident size; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class AnonSampler:
    """Samples ``RssAnon`` in a thread (every ``interval`` s) and keeps the largest: the fallback for a kernel
    that refuses the high-water-mark reset. It can miss a peak shorter than the interval."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = read_status()["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, read_status()["RssAnon"])

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, read_status()["RssAnon"])


# ----------------------------------------------------------------------------------------------------------
# Worker (one rank of one configuration): python benchmarks/memory_model.py --worker JOB OUT_DIR


def worker(job_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    before_imports = read_status()
    spec = _before_baseline(GptSize(**job["size"]))
    gc.collect()
    baseline = read_status()
    baseline_cuda = torch.cuda.memory_allocated() if cuda else None
    vm, opt, inputs = _build(spec, job)
    for _ in range(job["warmup"]):
        _train_step(vm, opt, inputs)
    gc.collect()
    settled = read_status()
    settled_cuda = torch.cuda.memory_allocated() if cuda else None
    dist.barrier()
    peak, method = _measured_steps(vm, opt, inputs, job["steps"], cuda)
    after = read_status()
    row = {"rank": dist.get_rank(), "stage": vm.stage, "partition": list(vm.partition.ranges[vm.stage]),
           "method": method, "before_imports": before_imports, "baseline": baseline, "settled": settled,
           "after": after, "static": _static_bytes(vm, opt), "max_posted": list(vm.executor.max_posted)}
    if cuda:
        row.update(growth=peak - baseline_cuda, between_steps=settled_cuda - baseline_cuda)
    else:
        row.update(growth=_anon_growth(peak, method, baseline, after),
                   between_steps=settled["RssAnon"] - baseline["RssAnon"])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, row)
    if dist.get_rank() == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps({"ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's tear-down: everything is written


def _anon_growth(peak: int, method: str, baseline: dict, after: dict) -> int:
    """Peak anonymous memory over the baseline's. The high-water mark counts file-backed pages too: the measured
    steps leave those unchanged (``file_drift``), so the ones at the end are subtracted."""
    if method == "hwm":
        peak -= after["RssFile"] + after["RssShmem"]
    return peak - baseline["RssAnon"]


def _before_baseline(size: GptSize):
    """What the process needs whatever the model's size, so that the baseline includes it: the library, the data
    set, and the modules torch imports on first use (its optimizers import ``torch._dynamo`` at their first
    call: about 70 MB of Python objects). Returns the spec."""
    import torch

    import varuna_core.varuna  # noqa: F401

    spec = gpt_spec(size)
    spec.batch(2)
    param = torch.nn.Parameter(torch.zeros(1))
    param.sum().backward()
    opt = spec.optimizer([param])
    opt.step()
    opt.zero_grad()
    return spec


def _build(spec, job: dict):
    """The Varuna model of the plan (the whole GPT built; Varuna keeps the stage), AdamW over it, the batch."""
    from varuna_core import Varuna

    vm = Varuna(spec.build(), None, spec.batch(2), batch_size=job["batch"], chunk_size=job["mbs"],
                plan=job["plan"], shared_weights=spec.shared_weights, timeout=job["timeout"])
    params = list(vm.parameters())
    opt = spec.optimizer(params) if params else None
    if opt is not None:
        vm.set_optimizer(opt)
    return vm, opt, vm.replica_slice(spec.batch(job["batch"]))


def _train_step(vm, opt, inputs: dict) -> None:
    vm.step(inputs)
    if opt is not None:
        opt.step()
        opt.zero_grad()


def _measured_steps(vm, opt, inputs: dict, steps: int, cuda: bool) -> tuple[int, str]:
    """Run ``steps`` training steps; returns the peak (bytes) and how it was taken: ``cuda``
    (``max_memory_allocated``), ``hwm`` (``VmHWM``, file-backed pages included) or ``sampled`` (``RssAnon``)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            _train_step(vm, opt, inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), "cuda"
    if reset_peak():
        for _ in range(steps):
            _train_step(vm, opt, inputs)
        return read_status()["VmHWM"], "hwm"
    with AnonSampler() as sampler:
        for _ in range(steps):
            _train_step(vm, opt, inputs)
    return sampler.peak, "sampled"


def _static_bytes(vm, opt) -> dict[str, int]:
    """What this rank holds between steps, counted from its tensors: parameters, the gradient buckets, the
    optimizer state."""
    import torch

    state = 0
    if opt is not None:
        for entry in opt.state.values():
            state += sum(v.numel() * v.element_size() for v in entry.values()
                         if isinstance(v, torch.Tensor) and v.device.type != "meta")
    grads = sum(f.numel() * f.element_size() for f in vm.grad_buffer.flats)
    return {"params": vm.parameter_bytes(), "grads": grads, "optimizer": state}


# ----------------------------------------------------------------------------------------------------------
# Launcher


def launch(job: dict, world: int, tmp: Path, timeout: float, malloc: str) -> dict:
    """Start ``world`` workers on ``job``; kill all of them if one fails or the deadline passes."""
    from varuna_core.util.procs import run_local_workers

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "result.json").unlink(missing_ok=True)
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {"OMP_NUM_THREADS": "1", "VARUNA_CACHE_DIR": str(tmp.parent / "cache"), "PYTHONPATH": pythonpath}
    if malloc == "tuned":  # resident = allocated: every allocation touched, every free returned (docstring)
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_PERTURB_="165", MKL_DISABLE_FAST_MM="1")
    failure = run_local_workers([sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path), str(tmp)],
                                world, log_dir=tmp, timeout=timeout, cwd=ROOT, env=env)
    result_path = tmp / "result.json"
    if failure is None and not result_path.exists():
        failure = "rank 0 wrote no result"
    if failure is not None:
        logs = "\n".join(f"--- rank {r} ---\n" + (tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        return {"error": failure, "logs": logs}
    return json.loads(result_path.read_text())


def model_terms(prof, plan, stage: int) -> dict[str, float]:
    """A stage's prediction without the headroom (the memory model itself), split into its static part
    (parameters + gradients + optimizer state of its segments, from the profile) and what a step adds."""
    a, b = plan.partition[stage]
    static = sum(s.param_bytes + s.grad_bytes + s.optimizer_bytes for s in prof.segments[a:b])
    model = plan.stages[stage].memory_bytes / (1.0 + plan.headroom)
    return {"model": model, "static": static, "step": model - static}


def measure(cfg: Config, prof, args, tmp: Path) -> dict:
    """Plan ``cfg``, run it, and pair every stage's prediction with its rank's measurement."""
    from varuna_core.planning.artifacts import save_plan
    from varuna_core.planning.planner import PlanRequest, plan_for

    req = PlanRequest(gpus=cfg.pp, batch_size=args.batch_size, headroom=args.headroom)
    plan = plan_for(prof, req, pp=cfg.pp, dp=1, microbatch_size=cfg.mbs, schedule=cfg.schedule)
    run_dir = tmp / f"pp{cfg.pp}-{cfg.schedule}-mbs{cfg.mbs}"
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / "plan.json"
    save_plan(plan, plan_path)
    job = {"size": dataclasses.asdict(args.size), "plan": str(plan_path), "batch": args.batch_size, "mbs": cfg.mbs,
           "warmup": args.warmup, "steps": args.steps, "timeout": args.timeout, "device": args.device}
    started = time.perf_counter()
    res = launch(job, cfg.pp, run_dir, args.timeout, args.malloc)
    row = {"pp": cfg.pp, "schedule": cfg.schedule, "mbs": cfg.mbs, "num_microbatches": plan.num_microbatches,
           "partition": [list(r) for r in plan.partition], "wall_s": time.perf_counter() - started}
    if "error" in res:
        log(f"{cfg.label(args.batch_size)}: FAILED ({res['error']})\n{res['logs']}")
        return {**row, "error": res["error"], "stages": []}
    row.update(error=None, stages=[_pair(plan, prof, r) for r in sorted(res["ranks"], key=lambda g: g["stage"])])
    for s in row["stages"]:
        if abs(s["file_drift"]) > MiB:
            log(f"warning: {cfg.label(args.batch_size)} stage {s['stage']}: file-backed memory changed by "
                f"{s['file_drift'] / MiB:.1f} MiB during the measured steps; its peak is uncertain by as much")
    log(f"{cfg.label(args.batch_size)}: " + ", ".join(
        f"s{s['stage']} {s['predicted'] / MiB:.1f}/{s['measured'] / MiB:.1f} MiB" for s in row["stages"])
        + f" [{row['wall_s']:.1f}s]")
    return row


def _pair(plan, prof, rank: dict) -> dict:
    """One stage: the plan's prediction, the model's terms, the rank's measurement and its diagnostics."""
    predicted, measured = plan.stages[rank["stage"]].memory_bytes, rank["growth"]
    terms = model_terms(prof, plan, rank["stage"])
    return {
        "stage": rank["stage"], "segments": rank["partition"], "predicted": predicted, "measured": measured,
        "ratio": predicted / measured if measured > 0 else None,
        "model_ratio": terms["model"] / measured if measured > 0 else None, "model_terms": terms,
        "held_static": rank["static"],  # bytes of the rank's parameters, gradient buckets, optimizer state
        "between_steps": rank["between_steps"],  # growth held between steps (the static part and the rest)
        "before_baseline": rank["baseline"]["RssAnon"] - rank["before_imports"]["RssAnon"],
        "file_drift": rank["after"]["RssFile"] - rank["settled"]["RssFile"],  # over the measured steps
        "method": rank["method"], "max_posted": rank["max_posted"],
        "held_microbatches": plan.stages[rank["stage"]].held_microbatches,
    }


# ----------------------------------------------------------------------------------------------------------
# Output


def verdict(rows: list[dict], key: str = "ratio") -> dict:
    """Whether every stage's ``key`` (predicted / measured) lies in [LOW, HIGH], and the extremes."""
    ratios = [s[key] for r in rows for s in r["stages"] if s[key] is not None]
    failed = [f"pp={r['pp']} {r['schedule']} mbs={r['mbs']} stage {s['stage']}: {s[key]:.2f}"
              for r in rows for s in r["stages"] if s[key] is None or not LOW <= s[key] <= HIGH]
    return {"stages": len(ratios), "min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
            "outside": failed, "met": bool(ratios) and not failed and all(r["error"] is None for r in rows)}


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"machine: {meta['cpus']} CPUs, torch {meta['torch']}, device {meta['device']}; GPT {meta['size']} "
          f"(vocabulary 72), AdamW, global batch {meta['batch_size']}, dp=1; {meta['warmup']} warm-up + "
          f"{meta['steps']} measured step(s) per run; malloc: {meta['malloc']}; before the baseline (not counted): "
          f"{meta['before_baseline_mib'] or 0:.0f} MiB per process")
    print(f"plan: the plan's memory_bytes (the model + {meta['headroom']:.0%} headroom); model: without headroom; "
          "measured: peak anonymous resident memory during the measured steps minus the baseline before the model; "
          f"ratio: plan / measured (target {LOW}-{HIGH}), model ratio: model / measured. static: the model's "
          "parameters + gradients + optimizer state, held: the same counted from the rank's tensors, other: the rest "
          "of the growth between steps (the runtime's objects, not modelled); step: what a step adds, as the model "
          "predicts it and as measured (peak minus the memory between steps). MiB.")
    head = (f"{'pp':>2} {'schedule':<8} {'mbs':>3} {'M':>2} {'stage':>5} {'segs':>4} {'plan':>6} {'model':>6} "
            f"{'meas.':>6} {'ratio':>5} {'model':>5} | {'static':>6} {'held':>6} {'other':>5} | {'step':>5} "
            f"{'step':>5}")
    print(head)
    print(f"{'ratio':>{len(head) - 41}} | {'model':>6} {'meas.':>6} {'meas.':>5} | {'model':>5} {'meas.':>5}")
    print("-" * len(head))
    for r in rows:
        lead = f"{r['pp']:>2} {r['schedule']:<8} {r['mbs']:>3} {r['num_microbatches']:>2}"
        if r["error"] is not None:
            print(f"{lead} failed: {r['error']}")
            continue
        for s in r["stages"]:
            print(lead + " " + _stage_line(s))
            lead = " " * len(lead)
    for name, key in (("plan", "verdict"), ("model (no headroom)", "model_verdict")):
        v = meta[key]
        if v["min_ratio"] is None:
            print("no stage measured")
            return
        print(f"\n{name}: {v['stages']} stages, predicted / measured from {v['min_ratio']:.2f} to "
              f"{v['max_ratio']:.2f}; every stage within {LOW}-{HIGH}: {'yes' if v['met'] else 'NO'}")
        for line in v["outside"]:
            print(f"  outside: {line}")
    print(f"\ncriterion (the plan's prediction within {LOW}-{HIGH} of the measurement for every stage): "
          f"{'met' if meta['verdict']['met'] else 'NOT met'}; total run time {meta['total_s']:.0f}s")


def _stage_line(s: dict) -> str:
    mib = lambda x: f"{x / MiB:.1f}"  # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    held = sum(s["held_static"].values())
    terms = s["model_terms"]
    flag = "" if s["ratio"] is not None and LOW <= s["ratio"] <= HIGH else "  <--"
    segs = f"{s['segments'][0]}-{s['segments'][1] - 1}"
    return (f"{s['stage']:>5} {segs:>4} {mib(s['predicted']):>6} "
            f"{mib(terms['model']):>6} {mib(s['measured']):>6} {ratio(s['ratio']):>5} {ratio(s['model_ratio']):>5} | "
            f"{mib(terms['static']):>6} {mib(held):>6} {mib(s['between_steps'] - held):>5} | "
            f"{mib(terms['step']):>5} {mib(s['measured'] - s['between_steps']):>5}{flag}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 configurations instead of 24")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--n-layer", type=int, default=4, help="GPT blocks (segments: n_layer + 1)")
    parser.add_argument("--n-embd", type=int, default=512, help="GPT width")
    parser.add_argument("--n-head", type=int, default=8, help="attention heads")
    parser.add_argument("--block-size", type=int, default=64, help="sequence length")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--microbatch-sizes", default="4,8", help="two micro-batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the measured ones (≥ 1: optimizer state)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    parser.add_argument("--headroom", type=float, default=None,
                        help="the planner's headroom (default: the planner's own default, 0.1)")
    parser.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                        help="tuned: resident = allocated in the workers (glibc's MALLOC_MMAP_THRESHOLD_ and "
                        "MALLOC_PERTURB_, MKL_DISABLE_FAST_MM); default: the libraries' defaults")
    parser.add_argument("--keep", metavar="DIR", help="keep the profile, plans, logs and results in DIR")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    sizes = tuple(sorted(int(x) for x in args.microbatch_sizes.split(",") if x.strip()))
    if len(sizes) != 2 or sizes[0] < 1:
        parser.error("--microbatch-sizes takes two positive sizes")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be ≥ 1")
    if args.n_layer < 3:
        parser.error("--n-layer must be ≥ 3 (pp up to 4 needs 4 segments)")
    args.size = GptSize(args.n_layer, args.n_embd, args.n_head, args.block_size)
    if args.headroom is None:
        from varuna_core.planning.planner import PlanRequest

        args.headroom = PlanRequest.headroom  # the dataclass field's default
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 4 else "cpu"
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="varuna-memory-model-") as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        prof = _profile(args, sizes, tmp)
        rows.extend(measure(cfg, prof, args, tmp) for cfg in configs(args.quick, sizes))
    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "device": args.device,
            "size": dataclasses.asdict(args.size), "batch_size": args.batch_size, "microbatch_sizes": list(sizes),
            "warmup": args.warmup, "steps": args.steps, "malloc": args.malloc, "quick": args.quick,
            "headroom": args.headroom,
            "total_s": time.perf_counter() - started,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    meta["verdict"], meta["model_verdict"] = verdict(rows), verdict(rows, "model_ratio")
    before = [s["before_baseline"] for r in rows for s in r["stages"]]
    meta["before_baseline_mib"] = max(before) / MiB if before else None
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
    else:
        print_table(rows, meta)
    return 1 if any(r["error"] is not None for r in rows) else 0


def _profile(args, sizes: tuple[int, int], tmp: Path):
    """The GPT's profile at the two micro-batch sizes (one repeat: the memory numbers do not vary)."""
    from varuna_core.profiling.run import profile
    from varuna_core.util.versioned_io import save_artifact

    log(f"profiling the GPT {dataclasses.asdict(args.size)} at micro-batch sizes {list(sizes)} ...")
    t0 = time.perf_counter()
    prof = profile(gpt_spec(args.size), microbatch_sizes=list(sizes), nproc=1, repeats=1, warmup=0,
                   device=args.device)
    save_artifact(prof, tmp / "profile.json")
    log(f"profiled in {time.perf_counter() - t0:.1f}s")
    return prof


if __name__ == "__main__":
    sys.exit(main())
