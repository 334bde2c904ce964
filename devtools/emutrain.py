"""A training script for the exact-compute models (:mod:`devtools.emumodels`), run as a user runs one:
``varuna launch PLAN --hosts HOSTS -- devtools/emutrain.py --queue DIR``.

The workers join the job's process group, then train what ``DIR/batch-000.json``, ``batch-001.json``, ... say, one
batch after another, until a batch says ``{"stop": true}`` (or none comes within ``--idle-timeout``; every wait is
bounded). A batch is ``{"runs": [...], "warmup": 1, "steps": 3, "stop_factor": F, "bound": S}``; each run is
``{"plan": PATH, "out": PATH, "model": NAME, "batch": GLOBAL_BATCH, "keep": bool, "bound_s": SECONDS}``, a plan of
as many devices as the launched one (the launcher would place the ranks of any such plan on the same hosts:
consecutive ranks per node). For each run every rank builds the model afresh and wraps it with ``Varuna(model,
None, ..., plan=PATH)`` (that plan's map, partition, schedule and micro-batch size, and a data-parallel group of its
own), with an SGD optimizer (the one the profile timed); runs ``warmup`` untimed steps and ``steps`` timed ones:
``barrier()``, then ``step()`` + ``optimizer.step()`` + ``zero_grad()``, timed with ``perf_counter`` on every rank;
per step the slowest rank's time counts (an all-reduce of the maximum, so every rank knows it). Rank 0 writes the
run's ``out`` as soon as it is done: every step's time, and per rank and timed step the wall, compute and waiting
time of its actions (the runtime's observer), so that a difference with the simulator can be traced to a stage;
then ``batch-NNN.done`` once the whole batch is.

Hopeless runs (``stop_factor`` F, ``bound`` the best step measured before this batch): a run that is not ``keep``
is not run at all when its ``bound_s`` (a lower bound on its step from the bytes its links must carry,
:func:`devtools.regret.link_bound`) exceeds F times the best median measured so far (the bound, or this batch's
runs); its ``out`` then says ``skipped``. Otherwise it stops after a timed step slower than F times that best, or
after a warm-up step slower than 2F times it, and says so (``cut_short``: ``"timed"`` or ``"warmup"``). Every rank
sees the same slowest time, so all stop together. Such a run is known to be slower than the best by that factor,
which is all a search for the best needs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from devtools.emumodels import build_model, make_batch  # noqa: E402
from varuna_core import Varuna  # noqa: E402
from varuna_core.pipeline.tracing import ActionObserver, ActionTiming  # noqa: E402


class _Actions(ActionObserver):
    """Per timed step, this rank's actions' wall, compute and waiting time (seconds, summed)."""

    def __init__(self) -> None:
        self.rows: list[dict] | None = None

    def on_action(self, timing: ActionTiming) -> None:
        if self.rows is not None:
            row = self.rows[-1]
            row["wall"] += timing.end - timing.start
            row["compute"] += timing.compute
            row["waited"] += timing.waited
            row["actions"] += 1


def _slowest(seconds: float) -> float:
    took = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def train(run: dict, opts: dict, bound: float | None) -> float:
    """One configuration (``run``: plan, out, model, batch, keep): build, warm up, time; rank 0 writes ``out``.
    Returns the median step (infinite when cut short)."""
    model, batch_size = run["model"], run["batch"]
    started = time.time()
    vm = Varuna(build_model(model), None, make_batch(model, 2), batch_size=batch_size, chunk_size=None,
                plan=run["plan"], timeout=opts.get("timeout", 120.0))
    _beacon_now(vm)
    opt = torch.optim.SGD(list(vm.parameters()), lr=1e-3)
    vm.set_optimizer(opt)
    probe = vm.executor.add_observer(_Actions())
    inputs = vm.replica_slice(make_batch(model, batch_size))
    ready = time.time()
    times: list[float] = []
    warm: list[float] = []
    rows: list[dict] = []
    cut_short: str | None = None
    warmup, steps, factor = opts.get("warmup", 1), opts.get("steps", 3), opts.get("stop_factor")
    limit = None if run.get("keep") or bound is None or factor is None else bound * factor
    for i in range(warmup + steps):
        timed = i >= warmup
        if timed:
            rows.append({"wall": 0.0, "compute": 0.0, "waited": 0.0, "actions": 0})
        probe.rows = rows if timed else None
        dist.barrier()
        t0 = time.perf_counter()
        vm.step(inputs)
        opt.step()
        opt.zero_grad()
        took = _slowest(time.perf_counter() - t0)
        (times if timed else warm).append(took)
        last = i == warmup + steps - 1
        if limit is not None and not last:
            if timed and took > limit:
                cut_short = "timed"
                break
            if not timed and took > 2 * limit:
                cut_short = "warmup"
                break
    probe.rows = None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": vm.rank, "stage": vm.stage, "replica": vm.replica, "steps": rows})
    measured = statistics.median(times or warm)
    if vm.rank == 0:
        result = {"step_s": times, "warmup_s": warm, "median_s": measured, "cut_short": cut_short, "limit_s": limit,
                  "pp": vm.pp, "dp": vm.dp, "schedule": vm.schedule_name, "chunk": vm.chunk_size,
                  "partition": vm.partition.ranges, "setup_s": ready - started, "ranks": gathered,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        _write(Path(run["out"]), result)
    dist.barrier()
    _retire(vm)
    del vm, opt, probe
    gc.collect()
    return measured if cut_short is None else float("inf")


_BEACONS: list = []  # the heartbeats of the configuration built last (it beats while the worker waits for more)


def _beacon_now(vm: Varuna) -> None:
    """Each ``Varuna(...)`` under ``varuna launch`` sends heartbeats until the process ends; only the newest
    configuration's speak for this worker (the launcher ends a job whose ranks fall silent for a minute)."""
    while _BEACONS:
        _BEACONS.pop().silence()
    beacon = getattr(vm.supervision, "beacon", None)
    if beacon is not None:
        _BEACONS.append(beacon)


