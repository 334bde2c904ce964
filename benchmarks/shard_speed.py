"""Step time and bytes on the wire of a sharded optimizer (``shard_optimizer=True``) against the all-reduce.

The example GPT at pp=1 × dp=2 (two processes, gloo, one thread each), AdamW, trained for ``--steps`` measured
steps by each contender in fresh processes:

    allreduce   Varuna(model, "0,1", ...)                         gradients all-reduced, the optimizer whole
    sharded     Varuna(model, "0,1", ..., shard_optimizer=True)   reduce-scatter, the optimizer on half the
                                                                  state, all-gather of the updated half
    allreduce-after                                               allreduce with VARUNA_OVERLAP_SYNC=0: the
                                                                  all-reduce after the pipeline instead of
                                                                  bucket by bucket during the last backward

(``--contenders``; the default is the first two). ``--bucket-mb`` sets ``Varuna(bucket_mb=...)``.

At pp=1 the data-parallel sync is the only communication, so what differs is exactly what sharding changes.
A step is ``model.step`` + ``optimizer.step()`` + ``zero_grad()``, timed after a barrier; a run's step time is the
median over steps of the slower rank's. With ``--rounds N`` each contender runs N times in alternating order and
the best round counts (other work on the machine only ever slows a round down).

**Bytes.** Each pair runs in network namespaces of its own, so the kernel's interface counters hold only its
traffic: on ``--network loopback`` one namespace for both ranks (its ``lo`` counts every packet once), on
``--network slow`` one per rank joined by a veth pair limited to ``--rate`` (each rank's ``eth0`` sends what it
sends). The counters are read between barriers around the measured steps; bytes per step include the TCP/IP
headers and the few small messages of the step (loss, norm, barriers), the same for both contenders.

Targets: sharded ÷ allreduce step time ≤ 1.05 on both networks; bytes per step equal (a ring reduce-scatter and
a ring all-gather move what a ring all-reduce moves).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shard_speed.py                          # loopback
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shard_speed.py --network slow --rate 200mbit

Needs root (network namespaces). The script doubles as its own worker (``--worker SPEC OUT``, internal).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling benchmark whose network helpers this one reuses
    sys.path.insert(0, str(HERE))

from pipeline_vs_peers import (  # noqa: E402 - found through the sys.path entry above
    GPT_DIR,
    ROOT,
    NetworkUnavailable,
    SlowNetwork,
    ensure_iproute2,
    log,
    parse_rate,
)

from varuna_core.util.procs import run_workers  # noqa: E402

WORLD = 2
CONTENDERS = {"allreduce": {"shard": False, "overlap": True}, "sharded": {"shard": True, "overlap": True},
              "allreduce-after": {"shard": False, "overlap": False}}
NS_PREFIX = "shs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Step time and bytes per step, sharded optimizer vs all-reduce (dp=2).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4, help="per replica")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--network", choices=("loopback", "slow"), default="loopback")
    p.add_argument("--rate", default="200mbit", help="--network slow: each direction's rate (tc units)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="Varuna(bucket_mb=...): the all-reduce's buckets")
    p.add_argument("--contenders", default="allreduce,sharded",
                   help=f"comma-separated subset of {','.join(CONTENDERS)}, the first the base of the ratios")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
            p.error("--steps and --rounds must be >= 1, --warmup >= 0")
        try:
            args.rate_bps = parse_rate(args.rate)
        except ValueError as exc:
            p.error(str(exc))
        args.contenders = [c for c in args.contenders.split(",") if c]
        unknown = [c for c in args.contenders if c not in CONTENDERS]
        if unknown or len(set(args.contenders)) < 2 or len(set(args.contenders)) < len(args.contenders):
            p.error(f"--contenders: two or more of {', '.join(CONTENDERS)}, each once")
        if not args.bucket_mb > 0:
            p.error("--bucket-mb must be positive")
    return args


# ----------------------------------------------------------------------------------------------------------
# Worker


def tx_bytes(interface: str) -> int:
    """Bytes ``interface`` of this process's network namespace has sent."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == interface:
            return int(rest.split()[8])
    raise RuntimeError(f"no interface {interface} in /proc/net/dev")


def worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(GPT_DIR))
    from data import CharDataset
    from model import GPT, SHARED_WEIGHTS, GPTConfig

    from varuna_core import Varuna
    from varuna_core.env import OVERLAP_SYNC

    ds = CharDataset.load()
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=spec["block_size"], n_layer=spec["n_layer"],
                    n_head=spec["n_head"], n_embd=spec["n_embd"], dropout=0.0)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    mbs, per_replica = spec["microbatch_size"], spec["microbatch_size"] * spec["microbatches"]
    batch_size = WORLD * per_replica
    os.environ[OVERLAP_SYNC] = "1" if spec["overlap"] else "0"
    model = Varuna(gpt, "0,1", ds.get_batch("train", 2, cfg.block_size, torch.Generator().manual_seed(0)),
                   batch_size=batch_size, chunk_size=mbs, shared_weights=SHARED_WEIGHTS, schedule="1f1b", seed=0,
                   shard_optimizer=spec["shard"], from_cache=False, bucket_mb=spec["bucket_mb"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.set_optimizer(optimizer)
    batches = [ds.get_batch("train", batch_size, cfg.block_size, torch.Generator().manual_seed(1000 + i))
               for i in range(spec["warmup"] + spec["steps"])]
    times, losses = [], []
    sent = None
    for i, batch in enumerate(batches):
        if i == spec["warmup"]:
            dist.barrier()
            sent = tx_bytes(spec["interface"])
        dist.barrier()
        t0 = time.perf_counter()
        loss, overflow = model.step(model.replica_slice(batch))
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    dist.barrier()
    assert sent is not None
    sent = tx_bytes(spec["interface"]) - sent
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    Path(out_path).write_text(json.dumps({
        "times_s": times, "losses": losses, "sent_bytes": sent, "optimizer_bytes": state,
        "grad_bytes": sum(f.numel() * f.element_size() for f in model.grad_buffer.flats)}))


# ----------------------------------------------------------------------------------------------------------
# Launcher


class LoopbackNamespace:
    """One network namespace for both ranks, its ``lo`` up: its counters hold only the pair's traffic."""

    def __init__(self) -> None:
        self.name = f"{NS_PREFIX}{os.getpid()}"
        self.open_ = False

    def open(self) -> None:
        ensure_iproute2()
        import subprocess

        for argv in (["ip", "netns", "add", self.name], ["ip", "-n", self.name, "link", "set", "lo", "up"]):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode:
                raise NetworkUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or 'failed'}")
            self.open_ = True
        atexit.register(self.close)

    def close(self) -> None:
        import subprocess

        if self.open_:
            subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, check=False)
            self.open_ = False

    def command(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1"}


def run_pair(spec: dict, workdir: Path, tag: str, network, timeout: float) -> list[dict]:
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    outs = [workdir / f"{tag}.rank{r}.json" for r in range(WORLD)]

    def argv(rank: int) -> list[str]:
        return [*network.command(rank), sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
                str(outs[rank])]

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **network.env()}
    outcome = run_workers(argv, WORLD, log_dir=workdir, log_name=f"{tag}.rank{{rank}}.log", timeout=timeout,
                          env=env, cwd=ROOT, agent_store=False, die_with_parent=True, poll=0.05)
    if outcome.failed is not None or outcome.timed_out or any(outcome.returncodes) or \
            not all(o.exists() for o in outs):
        for r in range(WORLD):
            log(f"--- {tag} rank {r} ---\n{(workdir / f'{tag}.rank{r}.log').read_text()[-3000:]}")
        raise RuntimeError(f"{tag} failed: exit codes {outcome.returncodes}, timed out {outcome.timed_out}")
    return [json.loads(o.read_text()) for o in outs]


