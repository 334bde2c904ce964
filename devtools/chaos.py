"""Faults injected into a running ``varuna launch --morph`` job at steps drawn from a seeded schedule, and the
check that the job survived them without changing its numbers.

The job is the example GPT on test hosts reached over real SSH (:mod:`devtools.testhosts`), writing a
checkpoint every few steps. While it trains, each fault of the schedule is injected once the job's progress
(the highest step reported) reaches the fault's step:

* ``kill_worker``: SIGKILL of one worker (a crashed process);
* ``kill_agent``: SIGKILL of the node agent of one host (the host's workers die with it: a machine lost);
* ``stop_worker``: SIGSTOP of one worker (a hung machine: only its missing heartbeats tell);
* ``remove_host``: one host leaves the hosts file, and comes back once the job trains without it;
* ``preempt``: ``varuna notify-preempt`` for one host; it is offered again (a new hosts file) once the job
  trains without it;
* ``corrupt_checkpoint``: a byte of the newest complete checkpoint is flipped, then a worker is killed, so the
  restart meets the corrupt checkpoint and must fall back to the one before it;
* ``lose_host``: the whole host dies at once, without notice (every process of it SIGKILLed, its sshd too, and
  with it what its private disks held, such as its ``/dev/shm`` with its snapshots, when the cluster has private
  mounts); it boots again, empty, once the job trains without it, and the job grows back onto it.

For each fault that ends an attempt unasked (all but ``remove_host`` and ``preempt``) the result also says how
long the launcher took to notice (injection → the attempt's end), to recover (→ the first step of the next
attempt that trains), how many steps were lost (the progress when injected, less the step the job went on from)
and where the state came from (an in-memory snapshot, the store's checkpoint, or nothing: step 0).

A fault is *survived* when an attempt started after it trains past the step it was injected at (for
``remove_host`` and ``preempt``: also after the host came back). At the end the job must exit 0, and every
step's loss, each time the step was computed (a restart recomputes steps since its checkpoint), and every final
parameter must equal those of the same job run without interruption: the relative difference ≤ ``tolerance``,
for the losses ``|a - b| / |b|`` and for each parameter tensor ``||a - b|| / ||b||``. (Each tensor's largest
single-element difference, relative to its largest value, is reported too: a morph changes the order of the
gradient sums, Adam divides each gradient by its own running magnitude, and so an element whose gradient is
tiny carries rounding of the order of 1e-7 to 1e-5 after a hundred steps.)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from devtools.launching import ROOT, VARUNA, Launch, agent_pids, job_processes, process_environ, read_steps
from devtools.procs import Proc

__all__ = ["KINDS", "Fault", "ChaosResult", "schedule", "run_chaos"]

KINDS = ("kill_worker", "kill_agent", "stop_worker", "remove_host", "preempt", "corrupt_checkpoint", "lose_host")
SUDDEN = ("kill_worker", "kill_agent", "stop_worker", "corrupt_checkpoint", "lose_host")  # nobody asked to stop
TRAIN = ["examples/gpt/train.py", "--batch-size", "32", "--log-every", "10"]
TAIL_STEPS = 300  # a morph by handover warms the new configuration up while the old one trains on


@dataclass
class Fault:
    kind: str
    step: int  # injected once the job has reported this step
    target: int  # which worker (rank) or host (index) it hits
    detail: str = ""
    injected: float | None = None  # seconds since the job started
    survived: bool = False
    at: float | None = None  # when it was injected (wall clock)
    progress: int | None = None  # the highest step reported when it was injected
    detected_s: float | None = None  # injection -> the end of the attempt it hit
    recovered_s: float | None = None  # that end -> the first step of the next attempt that trained
    steps_lost: int | None = None  # progress when injected, less the step the job went on from
    source: str | None = None  # where the state came from: "snapshot step K", "store step K", "step 0"


@dataclass
class ChaosResult:
    seed: int
    steps: int
    faults: list[Fault]
    exit_code: int | None
    attempts: int
    restarts: int
    morphs: int
    refused_checkpoints: int
    loss_max_rel_diff: float | None
    params_max_rel_diff: float | None  # worst tensor's ||a - b|| / ||b||
    params_max_abs_rel_diff: float | None  # worst tensor's max|a - b| / max|b| (one element's rounding)
    params_worst: str | None  # the tensor of params_max_rel_diff
    step_reports: int
    seconds: float
    problems: list[str] = field(default_factory=list)
    # against the same layouts over the same steps (devtools/same_layouts.py), when replayed: the attempts of the
    # surviving history, the steps whose loss differs at all, and whether the final parameters are the same bits
    chain: list[int] | None = None
    layout_loss_mismatches: list | None = None
    layout_params_equal: bool | None = None

    @property
    def same_as_its_layouts(self) -> bool:
        """Every loss of the surviving history and every final parameter equal the replay's, to the bit."""
        return self.layout_loss_mismatches == [] and self.layout_params_equal is True

    @property
    def injected(self) -> int:
        return sum(f.injected is not None for f in self.faults)

    @property
    def survived(self) -> int:
        return sum(f.survived for f in self.faults)

    def equal(self, tolerance: float) -> bool:
        return (self.loss_max_rel_diff is not None and self.loss_max_rel_diff <= tolerance
                and self.params_max_rel_diff is not None and self.params_max_rel_diff <= tolerance)

    def as_dict(self, tolerance: float) -> dict:
        out = asdict(self)
        out.update(injected=self.injected, survived=self.survived, equal=self.equal(tolerance), tolerance=tolerance,
                   same_as_its_layouts=self.same_as_its_layouts)
        return out


