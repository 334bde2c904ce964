"""How much slower this machine runs an action right after its process waited, and whether two busy processes slow
each other: the two explanations for a pipelined run's compute exceeding a tight-loop profile.

A profile times each segment in a tight loop: the action before it ended a moment ago. In a pipeline, a stage
often waits for a message first (1F1B's first stage waits for each gradient), and on some machines the work after
an idle gap runs slower (the core's clock, its caches, the hypervisor's scheduling). This script measures, in one
process, one thread, the median time of a workload run right after an idle gap of each of ``--gaps`` ms, the gap
made two ways:

    sleep   ``time.sleep(gap)``                       (the thread sleeps; nothing else runs in the process)
    event   ``threading.Event.wait()`` for a timer    (as a receive's wake-up: another thread sets the event)

and, with ``--concurrent``, the same workload with no gap in ``--concurrent`` processes at once against one alone
(the cores shared, each process on its own core if there are enough).

Workloads (each a fixed piece of work, so its time is comparable across gaps):

    gpt      the example GPT's forward without autograd, micro-batch ``--microbatch-size`` (about 3 ms here)
    linear   ten ``Linear(64, 64)`` on 256 rows (about 0.3 ms)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/idle_penalty.py                  # Markdown tables
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/idle_penalty.py --json           # one JSON document

Progress goes to stderr. The penalty is the median after the gap minus the median with no gap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("gpt", "linear")
WAITS = ("sleep", "event")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="An action's time right after an idle gap of its process, and with "
                                            "other busy processes, against a tight loop.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gaps", default="0,0.5,2,5,20", help="idle gaps before each timed run, ms (comma-separated)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--waits", default=",".join(WAITS), help=f"comma-separated subset of {WAITS}")
    p.add_argument("--repeats", type=int, default=100, help="timed runs per workload, wait and gap")
    p.add_argument("--warmup", type=int, default=20, help="untimed runs before each workload's series")
    p.add_argument("--microbatch-size", type=int, default=4, help="the gpt workload's examples per forward")
    p.add_argument("--concurrent", type=int, default=2,
                   help="also time the workloads with no gap in this many processes at once (0: skip)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the tables")
    p.add_argument("--busy-worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.gaps = sorted({float(g) for g in args.gaps.split(",") if g.strip()})
    except ValueError:
        p.error(f"--gaps takes numbers in ms separated by commas, got {args.gaps!r}")
    if not args.gaps or args.gaps[0] < 0 or args.gaps[-1] > 1000:
        p.error("--gaps: between 0 and 1000 ms, at least one")
    if 0.0 not in args.gaps:
        args.gaps.insert(0, 0.0)  # the tight loop every penalty is measured against
    for name, allowed in (("workloads", WORKLOADS), ("waits", WAITS)):
        chosen = [w.strip() for w in getattr(args, name).split(",") if w.strip()]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            p.error(f"--{name}: choose from {', '.join(allowed)} (got {getattr(args, name)!r})")
        setattr(args, name, list(dict.fromkeys(chosen)))
    for name in ("repeats", "microbatch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.concurrent < 0 or args.concurrent == 1:
        p.error("--warmup must not be negative; --concurrent is 0 or at least 2")
    return args


def make_workload(name: str, microbatch_size: int) -> Callable[[], None]:
    """A fixed piece of CPU work without autograd (one thread; the caller sets the thread count)."""
    torch.manual_seed(0)
    if name == "linear":
        layer, x = torch.nn.Linear(64, 64), torch.randn(256, 64)

        def run_linear() -> None:
            with torch.no_grad():
                for _ in range(10):
                    layer(x)
        return run_linear
    if name == "gpt":
        gpt_dir = ROOT / "examples" / "gpt"
        if str(gpt_dir) not in sys.path:
            sys.path.insert(0, str(gpt_dir))
        from model import GPT, GPTConfig

        config = GPTConfig(vocab_size=512)
        model = GPT(config).eval()
        idx = torch.randint(0, config.vocab_size, (microbatch_size, config.block_size))

        def run_gpt() -> None:
            with torch.no_grad():
                model(idx, idx)
        return run_gpt
    raise ValueError(f"unknown workload {name!r}")


def idle(wait: str, gap_s: float) -> None:
    """Leave the thread idle for ``gap_s`` seconds: asleep, or blocked on an event another thread sets."""
    if gap_s <= 0:
        return
    if wait == "sleep":
        time.sleep(gap_s)
        return
    event = threading.Event()
    timer = threading.Timer(gap_s, event.set)
    timer.start()
    event.wait()
    timer.join()


def series(work: Callable[[], None], wait: str, gap_s: float, repeats: int) -> list[float]:
    """``repeats`` times of ``work``, each right after an idle gap of ``gap_s`` (seconds)."""
    times = []
    for _ in range(repeats):
        idle(wait, gap_s)
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per wait and gap: the median time (ms) and its penalty against the same series' tight loop."""
    work = make_workload(name, args.microbatch_size)
    for _ in range(args.warmup):
        work()
    rows = []
    for wait in args.waits:
        base = None
        for gap in args.gaps:
            print(f"[{name}] {wait} {gap:g} ms ...", file=sys.stderr, flush=True)
            median = statistics.median(series(work, wait, gap / 1e3, args.repeats)) * 1e3
            base = median if base is None else base
            rows.append({"workload": name, "wait": wait, "gap_ms": gap, "median_ms": median,
                         "penalty_ms": median - base, "penalty": median / base - 1})
    return rows


