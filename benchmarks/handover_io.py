"""What a handover costs a worker, against a checkpoint through the store, in one process: the example GPT with
AdamW, one step trained, then (each ``--repeats`` times, side by side in one run):

* ``publish``: :meth:`Varuna.publish_state` onto a job's shelf in ``--shelf-root`` (a tmpfs: ``/dev/shm``), what an
  old worker does at a handover (a file per parameter, written once where it stays, hashed);
* ``take``: :meth:`Varuna.take_state` of that step into a fresh ``Varuna``, what a warm worker on the same host does
  (the blobs linked in place, read straight into the live tensors);
* ``save``: :meth:`Varuna.checkpoint` into ``--store`` (a disk: ``O_DIRECT`` where it allows);
* ``load``: :meth:`Varuna.load_checkpoint` of it into a fresh ``Varuna`` (every file hashed, all or nothing).

``--device cuda`` runs it on the GPU (the state then goes device -> pinned host memory -> shelf, and back). Rates
are GB/s (10^9 bytes) of checkpointed state over the best time. A take must restore every tensor bit for bit (the
run fails otherwise). The wire between hosts is not in it (``morph_latency.py`` and ``shelf_throughput.py`` are).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from model import GPT, GPTConfig  # noqa: E402

from varuna_core import Varuna  # noqa: E402
from varuna_core.launch.shelf import DEFAULT_ROOT, Shelf  # noqa: E402
from varuna_core.worker.morph import holder_rank  # noqa: E402


def build(args: argparse.Namespace, seed: int) -> tuple[Varuna, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=72, block_size=64, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    dropout=0.0)
    x = torch.randint(0, 72, (2, 64))
    vm = Varuna(GPT(cfg), "0", {"idx": x, "targets": x}, batch_size=4, chunk_size=2, device=args.device)
    opt = torch.optim.AdamW(vm.parameters(), lr=1e-4)
    vm.set_optimizer(opt)
    return vm, opt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, work) -> float:
    sync(device)
    start = time.perf_counter()
    work()
    sync(device)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shelf-root", default=str(DEFAULT_ROOT), help="a tmpfs for the shelf (default /dev/shm)")
    p.add_argument("--store", default=None, help="a directory on disk for the store (default: a temporary one in "
                   "/var/tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args()
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")

    vm, opt = build(args, 0)
    x = torch.randint(0, 72, (4, 64))
    vm.step({"idx": x, "targets": x})
    opt.step()
    shelf_dir = Path(tempfile.mkdtemp(dir=args.shelf_root, prefix="handover-io-"))
    store = Path(tempfile.mkdtemp(dir=args.store or "/var/tmp", prefix="handover-io-store-"))
    shelf = Shelf("handover-io", root=shelf_dir)
    times: dict[str, list[float]] = {"publish": [], "take": [], "save": [], "load": []}
    same = True
    try:
        for _ in range(args.repeats):
            shelf.clear()
            times["publish"].append(timed(args.device, lambda: vm.publish_state(shelf.reserve)))
        size = sum(e.size for e in shelf.manifest().values())

        def fetch(holder, names, into, max_bytes):
            for name in names:
                shelf.get_into(name, lambda e: into(e.name, e.size), verify=False)

        def link(holder, name, path):
            entry = shelf.link(name, path)
            return entry.size, entry.digest

        for i in range(args.repeats):
            fresh, _ = build(args, 1 + i)
            times["take"].append(timed(args.device, lambda fresh=fresh: fresh.take_state(
                step=vm.iteration, locate=holder_rank, fetch=fetch, staging=shelf_dir, link=link, in_place=True)))
            same &= all(torch.equal(a, b) for a, b in zip(vm.parameters(), fresh.parameters(), strict=True))
            del fresh
        for _ in range(args.repeats):
            shutil.rmtree(store)
            store.mkdir()
            times["save"].append(timed(args.device, lambda: vm.checkpoint(store)))
        for i in range(args.repeats):
            fresh, _ = build(args, 10 + i)
            times["load"].append(timed(args.device, lambda fresh=fresh: fresh.load_checkpoint(store)))
            del fresh
    finally:
        shutil.rmtree(shelf_dir, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    report = {"device": device, "config": {"n_layer": args.n_layer, "n_embd": args.n_embd}, "state_bytes": size,
              "seconds": times, "bit_equal": same}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"GPT {args.n_layer} x {args.n_embd} with AdamW on {device}: {size / 1e9:.2f} GB of state")
        for name, seconds in times.items():
            print(f"  {name:8s} " + "  ".join(f"{s:6.2f} s" for s in seconds)
                  + f"   {size / min(seconds) / 1e9:5.2f} GB/s (best)")
    if not same:
        print("a take did not restore every parameter bit for bit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
