"""How well does the planner's simulator predict the real step time?

For a set of configurations (pipeline depth ``pp``, data-parallel width ``dp``, micro-batch size, global batch,
schedule) this script

1. profiles the model once (``varuna_core.profiling.run.profile(..., nproc=2)``, so the profile holds the
   point-to-point and all-reduce curves),
2. makes the plan of exactly that configuration (``varuna_core.planning.planner.plan_for``) and keeps its predicted step
   time (``plan.prediction.step_time``),
3. runs it: ``pp·dp`` fresh local processes (gloo on 127.0.0.1, ``OMP_NUM_THREADS=1``, a hard timeout, all
   killed when one fails), each wrapping the model with ``Varuna(model, None, dummy_inputs, batch_size=B,
   chunk_size=mbs, plan=plan_path)`` and an SGD optimizer (the spec's ``optimizer``, so the profiler times the
   same one); 2 warm-up steps, then timed steps (``barrier()``, then ``step()`` + ``optimizer.step()`` +
   ``zero_grad()`` timed with ``perf_counter``; per step the slowest rank counts; the median over the timed
   steps is reported), and
4. prints predicted vs measured step time and ``error = (predicted − measured) / measured``, with a breakdown
   that says where a difference comes from (see benchmarks/README.md).

Two models: a *sleep* model (8 segments whose forward and backward sleep set times: 8 processes do not compete
for 2 cores, and the profile measures exactly what the runtime runs, so what remains is the simulator's and the
runtime's share) and the example GPT (``examples/gpt/spec.py:spec`` with SGD: real compute, only configurations with
``pp·dp ≤ 2`` so that they fit 2 cores).

    python benchmarks/sim_accuracy.py            # full run (about 2.5 minutes on an idle 2-core machine)
    python benchmarks/sim_accuracy.py --quick    # fewer configurations and steps (about 1.5 minutes)
    python benchmarks/sim_accuracy.py --json     # one JSON document on stdout instead of the tables

Progress goes to stderr. Exit code 0 when every run succeeded (whether or not the accuracy targets were met;
the last lines of each table say), 1 when a run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from devtools import cpu  # noqa: E402
from devtools.models import SleepModel  # noqa: E402
from varuna_core import ModelSpec  # noqa: E402
from varuna_core.pipeline.tracing import ActionObserver, ActionTiming  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# The sleep model: 8 segments, (forward, backward) seconds each; a Linear(h, h) in front of each sleep.

SLEEP_TIMES = [
    (0.010, 0.020), (0.015, 0.030), (0.012, 0.025), (0.020, 0.040),
    (0.010, 0.020), (0.015, 0.035), (0.012, 0.022), (0.018, 0.030),
]
SLEEP_HIDDEN = 8


def _sleep_build() -> SleepModel:
    torch.manual_seed(0)
    return SleepModel(SLEEP_TIMES, SLEEP_HIDDEN)


def _sleep_batch(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, SLEEP_HIDDEN, generator=g), "y": torch.randn(n, SLEEP_HIDDEN, generator=g)}


def _sgd(lr: float):
    """The optimizer of the runs, also given to the profiler (which times one step of it per segment)."""
    return lambda params: torch.optim.SGD(params, lr=lr)


SLEEP_SPEC = ModelSpec(build=_sleep_build, batch=_sleep_batch, optimizer=_sgd(0.01), name="sim-accuracy-sleep")
SLEEP_REF = f"{Path(__file__).resolve()}:SLEEP_SPEC"


def gpt_spec() -> ModelSpec:
    """``examples/gpt/spec.py:spec`` with the runs' SGD optimizer (that spec leaves it to the default, AdamW)."""
    from varuna_core.model.spec import load_spec

    base = load_spec(f"{ROOT / 'examples' / 'gpt' / 'spec.py'}:spec")
    return dataclasses.replace(base, optimizer=_sgd(0.05), name="examples/gpt (SGD)")


GPT_REF = f"{Path(__file__).resolve()}:gpt_spec"