def busy_worker(name: str, microbatch_size: int, repeats: int, warmup: int) -> None:
    """One of the concurrent processes (``--busy-worker``): warm up, say ``ready``, wait for ``go`` on stdin, then
    print the median time (ms) of ``repeats`` runs with no gap."""
    work = make_workload(name, microbatch_size)
    for _ in range(warmup):
        work()
    print("ready", flush=True)
    sys.stdin.readline()
    print(statistics.median(series(work, "sleep", 0.0, repeats)) * 1e3, flush=True)


def measure_concurrent(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The workload's median with no gap in one process alone, then in ``--concurrent`` processes started
    together (each warmed up first)."""
    medians: dict[int, list[float]] = {}
    for n in (1, args.concurrent):
        print(f"[{name}] {n} process(es) at once ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--busy-worker", name, "--microbatch-size",
               str(args.microbatch_size), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(n)]
        try:
            for proc in procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a --busy-worker process of {name} did not start (exit {proc.wait()})")
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            medians[n] = sorted(float(proc.communicate(timeout=600)[0]) for proc in procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    alone, together = medians[1][0], medians[args.concurrent]
    return {"workload": name, "processes": args.concurrent, "alone_ms": alone, "concurrent_ms": together,
            "slowdown": max(together) / alone - 1}


def tables(rows: list[dict[str, Any]], concurrent: list[dict[str, Any]]) -> str:
    lines = ["| workload | wait | gap (ms) | median (ms) | penalty (ms) | penalty |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['wait']} | {r['gap_ms']:g} | {r['median_ms']:.3f} | {r['penalty_ms']:+.3f} | "
              f"{r['penalty']:+.1%} |" for r in rows]
    if concurrent:
        lines += ["", "| workload | alone (ms) | processes at once | each (ms) | slowest vs alone |",
                  "|---|---:|---:|---|---:|"]
        for c in concurrent:
            each = " / ".join(f"{m:.3f}" for m in c["concurrent_ms"])
            lines.append(f"| {c['workload']} | {c['alone_ms']:.3f} | {c['processes']} | {each} | "
                         f"{c['slowdown']:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.busy_worker:
        busy_worker(args.busy_worker, args.microbatch_size, args.repeats, args.warmup)
        return 0
    rows = [row for name in args.workloads for row in measure(name, args)]
    concurrent = [measure_concurrent(name, args) for name in args.workloads] if args.concurrent else []
    if args.json:
        print(json.dumps({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                      "python": platform.python_version()},
                          "gaps": rows, "concurrent": concurrent}, indent=1))
    else:
        print(tables(rows, concurrent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