HOST_FAULTS = ("kill_agent", "remove_host", "preempt", "lose_host")  # the faults that hit a host, not a rank


def schedule(seed: int, kinds: list[str], *, first: int, gap: int, ranks: int, hosts: int) -> list[Fault]:
    """One fault of each of ``kinds`` in a seeded random order, the first at step ``first``, then every ``gap``
    to ``gap * 1.5`` steps, each hitting a seeded random rank or host."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    out, step = [], first
    for kind in order:
        target = rng.randrange(hosts) if kind in HOST_FAULTS \
            else rng.randrange(ranks)
        out.append(Fault(kind, step, target))
        step += rng.randint(gap, gap + gap // 2)
    return out


def run_chaos(cluster, plan: Path, workdir: Path, *, seed: int, kinds: list[str], steps: int | None = None,
              ckpt_every: int = 5, gap: int = 12, first: int = 10, slots: int = 2, heartbeat_timeout: float = 8,
              max_restarts: int = 4, timeout: float = 900, reference: Path | None = None,
              uninterrupted: bool = True, replay_layouts: bool = False, snapshot_every: str = "auto",
              steady: bool = True, stop_after: int | None = None, pace: float = 0.0,
              say=lambda text: None) -> ChaosResult:
    """Run the example GPT by ``plan`` over ``cluster``'s hosts with ``--morph``, inject the scheduled faults,
    and compare it with an uninterrupted run of the same plan on local processes (``reference``: a store of that
    run's final checkpoint and its launcher's run directory; when None it is made here, alongside the chaotic run,
    unless not ``uninterrupted``): a relative difference, the rounding of the other layouts the run went through.
    ``replay_layouts``: also replay the run's surviving history, its layouts over the same steps, and compare
    to the bit (:mod:`devtools.same_layouts`). ``snapshot_every``: the launcher's ``--snapshot-every`` (``0``: a
    crash always restarts from the store, e.g. to meet a corrupt checkpoint there). ``steady``: each fault waits
    until the hosts' fork servers serve (what a recovery's time is measured in); a host fault always waits until its
    host is in the job. ``stop_after``: once the last fault is survived and this many more steps trained, stop the
    launcher with SIGTERM (its checkpoint then ends the run, exit code 143) instead of training the tail that a
    morph begun by the last fault might need; the run is then compared only with its replayed layouts. ``pace``:
    seconds each rank of the chaotic run pauses after every step (``devtools/paced_train.py``: fewer steps trained
    while the run waits for what a fault brings, the same numbers); the reference and the replays are not paced."""
    if stop_after is not None and (uninterrupted or reference is not None):
        raise ValueError("stop_after ends the run early: only its replayed layouts can be compared with it")
    faults = schedule(seed, kinds, first=first, gap=gap, ranks=slots * len(cluster.hosts), hosts=len(cluster.hosts))
    # The tail after the last fault must outlast a whole morph (notice, pre-flight SSH check, checkpoint,
    # restart) when the last fault takes a host away and brings it back: steps take ~0.15 s, a morph seconds.
    steps = steps or faults[-1].step + gap + ckpt_every + TAIL_STEPS
    workdir.mkdir(parents=True, exist_ok=True)
    lines = cluster.hosts_file_lines(slots)
    hosts = workdir / "hosts"
    _write_hosts(hosts, lines)
    run_dir = workdir / "run"
    args = [str(plan), "--run-dir", str(run_dir), "--hosts", str(hosts), "--morph", "--ckpt-every", str(ckpt_every),
            "--heartbeat-timeout", str(heartbeat_timeout), "--grace", "2", "--max-restarts", str(max_restarts),
            "--snapshot-every", snapshot_every, *cluster.launcher_args(), "--",
            *(["devtools/paced_train.py", "--pace", str(pace), *TRAIN[1:]] if pace else TRAIN), "--steps", str(steps)]
    started = time.monotonic()
    pending = None if reference is not None or not uninterrupted else \
        _start_reference(plan, steps, workdir / "reference", timeout)
    launch = Launch(args, run_dir, timeout)
    problems: list[str] = []
    try:
        late = 0  # steps trained while waiting for the fork servers: the later faults come as much later
        for fault in faults:
            fault.step += late
            launch.wait_for(lambda: _progress(launch) >= fault.step, timeout=timeout)  # noqa: B023 - waited for here
            target = lines[fault.target].split()[0] if fault.kind in HOST_FAULTS else None
            launch.wait_for(lambda: _fork_servers_up(launch, target, servers=steady), timeout=timeout)  # noqa: B023
            late += max(0, _progress(launch) - fault.step)
            say(f"step {_progress(launch)}: {fault.kind} (target {fault.target})")
            before = _trained_attempts(launch)
            fault.at, fault.progress = time.time(), _progress(launch)
            fault.detail = _inject(fault, launch, cluster, hosts, lines, run_dir / "checkpoints")
            fault.injected = round(time.monotonic() - started, 1)
            fault.survived = _await_recovery(launch, fault, before, hosts, lines, timeout, cluster)
        if stop_after is not None:
            at = _progress(launch)
            launch.wait_for(lambda: _progress(launch) >= at + stop_after, timeout=timeout)
            launch.proc.send_signal(signal.SIGTERM)
        code = launch.wait()
    except AssertionError as exc:  # the launcher died or hung: report it, do not raise
        text = str(exc)
        problems.append(text if len(text) <= 2400 else f"{text[:400]} [...] {text[-2000:]}")  # why, then the end
        launch.kill()
        code = launch.proc.returncode
    except BaseException:
        if pending is not None:
            pending.close()
        raise
    finally:
        launch.close()
    seconds = time.monotonic() - started
    clean = 143 if stop_after is not None else 0
    if code != clean:
        problems.append(f"the launcher exited with {code}")
    last = steps
    if stop_after is not None and code == clean:
        last = next((e["checkpoint"] for e in launch.events() if e["event"] == "terminated"), None)
        if last is None:
            problems.append("the launcher stopped by SIGTERM reported no checkpoint")
            code = None
        else:
            steps = last
    for fault in faults:
        fault.survived = fault.survived and code == clean
    loss_diff, param_diff, abs_diff, worst = None, None, None, None
    if reference is not None or pending is not None:
        reference = reference or _finish_reference(pending)
        loss_diff, (param_diff, abs_diff, worst) = _compare(launch, run_dir / "checkpoints", reference, steps,
                                                            problems)
    events, reports = launch.events(), launch.reports()
    for fault in faults:
        _timings(fault, events, reports)
    chain, layout_losses, layout_params = None, None, None
    if replay_layouts and code == clean:
        from devtools.same_layouts import mismatches, replay, surviving_chain

        reports = launch.reports()
        links = surviving_chain(events, reports, run_dir, steps)
        chain = [link.attempt for link in links]
        expected, replayed = replay(links, workdir / "replay", TRAIN, timeout=timeout)
        layout_losses = mismatches(links, reports, expected)
        rel, absolute, _ = _params_diff(run_dir / "checkpoints" / f"step_{steps}", replayed, problems)
        layout_params = rel == 0.0 and absolute == 0.0
    ends = [e for e in events if e["event"] == "ending"]
    return ChaosResult(
        seed=seed, steps=steps, faults=faults, exit_code=code, attempts=len(ends),
        restarts=sum(e["kind"] == "crash" for e in ends),
        morphs=sum(e["kind"] in ("morph", "checkpointed") for e in ends),
        refused_checkpoints=sum(e["event"] == "checkpoint_refused" for e in events),
        loss_max_rel_diff=loss_diff, params_max_rel_diff=param_diff, params_max_abs_rel_diff=abs_diff,
        params_worst=worst, step_reports=len(launch.reports()),
        seconds=round(seconds, 1), problems=problems, chain=chain, layout_loss_mismatches=layout_losses,
        layout_params_equal=layout_params)


# ----------------------------------------------------------------------------------------------------------
# Injecting


def _inject(fault: Fault, launch: Launch, cluster, hosts: Path, lines: list[str], store: Path) -> str:
    job = launch.job()
    if fault.kind == "kill_worker":
        return _signal_worker(job, fault.target, signal.SIGKILL)
    if fault.kind == "stop_worker":
        return _signal_worker(job, fault.target, signal.SIGSTOP)
    if fault.kind == "kill_agent":
        pids = _agents_by_host(job, cluster)
        pid = pids.get(fault.target) or next(iter(pids.values()))
        os.kill(pid, signal.SIGKILL)
        return f"agent pid {pid} on host {fault.target}"
    if fault.kind == "remove_host":
        _write_hosts(hosts, [line for i, line in enumerate(lines) if i != fault.target])
        return f"removed {lines[fault.target].split()[0]}"
    if fault.kind == "preempt":
        name = lines[fault.target].split()[0]
        done = subprocess.run([str(VARUNA), "notify-preempt", name, "--in", "0", "--run-dir", str(launch.run_dir)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"notify-preempt failed: {done.stderr}")
        return f"preemption of {name}"
    if fault.kind == "lose_host":
        host = cluster.hosts[fault.target]
        cluster.crash(host)
        return f"host {fault.target} ({host.address}) died: every process, its sshd and its private disks"
    if fault.kind == "corrupt_checkpoint":  # the worker dies first: no newer checkpoint can complete after
        killed = _signal_worker(job, fault.target, signal.SIGKILL)
        newest = _newest_complete(store)
        data = sorted((store / f"step_{newest}").glob("__*.distcp"))[-1]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        return f"{killed}, then flipped a byte of step_{newest}/{data.name}"
    raise ValueError(f"unknown fault {fault.kind!r}")


def _signal_worker(job: str, rank: int, sig: int) -> str:
    workers = {}
    for pid, cmd in job_processes(job):
        if "train.py" in cmd:
            env = process_environ(pid)
            for item in env:
                if item.startswith(b"RANK="):
                    workers[int(item[5:])] = pid
            # a worker forked by its host's fork server shows the server's environment, and its rank in its name
            name = Proc(pid, 0).comm()
            if name.startswith("varuna-r") and name[8:].isdigit():
                workers[int(name[8:])] = pid
    if not workers:
        raise AssertionError("no worker of the job is running")
    rank = rank if rank in workers else sorted(workers)[rank % len(workers)]
    os.kill(workers[rank], sig)
    return f"{signal.Signals(sig).name} to rank {rank} (pid {workers[rank]})"


def _agents_by_host(job: str, cluster) -> dict[int, int]:
    """Host index -> the pid of the job's agent there (the agent's VARUNA_HOST is the host's address)."""
    out = {}
    for pid in agent_pids(job):
        env = b"\0".join(process_environ(pid))
        for i, host in enumerate(cluster.hosts):
            if b"SSH_CONNECTION=" in env and f" {host.address} ".encode() in env:
                out[i] = pid
    if not out:
        raise AssertionError("no agent of the job is running")
    return out


