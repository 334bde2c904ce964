"""Train the example character-level GPT with pipeline + data parallelism.

Run one process per rank, e.g. 4 pipeline stages on one machine:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/gpt/train.py --stage-to-rank-map "0;1;2;3"

or 2 stages x 2 replicas: ``--stage-to-rank-map "0,2;1,3"`` (stages separated by ';', the ranks of a stage's
replicas by ','). Without a map every rank is its own stage (one replica). Started with plain ``python``,
the script trains as a world of one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # model.py and data.py sit next to this script

from data import CharDataset
from model import GPT, SHARED_WEIGHTS, GPTConfig

from varuna_core import Varuna, meta_init


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage-to-rank-map", default=None,
                   help="placement, e.g. '0,2;1,3' (default: one stage per rank, '0;1;...;WORLD_SIZE-1')")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (examples per step)")
    p.add_argument("--chunk-size", type=int, default=4, help="micro-batch size")
    p.add_argument("--schedule", choices=["varuna", "1f1b", "gpipe", "zb", "varuna-zb"], default="varuna")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--build", choices=["meta", "cpu"], default="meta",
                   help="meta: build without memory, each rank allocates and initialises only its stage (values "
                        "independent of the layout); cpu: build the whole model on every rank first")
    p.add_argument("--weights", default=None,
                   help="start from these values: a .safetensors file or the output of `varuna ckpt merge`")
    p.add_argument("--data", default=None, help="text file to train on (default: the shipped data/input.txt)")
    p.add_argument("--ckpt-dir", default=os.environ.get("VARUNA_CKPT_DIR"),
                   help="checkpoint store for a final checkpoint (default: $VARUNA_CKPT_DIR, set by varuna launch)")
    p.add_argument("--shard-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="shard the AdamW state over each stage's data-parallel replicas (default: the plan's "
                   "choice, else not)")
    p.add_argument("--wire-dtype", choices=["exact", "bf16", "fp16"], default=None,
                   help="bf16/fp16: activations and gradients cross between stages in it, half the bytes (default: "
                   "the plan's choice, else exact)")
    p.add_argument("--plan", default=os.environ.get("VARUNA_PLAN"),
                   help="a plan from `varuna plan` (default: $VARUNA_PLAN): it sets the stage-to-rank map, "
                   "partition, schedule and micro-batch size")
    return p.parse_args()


def main() -> None:
    args = parse_args()

    # torchrun (or `varuna launch`) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; Varuna
    # creates the process group from them (gloo on CPU, NCCL on CUDA). A plain `python train.py` is a world of one.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    stage_to_rank_map = args.stage_to_rank_map or ";".join(str(r) for r in range(world_size))
    if args.plan and not args.stage_to_rank_map:
        stage_to_rank_map = None  # the plan's

    # Data and model: built identically on every rank (same text, same seed).
    ds = CharDataset.load(args.data) if args.data else CharDataset.load()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    if args.build == "meta":
        with meta_init():  # parameters on the meta device: no memory until Varuna allocates this rank's stage
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    n_params = model.num_parameters()
    dummy_inputs = ds.get_batch("train", 2, args.block_size, torch.Generator().manual_seed(args.seed))

    model = Varuna(model, stage_to_rank_map, dummy_inputs=dummy_inputs, batch_size=args.batch_size,
                   chunk_size=None if args.plan else args.chunk_size, shared_weights=SHARED_WEIGHTS,
                   schedule=args.schedule, seed=args.seed,
                   init=GPT.init_module if args.build == "meta" else None, weights=args.weights,
                   plan=args.plan, shard_optimizer=args.shard_optimizer, wire_dtype=args.wire_dtype)
    # Created after wrapping: each rank only holds (and optimizes) its own stage's parameters. Under
    # `varuna launch` after a restart or a morph, set_optimizer also restores the checkpoint to resume from.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.set_optimizer(optimizer)
    model.total_steps = args.steps  # for the launcher's ETA

    if model.rank == 0:
        print(f"model: {n_params / 1e3:.1f}k parameters, vocab {ds.vocab_size}, {cfg}")
        print(f"world {world_size}: {model.pp} stage(s) x {model.dp} replica(s), map {model.topology.to_string()!r}, "
              f"schedule {model.schedule_name}, partition {model.partition.to_string()}, global batch "
              f"{args.batch_size}, micro-batch {model.chunk_size}"
              f"{', optimizer sharded over the replicas' if model.shard_optimizer and model.dp > 1 else ''}"
              f"{f', {model.wire_dtype} on the wire' if model.wire_dtype and model.pp > 1 else ''}",
              flush=True)

    loss = float("nan")
    t_start = time.perf_counter()
    first = model.iteration  # 0, or the step a resumed checkpoint was taken at
    if model.rank == 0 and first:
        print(f"resumed at step {first}", flush=True)
    for step in range(first, args.steps):
        # Every rank draws the same global batch from a generator seeded by (seed, step); all stages of a
        # replica then take the same contiguous slice of it.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        batch = ds.get_batch("train", args.batch_size, args.block_size, gen)
        inputs = model.replica_slice(batch)

        loss, overflow = model.step(inputs)  # loss of the whole global batch, on every rank
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()

        if model.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            elapsed = time.perf_counter() - t_start
            print(f"step {step:5d} loss {float(loss):.4f} ({elapsed:.1f}s)", flush=True)

    elapsed = time.perf_counter() - t_start
    if args.ckpt_dir and model.iteration > first:
        model.checkpoint(args.ckpt_dir)  # collective; step_<iteration>, loadable under any layout
    # Held-out loss on one global batch of validation text, each replica evaluating its slice.
    val_batch = ds.get_batch("val", args.batch_size, args.block_size, torch.Generator().manual_seed(args.seed))
    val_loss = model.evaluate(model.replica_slice(val_batch))
    if model.rank == 0:
        trained = max(args.steps - first, 0)  # 0 when resumed at or past --steps
        tokens = trained * args.batch_size * args.block_size
        print(f"final loss {float(loss):.4f} (validation {val_loss:.4f}) after {trained} steps in "
              f"{elapsed:.1f}s: {tokens / max(elapsed, 1e-9):,.0f} tokens/s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
