"""What ``wire_dtype`` costs in accuracy: the example GPT's loss curve with bf16 and fp16 on the wire vs the exact one.

The example GPT (``examples/gpt``, its default config: 4 blocks of width 64, block size 64, AdamW at lr 3e-3, global
batch 32 in micro-batches of 4, the ``varuna`` schedule) trains for ``--steps`` steps (600, as ``make demo``) at
pp=2 on two local processes (gloo, one thread each), once per configuration, with the same seed and the same
batches (drawn from a generator seeded by the step, as ``examples/gpt/train.py`` draws them):

    exact   Varuna(..., precision=P)                     every activation and gradient crosses in fp32
    bf16    Varuna(..., precision=P, wire_dtype="bf16")  rounded to bf16 at the cut, both ways
    fp16    Varuna(..., precision=P, wire_dtype="fp16")  rounded to fp16 at the cut, both ways

for each compute precision P of ``--precisions`` (fp32, and bf16 autocast). Per run it reports the final training
loss (the mean of the last 50 steps', the curve being noisy), the validation loss after training, and against the
exact run of the same precision the largest gap between the two curves at the same step, absolute and relative,
and where. The runs are deterministic: a gap is what the wire's rounding did, not noise.

The cost of fp16's overflow check is measured beside it, in this process: one message of the GPT's cut value
(``[micro-batch, block, width]`` fp32) cast to fp16 with and without the count of overflowing values
(:func:`varuna_core.pipeline.p2p.to_wire`), median of ``--check-repeats`` runs, and set against the exact run's
measured step time with the messages a step sends (one per micro-batch each way).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_dtype.py                  # table (about 10 minutes on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_dtype.py --json           # one JSON document on stdout
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/wire_dtype.py --steps 100 --precisions fp32

Progress goes to stderr. The script doubles as its own worker (``--worker SPEC OUT``, internal).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPT_DIR = ROOT / "examples" / "gpt"
WIRES = ("exact", "bf16", "fp16")
TAIL = 50  # steps the final training loss is averaged over


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The example GPT's loss with bf16 and fp16 on the wire vs exact (pp=2).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--precisions", default="fp32,bf16", help="compute precisions, comma-separated (fp32, bf16)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--schedule", default="varuna")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-repeats", type=int, default=200, help="repeats of the overflow check's timing")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        args.precision_list = [x.strip() for x in args.precisions.split(",") if x.strip()]
        if not args.precision_list or any(x not in ("fp32", "bf16") for x in args.precision_list):
            p.error(f"--precisions takes fp32 and/or bf16, got {args.precisions!r}")
        if args.steps < TAIL or args.check_repeats < 1:
            p.error(f"--steps must be at least {TAIL}, --check-repeats at least 1")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Worker: one rank of one run


def _gpt(seed: int):
    """The example's dataset and its default GPT, built on meta (each rank makes only its stage, seeded by layout-
    independent names, as ``examples/gpt/train.py`` builds it)."""
    sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, SHARED_WEIGHTS, GPTConfig

    from varuna_core import meta_init

    ds = CharDataset.load()
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
    with meta_init():
        model = GPT(cfg)
    return ds, cfg, model, SHARED_WEIGHTS, GPT.init_module


def worker(spec_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from varuna_core import Varuna

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    seed = spec["seed"]
    ds, cfg, gpt, shared, init = _gpt(seed)
    wire = None if spec["wire"] == "exact" else spec["wire"]
    model = Varuna(gpt, "0;1", ds.get_batch("train", 2, cfg.block_size, torch.Generator().manual_seed(seed)),
                   batch_size=spec["batch_size"], chunk_size=spec["chunk_size"], shared_weights=shared,
                   schedule=spec["schedule"], seed=seed, init=init, precision=spec["precision"], wire_dtype=wire)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.set_optimizer(optimizer)
    losses, times = [], []
    for step in range(spec["steps"]):
        batch = ds.get_batch("train", spec["batch_size"], cfg.block_size,
                             torch.Generator().manual_seed(seed * 1_000_003 + step))
        started = time.perf_counter()
        loss, overflow = model.step(model.replica_slice(batch))
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        losses.append(loss)
    val = ds.get_batch("val", spec["batch_size"], cfg.block_size, torch.Generator().manual_seed(seed))
    val_loss = model.evaluate(model.replica_slice(val))
    if model.rank == 0:
        Path(out_path).write_text(json.dumps({"losses": losses, "val_loss": val_loss,
                                              "step_time": statistics.median(times)}))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Driver


def run(args: argparse.Namespace, precision: str, wire: str, work: Path) -> dict[str, Any]:
    """One configuration on two fresh processes; its losses, validation loss and median step time."""
    from varuna_core.util.procs import run_workers

    name = f"{precision}-{wire}"
    spec, out = work / f"{name}.json", work / f"{name}.out.json"
    spec.write_text(json.dumps({"precision": precision, "wire": wire, "steps": args.steps, "seed": args.seed,
                                "batch_size": args.batch_size, "chunk_size": args.chunk_size,
                                "schedule": args.schedule}))
    started = time.perf_counter()
    outcome = run_workers([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec), str(out)], 2,
                          log_dir=work, log_name=f"{name}.rank{{rank}}.log", timeout=args.timeout,
                          env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)
    if outcome.timed_out or any(outcome.returncodes) or not out.exists():
        tails = "\n".join((work / f"{name}.rank{r}.log").read_text()[-2000:] for r in range(2))
        raise RuntimeError(f"{name} failed (exit codes {outcome.returncodes}):\n{tails}")
    log(f"{name}: {time.perf_counter() - started:.0f} s")
    return json.loads(out.read_text())


def smoothed(losses: list[float], window: int = TAIL) -> list[float]:
    """The mean of each ``window`` consecutive losses (the curve without the batch-to-batch noise)."""
    return [statistics.fmean(losses[i : i + window]) for i in range(len(losses) - window + 1)]


def compare(exact: dict, other: dict) -> dict[str, Any]:
    """The largest gap between two loss curves at the same step, absolute and relative to the exact one, the mean
    gap, and the largest gap between their means over ``TAIL`` consecutive steps."""
    gaps = [abs(a - b) for a, b in zip(exact["losses"], other["losses"], strict=True)]
    at = max(range(len(gaps)), key=gaps.__getitem__)
    means = [abs(a - b) for a, b in zip(smoothed(exact["losses"]), smoothed(other["losses"]), strict=True)]
    return {"max_gap": gaps[at], "max_gap_step": at, "max_gap_rel": gaps[at] / exact["losses"][at],
            "mean_gap": statistics.fmean(gaps), "max_smoothed_gap": max(means)}


def check_cost(args: argparse.Namespace) -> dict[str, float]:
    """Seconds to put one message of the GPT's cut value on an fp16 wire, without and with the overflow count."""
    import torch

    from varuna_core.pipeline.p2p import to_wire

    torch.set_num_threads(1)
    x = torch.randn(args.chunk_size, 64, 64)
    count = torch.zeros(())

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        samples = []
        for _ in range(args.check_repeats):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    cast = timed(lambda: to_wire([x], [torch.float16]))
    checked = timed(lambda: to_wire([x], [torch.float16], count))
    return {"cast": cast, "cast_and_check": checked, "check": max(checked - cast, 0.0), "elements": x.numel()}