def _write_hosts(path: Path, lines: list[str], note: str = "") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines) + (f"# {note}\n" if note else ""))
    tmp.replace(path)  # an atomic swap, as an operator's tooling would do it


def _newest_complete(store: Path) -> int:
    steps = [int(p.name[5:]) for p in store.glob("step_*") if (p / "COMPLETE").exists()]
    if not steps:
        raise AssertionError(f"no complete checkpoint in {store} to corrupt")
    return max(steps)


# ----------------------------------------------------------------------------------------------------------
# Watching


def _progress(launch: Launch) -> int:
    reports = launch.reports()
    return max((r["step"] for r in reports), default=-1)


def _training_hosts(events: list[dict]) -> tuple[int, set[str]] | None:
    """The newest attempt that trained and the hosts it trains on now (less those a regroup left out)."""
    trained = {e["attempt"] for e in events if e["event"] == "first_step"}
    starts = [e for e in events if e["event"] == "starting" and e["attempt"] in trained]
    if not starts:
        return None
    hosts = set(starts[-1]["hosts"])
    for regroup in (e for e in events if e["event"] == "regroup" and e["attempt"] == starts[-1]["attempt"]):
        hosts -= set(regroup["hosts"])
    return starts[-1]["attempt"], hosts


def _fork_servers_up(launch: Launch, host: str | None = None, *, servers: bool = True) -> bool:
    """Whether every host of the newest attempt that trained has reported its fork server (served, or why not),
    and ``host`` (a host fault's target) is one of them: a fault then meets the job in its steady state, as one
    that comes hours into a run does, not while the servers still import (a few seconds after the job's first
    step), and a host fault meets a host the job uses (one left out after an earlier fault is taken back first)."""
    events = launch.events()
    training = _training_hosts(events)
    if training is None:
        return False
    attempt, hosts = training
    told = {e["host"] for e in events if e["event"] == "fork_server" and e["attempt"] == attempt}
    return (not servers or hosts <= told) and (host is None or host in hosts)


