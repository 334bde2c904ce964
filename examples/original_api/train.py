"""A training script written exactly in the original Varuna's style (its README and class documentation).

Run it the original's way (`python -m varuna.run_varuna` passes --rank --local_rank --stage_to_rank_map
--chunk_size and --batch-size, the per-process batch), or under torchrun with those given by hand:

    echo 127.0.0.1 > machines.txt
    python -m varuna.run_varuna --machine_list machines.txt --gpus_per_node 2 --batch_size 16 --nstages 2 \
        --chunk_size 4 examples/original_api/train.py --steps 20
    torchrun --nproc_per_node 2 examples/original_api/train.py --stage_to_rank_map "0;1" --chunk_size 4 \
        --batch-size 16 --steps 20

Rank 0 prints `step <i> loss <loss>` for every step.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import SHARED_WEIGHTS, SampleModel, Text

from varuna import Varuna, get_this_rank_config_varuna, get_varuna_config


def parse_args():
    parser = argparse.ArgumentParser()
    # passed by the launcher
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stage_to_rank_map", type=str, default=None)
    parser.add_argument("--chunk_size", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="per-process batch size")
    # the script's own
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save", type=str, default="checkpoints", help="global checkpoint store")
    parser.add_argument("--resume_step", type=int, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    rank = args.rank if args.rank >= 0 else int(os.environ.get("RANK", 0))
    local_rank = args.local_rank if args.local_rank >= 0 else int(os.environ.get("LOCAL_RANK", 0))
    dist.init_process_group(backend="gloo", init_method="env://")

    pipeline_depth, data_depth = get_varuna_config(args.stage_to_rank_map)
    stage, dp_rank = get_this_rank_config_varuna(args.stage_to_rank_map, rank)
    global_batch_size = args.batch_size * data_depth

    text = Text()
    torch.manual_seed(args.seed)
    model = SampleModel(text.vocab_size)  # full model on CPU

    def get_batch_fn(size, device=None):
        batch = text.batch(size, args.seed)
        if device is not None:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        return batch

    model = Varuna(model, args.stage_to_rank_map, get_batch_fn, global_batch_size, args.chunk_size, args.fp16,
                   local_rank=local_rank, device=-1, shared_weights=SHARED_WEIGHTS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.set_optimizer(optimizer)

    iteration = 0
    if args.resume_step is not None:
        iteration = model.load_checkpoint(args.save, args.resume_step)
    iteration = max(iteration, model.iteration)  # under varuna launch, a restart has resumed by itself

    def handler(signum, _):
        model.checkpoint(args.save, iteration, None, True)
        exit()

    signal.signal(signal.SIGUSR1, handler)

    while iteration < args.steps:
        batch = text.step_batch(iteration, global_batch_size, args.seed)
        lo, hi = dp_rank * args.batch_size, (dp_rank + 1) * args.batch_size  # this replica's examples
        inputs = {k: v[lo:hi] if torch.is_tensor(v) else v for k, v in batch.items()}
        loss, overflow = model.step(inputs)
        loss = torch.Tensor([loss])
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {iteration} loss {loss.item()!r} (stage {stage} of {pipeline_depth}, replica {dp_rank} "
                  f"of {data_depth})", flush=True)
        iteration += 1

    model.checkpoint(args.save, iteration, None, True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
