"""The planner's regret on an emulated cluster: profile, plan, run every configuration the planner considered,
compare its choice with the best measured. Shared by ``benchmarks/plan_regret.py`` and the suite's shortened test.

A :class:`Scenario` is a model of :mod:`devtools.emumodels`, a cluster shape (hosts × slots) and the rate of the
link between hosts. For one scenario:

1. **Profile** the model on the cluster's first host, as a user would on one of their machines: ``varuna profile
   devtools/emumodels.py:MODEL --nproc 2`` over SSH on ``h0`` (segments, and the links inside a host: its
   loopback). ``varuna profile`` measures no link between hosts (a profile is taken on one host; the README's
   ``--hosts`` form does not exist yet), so
2. **the link** between hosts is measured as the profiler measures a link (:meth:`EmuCluster.probe_link`: gloo
   ping-pong between ``h0`` and ``h1``, fitted to latency + bytes / bandwidth with the profiler's fit) and given to
   the planner as ``--link-rate``/``--link-latency``, the documented way to tell it the link a profile lacks.
3. **Plan**: :func:`~varuna_core.planning.planner.make_plan` (what ``varuna plan`` runs) for the cluster's devices
   and ``--gpus-per-node`` its slots, the scenario's batch, micro-batch sizes and schedules, the optimizer state
   whole, and ``top`` large enough that the plan lists every configuration it scored: with no memory limit the
   search scores every one it considers (each ``pp`` from 1 to the segments, ``dp = ⌊devices / pp⌋``, each
   micro-batch size that fits a replica's batch, each schedule), which :func:`considered` enumerates independently
   and the plan's list is checked against. Each configuration's plan is made by
   :func:`~varuna_core.planning.planner.plan_for` (its predicted step must equal the search's).
4. **Run** every configuration with ``varuna launch PLAN --hosts HOSTS -- devtools/emutrain.py``: one launch per
   number of devices and cluster (:class:`LaunchPool`), whose workers train the configurations of that size one after
   another (each a fresh ``Varuna(..., plan=...)`` with process groups of its own; see :mod:`devtools.emutrain`),
   ``warmup`` + ``steps`` steps each, the median of the slowest rank's step. Configurations hopelessly slower than
   the best so far (``stop_factor``), never the planner's choice, are cut short after a step that says so, or not run
   at all where the bytes their links must carry already take that long (:func:`link_bound`: no simulator involved).
5. **Report**: the choice, the best measured, the regret (choice ÷ best − 1) and each configuration's simulator
   error (predicted ÷ measured − 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from devtools.emucluster import EmuCluster, LinkProbe, parse_delay
from devtools.launching import ROOT, Launch

__all__ = ["Scenario", "Config", "LaunchPool", "profile_on", "considered", "plan_scenario", "link_bound",
           "run_configs", "summarize", "measure"]

VARUNA = Path(sys.executable).parent / "varuna"


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str
    hosts: int
    slots: int
    rate: str  # a tc rate: 1gbit, 200mbit, 50mbit
    delay: str = "0ms"
    batch: int = 16
    microbatch_sizes: tuple[int, ...] = (2, 4)
    schedules: tuple[str, ...] = ("1f1b", "zb")

    @property
    def name(self) -> str:
        delay = "" if parse_delay(self.delay) == 0 else f"+{self.delay}"
        return f"{self.model}/{self.hosts}x{self.slots}/{self.rate}{delay}"

    @property
    def devices(self) -> int:
        return self.hosts * self.slots


@dataclasses.dataclass(frozen=True)
class Config:
    pp: int
    dp: int
    mbs: int
    schedule: str
    placement: str = "pipeline"  # or "stage": a stage's replicas on consecutive ranks (Topology.by_stage)

    @property
    def devices(self) -> int:
        return self.pp * self.dp

    def label(self) -> str:
        return f"{self.pp}x{self.dp}{'s' if self.placement == 'stage' else ''} mb{self.mbs} {self.schedule}"


def _log(progress: Callable[[str], None] | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


def profile_on(emu: EmuCluster, model: str, out: Path, *, sizes: tuple[int, ...], repeats: int = 5, warmup: int = 2,
               timeout: float = 300.0) -> Path:
    """``varuna profile devtools/emumodels.py:MODEL --nproc 2`` on the cluster's first host, over SSH; returns
    ``out`` (the hosts share this machine's files)."""
    out.unlink(missing_ok=True)
    env = (f"OMP_NUM_THREADS=1 PYTHONPATH={shlex.quote(str(ROOT))} "
           f"VARUNA_CACHE_DIR={shlex.quote(str(out.parent / 'cache'))}")
    command = (f"cd {shlex.quote(str(ROOT))} && {env} {shlex.quote(str(VARUNA))} profile "
               f"devtools/emumodels.py:{model} --nproc 2 --microbatch-sizes {','.join(map(str, sizes))} "
               f"--repeats {repeats} --warmup {warmup} -o {shlex.quote(str(out))}")
    done = emu.cluster.run(emu.cluster.hosts[0], command, timeout=timeout)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"profiling {model} on {emu.cluster.hosts[0].name} failed (exit {done.returncode}):\n"
                           f"{(done.stderr or done.stdout)[-2000:]}")
    return out