def _trained_attempts(launch: Launch) -> int:
    """Attempts that trained, and regroups (the survivors of a lost host going on in their processes: a new
    layout that trains, without a new attempt)."""
    return sum(e["event"] in ("first_step", "regroup") for e in launch.events())


def _await_recovery(launch: Launch, fault: Fault, before: int, hosts: Path, lines: list[str],
                    timeout: float, cluster=None) -> bool:
    """Wait until an attempt started after the fault trains past its step; bring a removed, preempted or lost
    host back first, and wait for the attempt that uses it again."""
    launch.wait_for(lambda: _trained_attempts(launch) > before and _progress(launch) > fault.step, timeout=timeout)
    if fault.kind in ("remove_host", "preempt", "lose_host"):
        again = _trained_attempts(launch)
        at = _progress(launch)
        if fault.kind == "lose_host":
            cluster.boot(cluster.hosts[fault.target])  # the launcher's checks find it again
        else:
            _write_hosts(hosts, lines, note=f"back after {fault.kind} at step {fault.step}")
        launch.wait_for(lambda: _trained_attempts(launch) > again and _progress(launch) > at, timeout=timeout)
    return True


def _timings(fault: Fault, events: list[dict], reports: list[dict]) -> None:
    """Detection, recovery, steps lost and the state's source of a fault that ended an attempt unasked."""
    if fault.kind not in SUDDEN or fault.at is None:
        return
    ended = next((e for e in events if e["event"] == "ending" and e["t"] >= fault.at and e["kind"] == "crash"), None)
    regroup = next((e for e in events if e["event"] == "regroup" and e["t"] >= fault.at), None)
    if regroup is not None and (ended is None or regroup["t"] < ended["t"]):
        _regroup_timings(fault, regroup, reports)
        return
    if ended is None:
        return
    fault.detected_s = round(ended["t"] - fault.at, 2)
    first = next((e for e in events if e["event"] == "first_step" and e["t"] > ended["t"]), None)
    if first is None:
        return
    fault.recovered_s = round(first["t"] - ended["t"], 2)
    recovering = next((e for e in events if e["event"] == "recovering" and ended["t"] <= e["t"] <= first["t"]), None)
    go = next((e for e in events if e["event"] == "go" and e["attempt"] == first["attempt"]), None)
    start = next((e for e in events if e["event"] == "starting" and e["attempt"] == first["attempt"]), None)
    if recovering is not None:
        resumed, fault.source = recovering["step"], f"snapshot step {recovering['step']}"
    elif go is not None and go.get("step") is not None:
        resumed, fault.source = go["step"], f"{go['source']} step {go['step']}"
    elif start is not None and start.get("resume") is not None:
        resumed, fault.source = start["resume"], f"store step {start['resume']}"
    else:
        resumed, fault.source = 0, "step 0"
    if fault.progress is not None:
        fault.steps_lost = max(0, fault.progress + 1 - resumed)


