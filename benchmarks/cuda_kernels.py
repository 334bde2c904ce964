"""The extension's CUDA kernel against torch's own ops, side by side in one run on one GPU, and against the
device's memory bandwidth measured in the same run (every case here is bound by memory, not arithmetic).

A kernel earns its place only if it beats torch here; one that does not is dropped (``csrc/README.md`` records
the decisions and the numbers).

Cases (``varuna_core.pipeline.fused``):

* **grad pass, fp16 loss scaling**: a stage's gradients unscaled in place, checked for inf/NaN and normed.
  torch: ``torch._amp_foreach_non_finite_check_and_unscale_`` then ``torch._foreach_norm``, squared and summed in
  float64 (what ``finish_step`` runs without the kernel); ours: ``unscale_sq_norms_cuda`` then the sum. Bytes:
  the gradients read and written once (the least any implementation moves).
* **grad pass, no scaling** (bf16/fp32 training): the norm alone. torch: ``_foreach_norm``; ours: the kernel with no
  scale (read once; it also flags non-finite values).

A pack/cast kernel (a cut's tensors cast into one send buffer, and back) was measured by this script at commit
e77a8d1 and dropped: csrc/README.md has its numbers.

Gradients: the parameter shapes of the example GPT (``examples/gpt``: 52 small tensors, launch-bound)
and of a 1.21 B GPT (24 blocks of width 2048, as ``benchmarks/gpu.py``'s big model: bandwidth-bound), fp32 (the
master gradients of fp16/bf16 autocast). Values are ``randn``; the scale is 1.0 so that repeated unscaling keeps
them (both implementations still read and write every element). Timing: CUDA events around ``--reps`` calls after
``--warmup`` calls, the median of ``--trials`` such means.

    python benchmarks/cuda_kernels.py             # on a GPU with the extension built with its CUDA kernels
    python benchmarks/cuda_kernels.py --json-out r.json

Exit code 0 when every case ran, 1 when one failed, 2 when there is no GPU or the kernels are not built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from varuna_core.pipeline import fused  # noqa: E402


def gpt_shapes(layers: int, width: int, vocab: int, seq: int) -> list[tuple[int, ...]]:
    """The parameter shapes of ``examples/gpt/model.py``'s GPT (tied head: the embedding counted once)."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (seq, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return [*shapes, (width,), (width,)]


def timed(fn: Callable[[], object], *, warmup: int, reps: int, trials: int) -> float:
    """Seconds per call: the median over ``trials`` of the mean over ``reps`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    means = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(means)


def copy_bandwidth(args) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB, read and write counted: the physical limit here."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), warmup=args.warmup, reps=args.reps, trials=args.trials)
    return 2 * src.numel() * 4 / seconds


def grad_cases(name: str, shapes, args, bandwidth: float) -> list[dict]:
    grads = [torch.randn(s, device="cuda") for s in shapes]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    found = torch.zeros(1, device="cuda")
    one = torch.ones(1, device="cuda")

    def torch_scaled():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()

    def ours_scaled():
        return fused.unscale_sq_norms_cuda(grads, one, found).sum()

    def torch_plain():
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()

    def ours_plain():
        return fused.unscale_sq_norms_cuda(grads, None, found).sum()

    rows = []
    for case, theirs, ours, moved in (("grad pass, fp16 scaling", torch_scaled, ours_scaled, 2 * nbytes),
                                      ("grad pass, norm only", torch_plain, ours_plain, nbytes)):
        t_theirs = timed(theirs, warmup=args.warmup, reps=args.reps, trials=args.trials)
        t_ours = timed(ours, warmup=args.warmup, reps=args.reps, trials=args.trials)
        rows.append(row(f"{case} ({name})", len(grads), nbytes, moved, t_theirs, t_ours, bandwidth))
    return rows


def row(case: str, tensors: int, nbytes: int, moved: int, t_theirs: float, t_ours: float, bandwidth: float) -> dict:
    return {"case": case, "tensors": tensors, "MB": nbytes / 1e6, "torch_us": t_theirs * 1e6, "ours_us": t_ours * 1e6,
            "speedup": t_theirs / t_ours, "ours_of_bandwidth": moved / t_ours / bandwidth,
            "torch_of_bandwidth": moved / t_theirs / bandwidth}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/cuda_kernels.py: no CUDA device (hint: run it on a GPU machine)", file=sys.stderr)
        return 2
    if fused.cuda_kernels() is None:
        print("benchmarks/cuda_kernels.py: varuna_core._native has no CUDA kernels (hint: build it where nvcc is "
              "found, csrc/README.md)", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(args)
    rows: list[dict] = []
    failed = False
    cases: list[tuple[str, Callable[[], list[dict]]]] = [
        ("example GPT grads", lambda: grad_cases("example GPT, 52 tensors", gpt_shapes(4, 64, 65, 64), args,
                                                 bandwidth)),
        ("1.21B GPT grads", lambda: grad_cases("1.21B GPT, 292 tensors", gpt_shapes(24, 2048, 50304, 1024), args,
                                               bandwidth)),
    ]
    for what, case in cases:
        try:
            rows += case()
        except Exception as err:  # noqa: BLE001 - one failed case is reported, the others still run
            print(f"{what}: FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            failed = True
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    meta = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "copy_bandwidth_GBps": bandwidth / 1e9}
    print(f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}; device-to-device copy "
          f"{bandwidth / 1e9:.0f} GB/s (read + write)\n")
    print("| case | tensors | MB | torch µs | ours µs | torch/ours | ours of copy BW | torch of copy BW |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['tensors']} | {r['MB']:.1f} | {r['torch_us']:.1f} | {r['ours_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['ours_of_bandwidth']:.0%} | {r['torch_of_bandwidth']:.0%} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
