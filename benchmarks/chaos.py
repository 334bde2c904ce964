"""Chaos: every kind of fault a preemptible cluster throws at a job, injected into one `varuna launch --morph`
run at seeded random steps, and whether the job survived each one without changing a single number.

The job is ``examples/gpt/train.py`` planned for 4 devices from a fresh profile (the planner's choice, which is
also what a morph plans again when the devices come back; micro-batch 4 throughout), over two test
hosts reached with the real ssh client (``devtools/testhosts.py``: network namespaces with their own sshd and
address; loopback aliases where namespaces are not permitted), with a checkpoint every ``--ckpt-every`` steps.
The faults (``devtools/chaos.py`` says exactly what each does): SIGKILL of a worker, SIGKILL of a host's agent,
SIGSTOP of a worker, a host removed from the hosts file and added back, a preemption notice for a host (offered
again afterwards), a corrupt newest checkpoint (a flipped byte, then a worker killed so that the restart
meets it), and a whole host lost without notice (every process of it killed, its sshd too, and its own
``/dev/shm`` with the snapshots on it; it boots again, empty, once the job trains without it). For each fault
that ends an attempt unasked it reports how long the launcher took to notice, to train again, the steps lost and
where the state came from (an in-memory snapshot, the store's checkpoint).
Its surviving history (the attempts whose steps led to the final state, each with its layout) is then
replayed through a store on local processes (``devtools/same_layouts.py``) and compared to the bit: every loss
and every final parameter. The same job run without interruption on one layout is compared too: the largest
relative differences of the losses and of the final parameters (per tensor, ``||a - b|| / ||b||``), with each
tensor's largest single-element difference beside them, measure the rounding of the other layouts the run went
through (they grow with the steps spent on them; a morph by handover trains on while the new configuration warms
up).

Reports faults injected and survived, attempts, restarts, morphs, checkpoints set aside, and both comparisons.
Exit code 0 when every fault was survived and the run equals its layouts replayed to the bit, 1 otherwise.

    python benchmarks/chaos.py [--seed 1] [--rounds 2] [--kinds kill_worker,preempt,...] [--json]
    python benchmarks/chaos.py --rounds 1 --kinds lose_host --pp 4 --dp 1 --no-reference   # last copies lost
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-5


def log(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    from devtools.chaos import KINDS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (round r uses seed + r)")
    p.add_argument("--rounds", type=int, default=2, help="runs, each with every kind of fault once")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--gap", type=int, default=12, help="steps between faults (up to 1.5x, seeded)")
    p.add_argument("--ckpt-every", type=int, default=5, help="steps between periodic checkpoints")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--keep", default=None, help="copy the work directory (runs, logs, checkpoints) here")
    p.add_argument("--pp", type=int, default=None, help="plan this many stages (with --dp) instead of the "
                   "planner's choice for 4 devices: --pp 4 --dp 1 has one copy of each stage, so a lost host "
                   "loses its stages' last copies")
    p.add_argument("--dp", type=int, default=None, help="replicas of each stage (with --pp; pp x dp = 4)")
    p.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run beside the chaotic "
                   "one (it shares the cores and doubles every start's time); only the replayed layouts are "
                   "compared")
    args = p.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds or args.rounds < 1 or args.gap < 2 or args.ckpt_every < 1:
        p.error(f"unknown fault kinds {unknown}" if unknown else "need at least one kind, --rounds ≥ 1, --gap ≥ 2 "
                "and --ckpt-every ≥ 1")
    if (args.pp is None) != (args.dp is None) or (args.pp is not None and args.pp * args.dp != 4):
        p.error("give --pp and --dp together, with pp x dp = 4 (two hosts of two slots)")

    from devtools.chaos import run_chaos
    from devtools.launching import end_bench, make_plan, profile_example_gpt
    from devtools.testhosts import start_cluster

    work = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    cluster = None
    results = []
    try:
        plan = make_plan(profile_example_gpt(work / "profile.json"), work / "plan.yaml", gpus=4, pp=args.pp,
                         dp=args.dp)
        from varuna_core.planning.artifacts import load_plan

        chosen = load_plan(plan)
        whose = "the planner's choice" if args.pp is None else "the shape asked"
        log(f"profiled the example GPT; {whose} for 4 devices: pp={chosen.pp} x dp={chosen.dp}")
        # each host's /dev/shm is its own (a lost host takes its snapshots with it); the store is shared
        cluster = start_cluster(2, work / "hosts", private=("/dev/shm",))
        log(f"2 SSH hosts ({cluster.mode}): {', '.join(h.address for h in cluster.hosts)}")
        for r in range(args.rounds):
            seed = args.seed + r
            log(f"round {r + 1}/{args.rounds}, seed {seed}: {len(kinds)} faults")
            started = time.monotonic()
            result = run_chaos(cluster, plan, work / f"round{r + 1}", seed=seed, kinds=kinds, gap=args.gap,
                               ckpt_every=args.ckpt_every, timeout=1800, replay_layouts=True,
                               uninterrupted=not args.no_reference,
                               say=lambda m: log(f"  {m}"))
            log(f"round {r + 1}: {result.survived}/{result.injected} survived, exit {result.exit_code}, "
                f"{time.monotonic() - started:.0f}s")
            results.append(result)
    finally:
        end_bench(cluster, work, args.keep)
        ok = all(r.exit_code == 0 and r.survived == r.injected == len(r.faults) and r.same_as_its_layouts and
             not r.problems for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "rounds": [r.as_dict(TOLERANCE) for r in results]}, indent=2))
    else:
        _print(results)
    return 0 if ok else 1


def _print(results) -> None:
    print("| round | seed | steps | faults injected | survived | attempts | restarts | morphs | checkpoints set aside "
          "| same bits as its layouts replayed (attempts) | vs uninterrupted: losses max rel. diff | parameters: max "
          "rel. diff (tensor) | parameters: max element diff | seconds |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |")

    def fmt(x):
        return f"{x:.1e}" if x is not None else "-"

    for i, r in enumerate(results, 1):
        print(f"| {i} | {r.seed} | {r.steps} | {r.injected} | {r.survived} | {r.attempts} | {r.restarts} | "
              f"{r.morphs} | {r.refused_checkpoints} | {'yes' if r.same_as_its_layouts else 'NO'} "
              f"({', '.join(map(str, r.chain or []))}) | {fmt(r.loss_max_rel_diff)} | {fmt(r.params_max_rel_diff)} "
              f"({r.params_worst or '-'}) | {fmt(r.params_max_abs_rel_diff)} | {r.seconds:.0f} |")
    print()
    print("| round | step | fault | what was done | survived | detected (s) | recovered (s) | steps lost "
          "| state from |")
    print("| ---: | ---: | --- | --- | --- | ---: | ---: | ---: | --- |")

    def sec(x):
        return f"{x:.1f}" if x is not None else "-"

    for i, r in enumerate(results, 1):
        for f in r.faults:
            print(f"| {i} | {f.step} | {f.kind} | {f.detail} | {'yes' if f.survived else 'NO'} | {sec(f.detected_s)} "
                  f"| {sec(f.recovered_s)} | {f.steps_lost if f.steps_lost is not None else '-'} | "
                  f"{f.source or '-'} |")
    for i, r in enumerate(results, 1):
        for problem in r.problems:
            print(f"round {i}: problem: {problem}")


if __name__ == "__main__":
    sys.exit(main())
