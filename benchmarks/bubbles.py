"""Bubbles, exactly: the step time of each schedule on a model whose ``F``, ``B`` and ``W`` take known times,
against the simulator and against the theoretical bubble.

The model (``devtools.models.SplitSleepModel``) has one segment per stage; each sleeps ``F`` in its forward,
``B`` in the backward to its input and ``W`` when its weight's gradient is computed (in the backward under an
unsplit schedule, in ``W`` under a split one). Sleeping processes do not compete for the cores, so ``pp`` of them
share two cores and what is measured is the schedule (and the runtime's own time per action), not the CPU.

For each depth ``pp`` (2, 4, 8: one launch of ``pp`` local processes, gloo on 127.0.0.1, one thread each) and
``M`` ∈ {pp, 2pp, 4pp} micro-batches of one example, every schedule runs a warm-up step and ``--steps`` timed
steps; the pipeline's part of a step is timed (from the barrier to the end of the rank's last action; per step
the slowest rank counts; the median is reported: the gradient sync and the optimizer are the same for every
schedule), and it is compared with

* ``ideal``: a stage's own work, ``M·(F+B+W)`` (``M·(2F+B+W)`` where the schedule recomputes);
* ``theory``: ``1f1b`` ``ideal + (pp-1)(F+B+W)``; ``zb`` (ZB-H1) ``ideal + (pp-1)(F+B-W)`` (Qi et al.); the
  others have no closed form (``-``);
* ``simulated``: the planner's simulator (:func:`varuna_core.planning.simulate.simulate`) on the schedule the
  runtime ran, with each stage's F, R, B and W the mean the runtime measured (sleep plus its own time per
  action), messages free (a few bytes on the loopback), and no opportunistic forward (gloo's receives cannot
  tell that they completed, so on CPU the runtime never moves a forward): what the planner predicts from a
  profile of this model; the error is the schedule model's.

It also prints, per ``(pp, M)``, the share of its unsplit twin's bubble that each split schedule removes
(``zb`` against ``1f1b``, ``varuna-zb`` against ``varuna``; bubble = measured − the busiest stage's measured
work, which counts the runtime's own time per action too). The targets: ``zb`` removes ≥ 2/3 at ``M = 2pp``;
the simulator within 3% on every row.

    python benchmarks/bubbles.py [--unit 0.02] [--pp 2,4,8] [--steps 3] [--json]

Progress goes to stderr. Exit code 0 when every run succeeded (the targets are reported, not enforced), 1 when a
run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEDULES = ("1f1b", "varuna", "zb", "varuna-zb")
HIDDEN = 8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Worker: python benchmarks/bubbles.py --worker JOB OUT_DIR (one process of one depth; runs every M and schedule)


def worker(job_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from devtools.models import SplitSleepModel
    from varuna_core import Varuna
    from varuna_core.pipeline.tracing import ActionObserver, ActionTiming

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    rank, pp, unit = int(os.environ["RANK"]), job["pp"], job["unit"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))

    class Actions(ActionObserver):
        def __init__(self) -> None:
            self.rows: list[list] | None = None
            self.pipeline_end = 0.0

        def on_action(self, timing: ActionTiming) -> None:
            if self.rows is not None:
                self.rows.append([timing.action.op.value, timing.end - timing.start, timing.compute, timing.waited])

        def on_run(self, start: float, end: float) -> None:
            self.pipeline_end = end

    def batch(n: int) -> dict:
        g = torch.Generator().manual_seed(n)
        return {"x": torch.randn(n, HIDDEN, generator=g), "y": torch.randn(n, HIDDEN, generator=g)}

    results = []
    for num_mb in job["microbatches"]:
        for schedule in job["schedules"]:
            torch.manual_seed(0)
            model = SplitSleepModel([(unit, unit, unit)] * pp, HIDDEN)
            vm = Varuna(model, ";".join(str(s) for s in range(pp)), batch(2), batch_size=num_mb, chunk_size=1,
                        schedule=schedule, timeout=job["timeout"])
            opt = torch.optim.SGD(list(vm.parameters()), lr=1e-3)
            vm.set_optimizer(opt)
            probe = vm.executor.add_observer(Actions())
            inputs = vm.replica_slice(batch(num_mb))
            times, actions = [], []
            for i in range(1 + job["steps"]):
                probe.rows = actions if i >= 1 else None
                dist.barrier()
                t0 = time.perf_counter()
                vm.step(inputs)
                opt.step()
                opt.zero_grad()
                if i >= 1:  # the pipeline's part of the step: what the schedule decides (and the simulator models)
                    times.append(probe.pipeline_end - t0)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            per_op: dict[str, list[float]] = {}
            for op, wall, _compute, waited in actions:
                per_op.setdefault(op, []).append(wall - waited)  # the action's own time, waits excluded
            gathered: list = [None] * pp
            dist.all_gather_object(gathered, {op: statistics.fmean(v) for op, v in per_op.items()})
            results.append({"schedule": schedule, "microbatches": num_mb, "pipeline_s": slowest.tolist(),
                            "per_stage": gathered})
            dist.barrier()
    if rank == 0:
        (Path(out_dir) / "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(job: dict, world: int, tmp: Path, timeout: float) -> list[dict]:
    from varuna_core.util.procs import run_local_workers

    tmp.mkdir(parents=True, exist_ok=True)
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    failure = run_local_workers([sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path), str(tmp)],
                                world, log_dir=tmp, timeout=timeout, cwd=ROOT,
                                env=dict(VARUNA_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=pythonpath))
    result = tmp / "result.json"
    if failure is None and not result.exists():
        failure = "rank 0 wrote no result"
    if failure is not None:
        logs = "\n".join(f"--- rank {r} ---\n" + (tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise RuntimeError(f"pp={world}: {failure}\n{logs}")
    return json.loads(result.read_text())


# ----------------------------------------------------------------------------------------------------------
# What the run is compared with


def ideal(schedule: str, pp: int, num_mb: int, unit: float) -> float:
    """A stage's own work in one step: every micro-batch's F, B and W (and R where the schedule recomputes)."""
    from varuna_core.ir.schedule import recompute_stages

    return num_mb * unit * (4 if any(recompute_stages(schedule, pp)) else 3)


def busy(schedule: str, pp: int, num_mb: int, per_stage: list[dict]) -> float:
    """The busiest stage's work as measured: its actions' mean times (the sleeps and the runtime's own time per
    action) times their counts. The bubble is what the pipeline takes beyond it."""
    from varuna_core.ir.schedule import generate

    sched = generate(schedule, pp, num_mb)
    return max(sum(t.get(a.op.value, 0.0) for a in sched.stage_actions(s)) for s, t in enumerate(per_stage))


def theory(schedule: str, pp: int, num_mb: int, unit: float) -> float | None:
    """The closed form of the step time with equal F, B and W and free messages, where there is one."""
    if schedule == "1f1b":
        return (num_mb + pp - 1) * 3 * unit
    if schedule == "zb":
        return 3 * num_mb * unit + (pp - 1) * unit  # (pp-1)(F+B-W)
    return None


def simulated(schedule: str, pp: int, num_mb: int, per_stage: list[dict]) -> float:
    """The simulator on the schedule the runtime ran, with each stage's measured mean action times."""
    from varuna_core.ir.schedule import generate
    from varuna_core.planning.simulate import StageCosts, simulate

    costs = [StageCosts(forward=t.get("F", 0.0), recompute=t.get("R", 0.0), backward=t.get("B", 0.0),
                        weight=t.get("W", 0.0)) for t in per_stage]
    # gloo's receives report completion only once waited for, so on CPU the runtime never moves a forward before
    # a recompute ([Note: opportunistic forward]): simulate that runtime
    return simulate(generate(schedule, pp, num_mb), costs, opportunistic=False).pipeline_time


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--unit", type=float, default=0.02, help="seconds of each F, B and W (default 0.02)")
    p.add_argument("--pp", default="2,4,8", help="pipeline depths (comma-separated)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of the schedules")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one depth's launch")
    args = p.parse_args()
    depths = [int(x) for x in args.pp.split(",") if x.strip()]
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    if not depths or min(depths) < 2 or args.unit <= 0 or args.steps < 1 or not set(schedules) <= set(SCHEDULES):
        p.error(f"need depths ≥ 2, --unit > 0, --steps ≥ 1 and schedules among {', '.join(SCHEDULES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bubbles-") as tmp:
        for pp in depths:
            mbs = [pp, 2 * pp, 4 * pp]
            log(f"pp={pp}: M in {mbs}, {', '.join(schedules)} ...")
            started = time.perf_counter()
            job = {"pp": pp, "unit": args.unit, "microbatches": mbs, "schedules": schedules, "steps": args.steps,
                   "timeout": 120}
            for res in launch(job, pp, Path(tmp) / f"pp{pp}", args.timeout):
                m, name = res["microbatches"], res["schedule"]
                measured = statistics.median(res["pipeline_s"])
                sim = simulated(name, pp, m, res["per_stage"])
                rows.append({"pp": pp, "M": m, "schedule": name, "measured_s": measured, "simulated_s": sim,
                             "sim_error": (sim - measured) / measured, "ideal_s": ideal(name, pp, m, args.unit),
                             "busy_s": busy(name, pp, m, res["per_stage"]),
                             "theory_s": theory(name, pp, m, args.unit), "per_stage": res["per_stage"]})
            log(f"pp={pp}: {time.perf_counter() - started:.0f}s")
    removed = []
    for pp in depths:
        for m in (pp, 2 * pp, 4 * pp):
            by = {r["schedule"]: r for r in rows if r["pp"] == pp and r["M"] == m}
            for name, base_name in (("zb", "1f1b"), ("varuna-zb", "varuna")):  # each against its unsplit twin
                if name in by and base_name in by:
                    base = by[base_name]["measured_s"] - by[base_name]["busy_s"]
                    if base > 0:
                        removed.append({"pp": pp, "M": m, "schedule": name, "vs": base_name,
                                        "removed": 1 - (by[name]["measured_s"] - by[name]["busy_s"]) / base})
    worst = max(abs(r["sim_error"]) for r in rows)
    if args.json:
        print(json.dumps({"unit_s": args.unit, "rows": rows, "bubble_removed": removed,
                          "max_abs_sim_error": worst}, indent=2))
        return 0
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
    print(f"F = B = W = {args.unit * 1e3:.0f} ms per micro-batch and stage\n")
    print("| pp | M | schedule | measured (ms) | simulated (ms) | error | theory (ms) | ideal (ms) | busiest stage "
          "(ms) | bubble (ms) |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['pp']} | {r['M']} | {r['schedule']} | {ms(r['measured_s'])} | {ms(r['simulated_s'])} | "
              f"{r['sim_error']:+.1%} | {ms(r['theory_s'])} | {ms(r['ideal_s'])} | {ms(r['busy_s'])} | "
              f"{ms(r['measured_s'] - r['busy_s'])} |")
    print(f"\nlargest simulator error: {worst:.1%} (target 3%)\n")
    print("| pp | M | schedule | share of the unsplit schedule's bubble removed |")
    print("| ---: | ---: | --- | ---: |")
    for r in removed:
        print(f"| {r['pp']} | {r['M']} | {r['schedule']} | {r['removed']:.0%} of {r['vs']}'s |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:
        log(f"error: {exc}")
        sys.exit(1)
