"""What the Hugging Face examples share: the shipped text as token ids, and the training script.

The model comes from ``transformers``, built from a config (nothing is downloaded) and never edited:
``Varuna(..., cutpoints="auto")`` puts the cut points between its transformer blocks and finds the tied
embedding by itself. Each example folder holds ``model.py`` (the config and what one batch looks like),
``spec.py`` (for ``varuna profile``) and ``train.py`` (this module's :func:`main` on that model). They run as one
process, under ``torchrun`` (with ``--stage-to-rank-map``) or under ``varuna launch`` (with a plan).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpt"))  # the character data of the example GPT

from data import CharDataset

from varuna_core import ModelSpec, Varuna

__all__ = ["CharDataset", "main", "model_spec"]


def model_spec(example: ModuleType, name: str) -> ModelSpec:
    """``example``'s model at the training script's default size, as a spec for ``varuna profile``."""
    args = parser("").parse_args([])
    ds = CharDataset.load()

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return example.build(ds.vocab_size, args)

    def batch(n: int) -> dict:
        return example.batch(ds, "train", n, args, torch.Generator().manual_seed(n))

    return ModelSpec(build=build, batch=batch, cutpoints="auto", name=name)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stage-to-rank-map", default=None,
                   help="placement, e.g. '0,2;1,3' (default: one stage per rank; a plan sets it)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (examples per step)")
    p.add_argument("--chunk-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--schedule", choices=["varuna", "1f1b", "gpipe", "zb", "varuna-zb"], default="varuna")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--plan", default=os.environ.get("VARUNA_PLAN"), help="a plan from `varuna plan`")
    p.add_argument("--ckpt-dir", default=os.environ.get("VARUNA_CKPT_DIR"),
                   help="checkpoint store for a final checkpoint (default: $VARUNA_CKPT_DIR)")
    return p


def main(example: ModuleType) -> None:
    """Train ``example.build(vocab_size, args)`` on ``example.batch(ds, split, n, args, generator)``."""
    args = parser(example.__doc__.strip().splitlines()[0]).parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    stage_to_rank_map = args.stage_to_rank_map or (None if args.plan else ";".join(map(str, range(world_size))))
    ds = CharDataset.load()
    torch.manual_seed(args.seed)
    model = example.build(ds.vocab_size, args)
    dummy = example.batch(ds, "train", 2, args, torch.Generator().manual_seed(args.seed))
    model = Varuna(model, stage_to_rank_map, dummy_inputs=dummy, batch_size=args.batch_size,
                   chunk_size=None if args.plan else args.chunk_size, schedule=args.schedule, plan=args.plan,
                   cutpoints="auto", loss_reduction=example.LOSS_REDUCTION)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.set_optimizer(optimizer)  # under `varuna launch`, also restores the checkpoint to resume from
    model.total_steps = args.steps
    if model.rank == 0:
        tied = "; tied across stages: " + ", ".join(" = ".join(t.names) for t in model.ties) if model.ties else ""
        print(f"{example.NAME}: {model.pp} stage(s) x {model.dp} replica(s), {model.structure.num_segments} "
              f"segments (a cut before every block but the first), partition {model.partition.to_string()}"
              f"{tied}", flush=True)
    first = model.iteration
    loss = float("nan")
    started = time.perf_counter()
    for step in range(first, args.steps):
        batch = example.batch(ds, "train", args.batch_size, args,
                              torch.Generator().manual_seed(args.seed * 1_000_003 + step))
        loss, overflow = model.step(model.replica_slice(batch))
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        if model.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:5d} loss {loss:.4f} ({time.perf_counter() - started:.1f}s)", flush=True)
    if args.ckpt_dir and model.iteration > first:
        model.checkpoint(args.ckpt_dir)
    val = example.batch(ds, "val", args.batch_size, args, torch.Generator().manual_seed(args.seed))
    val_loss = model.evaluate(model.replica_slice(val))
    if model.rank == 0:
        print(f"final loss {loss:.4f} (validation {val_loss:.4f})", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
