"""Goodput under a preemption trace: the useful training a job gets done in a fixed wall-clock window while its
hosts come and go, against the same job left alone, for the two ways ``varuna launch --morph`` can survive it.

The job is ``examples/gpt/train.py`` planned for 4 devices (``devtools/launching.py``: the planner's choice,
micro-batch 4), over two SSH test hosts with 2 slots each (``devtools/testhosts.py``: network namespaces, each
with its own ``/dev/shm``, so a lost host takes its snapshots with it; the store is shared, as the restart path
needs). A seeded **trace** of events, the same for every path, hits it at fixed times after its first step:

* ``loss``: a host dies without notice (every process of it SIGKILLed, its sshd too, its ``/dev/shm`` gone:
  ``HostCluster.crash``), and boots again, empty, ``down`` seconds later;
* ``notice``: ``varuna notify-preempt HOST --in NOTICE``, then the host dies ``NOTICE`` seconds later as a
  reclaimed spot VM does (whether or not the job has left it), and is offered again (a new hosts file) once it
  is back ``down`` seconds after that.

One host is down at most at a time (the next event comes after the host is back). Events start after
``--lead`` seconds and none starts in the window's last ``--tail`` seconds, so that the window ends on a job
that trains. The trace's rate is a stated compression of a real one: the harshest trace of Oobleck (SOSP'23),
one preemption every 10 minutes, times ``--compress`` (default 10: one event a minute on average, exponential
gaps, 75% without notice), a 30 s notice (Azure and GCP give 30 s; AWS 2 minutes) divided by the same factor
but kept at least 5 s, and a host down for an exponential time of mean 20 s.

Paths, each run for ``--window`` seconds from its first step:

* **uninterrupted**: the same job, no events (the rate the others are divided by; 4 devices throughout);
* **restart**: ``--no-handover --snapshot-every 0``: a notice checkpoints to the store and restarts; a loss
  restarts from the store's newest checkpoint (``--ckpt-every``), today's path;
* **handover + snapshots**: ``--morph`` defaults: a notice hands the state over through the hosts' memory to
  new workers warmed up beside the old ones; a loss recovers from the newest in-memory snapshot whose copies
  survive (``--snapshot-every auto``), else from the store.

Useful progress at the window's end is the step the job's current history has reached (the newest attempt's
highest reported step, sampled every 0.25 s); **goodput** = that ÷ the uninterrupted run's. Also reported per
path: the attempts, restarts and morphs the launcher made, and the seconds each event cost on average
(``(uninterrupted steps - steps) x uninterrupted step time / events``), with which the goodput at the real
rate (one event per 10 minutes per job) is projected as ``1 - cost / 600``.

    python benchmarks/goodput.py [--seed 1] [--window 180] [--compress 10] [--json]

Exit code 0 when every run ended its window training; 1 otherwise; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL_GAP = 600.0  # s between preemptions in Oobleck's harshest trace
REAL_NOTICE = 30.0  # s of notice on Azure and GCP
MEAN_DOWN = 20.0  # s a host stays away
NO_NOTICE = 0.75  # share of events without notice
TRAIN = ["examples/gpt/train.py", "--batch-size", "32", "--log-every", "50"]
PATHS = {
    "uninterrupted": [],
    "restart": ["--no-handover", "--snapshot-every", "0"],
    "handover + snapshots": [],
}


def log(msg: str) -> None:
    print(f"[goodput] {msg}", file=sys.stderr, flush=True)


@dataclass
class Event:
    kind: str  # "loss" or "notice"
    at: float  # s after the first step
    host: int
    notice: float  # s from the notice to the host's death (0 for a loss)
    down: float  # s from its death to its return


def make_trace(seed: int, *, window: float, compress: float, lead: float, tail: float, hosts: int) -> list[Event]:
    """The seeded events of one window: exponential gaps of mean ``REAL_GAP / compress`` counted from the moment
    the previous event's host is back, none before ``lead`` or starting later than ``window - tail``."""
    rng = random.Random(seed)
    gap = REAL_GAP / compress
    notice = max(5.0, REAL_NOTICE / compress)
    out: list[Event] = []
    t = lead
    while True:
        t += rng.expovariate(1 / gap)
        if t > window - tail:
            return out
        kind = "loss" if rng.random() < NO_NOTICE else "notice"
        down = max(3.0, rng.expovariate(1 / MEAN_DOWN))
        ev = Event(kind, round(t, 1), rng.randrange(hosts), notice if kind == "notice" else 0.0, round(down, 1))
        out.append(ev)
        t += ev.notice + ev.down


