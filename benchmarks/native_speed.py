"""How fast the planner's inner call is: ``_native.simulate_generated`` vs the pure-Python reference.

Times 10,000 native calls per schedule for 8 stages x 32 micro-batches, and the Python reference
(``generate`` + ``simulate_python``, what ``varuna plan`` falls back to without the extension) on fewer calls,
then prints per-call times and the speed-up. Not a test: nothing is asserted.

    .venv/bin/python benchmarks/native_speed.py [--calls 10000] [--python-calls 100] [--stages 8] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import random
import time

from varuna_core.ir.schedule import SCHEDULE_NAMES, generate
from varuna_core.planning.simulate import StageCosts, require_native, simulate_python


def _costs(p: int, seed: int = 0) -> list[StageCosts]:
    rng = random.Random(seed)
    return [StageCosts(forward=rng.uniform(8e-3, 12e-3), recompute=rng.uniform(8e-3, 12e-3),
                       backward=rng.uniform(16e-3, 24e-3), send_activation=1e-3, send_gradient=1e-3,
                       allreduce=30e-3, forward_last=5e-3, recompute_last=5e-3, backward_last=10e-3)
            for _ in range(p)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000, help="native calls per schedule")
    parser.add_argument("--python-calls", type=int, default=100, help="Python reference calls per schedule")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--sends", type=int, default=4, help="max_concurrent_sends")
    args = parser.parse_args()
    native = require_native()
    p, m = args.stages, args.microbatches
    costs = _costs(p)
    tuples = [c.as_tuple() for c in costs]
    print(f"simulate_generated, {p} stages x {m} micro-batches, max_concurrent_sends={args.sends}")
    print(f"{'schedule':<8} {'native: calls':>14} {'total s':>9} {'us/call':>9}   "
          f"{'python: calls':>13} {'total s':>9} {'us/call':>9}   {'speed-up':>8}")
    for name in SCHEDULE_NAMES:
        opportunistic = name == "varuna"
        native.simulate_generated(name, p, m, tuples, args.sends, opportunistic)  # warm up
        t0 = time.perf_counter()
        for _ in range(args.calls):
            native.simulate_generated(name, p, m, tuples, args.sends, opportunistic)
        t_native = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.python_calls):
            simulate_python(generate(name, p, m), costs, max_concurrent_sends=args.sends, opportunistic=opportunistic)
        t_python = time.perf_counter() - t0
        per_native = t_native / args.calls * 1e6
        per_python = t_python / args.python_calls * 1e6
        print(f"{name:<8} {args.calls:>14} {t_native:>9.3f} {per_native:>9.1f}   "
              f"{args.python_calls:>13} {t_python:>9.3f} {per_python:>9.1f}   {per_python / per_native:>7.0f}x")


if __name__ == "__main__":
    main()
