"""Profile the example model the original's way: every process runs this script, the `Profiler` shares the
cut points among them and measures the network; rank 0 writes `<save>/profile.json`, which `AutoConfig`
(config.py) and `python -m varuna.run_varuna --profile_folder <save>` read.

    torchrun --nproc_per_node 2 examples/original_api/profile_model.py --save profiles
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import SHARED_WEIGHTS, SampleModel, Text

from varuna import Profiler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max_micro_bs", type=int, default=4)
    parser.add_argument("--save", type=str, default="profiles")
    args, _ = parser.parse_known_args()  # the launcher's other arguments (--stage_to_rank_map ...) are not used
    return args


def main():
    args = parse_args()
    dist.init_process_group(backend="gloo", init_method="env://")
    text = Text()
    torch.manual_seed(args.seed)
    model = SampleModel(text.vocab_size)

    def get_batch(size, device=None):
        return text.batch(size, args.seed)

    profiler = Profiler(model, get_batch, device=-1, fp16=args.fp16, out_folder=args.save,
                        shared_weights=SHARED_WEIGHTS)
    profiler.set_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    microbatches_to_profile = list(range(1, args.max_micro_bs + 1))
    profile = profiler.profile_all(microbatches_to_profile)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"profiled {profile.num_segments} segments at micro-batch sizes {profile.microbatch_sizes}: "
              f"{Path(args.save) / 'profile.json'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