def _regroup_timings(fault: Fault, regroup: dict, reports: list[dict]) -> None:
    """A fault the survivors regrouped around: noticed when the launcher lost the agent (the decision's time less
    its wait for the survivors), recovered at the first record of the step they redid; one step lost (the one in
    flight), no state moved."""
    noticed = regroup["t"] - regroup["waited"]
    fault.detected_s = round(noticed - fault.at, 2)
    redone = [r["t"] for r in reports if r["step"] == regroup["step"] and r["t"] > noticed]
    if redone:
        fault.recovered_s = round(min(redone) - noticed, 2)
    fault.source = f"regroup at step {regroup['step']} (dp={regroup['dp']}, no process started)"
    if fault.progress is not None:
        fault.steps_lost = max(0, fault.progress + 1 - regroup["step"])


# ----------------------------------------------------------------------------------------------------------
# Comparing with an uninterrupted run


def _start_reference(plan: Path, steps: int, where: Path, timeout: float) -> Launch:
    """The uninterrupted run, started now: it trains while the chaotic run mostly waits (restarts, timeouts)."""
    where.mkdir(parents=True, exist_ok=True)
    run_dir = where / "run"
    return Launch([str(plan), "--run-dir", str(run_dir), "--", *TRAIN, "--steps", str(steps)], run_dir, timeout)


