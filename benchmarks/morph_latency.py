"""How long does a morph take? From the moment the hosts file changes to the first step of the new
configuration, split into its phases, for the example GPT on two SSH hosts.

The hosts are network namespaces with their own sshd and address (``devtools/testhosts.py``; loopback
aliases where namespaces are not permitted), reached with the real ssh client, as a cluster would be. The job
is ``examples/gpt/train.py`` planned for 4 devices (2 hosts × 2 workers) from a fresh profile, launched with
``varuna launch --morph``. After ``--warm`` steps the second host is removed from the hosts file (shrink to 2
devices); after ``--warm`` more steps it is added back (grow to 4). Each morph is timed from the launcher's
``events.jsonl`` (wall-clock stamps of the launcher, and of the workers in their heartbeats):

* **checkpoint**: the launcher sees the change and signals the workers -> every worker has written the
  on-demand checkpoint and exited (this includes finishing the step in progress);
* **teardown**: -> every agent (and so every worker process) on every host is gone;
* **re-plan**: -> the new configuration is planned (new hosts checked over SSH, the plan searched again from the
  profile) and the start begins;
* **start**: -> the slowest worker has built its model and ``Varuna`` (SSH, agents, Python and torch imports,
  structure discovery, process group);
* **load**: -> the slowest worker has loaded the checkpoint;
* **first step**: -> the launcher hears of the first completed step of the new configuration.

Target (from the issue): at most 30 s from the change to the first step. Prints a table (or ``--json``);
exit code 0 when both morphs were measured, 1 when the run failed.

    python benchmarks/morph_latency.py [--warm 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARUNA = Path(sys.executable).parent / "varuna"
TARGET_S = 30.0
PHASES = ("checkpoint", "teardown", "re-plan", "start", "load", "first step")


def log(msg: str) -> None:
    print(f"[morph_latency] {msg}", file=sys.stderr, flush=True)


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, **kw)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{done.stderr[-2000:]}")
    return done


def phases(evs: list[dict], attempt: int) -> dict:
    """The split of the morph that ended ``attempt`` (see the module docstring)."""
    def at(kind: str, n: int, **match) -> dict:
        return next(e for e in evs if e["event"] == kind and e.get("attempt", n) == n
                    and all(e.get(k) == v for k, v in match.items()))

    changed = next(e for e in evs if e["event"] == "signal" and e["attempt"] == attempt)
    ended = at("ending", attempt)
    stopped = at("stopped", attempt)
    starting = at("starting", attempt + 1)
    first = at("first_step", attempt + 1)
    t_ready = first.get("t_ready") or first["t"]
    t_resumed = first.get("t_resumed") or t_ready
    split = {
        "checkpoint": ended["t"] - changed["t"],
        "teardown": stopped["t"] - ended["t"],
        "re-plan": starting["t"] - stopped["t"],
        "start": t_ready - starting["t"],
        "load": t_resumed - t_ready,
        "first step": first["t"] - t_resumed,
    }
    before = at("starting", attempt)
    return {"reason": changed["reason"], "from": f"pp={before['pp']} dp={before['dp']}",
            "to": f"pp={starting['pp']} dp={starting['dp']}", "resume_step": starting["resume"],
            "split_s": split, "total_s": first["t"] - changed["t"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=20, help="steps before each change")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--keep", default=None, help="copy the run directory here")
    args = p.parse_args()

    from devtools.launching import read_events as events
    from devtools.launching import read_steps
    from devtools.testhosts import start_cluster

    def steps_done(run: Path) -> int:
        return len(read_steps(run))

    work = Path(tempfile.mkdtemp(prefix="morph-bench-"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cluster = None
    launcher = None
    try:
        log("profiling the example GPT and planning for 4 devices")
        sh([str(VARUNA), "profile", "examples/gpt/spec.py:spec", "--nproc", "2", "-o", str(work / "profile.json")],
           env=env, timeout=300)
        sh([str(VARUNA), "plan", str(work / "profile.json"), "--gpus", "4", "--gpus-per-node", "2",
            "--batch-size", "32", "--gpu-memory", "6MiB", "-o", str(work / "plan.yaml")], env=env, timeout=120)
        cluster = start_cluster(2, work / "hosts")
        log(f"2 SSH hosts ({cluster.mode}): {', '.join(h.address for h in cluster.hosts)}")
        lines = cluster.hosts_file_lines(2)
        hosts = work / "hosts.txt"
        hosts.write_text("\n".join(lines) + "\n")
        ssh = cluster.launcher_args()
        run = work / "run"
        total_steps = 3 * args.warm + 30
        with open(work / "launcher.log", "w") as launcher_log:  # the launcher writes to its own copy
            launcher = subprocess.Popen(
                [str(VARUNA), "launch", str(work / "plan.yaml"), "--hosts", str(hosts), "--morph", *ssh,
                 "--run-dir", str(run), "--", "examples/gpt/train.py", "--batch-size", "32", "--steps",
                 str(total_steps)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=launcher_log)

        def wait(cond, what: str, timeout: float = 300) -> None:
            end = time.monotonic() + timeout
            while not cond():
                if launcher.poll() is not None or time.monotonic() > end:
                    raise SystemExit(f"gave up waiting for {what}:\n{(work / 'launcher.log').read_text()[-3000:]}")
                time.sleep(0.1)

        def attempts(n: int) -> bool:
            return sum(e["event"] == "first_step" for e in events(run)) >= n

        wait(lambda: steps_done(run) >= args.warm, "the first steps")
        log("removing the second host from the hosts file")
        hosts.write_text(lines[0] + "\n")
        wait(lambda: attempts(2), "the shrunk job's first step")
        at = steps_done(run)
        wait(lambda: steps_done(run) >= at + args.warm, "steps after the shrink")
        log("adding it back")
        hosts.write_text("\n".join(lines) + "\n")
        wait(lambda: attempts(3), "the grown job's first step")
        if launcher.wait(timeout=600) != 0:
            raise SystemExit(f"the job failed:\n{(work / 'launcher.log').read_text()[-3000:]}")
        evs = events(run)
        report = {"hosts_mode": cluster.mode, "target_s": TARGET_S,
                  "morphs": [phases(evs, 1), phases(evs, 2)]}
        if args.keep:
            shutil.copytree(run, Path(args.keep), dirs_exist_ok=True)
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"morph latency of the example GPT over SSH ({report['hosts_mode']} hosts), seconds:")
    print(f"   {'':<34}" + "".join(f"{name:>12}" for name in PHASES) + f"{'total':>9}")
    for m in report["morphs"]:
        label = f"{m['from']} -> {m['to']} (step {m['resume_step']})"
        print(f"   {label:<34}" + "".join(f"{m['split_s'][name]:>12.2f}" for name in PHASES)
              + f"{m['total_s']:>9.2f}")
    worst = max(m["total_s"] for m in report["morphs"])
    verdict = "PASS" if worst <= TARGET_S else "FAIL"
    print(f"target: hosts-file change -> first step of the new configuration <= {TARGET_S:.0f} s: {verdict} "
          f"(worst {worst:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