def position(reports: list[dict]) -> int:
    """The step the job's current history has reached: the newest attempt's highest reported step (an attempt
    that has not reported yet leaves the previous one's, at most one event's lost steps too many)."""
    if not reports:
        return 0
    newest = max(r["attempt"] for r in reports)
    return max(r["step"] for r in reports if r["attempt"] == newest)


@dataclass
class PathResult:
    path: str
    steps: int  # the current history's step at the window's end
    events: int
    attempts: int
    restarts: int
    morphs: int
    training_at_end: bool
    goodput: float | None = None
    cost_per_event: float | None = None  # s
    projected: float | None = None  # goodput at one event per REAL_GAP
    step_time: float | None = None  # s, median of the window's reported steps
    problems: list[str] = field(default_factory=list)


def summarize(results: list[PathResult], clean_steps: int, clean_step_time: float) -> None:
    """Goodput, the cost of an event and the projection at the real rate, from the uninterrupted run's numbers."""
    for r in results:
        r.goodput = r.steps / clean_steps if clean_steps else None
        if r.events:
            r.cost_per_event = max(0, clean_steps - r.steps) * clean_step_time / r.events
            r.projected = max(0.0, 1 - r.cost_per_event / REAL_GAP)


class Sampler(threading.Thread):
    """Polls the launcher's reports every 0.25 s; ``at(t)`` is the position at ``t`` s after the first step."""

    def __init__(self, launch) -> None:
        super().__init__(daemon=True)
        self.launch, self.samples, self.first = launch, [], None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            reports = self.launch.reports()
            now = time.monotonic()
            if reports and self.first is None:
                self.first = now
            if self.first is not None:
                self.samples.append((now - self.first, position(reports)))
            self.stop.wait(0.25)

    def at(self, t: float) -> int:
        return max((p for s, p in self.samples if s <= t), default=0)


