"""Choose the pipeline depth and micro-batch size from a profile, as the original's `AutoConfig` did.

    python examples/original_api/config.py --num_gpus 4 --batch_size 32 --profile_folder profiles

Prints `pp <P> micro_batch <M> time <seconds>` for the best configuration, then the time of each depth.
"""

import argparse

from varuna import AutoConfig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_gpus", type=int, required=True)
    parser.add_argument("--gpus_per_vm", type=int, default=None)
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--profile_folder", type=str, default="profiles")
    parser.add_argument("--gpu_memory_capacity", type=int, default=None, help="bytes per device")
    args = parser.parse_args()

    config = AutoConfig(args.num_gpus, args.gpus_per_vm or args.num_gpus, args.batch_size, args.profile_folder,
                        gpu_memory_capacity=args.gpu_memory_capacity, verbose=False)
    pp, micro_batch, seconds = config.get_min()
    print(f"pp {pp} micro_batch {micro_batch} time {seconds:.6f}")
    for depth, step_time in sorted(config.batch_times.items()):
        print(f"  pp={depth}: micro-batch {config.micro_batch[depth]}, {step_time * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