def table(meta: dict, rows: list[dict], cost: dict) -> str:
    lines = [("| precision | wire | final loss (mean of last 50) | validation loss | largest gap to exact (step) | "
              "relative | mean gap | largest gap of 50-step means | step ms |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        exact = r["wire"] == "exact"
        gap = "—" if exact else f"{r['max_gap']:.4f} ({r['max_gap_step']})"
        rel = "—" if exact else f"{r['max_gap_rel']:.2%}"
        mean = "—" if exact else f"{r['mean_gap']:.4f}"
        smooth = "—" if exact else f"{r['max_smoothed_gap']:.4f}"
        lines.append(f"| {r['precision']} | {r['wire']} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | {gap} | "
                     f"{rel} | {mean} | {smooth} | {r['step_time'] * 1e3:.1f} |")
    per_step = 2 * meta["microbatches"]  # one message per micro-batch each way crosses the one cut
    step = next(r["step_time"] for r in rows if r["wire"] == "exact")
    lines.append("")
    lines.append(f"fp16 overflow check: {cost['check'] * 1e6:.1f} µs per message of {cost['elements']:,} values "
                 f"(the cast alone {cost['cast'] * 1e6:.1f} µs); {per_step} messages a step cross the cut, "
                 f"{per_step * cost['check'] * 1e3:.2f} ms of a {step * 1e3:.1f} ms step "
                 f"({per_step * cost['check'] / step:.2%}), on the two ranks together")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="wire-dtype-") as tmp:
        for precision in args.precision_list:
            runs = {wire: run(args, precision, wire, Path(tmp)) for wire in WIRES}
            for wire, result in runs.items():
                row = {"precision": precision, "wire": wire, "final_loss": statistics.fmean(result["losses"][-TAIL:]),
                       "val_loss": result["val_loss"], "step_time": result["step_time"],
                       "first_loss": result["losses"][0], "losses": result["losses"]}
                if wire != "exact":
                    row.update(compare(runs["exact"], result))
                rows.append(row)
    cost = check_cost(args)
    import torch

    meta = {"steps": args.steps, "batch_size": args.batch_size, "chunk_size": args.chunk_size,
            "microbatches": -(-args.batch_size // args.chunk_size), "schedule": args.schedule, "seed": args.seed,
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"meta": meta, "runs": rows, "check_cost": cost}, indent=2))
    else:
        print(table(meta, rows, cost))
    return 0


if __name__ == "__main__":
    sys.exit(main())