def summarize(ranks: list[dict], loopback: bool) -> dict:
    per_step = [max(r["times_s"][i] for r in ranks) for i in range(len(ranks[0]["times_s"]))]
    steps = len(per_step)
    # loopback: one lo counts both ranks' packets (rank 0's read); slow: each rank's eth0 its own
    sent = ranks[0]["sent_bytes"] if loopback else sum(r["sent_bytes"] for r in ranks)
    return {"step_ms": statistics.median(per_step) * 1e3, "bytes_per_step": sent / steps,
            "optimizer_bytes": [r["optimizer_bytes"] for r in ranks], "grad_bytes": ranks[0]["grad_bytes"],
            "losses": ranks[0]["losses"]}


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    loopback = args.network == "loopback"
    try:
        network = LoopbackNamespace() if loopback else SlowNetwork(args.rate_bps, 0.0)
        network.open()
    except NetworkUnavailable as exc:
        log(f"skipped: {exc}")
        return 1
    spec = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "block_size", "microbatch_size",
                                           "microbatches", "steps", "warmup", "bucket_mb")}
    spec["interface"] = "lo" if loopback else "eth0"
    runs: dict[str, list[dict]] = {name: [] for name in args.contenders}
    try:
        with tempfile.TemporaryDirectory(prefix="shard-speed-") as tmp:
            for rnd in range(args.rounds):
                order = list(args.contenders) if rnd % 2 == 0 else list(reversed(args.contenders))
                for name in order:
                    log(f"round {rnd + 1}/{args.rounds}: {name} ...")
                    ranks = run_pair({**spec, **CONTENDERS[name]}, Path(tmp), f"{name}-{rnd}", network,
                                     args.timeout)
                    runs[name].append(summarize(ranks, loopback))
    finally:
        network.close()
    best = {name: min(rs, key=lambda r: r["step_ms"]) for name, rs in runs.items()}
    first, *others = args.contenders
    base = best[first]
    report = {
        "network": args.network if loopback else f"slow {args.rate}", "config": spec, "runs": runs, "best": best,
        "base": first,
        "step_ratio": {name: best[name]["step_ms"] / base["step_ms"] for name in others},
        "bytes_ratio": {name: best[name]["bytes_per_step"] / base["bytes_per_step"] for name in others},
        "same_losses": {name: best[name]["losses"] == base["losses"] for name in others},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"pp=1 × dp=2, GPT {args.n_layer}×{args.n_embd} ({base['grad_bytes'] / 2**20:.1f} MB of gradients, "
          f"buckets of {args.bucket_mb:g} MB), AdamW, {args.network if loopback else f'slow link {args.rate}'}, "
          f"best of {args.rounds} rounds")
    print(f"{'contender':<15} {'step ms':>9} {'ratio':>6} {'MB sent/step':>13} {'ratio':>6} "
          f"{'optimizer MB/rank':>18}  medians of the rounds (ms)")
    for name, b in best.items():
        medians = ", ".join(f"{r['step_ms']:.1f}" for r in runs[name])
        print(f"{name:<15} {b['step_ms']:>9.1f} {b['step_ms'] / base['step_ms']:>6.3f} "
              f"{b['bytes_per_step'] / 2**20:>13.2f} {b['bytes_per_step'] / base['bytes_per_step']:>6.3f} "
              f"{max(b['optimizer_bytes']) / 2**20:>18.2f}  {medians}")
    for name in others:
        same = report["same_losses"][name]
        why = ("equal to rounding is what is guaranteed: the optimizer updates pieces in one, whole tensors in the "
               "other" if CONTENDERS[name]["shard"] != CONTENDERS[first]["shard"] else "equal is what is guaranteed")
        print(f"every step's loss {'equal' if same else 'not bit-equal'} between {first} and {name} ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
