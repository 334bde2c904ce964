"""What splitting the backward into B (input gradients) and W (weight gradients) costs, per segment of the example GPT.

Each segment of ``examples/gpt`` (its default config: 4 blocks of width 64, block size 64; cut at the model's
CutPoints: segment 0 the embeddings, 1-3 a block each, 4 the last block, ``ln_f``, the tied head and the loss) is
built as a stage of its own (``StageSlice``, as the profiler times segments) and run on micro-batches of
``--microbatch-size`` examples (4) with random incoming activations and random output gradients, in one process,
one thread. Per repeat, side by side on the same parameters (``.grad`` views of one flat buffer, as the runtime
attaches them):

    unsplit    forward with graph, then ``torch.autograd.backward``                 -> F, backward
    split      forward under ``splitting(store, route)``, the same backward (B), then -> F, B, W, bytes
               ``store.run()`` (W); bytes: ``store.nbytes`` after B (what W keeps alive for this micro-batch)

Every time is the median over ``--repeats`` (after ``--warmup``), in ms; ``B+W / unsplit`` is the price of the
split (zero-bubble schedules pay it to move W into idle slots), ``F split / F`` the forward's. One route per
segment for all repeats, as the executor's step: the first forward under the mode that sees every torch call, the
later ones through the ``nn.Linear`` forwards alone (linears with a bias hooked: [Note: hooked linear]).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_cost.py            # Markdown table
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/split_cost.py --json     # one JSON document on stdout

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
GPT_DIR = ROOT / "examples" / "gpt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="B and W of a split backward vs the unsplit backward, per segment of "
                                            "the example GPT.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=None, help="width (default: the example's, 64)")
    p.add_argument("--n-layer", type=int, default=None, help="blocks (default: the example's, 4)")
    p.add_argument("--n-head", type=int, default=None, help="attention heads (default: the example's, 4)")
    p.add_argument("--repeats", type=int, default=30, help="measured repeats per segment")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the runtime's workers use one)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    args = p.parse_args(argv)
    for name in ("microbatch_size", "repeats", "threads", "n_embd", "n_layer", "n_head"):
        if getattr(args, name) is None:
            continue
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def summarize(segment: int, params: int, samples: dict[str, list[float]], nbytes: list[int]) -> dict:
    """One row: medians in ms, the ratios, and the bytes W keeps per micro-batch (equal on every repeat)."""
    row: dict[str, Any] = {"segment": segment, "params": params}
    for key in ("forward", "forward_split", "backward", "b", "w"):
        row[f"{key}_ms"] = median_ms(samples[key])
    both = [b + w for b, w in zip(samples["b"], samples["w"], strict=True)]
    row["b_plus_w_ms"] = median_ms(both)
    row["split_ratio"] = row["b_plus_w_ms"] / row["backward_ms"]
    row["b_ratio"] = row["b_ms"] / row["backward_ms"]
    row["forward_ratio"] = row["forward_split_ms"] / row["forward_ms"]
    row["w_bytes"] = max(nbytes) if nbytes else 0
    return row


def total(rows: list[dict]) -> dict:
    """The whole model: sums of the segments' medians."""
    out: dict[str, Any] = {"segment": "all", "params": sum(r["params"] for r in rows)}
    for key in ("forward_ms", "forward_split_ms", "backward_ms", "b_ms", "w_ms", "b_plus_w_ms", "w_bytes"):
        out[key] = sum(r[key] for r in rows)
    out["split_ratio"] = out["b_plus_w_ms"] / out["backward_ms"]
    out["b_ratio"] = out["b_ms"] / out["backward_ms"]
    out["forward_ratio"] = out["forward_split_ms"] / out["forward_ms"]
    return out


