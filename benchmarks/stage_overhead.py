"""What a later stage pays for running the user's whole forward: the code before its incoming cut, on placeholders.

Every stage runs the model's own ``forward``; a stage after the first runs the code before its incoming cut with
the earlier stages' modules stubbed out ([Note: slicing] in ``varuna_core/model/stage.py``): each stub returns a
placeholder (``meta`` tensors) and the glue between them (an add of embeddings, a dropout) runs on ``meta``,
where torch's shape rules are Python. That part is pure overhead, paid once per forward and once per recompute.

For each stage after the first of the example GPT split into ``--pp`` even stages (its CutPoints: segment 0 the
embeddings, one block each after that), built as the runtime builds it (``StageSlice``) and run on micro-batches
of ``--microbatch-size`` examples with a random incoming activation, in one process, one thread, this times the
forward and, apart, the code before the incoming cut (the stage's ``on_incoming`` callback marks the cut), with
the memo of meta ops on and off ([Note: meta op memo] in ``varuna_core/model/meta_ops.py``), side by side in
alternating order. Medians over ``--repeats`` after ``--warmup``, in ms.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stage_overhead.py                 # Markdown table
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stage_overhead.py --pp 4 --json   # one JSON document

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from split_cost import gpt_shape, gpt_spec, print_report  # noqa: E402 - after the path is set


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The forward of each later stage of the example GPT and the part of it "
                                            "before the incoming cut, with the memo of meta ops on and off.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="stages (even split of the segments)")
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=None, help="width (default: the example's, 64)")
    p.add_argument("--n-layer", type=int, default=None, help="blocks (default: the example's, 4)")
    p.add_argument("--n-head", type=int, default=None, help="attention heads (default: the example's, 4)")
    p.add_argument("--repeats", type=int, default=200, help="measured forwards per stage and memo setting")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    args = p.parse_args(argv)
    for name in ("pp", "microbatch_size", "repeats", "n_embd", "n_layer", "n_head"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.pp < 2:
        p.error("--pp must be at least 2 (the first stage runs no code before a cut)")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    return args


def even_ranges(segments: int, pp: int) -> list[tuple[int, int]]:
    """``pp`` contiguous ranges of ``segments`` whose sizes differ by one at most (the larger ones first)."""
    if not 1 <= pp <= segments:
        raise ValueError(f"cannot split {segments} segments into {pp} stages")
    size, extra = divmod(segments, pp)
    ranges, start = [], 0
    for s in range(pp):
        stop = start + size + (1 if s < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


class LaterStage:
    """One stage after the first, built as the runtime builds it, with a random incoming activation."""

    def __init__(self, spec, structure, ranges: list[tuple[int, int]], stage: int, n: int) -> None:
        from varuna_core.ir.partition import Partition
        from varuna_core.model.stage import StageSlice, find_tie_sets, weight_groups
        from varuna_core.model.values import ValueSource

        partition = Partition.from_ranges(ranges, structure.num_segments)
        model = spec.make()
        ties = find_tie_sets(model, structure, partition, weight_groups(model, list(spec.shared_weights or [])))
        self.slice = StageSlice(model, structure, partition, stage, ties, torch.device("cpu"),
                                values=ValueSource(seed=0, init=spec.init), state_checks=False)
        self.n = n
        self.inputs = spec.inputs(n)
        generator = torch.Generator().manual_seed(stage)
        incoming = self.slice.incoming_spec
        assert incoming is not None
        self.incoming = incoming.assemble(
            torch.randn(leaf.shape_for(n), generator=generator).to(leaf.torch_dtype)
            if leaf.is_float else torch.zeros(leaf.shape_for(n), dtype=leaf.torch_dtype)
            for _, leaf in incoming.tensor_leaves)
        self._cut_at = 0.0
        self.slice.on_incoming = self._mark
        from varuna_core.model.meta_ops import MetaResults

        self._memos = {True: MetaResults(), False: MetaResults(limit=0)}  # each kept across forwards

    def _mark(self) -> None:
        self._cut_at = time.perf_counter()

    def memo(self, on: bool) -> None:
        self.slice._placeholders().results = self._memos[on]

    def forward(self) -> tuple[float, float]:
        """(seconds of the forward, seconds of it before the incoming cut)."""
        start = time.perf_counter()
        self.slice.forward(self.inputs, self.incoming, self.n)
        return time.perf_counter() - start, self._cut_at - start


def measure(stage: LaterStage, repeats: int, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {k: [] for k in ("forward_on", "pre_on", "forward_off", "pre_off")}
    for i in range(warmup + repeats):
        for on in ((True, False) if i % 2 == 0 else (False, True)):  # alternate which setting runs first
            stage.memo(on)
            forward, pre = stage.forward()
            if i >= warmup:
                tag = "on" if on else "off"
                samples[f"forward_{tag}"].append(forward)
                samples[f"pre_{tag}"].append(pre)
    return samples


def summarize(stage: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    row: dict[str, Any] = {"stage": stage}
    for key, values in samples.items():
        row[f"{key}_ms"] = statistics.median(values) * 1e3
    row["pre_share_on"] = row["pre_on_ms"] / row["forward_on_ms"]
    row["pre_share_off"] = row["pre_off_ms"] / row["forward_off_ms"]
    return row


def table(rows: list[dict]) -> str:
    head = ("| stage | forward, memo (ms) | before the cut, memo (ms) | share | forward, no memo (ms) "
            "| before the cut, no memo (ms) | share |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['stage']} | {r['forward_on_ms']:.3f} | {r['pre_on_ms']:.3f} | {r['pre_share_on']:.0%} | "
              f"{r['forward_off_ms']:.3f} | {r['pre_off_ms']:.3f} | {r['pre_share_off']:.0%} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from varuna_core.model.discovery import discover, make_batch_fn
    from varuna_core.model.values import ValueSource

    spec, config = gpt_spec(args)
    batch_fn, dims = make_batch_fn(spec.inputs, None)
    structure = discover(spec.make(), batch_fn, dims, use_cache=False, values=ValueSource(seed=0, init=spec.init))
    try:
        ranges = even_ranges(structure.num_segments, args.pp)
    except ValueError as exc:
        print(f"error: {exc} (the example has {structure.num_segments} segments: lower --pp or raise --n-layer)",
              file=sys.stderr)
        return 2
    rows = []
    for s in range(1, args.pp):
        print(f"stage {s} (segments {ranges[s][0]}-{ranges[s][1] - 1}): {args.warmup}+{args.repeats} forwards",
              file=sys.stderr, flush=True)
        rows.append(summarize(s, measure(LaterStage(spec, structure, ranges, s, args.microbatch_size),
                                         args.repeats, args.warmup)))
    shape = gpt_shape(config)
    meta = {"model": f"examples/gpt {shape}", "pp": args.pp, "ranges": ranges,
            "microbatch_size": args.microbatch_size, "repeats": args.repeats, "warmup": args.warmup,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print_report(args.json, meta, "stages", rows,
                 f"examples/gpt ({shape}), pp={args.pp} {ranges}, micro-batch {args.microbatch_size}, one thread, "
                 f"medians of {args.repeats} forwards (torch {torch.__version__})", table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
