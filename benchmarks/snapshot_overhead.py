"""What in-memory snapshots cost the training: the same job with snapshots off, every step (``--snapshot-every
1``) and at the default (``auto``: as often as costs at most 2% of the training time, chosen from each snapshot's
measured cost), side by side in one run, on two SSH test hosts that share no file system (each snapshot's copy
crosses the hosts' link, as on a cluster).

The model is the example GPT (``--model small``, the default) or the GPT of 20 × 1024 of ``morph_latency.py``
(``--model big``), planned pp=2 × dp=1 over the 2 hosts × 1 slot from a fresh profile. Each setting runs
``--steps`` steps of ``varuna launch --morph --snapshot-every X`` to its end, ``--repeats`` times, the settings
interleaved so that the machine's drift falls on all of them alike. Per setting:

* **step (s)**: the mean of the launcher's step times past the first ``--skip`` steps (a step's time runs from
  the start of one step to the start of the next, so the snapshot taken at a step's start is in it);
* **overhead**: that mean against the same mean with snapshots off: the share of the training time snapshots cost;
* **snapshot (s)**: the median time of one snapshot (the slowest rank's: publish, the copy to the other host, the
  agreement), from the launcher's ``snapshot`` events; **every**: the interval the run used (auto: the last one
  chosen); **per host (MB)**: the memory one snapshot holds on a host (its own ranks' files and its copy of the
  other host's).

Target: the default's overhead at most 2% of the step time (the automatic choice's own budget). Prints a table
(``--json``: one JSON document; the table then goes to stderr); progress on stderr. Exit code 1 when a run failed,
else 0 whatever the target says.

    python benchmarks/snapshot_overhead.py [--model small|big] [--steps 200] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.morph_latency import MODELS, SMALL, Model, prepare  # noqa: E402

SETTINGS = ("0", "1", "auto")
TARGET = 0.02


def log(msg: str) -> None:
    print(f"[snapshot_overhead] {msg}", file=sys.stderr, flush=True)


def train_args(model: Model, steps: int) -> list[str]:
    args = model.train_args()
    return [*args[:args.index("--steps")], "--steps", str(steps)]


def run_once(model: Model, plan: Path, cluster, hosts: Path, store: Path, work: Path, setting: str, steps: int,
             timeout: float) -> dict[str, Any]:
    """One job of ``steps`` steps with ``--snapshot-every setting``; its step times and snapshot events."""
    from devtools.launching import Launch

    run = Path(tempfile.mkdtemp(prefix=f"run-{setting}-", dir=work))
    launch = Launch([str(plan), "--run-dir", str(run), "--ckpt-dir", str(store), "--hosts", str(hosts), "--morph",
                     "--snapshot-every", setting, *cluster.launcher_args(), "--", *train_args(model, steps)],
                    run, timeout=timeout)
    try:
        code = launch.wait()
        output = launch.output()
    finally:
        launch.close()
    if code != 0:
        logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-1500:] for p in sorted((run / "logs").glob("*.log")))
        raise RuntimeError(f"--snapshot-every {setting}: the job exited with {code}: {output[-1500:]}{logs}")
    reports = {r["step"]: r for r in launch.reports()}
    snapshots = [e for e in launch.events() if e["event"] == "snapshot"]
    shutil.rmtree(run, ignore_errors=True)
    for step in store.glob("*"):  # each job starts from an empty store
        shutil.rmtree(step, ignore_errors=True)
    return {"step_times": {s: r.get("step_time") for s, r in reports.items()}, "snapshots": snapshots}


def summarize(runs: dict[str, list[dict]], skip: int) -> list[dict[str, Any]]:
    """One row per setting: mean step time past ``skip``, overhead against off, snapshot cost, interval, bytes."""
    def mean_step(run: dict) -> float:
        times = [t for s, t in run["step_times"].items() if s >= skip and t]
        return statistics.fmean(times)

    base = statistics.fmean(mean_step(r) for r in runs["0"]) if runs.get("0") else None
    rows = []
    for setting, done in runs.items():
        step = statistics.fmean(mean_step(r) for r in done)
        snaps = [e for r in done for e in r["snapshots"]]
        held = [max(e["host_bytes"].values()) for e in snaps if e.get("host_bytes")]
        rows.append({
            "setting": setting, "step_s": step, "overhead": None if base is None else step / base - 1,
            "snapshots": len(snaps) / max(1, len(done)),
            "snapshot_s": statistics.median(e["seconds"] for e in snaps) if snaps else None,
            "every": snaps[-1]["every"] if snaps else None,
            "per_host_MB": max(held) / 1e6 if held else None,
            "peer": all(e.get("peer") for e in snaps) if snaps else None,
        })
    return rows


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "—" if x is None else format(x, fmt)


def table(report: dict) -> str:
    head = (f"{report['model']}: {report['steps']} steps x {report['repeats']} runs per setting, step times past "
            f"step {report['skip']}")
    columns = ("| --snapshot-every | step (s) | overhead | snapshots per run | snapshot (s) | every | per host (MB) | "
               "copy on the other host |")
    out = [head, "", columns, "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        overhead = "—" if row["overhead"] is None else f"{100 * row['overhead']:+.1f}%"
        every = _f(row["every"], "d") if row["every"] else "—"
        peer = "—" if row["peer"] is None else "yes" if row["peer"] else "no"
        out.append(f"| {row['setting']} | {_f(row['step_s'])} | {overhead} | {row['snapshots']:.0f} | "
                   f"{_f(row['snapshot_s'])} | {every} | {_f(row['per_host_MB'], '.1f')} | {peer} |")
    auto = next((r for r in report["rows"] if r["setting"] == "auto"), None)
    if auto is not None and auto["overhead"] is not None:
        verdict = "PASS" if auto["overhead"] <= TARGET else "FAIL"
        out += ["", (f"default (auto): {100 * auto['overhead']:+.1f}% of the step time against a target of "
                     f"{100 * TARGET:.0f}%: {verdict}")]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the means (the first are slower)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps <= args.skip + 10 or args.repeats < 1:
        p.error("--steps must exceed --skip by more than 10, --repeats at least 1")
    model = MODELS[args.model]

    from devtools.testhosts import start_cluster

    work = Path(tempfile.mkdtemp(prefix="snapshot-bench-"))
    store = Path(tempfile.mkdtemp(prefix="varuna-snapbench-store-", dir="/var/tmp"))
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    failed = None
    cluster = None
    try:
        # each host's shelf is its own (a snapshot's copy must cross the link); the store, which only the script's
        # final checkpoint writes, is one directory both hosts see
        cluster = start_cluster(2, work / "hosts", private=("/dev/shm",),
                                private_size="2g" if model is SMALL else "12g")
        hosts = work / "hosts.txt"
        hosts.write_text("".join(line + "\n" for line in cluster.hosts_file_lines(1)))
        log(f"2 SSH hosts ({cluster.mode}); profiling {model.label} and planning pp=2 x dp=1")
        plan = prepare(model, work)
        for repeat in range(args.repeats):
            for setting in SETTINGS:
                started = time.monotonic()
                runs[setting].append(run_once(model, plan, cluster, hosts, store, work, setting, args.steps,
                                              timeout=model.timeout + 30 * args.steps))
                log(f"run {repeat + 1}/{args.repeats}, --snapshot-every {setting}: {time.monotonic() - started:.0f} s")
    except Exception as exc:  # noqa: BLE001 - report what was measured
        failed = f"{type(exc).__name__}: {exc}"
        log(failed)
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    runs = {s: r for s, r in runs.items() if r}
    report = {"model": model.label, "steps": args.steps, "skip": args.skip, "repeats": args.repeats,
              "machine": {"cpus": os.cpu_count()}, "rows": summarize(runs, args.skip) if runs else [],
              "error": failed}
    text = table(report)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
