"""Does ``varuna plan`` pick the configuration a user would have found by trying them all? The planner's regret
on an emulated commodity cluster, and its simulator's error on every configuration.

A scenario is a model × a cluster shape × the rate of the link between hosts. The cluster
(:mod:`devtools.emucluster`) is ``H`` network-namespace hosts with their own sshd, ``G`` worker slots each
(loopback speed between the workers of a host), each host's link limited to the rate both ways by tc's token
bucket. The models (:mod:`devtools.emumodels`) are exact-compute: each segment's F, B and W sleep for times
derived from a GPT-2 XL layer on an A100 (an estimate; the module says how), while activations, gradients and
parameters of real sizes cross the links. For each scenario (see :mod:`devtools.regret` for the details):

1. the model is profiled on the cluster's first host (``varuna profile --nproc 2`` over SSH; once per model and
   cluster), and the link between hosts is measured (gloo ping-pong between two hosts, the profiler's fit; once per
   rate and cluster) and given to the planner as ``--link-rate``/``--link-latency`` (a profile knows no link
   between hosts);
2. ``make_plan`` (what ``varuna plan`` runs) plans for the cluster's devices; every configuration its search
   considers (pipeline depth, data-parallel width, micro-batch size, schedule) is listed by the plan (``top`` at
   its maximum; checked against an independent enumeration), and each gets its own plan;
3. every configuration runs under ``varuna launch PLAN --hosts ...`` on the emulated hosts (one launch per number
   of devices and cluster, kept: its workers train the configurations of that size one after another, each a fresh
   ``Varuna(..., plan=...)``; the first scenario's choice is also launched alone, to check that this measures what
   its own launch would); ``--warmup`` + ``--steps`` steps each, the median of the slowest rank's step.
   Configurations hopelessly slower than the best measured so far (``--stop-factor``), never the planner's choice,
   are cut short after a step that shows it, or not run where the bytes the busiest host's link must receive in a
   step already take that long at the link's nominal rate (the *link bound*, which owes nothing to the simulator);
4. it reports the planner's choice, the best measured configuration, the **regret** (measured step of the choice
   ÷ best measured − 1), the simulator's error (predicted ÷ measured − 1) and the link bound on every
   configuration, and the cores other processes kept busy meanwhile (a shared machine's noise).

The summary: the share of scenarios with regret ≤ 5%, the largest regret, the median |simulator error| (targets of
issue 34: regret ≤ 5% in ≥ 90% of the scenarios and never > 10%; median |error| ≤ 5%; reported, not enforced).

    python benchmarks/plan_regret.py                                  # 2 models x 2 shapes x 3 rates (~25 min)
    python benchmarks/plan_regret.py --scenarios 'xl/2x4/*' --json    # a subset (fnmatch on the names)
    python benchmarks/plan_regret.py --keep runs/regret               # keep profiles, plans, logs and results

Needs root (network namespaces, tc). Progress on stderr; tables (or ``--json``) on stdout. Exit code 0 when every
run succeeded, 1 when one failed (its row says why), 2 on bad options or when the cluster cannot be built here.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from devtools import cpu  # noqa: E402
from devtools.emucluster import (  # noqa: E402
    ClusterUnavailable,
    close_on_signals,
    parse_delay,
    parse_rate,
    start_emucluster,
)
from devtools.emumodels import MODELS, summary  # noqa: E402
from devtools.regret import LaunchPool, Scenario, measure, profile_on  # noqa: E402

TARGET_REGRET, TARGET_SHARE, TARGET_WORST, TARGET_SIM = 0.05, 0.90, 0.10, 0.05


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="xl,long", help=f"comma-separated, of {', '.join(sorted(MODELS))}")
    p.add_argument("--shapes", default="2x4,4x2", help="cluster shapes HOSTSxSLOTS (default 2x4,4x2)")
    p.add_argument("--rates", default="1gbit,200mbit,50mbit", help="rates of the link between hosts (tc units)")
    p.add_argument("--delay", default="0ms", help="one-way delay added between hosts (netem), e.g. 1ms")
    p.add_argument("--scenarios", default="*", help="only the scenarios whose name MODEL/HxG/RATE matches one of "
                   "these comma-separated fnmatch patterns, e.g. 'xl/2x4/*,long/*/50mbit'")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--microbatch-sizes", default="2,4", help="profiled, and the planner's choices (default 2,4)")
    p.add_argument("--schedules", default="1f1b,zb", help="the planner's choices (default 1f1b,zb)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run, after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every configuration (each its own workers' pass; the median of their medians)")
    p.add_argument("--profile-repeats", type=int, default=5, help="the profiler's timed repetitions (default 5)")
    p.add_argument("--stop-factor", type=float, default=1.5,
                   help="cut a run short once a step takes this factor of the best median so far (0: never)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take (default 600)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each profile and scenario, wait up to S seconds for other processes to leave the "
                   "cores (a shared machine)")
    p.add_argument("--no-alone", action="store_true",
                   help="skip the check that the first scenario's choice measures the same launched alone")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the tables")
    p.add_argument("--keep", metavar="DIR", help="keep profiles, plans, logs and results in DIR")
    args = p.parse_args(argv)
    try:
        args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
        if not args.model_list or set(args.model_list) - set(MODELS):
            raise ValueError(f"--models: choose from {', '.join(sorted(MODELS))}")
        args.shape_list = []
        for s in args.shapes.split(","):
            h, _, g = s.strip().partition("x")
            if not (h.isdigit() and g.isdigit() and int(h) >= 2 and int(g) >= 1):
                raise ValueError(f"--shapes: {s!r} is not HOSTSxSLOTS with at least 2 hosts (e.g. 2x4)")
            args.shape_list.append((int(h), int(g)))
        args.rate_list = [r.strip() for r in args.rates.split(",") if r.strip()]
        for r in args.rate_list:
            parse_rate(r)
        parse_delay(args.delay)
        args.sizes = tuple(sorted({int(x) for x in args.microbatch_sizes.split(",") if x.strip()}))
        args.schedule_list = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
        if not args.sizes or min(args.sizes) < 1 or not args.schedule_list:
            raise ValueError("--microbatch-sizes and --schedules need at least one value each")
        if args.steps < 3 or args.warmup < 0 or args.repeats < 1 or args.batch_size < 1:
            raise ValueError("need --steps ≥ 3, --warmup ≥ 0, --repeats ≥ 1 and --batch-size ≥ 1")
    except ValueError as exc:
        p.error(str(exc))
    args.patterns = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    return args


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    """Every scenario asked for, in the order they run: shape, then rate, then model."""
    out = []
    for hosts, slots in args.shape_list:
        for rate in args.rate_list:
            for model in args.model_list:
                sc = Scenario(model, hosts, slots, rate, args.delay, args.batch_size, args.sizes, args.schedule_list)
                if any(fnmatch.fnmatch(sc.name, pat) for pat in args.patterns):
                    out.append(sc)
    return out


def repeat_rows(runs: list[dict]) -> dict:
    """One scenario measured ``--repeats`` times: each configuration's measured step is the median of its runs'
    medians (over the runs that were not cut short, if any); the summary is taken again from those rows."""
    from devtools.regret import summarize

    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    rows = []
    for k, row in enumerate(runs[0]["rows"]):
        same = [r["rows"][k] for r in runs]
        full = [r for r in same if r["measured_s"] is not None and not r["cut_short"]]
        ran = full or [r for r in same if r["measured_s"] is not None]
        new = dict(row)
        if ran:
            new.update(measured_s=statistics.median(r["measured_s"] for r in ran),
                       cut_short=None if full else ran[0]["cut_short"], error=None,
                       runs_s=[r["measured_s"] for r in same])
            new["sim_error"] = new["predicted_s"] / new["measured_s"] - 1
        rows.append(new)
    merged["rows"] = rows
    merged.update(summarize(rows))
    return merged


def failed_scenario(sc: Scenario, error: str) -> dict:
    """The entry of a scenario that could not be planned or run at all."""
    return {"scenario": sc.name, "model": sc.model, "hosts": sc.hosts, "slots": sc.slots, "rate": sc.rate,
            "error": error, "rows": [], "choice": None, "choice_predicted_s": None, "choice_measured_s": None,
            "best": None, "best_measured_s": None, "regret": None, "configs": 0, "ran": 0, "cut_short": 0,
            "skipped": 0, "failed": 1, "median_abs_sim_error": None, "median_abs_sim_error_full": None}


def check_alone(emu, scenario: Scenario, result: dict, work: Path, args) -> dict:
    """The planner's choice launched alone (a ``varuna launch`` of its own plan, nothing else in its workers)
    against its step measured in the kept launch: whether training configurations one after another in the same
    workers measures what separate launches would."""
    choice = next(r for r in result["rows"] if r["choice"])
    out = work / "alone.json"
    out.unlink(missing_ok=True)
    pool = LaunchPool(emu, work / "alone")
    run = {"plan": choice["plan"], "out": str(out), "model": scenario.model, "batch": scenario.batch, "keep": True}
    try:
        why = pool.submit(choice["devices"], Path(choice["plan"]), {"runs": [run], "warmup": args.warmup,
                                                                     "steps": args.steps}, 300)
    finally:
        pool.close()
    if why is not None or not out.exists():
        return {"config": choice["config"], "error": (why or "no result").splitlines()[0]}
    alone = json.loads(out.read_text())["median_s"]
    return {"config": choice["config"], "in_sequence_s": choice["measured_s"], "alone_s": alone,
            "difference": alone / choice["measured_s"] - 1 if choice["measured_s"] else None}


def run(args: argparse.Namespace, work: Path) -> dict:
    todo = scenarios_of(args)
    if not todo:
        raise ValueError(f"no scenario matches --scenarios {args.scenarios!r}")
    log(f"{len(todo)} scenario(s): {', '.join(s.name for s in todo)}")
    for m in sorted({s.model for s in todo}):
        log(f"  {summary(m)}")
    results: list[dict] = []
    profiles: dict[str, dict] = {}
    links: dict[str, dict] = {}
    alone: dict | None = None
    launches: list[dict] = []
    started = time.monotonic()
    shapes = list(dict.fromkeys((s.hosts, s.slots) for s in todo))
    for hosts, slots in shapes:
        shape = f"{hosts}x{slots}"
        here = [s for s in todo if (s.hosts, s.slots) == (hosts, slots)]
        log(f"[{shape}] starting {hosts} hosts x {slots} slots ...")
        emu = start_emucluster(hosts, slots, work / shape / "hosts")
        pool = LaunchPool(emu, work / shape / "launches")
        try:
            for model in dict.fromkeys(s.model for s in here):
                if args.wait_idle:  # a profile taken while other processes hold the cores misleads every plan
                    cpu.wait_idle(args.wait_idle)
                load, t0 = cpu.Load(tree=True), time.monotonic()
                try:
                    path = profile_on(emu, model, work / shape / f"profile-{model}.json", sizes=args.sizes,
                                      repeats=args.profile_repeats, warmup=2)
                except (RuntimeError, OSError) as exc:  # the scenarios of this model fail; the others go on
                    profiles[f"{model}/{shape}"] = {"error": str(exc)}
                    log(f"[{shape}] profiling {model} FAILED: {exc}")
                    continue
                busy = load.other_cores()
                profiles[f"{model}/{shape}"] = {"path": str(path), "seconds": time.monotonic() - t0,
                                                "other_cores": busy}
                log(f"[{shape}] profiled {model} on {emu.cluster.hosts[0].name} in {time.monotonic() - t0:.0f}s "
                    f"(other processes kept {busy or 0:.2f} cores busy)")
            for rate in dict.fromkeys(s.rate for s in here):
                emu.set_link(parse_rate(rate), parse_delay(args.delay))
                t0 = time.monotonic()
                link = emu.probe_link(work / shape / f"probe-{rate}")
                links[f"{shape}/{rate}"] = {"nominal": rate, "latency_s": link.latency, "bandwidth_Bps": link.bandwidth,
                                            "fit_error": link.rel_error, "sizes": link.sizes, "times_s": link.times}
                log(f"[{shape}] link at {rate}: measured {link.describe()} ({time.monotonic() - t0:.0f}s)")
                for sc in (s for s in here if s.rate == rate):
                    if args.wait_idle:
                        cpu.wait_idle(args.wait_idle)
                    log(f"[{sc.name}] ({time.monotonic() - started:.0f}s so far)")
                    sdir = work / sc.name.replace("/", "-")
                    load, t0 = cpu.Load(tree=True), time.monotonic()
                    runs = []
                    prof = profiles[f"{sc.model}/{shape}"]
                    try:
                        if "error" in prof:
                            raise RuntimeError(f"no profile: {prof['error']}")
                        for rep in range(args.repeats):
                            rdir = sdir if args.repeats == 1 else sdir / f"repeat{rep}"
                            runs.append(measure(pool, sc, Path(prof["path"]), link, rdir, warmup=args.warmup,
                                                steps=args.steps, stop_factor=args.stop_factor or None,
                                                timeout=args.timeout, progress=log))
                    except RuntimeError as exc:  # reported; the other scenarios go on
                        log(f"[{sc.name}] FAILED: {exc}")
                        results.append(failed_scenario(sc, str(exc)))
                        continue
                    result = repeat_rows(runs)
                    result.update(seconds=time.monotonic() - t0, other_cores=load.other_cores(),
                                  repeats=args.repeats)
                    if alone is None and not args.no_alone:
                        pool.close()  # its workers would otherwise sit beside the alone launch's
                        alone = check_alone(emu, sc, result, sdir if args.repeats == 1 else sdir / "repeat0", args)
                        log(f"[{sc.name}] the choice launched alone: {alone}")
                    results.append(result)
                    regret = result["regret"]
                    log(f"[{sc.name}] choice {result['choice']}, best {result['best']}, regret "
                        f"{'-' if regret is None else f'{regret:+.1%}'} ({result['seconds']:.0f}s)")
        finally:
            pool.close()
            launches.extend(pool.launches)
            emu.close()
    import torch

    from varuna_core.planning.simulate import native_module

    meta = {"cpus": os.cpu_count(), "torch": torch.__version__, "native_simulator": native_module() is not None,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "stop_factor": args.stop_factor,
            "batch": args.batch_size, "microbatch_sizes": list(args.sizes), "schedules": list(args.schedule_list),
            "delay": args.delay, "total_s": time.monotonic() - started, "argv": sys.argv[1:],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "models": {m: summary(m) for m in sorted({s.model for s in todo})}}
    return {"meta": meta, "profiles": profiles, "links": links, "alone": alone, "launches": launches,
            "scenarios": results, "summary": overall(results)}


def overall(results: list[dict]) -> dict:
    regrets = [r["regret"] for r in results if r["regret"] is not None]
    errors = [abs(row["sim_error"]) for r in results for row in r["rows"] if row.get("sim_error") is not None]
    full = [abs(row["sim_error"]) for r in results for row in r["rows"]
            if row.get("sim_error") is not None and not row.get("cut_short")]
    choices = [abs(row["sim_error"]) for r in results for row in r["rows"]
               if row["choice"] and row.get("sim_error") is not None]
    return {"scenarios": len(results), "with_regret": len(regrets),
            "share_within_5pct": sum(1 for x in regrets if x <= TARGET_REGRET) / len(regrets) if regrets else None,
            "largest_regret": max(regrets) if regrets else None,
            "median_abs_sim_error": statistics.median(errors) if errors else None,
            "median_abs_sim_error_full_runs": statistics.median(full) if full else None,
            "median_abs_sim_error_choices": statistics.median(choices) if choices else None,
            "configurations": sum(len(r["rows"]) for r in results),
            "predicted_below_link_bound": sum(1 for r in results for row in r["rows"]
                                              if row["predicted_s"] < row["link_bound_s"]),
            "failed": sum(r["failed"] for r in results)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def print_report(report: dict) -> None:
    meta = report["meta"]
    print(f"machine: {meta['cpus']} CPUs, torch {meta['torch']}, simulator "
          f"{'native' if meta['native_simulator'] else 'python'}; global batch {meta['batch']}, micro-batch sizes "
          f"{meta['microbatch_sizes']}, schedules {meta['schedules']}; {meta['warmup']} warm-up + {meta['steps']} "
          f"timed steps per run, {meta['repeats']} run(s) per configuration; total {meta['total_s'] / 60:.1f} min")
    for line in meta["models"].values():
        print(f"  {line}")
    print("\nprofiles (varuna profile --nproc 2 on the first host):")
    for name, prof in report["profiles"].items():
        if "error" in prof:
            print(f"  {name}: FAILED: {prof['error'][:200]}")
        else:
            print(f"  {name}: {prof['seconds']:.0f}s, other processes kept {prof['other_cores'] or 0:.2f} cores busy")
    print("\nlinks between hosts as measured (gloo ping-pong, the profiler's fit), given to the planner:")
    for name, link in report["links"].items():
        biggest = link["sizes"][-1] / link["times_s"][-1] * 8 / 1e6
        print(f"  {name}: {link['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s + {link['latency_s'] * 1e6:.0f} µs per message "
              f"(fit error {link['fit_error']:.0%}; the largest message, {link['sizes'][-1] >> 10} KiB, at "
              f"{biggest:.0f} Mbit/s)")
    for sc in report["scenarios"]:
        if sc.get("error"):
            print(f"\n### {sc['scenario']}: FAILED: {sc['error'][:300]}")
            continue
        load = sc.get("other_cores")
        print(f"\n### {sc['scenario']}: choice {sc['choice']}, best measured {sc['best']}, regret {_pct(sc['regret'])}"
              f" ({sc['configs']} configurations, {sc['cut_short']} cut short, {sc['skipped']} not run, {sc['failed']} "
              f"failed; other processes "
              f"kept {0 if load is None else load:.2f} cores busy)\n")
        print("| configuration | predicted (ms) | measured (ms) | simulator error | link bound (ms) | |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for row in sorted(sc["rows"], key=lambda r: (r["measured_s"] is None, r["measured_s"] or r["link_bound_s"])):
            note = []
            if row["choice"]:
                note.append("**choice**")
            if row["config"] == sc["best"]:
                note.append("**best**")
            if row.get("cut_short"):
                note.append(f"cut short ({row['cut_short']})")
            if row.get("skipped"):
                note.append(f"not run: its link alone needs ≥ {_ms(row['link_bound_s'])} ms")
            elif row["measured_s"] is None:
                note.append(f"FAILED: {(row['error'] or '').splitlines()[0][:100]}")
            if row["predicted_s"] < row["link_bound_s"]:
                note.append("predicted below the link bound")
            print(f"| {row['config']} | {_ms(row['predicted_s'])} | {_ms(row['measured_s'])} | "
                  f"{_pct(row.get('sim_error'))} | {_ms(row['link_bound_s'])} | {'; '.join(note)} |")
    if report.get("alone"):
        a = report["alone"]
        if "error" in a:
            print(f"\nthe choice launched alone: failed ({a['error']})")
        else:
            print(f"\nthe first scenario's choice ({a['config']}) launched alone: {_ms(a['alone_s'])} ms, in its "
                  f"launch's sequence {_ms(a['in_sequence_s'])} ms ({_pct(a['difference'])})")
    print("\n| scenario | choice | predicted (ms) | measured (ms) | best measured | best (ms) | regret | median abs "
          "error |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for sc in report["scenarios"]:
        err = sc["median_abs_sim_error"]
        print(f"| {sc['scenario']} | {sc['choice']} | {_ms(sc['choice_predicted_s'])} | {_ms(sc['choice_measured_s'])}"
              f" | {sc['best']} | {_ms(sc['best_measured_s'])} | {_pct(sc['regret'])} | "
              f"{'-' if err is None else f'{err:.1%}'} |")
    s = report["summary"]
    share, worst, med = s["share_within_5pct"], s["largest_regret"], s["median_abs_sim_error"]
    print(f"\nregret ≤ 5% in {'-' if share is None else f'{share:.0%}'} of {s['with_regret']} scenarios (target "
          f"≥ {TARGET_SHARE:.0%}: {_verdict(share is not None and share >= TARGET_SHARE)}); largest regret "
          f"{_pct(worst)} (target ≤ {TARGET_WORST:.0%}: {_verdict(worst is not None and worst <= TARGET_WORST)})")
    print(f"median |simulator error| {'-' if med is None else f'{med:.1%}'} over {s['configurations']} configurations "
          f"(target ≤ {TARGET_SIM:.0%}: {_verdict(med is not None and med <= TARGET_SIM)}); over the runs not cut "
          f"short {_frac(s['median_abs_sim_error_full_runs'])}, over the planner's choices "
          f"{_frac(s['median_abs_sim_error_choices'])}; {s['failed']} run(s) failed")
    print(f"predicted steps shorter than the time the busiest host's link needs for the step's bytes (link bound): "
          f"{s['predicted_below_link_bound']} of {s['configurations']} configurations")


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    close_on_signals()
    with tempfile.TemporaryDirectory(prefix="varuna-regret-") as scratch:
        work = Path(args.keep).resolve() if args.keep else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        try:
            report = run(args, work)
        except ClusterUnavailable as exc:
            log(f"error: the emulated cluster cannot be built here: {exc}")
            return 2
        except ValueError as exc:
            log(f"error: {exc}")
            return 2
        (work / "report.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