TARGETS = {"sleep": 0.05, "gpt": 0.15}  # median |error| the issue asks for


@dataclasses.dataclass(frozen=True)
class Config:
    pp: int
    dp: int
    mbs: int
    batch: int
    schedule: str

    @property
    def num_mb(self) -> int:  # per replica (the first replica's count, as the plan reports)
        return math.ceil(math.ceil(self.batch / self.dp) / self.mbs)

    def label(self) -> str:
        return f"pp={self.pp} dp={self.dp} mbs={self.mbs} M={self.num_mb} {self.schedule}"


# pp up to 8, dp up to 2, all three schedules, 2 to 8 micro-batches, one uneven split (pp=3 over 8 segments)
# and one smaller last micro-batch (B=14, mbs=4).
SLEEP_CONFIGS = [
    Config(8, 1, 1, 8, "varuna"),
    Config(8, 1, 2, 8, "1f1b"),
    Config(4, 2, 1, 8, "1f1b"),
    Config(4, 1, 4, 32, "varuna"),
    Config(4, 1, 2, 8, "gpipe"),
    Config(3, 1, 4, 14, "1f1b"),
    Config(2, 2, 2, 16, "varuna"),
    Config(2, 1, 1, 6, "1f1b"),
    Config(2, 2, 4, 24, "gpipe"),
    Config(1, 2, 4, 16, "1f1b"),
]
SLEEP_QUICK = [
    Config(8, 1, 1, 8, "varuna"),
    Config(4, 1, 2, 8, "gpipe"),
    Config(2, 2, 2, 16, "1f1b"),
    Config(2, 1, 1, 6, "varuna"),
]
GPT_CONFIGS = [
    Config(1, 1, 4, 32, "1f1b"),
    Config(1, 1, 8, 32, "gpipe"),
    Config(2, 1, 4, 32, "1f1b"),
    Config(2, 1, 4, 32, "varuna"),
    Config(2, 1, 4, 32, "gpipe"),
    Config(2, 1, 8, 32, "1f1b"),
    Config(2, 1, 8, 32, "varuna"),
    Config(2, 1, 8, 28, "1f1b"),  # a smaller last micro-batch (4 of 8 examples)
    Config(1, 2, 4, 32, "1f1b"),
    Config(1, 2, 8, 32, "gpipe"),
]
GPT_QUICK = [
    Config(1, 1, 4, 32, "1f1b"),
    Config(2, 1, 4, 32, "varuna"),
    Config(1, 2, 4, 32, "gpipe"),
]


WAITED = [0.0]  # seconds spent in wait_idle


def wait_idle(limit_s: float, threshold: float = 0.15) -> float:
    """Wait (up to ``limit_s``) until other processes keep fewer than ``threshold`` cores busy over 2-second
    windows (:func:`devtools.cpu.wait_idle`); the seconds waited are added up in ``WAITED``."""
    start = time.perf_counter()
    try:
        return cpu.wait_idle(limit_s, threshold)
    finally:
        WAITED[0] += time.perf_counter() - start


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Worker (one process of one configuration): python benchmarks/sim_accuracy.py --worker JOB OUT_DIR