def considered(scenario: Scenario, segments: int) -> list[Config]:
    """Every configuration the planner's search considers for the scenario (no memory limit, the optimizer state
    whole): what :func:`varuna_core.planning.planner.make_plan` loops over, written out independently."""
    out = []
    for pp in range(1, min(segments, scenario.devices) + 1):
        dp = min(scenario.devices // pp, scenario.batch)
        replica = math.ceil(scenario.batch / dp)
        for mbs in scenario.microbatch_sizes:
            if mbs > replica:
                continue
            placements = ("pipeline", "stage") if pp > 1 and dp > 1 and pp * dp > scenario.slots else ("pipeline",)
            out.extend(Config(pp, dp, mbs, schedule, placement) for schedule in scenario.schedules
                       for placement in placements)
    return out


def _request(scenario: Scenario, link: LinkProbe | None, top: int):
    from varuna_core.planning.planner import PlanRequest

    return PlanRequest(gpus=scenario.devices, batch_size=scenario.batch, gpus_per_node=scenario.slots, top=top,
                       microbatch_sizes=scenario.microbatch_sizes, schedules=scenario.schedules,
                       shard_optimizer=False, link_rate=None if link is None else link.bandwidth,
                       link_latency=None if link is None else link.latency)


def plan_scenario(profile_path: Path, scenario: Scenario, link: LinkProbe | None, workdir: Path):
    """The planner's choice and every configuration it considered, each with its own plan file: returns ``(plan,
    [(config, predicted step, plan path)])``, the choice first."""
    from varuna_core.planning.artifacts import load_profile, save_plan
    from varuna_core.planning.planner import MAX_TOP, make_plan, plan_for

    profile = load_profile(profile_path)
    expected = considered(scenario, profile.num_segments)
    if len(expected) > MAX_TOP + 1:
        raise ValueError(f"{scenario.name}: {len(expected)} configurations, more than a plan lists ({MAX_TOP + 1})")
    req = _request(scenario, link, top=MAX_TOP)
    plan = make_plan(profile, req)
    scored = [(Config(plan.pp, plan.dp, plan.microbatch_size, plan.schedule, placement_of(plan)),
               plan.prediction.step_time)]
    scored += [(Config(c.pp, c.dp, c.microbatch_size, c.schedule, c.placement), c.step_time)
               for c in plan.alternatives]
    if sorted(c.label() for c, _ in scored) != sorted(c.label() for c in expected):
        missing = {c.label() for c in expected} ^ {c.label() for c, _ in scored}
        raise RuntimeError(f"{scenario.name}: the plan lists other configurations than the search considers: "
                           f"{sorted(missing)}")
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    for k, (cfg, predicted) in enumerate(scored):
        one = plan_for(profile, req, pp=cfg.pp, dp=cfg.dp, microbatch_size=cfg.mbs, schedule=cfg.schedule,
                       placement=cfg.placement)
        if not math.isclose(one.prediction.step_time, predicted, rel_tol=1e-9):
            raise RuntimeError(f"{scenario.name} {cfg.label()}: plan_for predicts {one.prediction.step_time} s, the "
                               f"search {predicted} s")
        one.profile_path = str(profile_path)
        path = workdir / f"plan-{k:02d}.yaml"
        save_plan(one, path)
        out.append((cfg, predicted, path))
    return plan, out


def placement_of(plan) -> str:
    """``"stage"`` where the plan's map puts each stage's replicas on consecutive ranks, else ``"pipeline"``."""
    from varuna_core.ir.topology import Topology

    if plan.pp > 1 and plan.dp > 1 and \
            Topology.parse(plan.stage_to_rank_map) == Topology.by_stage(plan.pp, plan.dp):
        return "stage"
    return "pipeline"


def link_bound(plan, rate_bps: int) -> float:
    """A lower bound on the step of ``plan`` that owes nothing to the simulator: the bytes the busiest host must
    *receive* in one step over its link, at the link's nominal rate (tc's token bucket passes no more, headers
    included). What a host must receive: every activation and gradient from a neighbouring stage on another host
    (``activation_bytes`` per micro-batch each way), and, for every data-parallel group with ranks on several
    hosts, the whole of the stage's gradient bytes (whatever the algorithm, a host's ranks cannot end with the
    sum without receiving the other hosts' share of it; a ring moves ``2 (dp - 1) / dp`` of it)."""
    from varuna_core.ir.topology import Topology

    topology = Topology.parse(plan.stage_to_rank_map, plan.pp * plan.dp)
    node_of = {rank: i for i, ranks in enumerate(plan.nodes) for rank in ranks}
    received = [0.0] * len(plan.nodes)
    for r in range(plan.dp):
        ranks = topology.replica_ranks(r)
        for st in plan.stages[:-1]:
            a, b = node_of[ranks[st.stage]], node_of[ranks[st.stage + 1]]
            if a != b:
                received[b] += plan.num_microbatches * st.activation_bytes  # activations forward
                received[a] += plan.num_microbatches * st.activation_bytes  # their gradients back
    for st in plan.stages:
        hosts = {node_of[topology.replica_ranks(r)[st.stage]] for r in range(plan.dp)}
        if len(hosts) > 1:
            for h in hosts:
                received[h] += st.grad_bytes
    return max(received) / (rate_bps / 8)


class LaunchPool:
    """One ``varuna launch`` per number of devices on a cluster, started when first needed and kept: its workers
    (``devtools/emutrain.py --queue DIR``) train the batches of configurations written to ``DIR`` one after another,
    whatever their model, scenario or link rate. Starting 5-8 workers costs ~15 s of a 2-core machine (the
    launcher checks every host, then each worker imports torch), more than training a configuration; the
    launcher would place the ranks of any plan of that many devices on the same hosts (consecutive ranks per
    node), so a configuration trained in a kept launch measures what its own launch would (the benchmark checks
    it once). A launch that fails or runs out of time is ended and started again for the next batch."""

    def __init__(self, emu: EmuCluster, workdir: Path) -> None:
        self.emu, self.workdir = emu, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = emu.hosts_file(workdir / "hosts")
        self._live: dict[int, tuple[Launch, Path]] = {}
        self._next: dict[int, int] = {}
        self._started = 0
        self.launches: list[dict] = []  # every launch: devices, run dir, start-up seconds, how it ended

    def _launch(self, devices: int, plan: Path, progress: Callable[[str], None] | None) -> tuple[Launch, Path]:
        if devices in self._live and self._live[devices][0].proc.poll() is not None:  # it ended while idle
            self._drop(devices, f"ended while idle (exit {self._live[devices][0].proc.returncode})")
        if devices in self._live:
            return self._live[devices]
        self._started += 1
        name = f"launch{self._started:02d}-{devices}"
        queue, run_dir = self.workdir / f"{name}-queue", self.workdir / name
        queue.mkdir(parents=True, exist_ok=True)
        args = [str(plan), "--hosts", str(self.hosts), *self.emu.launcher_args(), "--run-dir", str(run_dir), "--",
                "devtools/emutrain.py", "--queue", str(queue)]
        _log(progress, f"  starting varuna launch of {devices} workers ({name})")
        launch = Launch(args, run_dir, timeout=24 * 3600)  # each batch is bounded on its own
        self._live[devices] = (launch, queue)
        self._next[devices] = 0
        self.launches.append({"devices": devices, "run_dir": str(run_dir), "started": time.time(), "ended": None})
        return launch, queue

    def _drop(self, devices: int, why: str) -> None:
        launch, _ = self._live.pop(devices)
        launch.close()
        for entry in self.launches:
            if entry["run_dir"] == str(launch.run_dir):
                entry["ended"] = why

    def submit(self, devices: int, plan: Path, batch: dict, deadline_s: float,
               progress: Callable[[str], None] | None = None) -> str | None:
        """Have the launch of ``devices`` workers train ``batch`` (its ``runs`` and options); returns None once its
        workers say it is done, else why not (the launch is then ended: the next batch starts a new one)."""
        launch, queue = self._launch(devices, plan, progress)
        k = self._next[devices]
        self._next[devices] += 1
        path = queue / f"batch-{k:03d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(batch))
        tmp.replace(path)
        done = path.with_suffix(".done")
        end = time.monotonic() + deadline_s
        try:
            while not done.exists():
                if launch.proc.poll() is not None:
                    why = (f"varuna launch exited with {launch.proc.returncode}:\n"
                           f"{_tail(launch.output(), launch.run_dir)}")
                    self._drop(devices, why.splitlines()[0])
                    return why
                if time.monotonic() > end:
                    why = f"not done within {deadline_s:.0f}s:\n{_tail(launch.output(), launch.run_dir)}"
                    self._drop(devices, why.splitlines()[0])
                    return why
                time.sleep(0.1)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): its workers are busy, they would not read a stop
            self._drop(devices, "interrupted")
            raise
        return None

    def close(self) -> None:
        """Tell every launch's workers to stop, wait (bounded) for the launchers to end, kill what is left."""
        for devices, (_, queue) in list(self._live.items()):
            path = queue / f"batch-{self._next[devices]:03d}.json"
            path.write_text(json.dumps({"stop": True}))
        end = time.monotonic() + 30  # idle workers read the stop within 0.1 s; the launchers then end
        for devices, (launch, _) in list(self._live.items()):
            try:
                launch.proc.wait(timeout=max(1.0, end - time.monotonic()))
                why = "done" if launch.proc.returncode == 0 else f"exit {launch.proc.returncode}"
            except subprocess.TimeoutExpired:
                why = "killed at the end"
            self._drop(devices, why)