def _finish_reference(launch: Launch) -> Path:
    try:
        code = launch.wait()
    finally:
        launch.close()
    if code != 0:
        raise AssertionError(f"the uninterrupted reference run failed ({code}):\n{launch.output()[-3000:]}")
    return launch.run_dir


def _compare(launch: Launch, store: Path, reference: Path, steps: int, problems: list[str]):
    """The largest relative difference of any step's loss (every time it was computed) and of any final
    parameter, against the reference run; None where there is nothing to compare."""
    expected = read_steps(reference)
    reports = launch.reports()
    missing = sorted(set(range(steps)) - {r["step"] for r in reports})
    if missing:
        problems.append(f"steps never reported: {missing[:10]}")
    loss = max((abs(r["loss"] - expected[r["step"]]) / abs(expected[r["step"]]) for r in reports
                if r["step"] in expected), default=None)
    return loss, _params_diff(store / f"step_{steps}", reference / "checkpoints" / f"step_{steps}", problems)


def _params_diff(got: Path, want: Path, problems: list[str]) -> tuple[float | None, float | None, str | None]:
    """Over every tensor of the two final checkpoints (merged, under the model's names): the largest relative
    difference ``||a - b|| / ||b||``, the largest ``max|a - b| / max|b|``, and the tensor of the first."""
    from safetensors.torch import load_file

    from varuna_core.checkpoint.tools import merge

    try:
        merge(got, got.parent.parent / "chaos.safetensors")
        merge(want, want.parent.parent / "reference.safetensors")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        problems.append(f"cannot compare the final parameters: {exc}")
        return None, None, None
    a = load_file(str(got.parent.parent / "chaos.safetensors"))
    b = load_file(str(want.parent.parent / "reference.safetensors"))
    if a.keys() != b.keys():
        problems.append(f"the final checkpoints hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
        return None, None, None
    rel, absolute, worst = 0.0, 0.0, None
    for name, value in b.items():
        diff = (a[name].double() - value.double())
        norm = float(diff.norm()) / (float(value.double().norm()) or 1.0)
        if norm >= rel:
            rel, worst = norm, name
        absolute = max(absolute, float(diff.abs().max()) / (float(value.abs().max()) or 1.0))
    return rel, absolute, worst