def _retire(vm: Varuna) -> None:
    """What a finished configuration leaves behind in a process that goes on: its data-parallel group (its
    connections)."""
    if vm.groups.dp is not None:
        dist.destroy_process_group(vm.groups.dp)


def _write(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def run_batch(batch: dict) -> None:
    """The batch's runs in order (see the module's docstring)."""
    best = batch.get("bound")
    factor = batch.get("stop_factor")
    for run in batch["runs"]:
        if Path(run["out"]).exists():  # done before (a batch tried again after a failure)
            continue
        if not run.get("keep") and best is not None and factor is not None and run.get("bound_s", 0.0) > factor * best:
            # the bytes its links must carry already take longer than that: not run
            if dist.get_rank() == 0:
                _write(Path(run["out"]), {"skipped": True, "bound_s": run["bound_s"], "best_s": best})
            continue
        measured = train(run, batch, best)
        best = measured if best is None else min(best, measured)


def _wait_for(path: Path, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", required=True, help="the directory whose batch-NNN.json files say what to train")
    p.add_argument("--idle-timeout", type=float, default=3600.0,
                   help="seconds to wait for the next batch before giving up (exit 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    queue = Path(args.queue)
    k = 0
    while True:
        path = queue / f"batch-{k:03d}.json"
        if not _wait_for(path, args.idle_timeout):
            print(f"no {path.name} within {args.idle_timeout:g}s: giving up", file=sys.stderr, flush=True)
            os._exit(3)
        batch = json.loads(path.read_text())
        if batch.get("stop"):
            break
        run_batch(batch)
        dist.barrier()
        if dist.get_rank() == 0:
            path.with_suffix(".done").touch()
        k += 1
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's tear-down (a CPU-second per process, and 8 of them share 2 cores)


if __name__ == "__main__":
    sys.exit(main())