def run_path(name: str, cluster, plan: Path, work: Path, trace: list[Event], args) -> PathResult:
    from devtools.chaos import _write_hosts
    from devtools.launching import ROOT as REPO
    from devtools.launching import VARUNA, Launch

    work.mkdir(parents=True)
    lines = cluster.hosts_file_lines(2)
    hosts = work / "hosts"
    _write_hosts(hosts, lines)
    run_dir = work / "run"
    steps = 100_000  # the window ends it, not the step count
    cmd = [str(plan), "--run-dir", str(run_dir), "--hosts", str(hosts), "--morph", "--ckpt-every",
           str(args.ckpt_every), "--heartbeat-timeout", "8", "--grace", "2", "--max-restarts", "50",
           *PATHS[name], *cluster.launcher_args(), "--", *TRAIN, "--steps", str(steps)]
    launch = Launch(cmd, run_dir, args.window + 600)
    sampler = Sampler(launch)
    sampler.start()
    problems: list[str] = []
    events = trace if name != "uninterrupted" else []
    try:
        launch.wait_for(lambda: sampler.first is not None, timeout=300)
        start = sampler.first
        assert start is not None
        for ev in events:
            _sleep_until(start + ev.at)
            host = cluster.hosts[ev.host]
            name_in_file = lines[ev.host].split()[0]
            if ev.kind == "notice":
                done = subprocess.run([str(VARUNA), "notify-preempt", name_in_file, "--in", str(ev.notice),
                                       "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True,
                                      timeout=60)
                if done.returncode != 0:
                    problems.append(f"notify-preempt failed: {done.stderr.strip()[-300:]}")
                _sleep_until(start + ev.at + ev.notice)
            log(f"  {name}: t={time.monotonic() - start:.1f}s {ev.kind} of host {ev.host}, down {ev.down}s")
            cluster.crash(host)
            _sleep_until(start + ev.at + ev.notice + ev.down)
            cluster.boot(host)
            if ev.kind == "notice":  # a preempted host is offered again by a new hosts file
                _write_hosts(hosts, lines, note=f"back after the notice at {ev.at}s")
        _sleep_until(start + args.window)
        end_steps = sampler.at(args.window)
        reports = launch.reports()
        training = any(s >= args.window - 10 and p > sampler.at(args.window - 10) for s, p in sampler.samples)
        if not training:
            problems.append("the job was not training at the window's end")
    except AssertionError as exc:
        text = str(exc)
        problems.append(text[-1500:])
        end_steps, reports, training = sampler.at(args.window), launch.reports(), False
    finally:
        sampler.stop.set()
        launch.kill()
        launch.close()
        for h in cluster.hosts:  # every host up for the next path
            try:
                cluster.boot(h)
            except Exception:  # noqa: BLE001 - a host that never went down is up already
                pass
    every = launch.events()
    ends = [e for e in every if e["event"] == "ending"]
    times = sorted(r["step_time"] for r in reports if r.get("step_time"))
    return PathResult(name, end_steps, len(events), sum(e["event"] == "starting" for e in every),
                      sum(e["kind"] == "crash" for e in ends),
                      sum(e["kind"] in ("morph", "checkpointed") for e in ends), training,
                      step_time=times[len(times) // 2] if times else None, problems=problems)


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1, help="seed of the trace")
    p.add_argument("--window", type=float, default=180.0, help="seconds of training measured per path")
    p.add_argument("--compress", type=float, default=10.0, help="events this many times more often than the real "
                   "trace (one every 10 minutes), the notice this many times shorter (at least 5 s)")
    p.add_argument("--lead", type=float, default=15.0, help="seconds before the first event may come")
    p.add_argument("--tail", type=float, default=45.0, help="seconds at the window's end with no event starting")
    p.add_argument("--ckpt-every", type=int, default=1000, help="steps between the store's checkpoints (1000 steps "
                   "of the example GPT here: about a minute, a 10-minute interval compressed as the trace is)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of: {', '.join(PATHS)}")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.add_argument("--keep", default=None, help="copy the work directory (runs, logs) here")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    if (set(names) - set(PATHS) or "uninterrupted" not in names or args.window <= args.lead + args.tail
            or args.compress <= 0 or args.ckpt_every < 1):
        p.error("--paths must name known paths, uninterrupted among them; --window > --lead + --tail; "
                "--compress > 0; --ckpt-every ≥ 1")
    trace = make_trace(args.seed, window=args.window, compress=args.compress, lead=args.lead, tail=args.tail,
                       hosts=2)
    log(f"trace (seed {args.seed}): " + "; ".join(f"{e.at}s {e.kind} h{e.host} down {e.down}s" for e in trace))

    from devtools.launching import end_bench, make_plan, profile_example_gpt
    from devtools.testhosts import start_cluster

    work = Path(tempfile.mkdtemp(prefix="goodput-bench-"))
    cluster = None
    results: list[PathResult] = []
    try:
        plan = make_plan(profile_example_gpt(work / "profile.json"), work / "plan.yaml", gpus=4)
        cluster = start_cluster(2, work / "hosts", private=("/dev/shm",))
        if cluster.mode != "netns":
            log("the hosts are loopback aliases (no network namespaces here): a host cannot die alone")
            return 1
        for i, name in enumerate(names):
            log(f"{name}: {args.window:.0f}s window")
            results.append(run_path(name, cluster, plan, work / f"path{i}", trace, args))
            r = results[-1]
            log(f"{name}: step {r.steps} at the window's end, {r.attempts} attempts")
    finally:
        end_bench(cluster, work, args.keep)
        clean = next(r for r in results if r.path == "uninterrupted")
    summarize(results, clean.steps, clean.step_time or args.window / max(clean.steps, 1))
    ok = all(r.training_at_end and not r.problems for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "seed": args.seed, "window": args.window, "compress": args.compress,
                          "trace": [asdict(e) for e in trace], "paths": [asdict(r) for r in results]}, indent=2))
    else:
        _print(results, trace, args)
    return 0 if ok else 1


def _print(results: list[PathResult], trace: list[Event], args) -> None:
    print(f"Trace (seed {args.seed}, {args.window:.0f} s window, one event per {REAL_GAP / args.compress:.0f} s on "
          f"average): " + "; ".join(f"{e.at:.0f} s {e.kind} of host {e.host} (down {e.down:.0f} s)" for e in trace))
    print()
    print("| path | steps in the window | goodput | events | attempts | restarts | morphs | s lost per event "
          "| projected goodput at 1 event / 10 min |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def pct(x):
        return f"{x:.1%}" if x is not None else "-"

    for r in results:
        cost = f"{r.cost_per_event:.1f}" if r.cost_per_event is not None else "-"
        print(f"| {r.path} | {r.steps} | {pct(r.goodput)} | {r.events} | {r.attempts} | {r.restarts} | {r.morphs} "
              f"| {cost} | {pct(r.projected)} |")
    for r in results:
        for problem in r.problems:
            print(f"{r.path}: problem: {problem}")


if __name__ == "__main__":
    sys.exit(main())