def worker(job_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    # wall-clock times of the start-up phases (the JSON output shows them relative to the launch)
    stamps = {"launched": float(os.environ.get("SIM_ACCURACY_LAUNCHED", "nan")), "imported": time.time()}
    t_start = time.perf_counter()
    vm, opt, inputs = _build(job, stamps)
    setup_s = time.perf_counter() - t_start
    stamps["varuna"] = time.time()
    probe = _PhaseProbe(vm)
    rows, actions, load = _timed_steps(vm, opt, inputs, job, probe)
    stamps["steps"] = time.time()
    times = torch.tensor(rows, dtype=torch.float64)
    slowest = times.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "stage": vm.stage, "replica": vm.replica, "rows": rows,
                                      "setup_s": setup_s, "stamps": stamps, "actions": actions,
                                      "cpu_s": load["cpu_s"], "num_microbatches": vm.num_microbatches,
                                      "microbatch_sizes": vm.microbatch_sizes})
    if rank == 0:
        _write_result(Path(out_dir), vm, slowest, gathered, load)
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's tear-down of torch (about 1 CPU-second per process, i.e. several seconds of wall
    # time when 8 processes share 2 cores); everything this process reports is written and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _build(job: dict, stamps: dict):
    """The process group, the Varuna model (and its optimizer), and this replica's batch."""
    import torch.distributed as dist

    from varuna_core import Varuna
    from varuna_core.model.spec import load_spec

    spec = load_spec(job["spec"])
    model = spec.build()
    batch_size = job["batch"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    stamps["process_group"] = time.time()
    vm = Varuna(model, None, spec.batch(2), batch_size=batch_size, chunk_size=job["mbs"], plan=job["plan"],
                shared_weights=spec.shared_weights, timeout=job["timeout"], init=spec.init)  # a meta build's
    params = list(vm.parameters())
    opt = spec.optimizer(params) if params else None  # SGD, the optimizer the profile timed
    if opt is not None:
        vm.set_optimizer(opt)
    return vm, opt, vm.replica_slice(spec.batch(batch_size))


class _PhaseProbe(ActionObserver):
    """Splits a step into phases, in this process only (the library is untouched).

    As the runtime's observer it gets, per action, its wall time, its compute (forward or backward, waits
    excluded) and its waits for messages, the end of the pipeline (``runtime.run``) and the end of the gradient
    sync (tied weights + data parallel). The rest of ``step()`` is the loss/norm all-reduce; then the optimizer.
    """

    def __init__(self, vm) -> None:
        self.marks: dict[str, float] = {}
        self.actions: list[list] | None = None  # per action while recording: [op, mb, wall s, compute s, wait s]
        vm.executor.add_observer(self)

    def on_action(self, timing: ActionTiming) -> None:
        if self.actions is not None:
            self.actions.append([timing.action.op.value, timing.action.mb, timing.end - timing.start,
                                 timing.compute, timing.waited])

    def on_run(self, start: float, end: float) -> None:
        self.marks["pipeline"] = end

    def on_sync(self, start: float, end: float) -> None:
        self.marks["sync"] = end


def _timed_steps(vm, opt, inputs: dict, job: dict, probe: _PhaseProbe) -> tuple[list, list, dict]:
    """Warm-up steps, then the timed ones: per step [total, pipeline end, sync end, step() end] relative to the
    barrier, per timed action [op, mb, wall s, compute s, wait s] (wall - compute - wait: the runtime's own
    overhead), and the machine's load over the timed steps."""
    import torch.distributed as dist

    rows, actions = [], []
    for i in range(job["warmup"] + job["steps"]):
        if i == job["warmup"]:  # machine load over the timed steps
            busy0, cpu0, wall0 = cpu.busy_cpu_s(), cpu.own_cpu_s(children=False), time.perf_counter()
        timed_step = i >= job["warmup"]
        probe.actions = actions if timed_step else None
        dist.barrier()
        t0 = time.perf_counter()
        vm.step(inputs)
        t_step = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        t1 = time.perf_counter()
        if timed_step:
            rows.append([t1 - t0, probe.marks["pipeline"] - t0, probe.marks["sync"] - t0, t_step - t0])
    probe.actions = None
    busy1, cpu1, wall1 = cpu.busy_cpu_s(), cpu.own_cpu_s(children=False), time.perf_counter()
    return rows, actions, {"busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
                           "cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0}


def _write_result(out_dir: Path, vm, slowest: torch.Tensor, gathered: list, load: dict) -> None:
    """Rank 0: the medians over steps of the slowest rank's phase ends, every rank's rows, the load."""
    others = None
    if load["busy_s"] is not None:
        others = max(0.0, (load["busy_s"] - sum(g["cpu_s"] for g in gathered)) / load["wall_s"])
    step_s = slowest[:, 0].tolist()
    result = {
        "step_s": step_s,
        "median_s": statistics.median(step_s),
        # medians over steps of the slowest rank's phase ends (seconds after the barrier)
        "pipeline_end_s": statistics.median(slowest[:, 1].tolist()),
        "sync_end_s": statistics.median(slowest[:, 2].tolist()),
        "step_end_s": statistics.median(slowest[:, 3].tolist()),
        "ranks": gathered,
        "other_cores": others,  # cores other processes kept busy during the timed steps
        "schedule": vm.schedule_name, "chunk": vm.chunk_size, "partition": vm.partition.ranges,
    }
    (out_dir / "result.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------
# Launcher


def launch(job: dict, world: int, tmp: Path, timeout: float) -> dict:
    """Start ``world`` workers on ``job``; kill all of them if one fails or the deadline passes."""
    from varuna_core.util.procs import run_local_workers

    tmp.mkdir(parents=True, exist_ok=True)
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    failure = run_local_workers(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path), str(tmp)], world,
        log_dir=tmp, timeout=timeout, cwd=ROOT,
        env=dict(SIM_ACCURACY_LAUNCHED=repr(time.time()), VARUNA_CACHE_DIR=str(tmp.parent / "cache"),
                 PYTHONPATH=pythonpath))
    result_path = tmp / "result.json"
    if failure is None and not result_path.exists():
        failure = "rank 0 wrote no result"
    if failure is not None:
        logs = "\n".join(f"--- rank {r} ---\n" + (tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        return {"error": failure, "logs": logs}
    return json.loads(result_path.read_text())


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def stage_breakdown(res: dict, plan, mbs: int) -> list[dict]:
    """Per rank: median (and mean) compute of its F, R and B (full-size micro-batches) next to the plan's numbers, the
    runtime's overhead per action, and per step its summed compute and waits (medians over the timed steps)."""
    out = []
    for r in sorted(res["ranks"], key=lambda g: (g["replica"], g["stage"])):
        st = plan.stages[r["stage"]]
        sizes = r["microbatch_sizes"]
        steps = max(1, len(r["rows"]))
        by_op: dict[str, list[float]] = {"F": [], "R": [], "B": []}
        overhead = []
        for op, mb, wall, compute, wait in r["actions"]:
            if sizes[mb] == mbs:
                by_op[op].append(compute)
            overhead.append(wall - compute - wait)
        per_step = len(r["actions"]) // steps
        busy = [sum(a[3] for a in r["actions"][i * per_step:(i + 1) * per_step]) for i in range(steps)]
        waits = [sum(a[4] for a in r["actions"][i * per_step:(i + 1) * per_step]) for i in range(steps)]
        out.append({
            "rank": r["rank"], "stage": r["stage"], "replica": r["replica"],
            "predicted_F_s": st.forward, "predicted_R_s": st.recompute, "predicted_B_s": st.backward,
            "measured_F_s": _median(by_op["F"]), "measured_R_s": _median(by_op["R"]),
            "measured_B_s": _median(by_op["B"]),
            "mean_F_s": _mean(by_op["F"]), "mean_R_s": _mean(by_op["R"]), "mean_B_s": _mean(by_op["B"]),
            "predicted_busy_s": st.busy, "measured_busy_s": _median(busy), "measured_wait_s": _median(waits),
            "overhead_per_action_s": _median(overhead), "actions_per_step": per_step,
        })
    return out


def resimulate(plan, stages: list[dict], *, overhead: bool) -> float:
    """The simulator's pipeline time for ``plan`` with each stage's *measured* mean F, R and B (replica 0),
    plus, if ``overhead``, the runtime's measured own time per action; communication as predicted. Compared
    with the measured pipeline time it separates the profile's error (compute estimates) from the schedule
    model's."""
    from varuna_core.ir.schedule import generate
    from varuna_core.planning.simulate import StageCosts, simulate

    costs = []
    for st in sorted((x for x in stages if x["replica"] == 0), key=lambda x: x["stage"]):
        p = plan.stages[st["stage"]]
        extra = st["overhead_per_action_s"] if overhead else 0.0
        pick = lambda measured, predicted: (measured if measured is not None else predicted) + extra  # noqa: E731, B023 - used in this iteration
        costs.append(StageCosts(pick(st["mean_F_s"], p.forward), pick(st["mean_R_s"], p.recompute),
                                pick(st["mean_B_s"], p.backward), p.send_activation, p.send_gradient, 0.0))
    return simulate(generate(plan.schedule, plan.pp, plan.num_microbatches), costs).pipeline_time


def measure_model(name: str, ref: str, configs: list[Config], sizes: list[int], repeats: int, args,
                  tmp: Path) -> dict:
    from varuna_core.planning.artifacts import save_plan
    from varuna_core.planning.planner import PlanRequest, plan_for
    from varuna_core.profiling.run import profile
    from varuna_core.util.versioned_io import save_artifact

    if args.wait_idle:
        wait_idle(args.wait_idle)
    log(f"[{name}] profiling {ref.rsplit('/', 1)[-1]} (nproc=2, micro-batch sizes {sizes}, {repeats} repeats) ...")
    load, t0 = cpu.Load(), time.perf_counter()
    prof = profile(ref, microbatch_sizes=sizes, nproc=2, repeats=repeats, warmup=3)
    profile_s, profile_others = time.perf_counter() - t0, load.other_cores()
    save_artifact(prof, tmp / f"{name}-profile.json")
    log(f"[{name}] profiled in {profile_s:.1f}s (other processes: {profile_others or 0:.2f} cores)")
    rows = []
    for k, cfg in enumerate(configs):
        req = PlanRequest(gpus=cfg.pp * cfg.dp, batch_size=cfg.batch)
        plan = plan_for(prof, req, pp=cfg.pp, dp=cfg.dp, microbatch_size=cfg.mbs, schedule=cfg.schedule)
        run_dir = tmp / f"{name}-{k}"
        run_dir.mkdir(parents=True, exist_ok=True)  # --keep DIR may hold an earlier run's files
        (run_dir / "result.json").unlink(missing_ok=True)
        plan_path = run_dir / "plan.json"
        save_plan(plan, plan_path)
        job = {"spec": ref, "plan": str(plan_path), "batch": cfg.batch, "mbs": cfg.mbs, "warmup": args.warmup,
               "steps": args.steps, "timeout": min(args.timeout, 120)}
        if args.wait_idle:
            waited = wait_idle(args.wait_idle)
            if waited > 2.5:
                log(f"[{name}] waited {waited:.0f}s for the machine to be idle")
        t1 = time.perf_counter()
        res = launch(job, cfg.pp * cfg.dp, run_dir, args.timeout)
        wall = time.perf_counter() - t1
        row = {"model": name, "pp": cfg.pp, "dp": cfg.dp, "mbs": cfg.mbs, "batch": cfg.batch,
               "num_microbatches": plan.num_microbatches, "schedule": cfg.schedule,
               "partition": [list(r) for r in plan.partition],
               "predicted_s": plan.prediction.step_time, "predicted_pipeline_s": plan.prediction.pipeline_time,
               "predicted_allreduce_s": plan.prediction.allreduce_time,
               "predicted_bubble": plan.prediction.bubble_fraction, "wall_s": wall}
        if "error" in res:
            row["error"] = res["error"]
            log(f"[{name}] {cfg.label()}: FAILED ({res['error']})\n{res['logs']}")
        else:
            measured = res["median_s"]
            stages = stage_breakdown(res, plan, cfg.mbs)
            first = [x for x in stages if x["replica"] == 0]
            pred_busy = sum(x["predicted_busy_s"] for x in first)
            try:
                resim, resim_ovh = resimulate(plan, stages, overhead=False), resimulate(plan, stages, overhead=True)
            except Exception as exc:  # noqa: BLE001 - a diagnostic only: never lose the run for it
                log(f"[{name}] re-simulation failed: {type(exc).__name__}: {exc}")
                resim = resim_ovh = None
            row.update(measured_s=measured, error=None, rel_error=(row["predicted_s"] - measured) / measured,
                       step_s=res["step_s"], pipeline_end_s=res["pipeline_end_s"], sync_end_s=res["sync_end_s"],
                       step_end_s=res["step_end_s"], other_cores=res["other_cores"],
                       compute_ratio=(sum(x["measured_busy_s"] for x in first) / pred_busy) if pred_busy else None,
                       overhead_per_action_s=_median([x["overhead_per_action_s"] for x in stages]),
                       resim_pipeline_s=resim, resim_overhead_pipeline_s=resim_ovh,
                       stages=stages, setup_s=max(r["setup_s"] for r in res["ranks"]),
                       startup_s={k: max(r["stamps"][k] - r["stamps"]["launched"] for r in res["ranks"])
                                  for k in ("imported", "process_group", "varuna")})
            noisy = " NOISY" if (res["other_cores"] or 0) > 0.2 else ""
            log(f"[{name}] {cfg.label()}: predicted {row['predicted_s'] * 1e3:.1f} ms, measured "
                f"{measured * 1e3:.1f} ms ({row['rel_error']:+.1%}) [{wall:.1f}s]{noisy}")
        rows.append(row)
    errors = [abs(r["rel_error"]) for r in rows if r.get("rel_error") is not None]
    return {"model": name, "reference": ref, "profile_s": profile_s, "profile_other_cores": profile_others,
            "microbatch_sizes": sizes, "profile_repeats": repeats, "rows": rows,
            "median_abs_error": statistics.median(errors) if errors else None, "target": TARGETS[name],
            "comm": [{"op": c.op, "group": c.group_size, "latency_s": c.fit.latency, "bandwidth_Bps": c.fit.bandwidth}
                     for c in prof.comm]}


def print_stages(row: dict) -> None:
    """Per rank: predicted / measured median F, R, B (ms, full-size micro-batches), compute and waits per step,
    and the runtime's own time per action."""
    ms = lambda x: "-" if x is None else f"{x * 1e3:.2f}"  # noqa: E731
    for st in row["stages"]:
        print(f"      rank {st['rank']} stage {st['stage']}: F {ms(st['predicted_F_s'])}/{ms(st['measured_F_s'])}  "
              f"R {ms(st['predicted_R_s'])}/{ms(st['measured_R_s'])}  B {ms(st['predicted_B_s'])}/"
              f"{ms(st['measured_B_s'])}  compute/step {ms(st['predicted_busy_s'])}/{ms(st['measured_busy_s'])}  "
              f"waits/step {ms(st['measured_wait_s'])}  own time/action {ms(st['overhead_per_action_s'])}")


def print_table(block: dict, stages: bool = False) -> None:
    load = block["profile_other_cores"]
    print(f"\n{block['model']} model ({block['reference'].rsplit('/', 1)[-1]}): profiled in {block['profile_s']:.1f}s "
          f"at micro-batch sizes {block['microbatch_sizes']}, {block['profile_repeats']} repeats; other processes "
          f"kept {load or 0:.2f} cores busy meanwhile" + ("  <-- NOISY profile" if (load or 0) > 0.2 else ""))
    head = (f"{'pp':>2} {'dp':>2} {'B':>3} {'mbs':>3} {'M':>2} {'schedule':<8} {'predicted ms':>12} "
            f"{'measured ms':>11} {'error':>7} | {'pred pipe':>9} {'resim':>7} {'+ovh':>7} {'pipe':>7} {'+sync':>7} "
            f"{'+step':>7} {'compute':>7} {'ovh/act':>7} {'load':>5}")
    print(head)
    print("-" * len(head))
    for r in block["rows"]:
        lead = (f"{r['pp']:>2} {r['dp']:>2} {r['batch']:>3} {r['mbs']:>3} {r['num_microbatches']:>2} "
                f"{r['schedule']:<8} {r['predicted_s'] * 1e3:>12.1f} ")
        if r.get("measured_s") is None:
            print(lead + f"{'failed':>11}   {r['error']}")
            continue
        ratio = f"{r['compute_ratio']:.2f}" if r.get("compute_ratio") is not None else "-"
        load = r["other_cores"]
        ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
        print(lead + f"{r['measured_s'] * 1e3:>11.1f} {r['rel_error']:>+7.1%} | "
              f"{r['predicted_pipeline_s'] * 1e3:>9.1f} {ms(r['resim_pipeline_s']):>7} "
              f"{ms(r['resim_overhead_pipeline_s']):>7} {r['pipeline_end_s'] * 1e3:>7.1f} "
              f"{r['sync_end_s'] * 1e3:>7.1f} {r['step_end_s'] * 1e3:>7.1f} "
              f"{ratio:>7} {r['overhead_per_action_s'] * 1e3:>7.2f} "
              f"{'-' if load is None else format(load, '.2f'):>5}{' NOISY' if (load or 0) > 0.2 else ''}")
        if stages:
            print_stages(r)
    med = block["median_abs_error"]
    if med is None:
        print("median |error|: n/a (no run succeeded)")
    else:
        verdict = "met" if med <= block["target"] else "NOT met"
        print(f"median |error| = {med:.1%} (target ≤ {block['target']:.0%}: {verdict})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and steps (about 1.5 minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    parser.add_argument("--models", default="sleep,gpt", help="comma-separated subset of sleep,gpt")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 6, quick 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one run may take")
    parser.add_argument("--stages", action="store_true",
                        help="under each row, print every rank's predicted / measured F, R and B times")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before the profile and each run, wait up to S seconds for the other processes on the "
                        "machine to go quiet (for shared machines; default: do not wait)")
    parser.add_argument("--keep", metavar="DIR", help="keep plans, logs and results in DIR")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    if args.steps is None:
        args.steps = 4 if args.quick else 6
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be ≥ 1 and --warmup ≥ 0")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"sleep", "gpt"}
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from sleep, gpt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    started = time.perf_counter()
    blocks = []
    with tempfile.TemporaryDirectory(prefix="varuna-sim-accuracy-") as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        if "sleep" in models:
            blocks.append(measure_model("sleep", SLEEP_REF, SLEEP_QUICK if args.quick else SLEEP_CONFIGS,
                                        [1, 2, 4], 3 if args.quick else 5, args, tmp))
        if "gpt" in models:
            blocks.append(measure_model("gpt", GPT_REF, GPT_QUICK if args.quick else GPT_CONFIGS, [4, 8],
                                        10 if args.quick else 20, args, tmp))
    total_s = time.perf_counter() - started
    from varuna_core.planning.simulate import native_module

    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "native_simulator": native_module() is not None,
            "quick": args.quick, "steps": args.steps, "warmup": args.warmup, "total_s": total_s,
            "waited_for_idle_s": WAITED[0],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json:
        print(json.dumps({"meta": meta, "models": blocks}, indent=2))
    else:
        print(f"machine: {meta['cpus']} CPUs, torch {meta['torch']}, simulator: "
              f"{'native' if meta['native_simulator'] else 'python'}; {args.warmup} warm-up + {args.steps} timed "
              f"steps per run; B: global batch, M: micro-batches per replica; error = (predicted - measured) / "
              f"measured")
        print("pred pipe: predicted pipeline time (before gradient syncs); resim: the simulator re-run with the "
              "measured F/R/B times, +ovh: and with the runtime's measured own time per action added; pipe / +sync / "
              "+step: median over steps of the slowest rank's time from the barrier to the end of the pipeline, of "
              "the gradient sync and of step() (loss all-reduce); measured adds the optimizer. compute: measured / "
              "predicted compute of replica 0's stages; ovh/act: the runtime's own time per action (ms); load: cores "
              "other processes kept busy during the timed steps (NOISY above 0.2). Times in ms.")
        for block in blocks:
            print_table(block, stages=args.stages)
        waited = f" ({WAITED[0]:.0f}s of it waiting for the machine to be idle)" if WAITED[0] >= 1 else ""
        print(f"\ntotal run time {total_s:.0f}s{waited}")
    failed = any(r.get("measured_s") is None for b in blocks for r in b["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
