"""How long `varuna plan` takes for a large cluster: 4096 devices, 8 per node, global batch 8192, over a
generated 96-segment profile (a GPT-like model: embedding, 94 equal blocks, head), with a memory limit.

    python benchmarks/plan_speed.py [--gpus 4096] [--segments 96] [--batch-size 8192]

Prints the in-process search time (median of 3) and the wall time of the `varuna plan` command (start-up
included), and whether the native simulator was used.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from varuna_core.planning.artifacts import (
    CommCurve,
    Environment,
    IdlePenalty,
    LinearFit,
    Profile,
    SegmentMeasure,
    SegmentProfile,
    Stat,
)
from varuna_core.planning.planner import PlanRequest, make_plan
from varuna_core.planning.simulate import native_module
from varuna_core.util.versioned_io import save_artifact


def gpt_like_profile(segments: int, sizes=(1, 2, 4, 8)) -> Profile:
    """Per example: a block takes 4 ms forward and 8 ms backward, saves 60 MB and emits 12 MB (2.5B-class)."""
    def stat(x):
        return Stat(median=x, p10=x, p90=x, repeats=5)

    segs = []
    for i in range(segments):
        scale = 0.5 if i in (0, segments - 1) else 1.0
        params = int(2.4e8 * scale)
        measures = [SegmentMeasure(
            microbatch_size=n, forward=stat(0.004 * n * scale), recompute=stat(0.0042 * n * scale),
            backward=stat(0.008 * n * scale), output_bytes=0 if i == segments - 1 else 12_000_000 * n,
            saved_bytes=int(60e6 * n * scale)) for n in sizes]
        segs.append(SegmentProfile(index=i, input_cut=None if i == 0 else f"cut{i - 1}",
                                   output_cut=None if i == segments - 1 else f"cut{i}", param_count=params // 2,
                                   param_bytes=params, grad_bytes=params, optimizer_bytes=4 * params,
                                   measures=measures))
    sizes_b = [2**10, 2**14, 2**17, 2**20, 2**22, 2**24]

    def curve(op, link, g, lat, bw):
        fit = LinearFit(latency=lat, bandwidth=bw, rel_error=0.05)
        return CommCurve(op=op, link=link, group_size=g, sizes=sizes_b, times=[fit.predict(s) for s in sizes_b],
                         fit=fit)

    comm = [curve("p2p", "intra", 2, 2e-5, 2e10), curve("p2p", "inter", 2, 5e-5, 3e9)]
    comm += [curve("allreduce", link, g, 5e-5 * g, 1e10 if link == "intra" else 2e9)
             for link in ("intra", "inter") for g in (2, 4, 8)]
    env = Environment(torch_version="-", python_version="-", device_type="cuda", devices=["generated"], threads=1,
                      hosts=["generated"], nproc=8, precision="fp16")
    # an idle penalty as the profiler records one (the 2-core VM's: every simulated action after a wait pays it)
    idle = IdlePenalty(gaps_s=[0.0005, 0.002, 0.005, 0.02], fractions=[0.06, 0.08, 0.1, 0.29], action_s=0.0017)
    return Profile(model="generated gpt-like", structure_hash="0" * 32, num_segments=segments,
                   cut_names=[f"cut{i}" for i in range(segments - 1)], microbatch_sizes=list(sizes), segments=segs,
                   comm=comm, idle_penalty=idle, environment=env, created="2026-01-01T00:00:00+00:00")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=4096)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--segments", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--gpu-memory", default="80GiB")
    args = ap.parse_args()
    profile = gpt_like_profile(args.segments)
    from varuna_core.ir.units import parse_bytes

    req = PlanRequest(gpus=args.gpus, batch_size=args.batch_size, gpus_per_node=args.gpus_per_node,
                      gpu_memory=parse_bytes(args.gpu_memory))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        plan = make_plan(profile, req)
        times.append(time.perf_counter() - start)
    print(f"native simulator: {'yes' if native_module() is not None else 'no (pure Python)'}")
    print(f"search: {statistics.median(times):.3f} s (median of 3) -> pp={plan.pp}, dp={plan.dp}, micro-batch "
          f"{plan.microbatch_size} x {plan.num_microbatches}, {plan.schedule}, step {plan.prediction.step_time:.3f} s")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        save_artifact(profile, path)
        varuna = Path(sys.executable).with_name("varuna")
        start = time.perf_counter()
        out = subprocess.run([str(varuna), "plan", str(path), "--gpus", str(args.gpus), "--gpus-per-node",
                              str(args.gpus_per_node), "--batch-size", str(args.batch_size), "--gpu-memory",
                              args.gpu_memory, "-o", str(Path(tmp) / "plan.yaml")], capture_output=True, text=True)
        wall = time.perf_counter() - start
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        sys.exit(1)
    print(f"`varuna plan` command: {wall:.3f} s wall (start-up included)")


if __name__ == "__main__":
    main()