def table(rows: list[dict]) -> str:
    head = ("| segment | params | F (ms) | F split (ms) | backward (ms) | B (ms) | W (ms) | B+W / backward "
            "| B / backward | W keeps (KiB/mb) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['segment']} | {r['params']:,} | {r['forward_ms']:.3f} | {r['forward_split_ms']:.3f} | "
              f"{r['backward_ms']:.3f} | {r['b_ms']:.3f} | {r['w_ms']:.3f} | {r['split_ratio']:.2f} | "
              f"{r['b_ratio']:.2f} | {r['w_bytes'] / 1024:.0f} |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class Segment:
    """One segment of the GPT built as a stage of its own, with random incoming values and output gradients."""

    def __init__(self, spec, structure, segment: int, n: int, precision: str) -> None:
        from varuna_core.ir.partition import Partition
        from varuna_core.model.stage import StageSlice, find_tie_sets, weight_groups
        from varuna_core.model.values import ValueSource

        count = structure.num_segments
        partition = Partition.from_ranges([(i, i + 1) for i in range(count)], count)
        model = spec.make()
        ties = find_tie_sets(model, structure, partition, weight_groups(model, list(spec.shared_weights or [])))
        self.stage = StageSlice(model, structure, partition, segment, ties, torch.device("cpu"),
                                values=ValueSource(seed=0, init=spec.init), state_checks=False)
        self.segment = segment
        self.n = n
        self.inputs = spec.inputs(n)
        self.params = [p for _, p in self.stage.param_names if p.requires_grad]
        flat = torch.zeros(sum(p.numel() for p in self.params))
        offset = 0
        for p in self.params:  # .grad views of one flat buffer, added to in place (as pipeline.grads attaches them)
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.generator = torch.Generator().manual_seed(segment)
        self.autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                         else torch.autocast("cpu", enabled=False))

    def incoming(self) -> Any:
        spec = self.stage.incoming_spec
        if spec is None:
            return None
        tensors = []
        for _, leaf in spec.tensor_leaves:
            shape = leaf.shape_for(self.n)
            if leaf.is_float:
                tensors.append(torch.randn(shape, generator=self.generator).to(leaf.torch_dtype).requires_grad_())
            else:
                tensors.append(torch.zeros(shape, dtype=leaf.torch_dtype))
        return spec.assemble(tensors)

    def forward(self, incoming: Any) -> Any:
        with self.autocast:
            return self.stage.forward(self.inputs, incoming, self.n)

    def roots(self, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        from varuna_core.model.payload import flatten

        if self.stage.is_last:
            return [out.float()], None
        leaves = [t for t in flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        return leaves, [torch.randn(t.shape, generator=self.generator).to(t) for t in leaves]


def measure(seg: Segment, repeats: int, warmup: int) -> tuple[dict[str, list[float]], list[int]]:
    from varuna_core.model.split import SplitRoute, WeightGrads, splitting

    route = SplitRoute()  # as the executor splits: after a step's first block, the module route
    samples: dict[str, list[float]] = {k: [] for k in ("forward", "forward_split", "backward", "b", "w")}
    nbytes: list[int] = []
    for i in range(warmup + repeats):
        keep = i >= warmup
        for split in ((False, True) if i % 2 == 0 else (True, False)):  # alternate which contender runs first
            incoming = seg.incoming()
            if not split:
                t_f, out = _timed(lambda incoming=incoming: seg.forward(incoming))
                roots, grads = seg.roots(out)
                t_b, _ = _timed(lambda roots=roots, grads=grads: torch.autograd.backward(roots, grads))
                if keep:
                    samples["forward"].append(t_f)
                    samples["backward"].append(t_b)
                continue
            store = WeightGrads()

            def forward_split(incoming=incoming, store=store):
                with splitting(store, route):
                    return seg.forward(incoming)

            t_f, out = _timed(forward_split)
            roots, grads = seg.roots(out)
            t_b, _ = _timed(lambda roots=roots, grads=grads: torch.autograd.backward(roots, grads))
            kept = store.nbytes
            del out, roots, grads  # the graph is gone after B; W has only what the store keeps
            t_w, _ = _timed(store.run)
            if keep:
                samples["forward_split"].append(t_f)
                samples["b"].append(t_b)
                samples["w"].append(t_w)
                nbytes.append(kept)
    return samples, nbytes


def gpt_spec(args: argparse.Namespace):
    """``examples/gpt/spec.py``'s spec, or the same model at the width, depth and heads the flags ask for."""
    import dataclasses

    if str(GPT_DIR) not in sys.path:
        sys.path.insert(0, str(GPT_DIR))
    from varuna_core import meta_init
    from varuna_core.model.spec import load_spec

    spec = load_spec(f"{GPT_DIR / 'spec.py'}:spec")
    example = sys.modules[spec.build.__module__]
    changes = {k: getattr(args, k) for k in ("n_embd", "n_layer", "n_head") if getattr(args, k) is not None}
    config = dataclasses.replace(example.CONFIG, **changes)
    if config == example.CONFIG:
        return spec, config

    def build():
        with meta_init():
            return example.GPT(config)

    return dataclasses.replace(spec, build=build, name=f"examples/gpt {changes}"), config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from varuna_core.model.discovery import discover, make_batch_fn
    from varuna_core.model.values import ValueSource

    spec, config = gpt_spec(args)
    batch_fn, dims = make_batch_fn(spec.inputs, None)
    structure = discover(spec.make(), batch_fn, dims, use_cache=False, precision=args.precision,
                         values=ValueSource(seed=0, init=spec.init))
    rows = []
    for s in range(structure.num_segments):
        seg = Segment(spec, structure, s, args.microbatch_size, args.precision)
        log(f"segment {s}: {sum(p.numel() for p in seg.params):,} parameters, {args.warmup}+{args.repeats} repeats")
        samples, nbytes = measure(seg, args.repeats, args.warmup)
        rows.append(summarize(s, sum(p.numel() for p in seg.params), samples, nbytes))
    rows.append(total(rows))
    shape = gpt_shape(config)
    meta = {"model": f"examples/gpt {shape}", "microbatch_size": args.microbatch_size,
            "precision": args.precision, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "warmup": args.warmup, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print_report(args.json, meta, "segments", rows,
                 f"examples/gpt ({shape}), micro-batch {args.microbatch_size}, {args.precision}, "
                 f"{torch.get_num_threads()} thread(s), medians of {args.repeats} repeats (torch {torch.__version__})",
                 table(rows))
    return 0


def gpt_shape(config) -> str:
    return f"n_layer={config.n_layer} n_head={config.n_head} n_embd={config.n_embd} block_size={config.block_size}"


def print_report(as_json: bool, meta: dict, key: str, rows: list[dict], title: str, text: str) -> None:
    """One JSON document ``{"meta": ..., key: rows}``, or the title and the Markdown table."""
    if as_json:
        print(json.dumps({"meta": meta, key: rows}, indent=2))
    else:
        print(f"{title}\n")
        print(text)


if __name__ == "__main__":
    sys.exit(main())