def run_configs(pool: LaunchPool, scenario: Scenario, planned: list, workdir: Path, *, warmup: int = 1,
                steps: int = 3, stop_factor: float | None = 2.0, timeout: float = 600.0,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run every planned configuration (``plan_scenario``'s list, the choice first) in ``pool``'s launches, one
    batch per number of devices; returns one row per configuration (``measured_s`` None and ``error`` set where it
    failed)."""
    from varuna_core.planning.artifacts import load_plan

    rate = pool.emu.rate_bps
    results: dict[int, dict] = {}
    failures: dict[int, str] = {}
    bounds = [link_bound(load_plan(path), rate) if rate else 0.0 for _, _, path in planned]
    skipped: set[int] = set()
    groups: dict[int, list[int]] = {}
    for k, (cfg, _, _) in enumerate(planned):
        groups.setdefault(cfg.devices, []).append(k)
    # the choice's size first; in each batch the configurations in predicted order (the best found early, so
    # that hopeless ones can be cut short), the choice first of all
    order = sorted(groups, key=lambda d: (0 not in groups[d], min(planned[k][1] for k in groups[d])))
    best: float | None = None
    for devices in order:
        todo = sorted(groups[devices], key=lambda k: (k != 0, planned[k][1]))
        if stop_factor is not None and best is not None:  # the link alone makes them hopeless: not run
            hopeless = {k for k in todo if k != 0 and bounds[k] > stop_factor * best}
            skipped |= hopeless
            todo = [k for k in todo if k not in hopeless]
        tries = 0
        while todo and tries <= len(groups[devices]):
            tries += 1
            runs = [{"plan": str(planned[k][2]), "out": str(workdir / f"result-{k:02d}.json"), "keep": k == 0,
                     "bound_s": bounds[k], "model": scenario.model, "batch": scenario.batch} for k in todo]
            batch = {"runs": runs, "warmup": warmup, "steps": steps, "stop_factor": stop_factor, "bound": best}
            deadline = min(timeout, sum(planned[k][1] for k in todo) * (warmup + steps) * 3 + 20 * len(todo) + 60)
            t0 = time.monotonic()
            why = pool.submit(devices, planned[todo[0]][2], batch, deadline, progress)
            left = []
            for k in todo:
                out = workdir / f"result-{k:02d}.json"
                if out.exists():
                    results[k] = json.loads(out.read_text())
                    if results[k].get("skipped"):
                        skipped.add(k)
                    elif results[k]["cut_short"] is None:
                        m = results[k]["median_s"]
                        best = m if best is None else min(best, m)
                else:
                    left.append(k)
            _log(progress, f"  {devices} devices: {len(todo) - len(left)} of {len(todo)} configuration(s) in "
                 f"{time.monotonic() - t0:.0f}s" + (f"; {why.splitlines()[0]}" if why else ""))
            if left:  # the first one without a result is the one that failed; the rest are tried again
                failures[left[0]] = why or "the batch ended without a result for it"
                todo = left[1:]
            else:
                todo = []
    rows = []
    for k, (cfg, predicted, path) in enumerate(planned):
        row = {"config": cfg.label(), "pp": cfg.pp, "dp": cfg.dp, "mbs": cfg.mbs, "schedule": cfg.schedule,
               "placement": cfg.placement, "devices": cfg.devices, "choice": k == 0, "predicted_s": predicted,
               "plan": str(path), "link_bound_s": bounds[k], "skipped": k in skipped}
        res = results.get(k)
        if k in skipped:
            row.update(measured_s=None, error=None)
        elif res is None:
            row.update(measured_s=None, error=failures.get(k, "not run"))
        else:
            row.update(measured_s=res["median_s"], step_s=res["step_s"], warmup_s=res["warmup_s"],
                       cut_short=res["cut_short"], setup_s=res["setup_s"], error=None,
                       sim_error=predicted / res["median_s"] - 1, ranks=res["ranks"])
        rows.append(row)
    return rows


def _tail(output: str, run_dir: Path) -> str:
    """The launcher's last lines and the end of rank 0's log."""
    log = run_dir / "logs" / "rank0.log"
    rank0 = log.read_text()[-1500:] if log.exists() else ""
    return output[-1500:] + ("\n--- rank 0 ---\n" + rank0 if rank0 else "")


def summarize(rows: list[dict]) -> dict:
    """The choice, the best measured configuration and the regret of a scenario's rows."""
    ran = [r for r in rows if r["measured_s"] is not None]
    choice = next(r for r in rows if r["choice"])
    full = [r for r in ran if not r["cut_short"]]
    best = min(full, key=lambda r: r["measured_s"]) if full else None
    regret = None
    if best is not None and choice["measured_s"] is not None:
        regret = choice["measured_s"] / best["measured_s"] - 1
    errors = [abs(r["sim_error"]) for r in ran]
    return {"choice": choice["config"], "choice_predicted_s": choice["predicted_s"],
            "choice_measured_s": choice["measured_s"], "best": None if best is None else best["config"],
            "best_measured_s": None if best is None else best["measured_s"], "regret": regret,
            "configs": len(rows), "ran": len(ran), "cut_short": sum(1 for r in ran if r["cut_short"]),
            "skipped": sum(1 for r in rows if r["skipped"]),
            "failed": sum(1 for r in rows if r["measured_s"] is None and not r["skipped"]),
            "median_abs_sim_error": statistics.median(errors) if errors else None,
            "median_abs_sim_error_full": statistics.median([abs(r["sim_error"]) for r in full]) if full else None}


def measure(pool: LaunchPool, scenario: Scenario, profile_path: Path, link: LinkProbe | None, workdir: Path,
            **run_options) -> dict:
    """Plan the scenario from ``profile_path`` and ``link``, run every configuration, summarise."""
    plan, planned = plan_scenario(profile_path, scenario, link, workdir)
    progress = run_options.get("progress")
    _log(progress, f"  planner's choice: {planned[0][0].label()} (predicted {planned[0][1] * 1e3:.0f} ms); "
         f"{len(planned)} configurations considered")
    rows = run_configs(pool, scenario, planned, workdir, **run_options)
    return {"scenario": scenario.name, "model": scenario.model, "hosts": scenario.hosts, "slots": scenario.slots,
            "rate": scenario.rate, "delay": scenario.delay, "batch": scenario.batch,
            "microbatch_sizes": list(scenario.microbatch_sizes), "schedules": list(scenario.schedules),
            "link": None if link is None else dataclasses.asdict(link), "assumptions": plan.assumptions,
            "rows": rows, **summarize(rows)}

