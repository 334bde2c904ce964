"""How much training time does a morph cost? The restart path (``--no-handover``: checkpoint to a shared store,
stop, start the new configuration, load) and the handover path (the default: the new configuration warms up beside
the old one, the old workers publish their state in their hosts' memory, the new ones take it) side by side, for a
shrink, a growth, a change of pipeline depth and a preemption notice, on the example GPT and on a GPT of a
billion bytes of parameters.

The hosts are two test hosts (``devtools/testhosts.py``: network namespaces with their own sshd and address, reached
with the real ssh client), each with a private tmpfs at ``/dev/shm`` (its shelf) and at the handover path's
checkpoint store: the handover path can only move state from host to host through the shelves' wire. The restart
path runs on the same hosts with its store outside the private paths (a directory of this machine's disk that
both hosts see, as an NFS store would be). Each model is planned pp=2 × dp=1 over the 2 hosts × 1 slot (from a
fresh profile); one ``varuna launch --morph`` run per model and path then goes through, a few steps apart:

1. **shrink**: the second host leaves the hosts file (2 devices -> 1: pp=2 -> pp=1, the **change of pipeline
   depth**);
2. **grow**: it comes back (1 -> 2 devices: the planner's choice for 2 devices);
3. **preempt**: ``varuna notify-preempt HOST --in --preempt-in`` for the second host (with the default
   ``--preempt-margin`` of 30 s a notice of 30 s or less acts at once; the handover path must publish by
   half the margin before the host goes, warm or not).

Each morph is split from the launcher's ``events.jsonl`` (wall clock) and ``metrics.jsonl`` (``t``: when the
launcher heard of each step), from the **decision** (the launcher sees the change) to the first step of the new
configuration:

* **warm-up** (handover: decision -> every new worker built and waiting at its resume point; it runs while the old
  configuration trains, off the critical path; restart: the start of the new workers, on the critical path);
* **ask**: decision -> the old workers are asked to stop (handover: once the new ones are warm);
* **finish**: -> the last step of the old configuration (the step in progress when asked);
* **state out**: -> every old rank published its state on its host's shelf (handover) / wrote its checkpoint to
  the store and exited (restart); of it, **publish** (second table) is the publish itself, from the first rank's
  start to the last rank's end (the rest: the last step's optimizer step and the next step's start);
* **relaunch**: -> handover: the launcher sends the go; restart: old agents gone, new hosts checked, re-planned,
  new workers started (built their model);
* **take / load**: -> every new rank holds the state (handover: from its own host's shelf and over the wire;
  restart: from the store);
* **first step**: -> the launcher hears of the first step of the new configuration;
* **time lost**: last step of the old configuration -> first step of the new, less one step time of the new
  configuration (the median of its next steps, from its third, that took no in-memory snapshot: at least two;
  ``step_new_with_snapshots_s`` in the JSON is the median with them): the training time the morph cost.

Bytes: handover: what the new ranks took from a shelf on their own host and from the other host; restart: the
checkpoint's bytes in the store (the store is this machine's disk: no bytes cross hosts here; on a cluster they
would cross twice, to the store and back). Rate: bytes / take-or-load time. The link between the two test hosts
is measured in the same run with the shelves' own wire (a ``ShelfServer`` on one host, ``fetch_into`` of
``--link-mib`` MiB from the other), in as many requests at once as a take makes to one holder (the rate the
targets use: what the wire carries when used as a take uses it) and in one request.

Targets: time lost ≤ 1.5 s on the example GPT; ≤ 1.5 s + (bytes moved across hosts / the link's rate) on the
big GPT. PASS / FAIL per row (the restart path is held to the same target, as the baseline). Prints tables (with
``--json`` one JSON document instead; the tables then go to stderr); progress on stderr. Every wait is bounded; a
run that fails is reported with its error and the others still run. Exit code 1 when a run failed (a morph not
measured), else 0, whatever the targets say.

    python benchmarks/morph_latency.py [--model small|big|both] [--paths restart,handover] [--json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BASE_TARGET_S = 1.5
PATHS = ("restart", "handover")
MORPHS = ("shrink", "grow", "preempt")


@dataclass(frozen=True)
class Model:
    """A model the benchmark trains: its spec (for the profile), its train.py flags, its plan."""

    key: str
    label: str
    spec: str
    config: dict[str, int]  # n_layer, n_head, n_embd, block_size
    batch: int
    microbatch: int
    between: int  # steps of each configuration before the next change
    timeout: float  # seconds one morph may take, warm-up included

    def train_args(self) -> list[str]:
        c = self.config
        return ["examples/gpt/train.py", "--batch-size", str(self.batch), "--n-layer", str(c["n_layer"]),
                "--n-head", str(c["n_head"]), "--n-embd", str(c["n_embd"]), "--block-size", str(c["block_size"]),
                "--log-every", "1", "--steps", "1000000"]


SMALL = Model("small", "example GPT", "examples/gpt/spec.py:spec",
              {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 64}, batch=32, microbatch=4, between=8,
              timeout=300)
BIG = Model("big", "GPT 20 x 1024", f"{Path(__file__).resolve()}:big_spec",
            {"n_layer": 20, "n_head": 16, "n_embd": 1024, "block_size": 64}, batch=4, microbatch=2, between=4,
            timeout=1200)
MODELS = {"small": SMALL, "big": BIG}


def log(msg: str) -> None:
    print(f"[morph_latency] {msg}", file=sys.stderr, flush=True)


def _gpt(config: dict[str, int]):
    """The example GPT of ``config`` on the meta device, and its dataset."""
    if str(ROOT / "examples" / "gpt") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from data import CharDataset
    from model import GPT, GPTConfig

    from varuna_core import meta_init

    data = CharDataset.load()
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=config["block_size"], n_layer=config["n_layer"],
                    n_head=config["n_head"], n_embd=config["n_embd"])
    with meta_init():
        return GPT(cfg), data


def big_spec():
    """The big GPT as a ModelSpec (``varuna profile benchmarks/morph_latency.py:big_spec``): the example GPT of
    ``BIG.config``, the same model ``train.py`` builds with ``BIG.train_args()``."""
    import torch

    from varuna_core import ModelSpec

    _, data = _gpt(BIG.config)  # puts examples/gpt on the import path
    from model import GPT, SHARED_WEIGHTS

    block = BIG.config["block_size"]

    def build():
        return _gpt(BIG.config)[0]

    def batch(n: int) -> dict:
        return data.get_batch("train", n, block, torch.Generator().manual_seed(n))

    return ModelSpec(build=build, batch=batch, shared_weights=SHARED_WEIGHTS, name="examples/gpt 20x1024",
                     init=GPT.init_module)


def model_size(model: Model) -> dict[str, int]:
    """Parameters (tied weights once), their fp32 bytes, the checkpointed state with Adam (parameters and two
    moments) and the training state (also the gradients)."""
    gpt, _ = _gpt(model.config)
    params = sum(p.numel() for p in gpt.parameters())
    return {"params": params, "param_bytes": 4 * params, "checkpoint_bytes": 12 * params,
            "training_bytes": 16 * params}


# ----------------------------------------------------------------------------------------------------------
# Reading a run


def _events(run: Path) -> list[dict]:
    from devtools.launching import read_events

    return read_events(run)


def _metrics(run: Path) -> list[dict]:
    from devtools.launching import read_reports

    return read_reports(run)


def _one(items: list[dict], what: str) -> dict:
    if not items:
        raise LookupError(f"no {what} in events.jsonl")
    return items[0]


def _store_bytes(store: Path, step: int) -> int | None:
    directory = store / f"step_{step}"
    if not directory.is_dir():
        return None
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _first_reports(mets: list[dict], attempt: int) -> list[dict]:
    """The first record of each step of ``attempt``, in step order (a step can be recorded twice: two ranks'
    reports of it heard in two polls of the launcher)."""
    first: dict[int, dict] = {}
    for m in mets:
        if m["attempt"] == attempt and (m["step"] not in first or m.get("t", 0) < first[m["step"]].get("t", 0)):
            first[m["step"]] = m
    return [first[s] for s in sorted(first)]


def _steady_steps(evs: list[dict], mets: list[dict], attempt: int) -> tuple[list[float], int]:
    """The step times of ``attempt`` from its third step on that carry no in-memory snapshot (a ``snapshot`` event
    of the attempt heard between the step's report and the one before), and how many did carry one. A snapshot
    copies the whole state (1.3-15 s for the big GPT here); the new configuration takes its first right after its
    first step, so a median over the two steps after that one is a snapshot's step half the time: "one step of
    the new configuration" is its step without one."""
    reports = _first_reports(mets, attempt)
    shots = [e["t"] for e in evs if e["event"] == "snapshot" and e.get("attempt") == attempt]
    clean, carried = [], 0
    for before, m in itertools.pairwise(reports[1:]):  # from the third step on
        if not m.get("step_time"):
            continue
        if any(before["t"] < t <= m["t"] for t in shots):
            carried += 1
        else:
            clean.append(m["step_time"])
    return clean, carried


def analyse(run: Path, path: str, t_change: float, old: int, store_bytes: int | None) -> dict[str, Any]:
    """The phases of the morph decided after ``t_change`` that ended attempt ``old`` (see the module docstring)."""
    evs, mets = _events(run), _metrics(run)
    decision = _one([e for e in evs if e["event"] in ("hosts_changed", "preempt_notice") and e["t"] >= t_change],
                    "decision (hosts_changed / preempt_notice) after the change")
    first = _one([e for e in evs if e["event"] == "first_step" and e["attempt"] > old and e["t"] > decision["t"]],
                 "first step of a new attempt")
    new = first["attempt"]
    before = _one([e for e in evs if e["event"] == "starting" and e["attempt"] == old], f"start of attempt {old}")
    after = _one([e for e in evs if e["event"] == "starting" and e["attempt"] == new], f"start of attempt {new}")
    olds, news = _first_reports(mets, old), _first_reports(mets, new)
    if not olds or len(news) < 3:
        raise LookupError(f"too few steps reported (old attempt {len(olds)}, new {len(news)})")
    if "t" not in olds[-1]:
        raise LookupError("metrics.jsonl records carry no wall-clock 't' (launcher too old)")
    last, first_new = olds[-1], news[0]
    steady, carried = _steady_steps(evs, mets, new)
    if not steady:
        raise LookupError("no step of the new configuration without a snapshot yet")
    step_new = statistics.median(steady)
    old_before = [m["step_time"] for m in olds if m.get("step_time") and m["t"] < decision["t"]][-5:]
    t0 = decision["t"]
    row: dict[str, Any] = {
        "path": path, "attempts": [old, new], "extra_attempts": new - old - 1,
        "from": f"pp={before['pp']} dp={before['dp']}", "to": f"pp={after['pp']} dp={after['dp']}",
        "hosts": [len(before["hosts"]), len(after["hosts"])], "reason": decision["event"],
        "last_old_step": last["step"], "first_new_step": first_new["step"],
        "step_old_s": statistics.median(old_before) if old_before else None, "step_new_s": step_new,
        "step_new_steps": len(steady), "step_new_snapshot_steps": carried,
        "step_new_with_snapshots_s": statistics.median(m["step_time"] for m in news[2:] if m.get("step_time")),
        "decision_to_first_step_s": first_new["t"] - t0,
        "time_lost_s": first_new["t"] - last["t"] - step_new,
    }
    handed_over = any(e["event"] == "published" and e["attempt"] == old for e in evs)
    if path == "handover" and not handed_over:
        row["path"] = "handover (fell back to the store)"
        if not any(e["event"] == "signal" and e["attempt"] == old for e in evs):
            raise LookupError(f"attempt {old} neither published its state nor was asked to checkpoint: "
                              f"{[e['event'] for e in evs if e.get('attempt') in (old, new)]}")
    if handed_over:
        asked = _one([e for e in evs if e["event"] == "handover_asked" and e["attempt"] == old], "handover_asked")
        published = _one([e for e in evs if e["event"] == "published" and e["attempt"] == old], "published")
        go = _one([e for e in evs if e["event"] == "go" and e["attempt"] == new], "go")
        local, remote = first.get("taken_local") or 0, first.get("taken_remote") or 0
        take = first["t_resumed"] - go["t"]
        during = [m["step_time"] for m in olds if m.get("step_time") and t0 < m["t"] <= asked["t"]]
        row.update({
            "source": go["source"], "go_step": go["step"],
            "warm_up_s": first["t_warm"] - t0, "warm_up_on_path": False,
            "step_old_warming_s": statistics.median(during) if during else None,
            "phases_s": {"ask": asked["t"] - t0, "finish": last["t"] - asked["t"],
                         "state out": published["t_published"] - last["t"],
                         "relaunch": go["t"] - published["t_published"], "take": take,
                         "first step": first_new["t"] - first["t_resumed"]},
            "publish_s": published["t_published"] - published["t_publishing"] if published.get("t_publishing")
            else None,  # of "state out": the publish itself, from the first rank's start to the last rank's end
            "published_bytes": published.get("bytes"), "bytes_local": local, "bytes_remote": remote,
            "rate_MBps": (local + remote) / take / 1e6 if take > 0 else None,
        })
    else:
        signalled = _one([e for e in evs if e["event"] == "signal" and e["attempt"] == old], "signal")
        ending = _one([e for e in evs if e["event"] == "ending" and e["attempt"] == old], "ending")
        stopped = _one([e for e in evs if e["event"] == "stopped" and e["attempt"] == old], "stopped")
        load = first["t_resumed"] - first["t_ready"]
        row.update({
            "source": "store", "go_step": after["resume"],
            "warm_up_s": first["t_ready"] - after["t"], "warm_up_on_path": True,
            "phases_s": {"ask": signalled["t"] - t0, "finish": last["t"] - signalled["t"],
                         "state out": ending["t"] - last["t"], "relaunch": first["t_ready"] - ending["t"],
                         "take": load, "first step": first_new["t"] - first["t_resumed"]},
            "relaunch_split_s": {"teardown": stopped["t"] - ending["t"], "re-plan": after["t"] - stopped["t"],
                                 "start": first["t_ready"] - after["t"]},
            "published_bytes": store_bytes, "bytes_local": store_bytes or 0, "bytes_remote": 0,
            "rate_MBps": (store_bytes or 0) / load / 1e6 if load > 0 and store_bytes else None,
        })
    return row


# ----------------------------------------------------------------------------------------------------------
# The link between the two test hosts, measured with the shelves' wire


def _ssh(cluster, host, command: str) -> list[str]:
    return ["ssh", *cluster.ssh_options(), "-p", str(host.port), f"{cluster.user}@{host.address}", command]


def _remote(args: str) -> str:
    script = shlex.quote(str(Path(__file__).resolve()))
    return f"cd {shlex.quote(str(ROOT))} && OMP_NUM_THREADS=1 exec {shlex.quote(sys.executable)} {script} {args}"


def serve_link(mib: int) -> None:
    """(On a test host) put ``mib`` MiB on a shelf in /dev/shm, serve it, say where on stdout, and serve until
    stdin closes."""
    from varuna_core.launch.shelf import Shelf, ShelfServer

    root = tempfile.mkdtemp(prefix="varuna-linkbench-", dir="/dev/shm")
    job, token, blobs = f"linkbench-{secrets.token_hex(4)}", secrets.token_hex(16), 16
    size = mib * 2**20 // blobs
    shelf = Shelf(job, root=root)
    try:
        data = os.urandom(size)
        names = [f"blocks.{i}.weight" for i in range(blobs)]
        for name in names:
            shelf.put(name, data, {"dtype": "uint8", "shape": [size]})
        with ShelfServer(shelf, token, host="0.0.0.0", timeout=60) as server:
            print(json.dumps({"port": server.port, "job": job, "token": token, "names": names, "size": size}),
                  flush=True)
            sys.stdin.read()
    finally:
        shelf.clear()
        shutil.rmtree(root, ignore_errors=True)


def fetch_link(address: str, port: int, repeats: int) -> None:
    """(On a test host) fetch what :func:`serve_link` serves, ``repeats`` times in as many requests at once as a
    take makes to one holder (``TAKE_STREAMS``), and as many times in one request; the times as JSON on stdout."""
    from concurrent.futures import ThreadPoolExecutor

    from varuna_core.checkpoint.handover import TAKE_STREAMS
    from varuna_core.launch.shelf import fetch_into

    info = json.loads(sys.stdin.readline())
    buffers = {name: bytearray(info["size"]) for name in info["names"]}
    total = info["size"] * len(info["names"])

    def one(names: list[str]) -> None:
        fetch_into(address, port, job=info["job"], token=info["token"], names=names,
                   into=lambda e: memoryview(buffers[e.name]), max_bytes=total, timeout=60)

    times: dict[int, list[float]] = {TAKE_STREAMS: [], 1: []}
    with ThreadPoolExecutor(TAKE_STREAMS) as pool:
        for _ in range(repeats):
            for streams in times:
                start = time.perf_counter()
                list(pool.map(one, [info["names"][i::streams] for i in range(streams)]))
                times[streams].append(time.perf_counter() - start)
    print(json.dumps({"bytes": total, "streams": TAKE_STREAMS, "seconds": times[TAKE_STREAMS],
                      "seconds_one": times[1]}), flush=True)


def measure_link(cluster, mib: int, repeats: int = 3) -> dict[str, Any]:
    """The shelf wire's rate from the second test host to the first (median of ``repeats`` fetches)."""
    server_host, client_host = cluster.hosts[1], cluster.hosts[0]
    server = subprocess.Popen(_ssh(cluster, server_host, _remote(f"--serve-link {mib}")), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 120)
        line = server.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the shelf server did not start on {server_host.address}: "
                               f"{server.stderr.read()[-2000:] if server.poll() is not None else 'no answer'}")
        port = json.loads(line)["port"]
        done = subprocess.run(_ssh(cluster, client_host, _remote(f"--fetch-link {server_host.address} {port} "
                                                                 f"--repeats {repeats}")),
                              input=line, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the fetch failed: {done.stderr[-2000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    seconds = statistics.median(got["seconds"])
    return {"bytes": got["bytes"], "seconds": got["seconds"], "rate_MBps": got["bytes"] / seconds / 1e6,
            "streams": got["streams"], "rate_one_MBps": got["bytes"] / statistics.median(got["seconds_one"]) / 1e6,
            "from": server_host.address, "to": client_host.address}


# ----------------------------------------------------------------------------------------------------------
# Running one job through its morphs


@dataclass
class Scenario:
    model: Model
    path: str
    rows: list[dict] = field(default_factory=list)
    error: str | None = None


def _write_hosts(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)


def _attempt_of_last_step(run: Path) -> tuple[int, int]:
    mets = _metrics(run)
    if not mets:
        return 0, -1
    last = max(mets, key=lambda m: (m["attempt"], m["step"]))
    return last["attempt"], last["step"]


def _steps_of(run: Path, attempt: int) -> int:
    return len({m["step"] for m in _metrics(run) if m["attempt"] == attempt})


def _new_attempt_trained(run: Path, old: int, t_change: float, steps: int) -> int | None:
    """The attempt that took over from ``old`` after ``t_change``, once it has reported ``steps`` steps."""
    firsts = [e for e in _events(run) if e["event"] == "first_step" and e["attempt"] > old and e["t"] > t_change]
    if not firsts:
        return None
    new = firsts[0]["attempt"]
    if _steps_of(run, new) < steps or len(_steady_steps(_events(run), _metrics(run), new)[0]) < 2:
        return None
    return new


def run_scenario(sc: Scenario, plan: Path, cluster, work: Path, store_private: Path, keep: Path | None,
                 preempt_in: float) -> None:
    from devtools.launching import VARUNA, Launch, job_processes

    model, path = sc.model, sc.path
    where = work / f"{model.key}-{path}"
    where.mkdir(parents=True, exist_ok=True)
    run, hosts = where / "run", where / "hosts.txt"
    store = store_private if path == "handover" else where / "store"
    lines = cluster.hosts_file_lines(1)
    _write_hosts(hosts, lines)
    args = [str(plan), "--run-dir", str(run), "--ckpt-dir", str(store), "--hosts", str(hosts), "--morph",
            "--grace", "5", *cluster.launcher_args()]
    if path == "restart":
        args += ["--no-handover", "--ckpt-keep", "2"]
    budget = model.timeout * (len(MORPHS) + 1)
    launch = Launch([*args, "--", *model.train_args()], run, timeout=budget)
    job = None
    try:
        log(f"{model.key}/{path}: started; waiting for {model.between} steps")
        launch.wait_for(lambda: len(_metrics(run)) >= model.between, model.timeout, poll=0.5)
        job = launch.job()
        for morph in MORPHS:
            old, _ = _attempt_of_last_step(run)
            t_change = time.time()
            if morph == "shrink":
                _write_hosts(hosts, lines[:1])
            elif morph == "grow":
                _write_hosts(hosts, lines)
            else:
                name = lines[1].split()[0]
                done = subprocess.run([str(VARUNA), "notify-preempt", name, "--in", f"{preempt_in:g}", "--run-dir",
                                       str(run)], cwd=ROOT, capture_output=True, text=True, timeout=60)
                if done.returncode != 0:
                    raise RuntimeError(f"notify-preempt failed: {done.stderr.strip()[-1000:]}")
            log(f"{model.key}/{path}: {morph} (attempt {old} runs)")
            new = launch.wait_for(lambda: _new_attempt_trained(run, old, t_change, model.between),  # noqa: B023
                                  model.timeout, poll=0.5)
            size = None
            if path == "restart":
                go = next(e for e in _events(run) if e["event"] == "starting" and e["attempt"] == new)
                size = _store_bytes(store, go["resume"]) if go.get("resume") is not None else None
            row = analyse(run, path, t_change, old, size)
            row["morph"] = morph
            sc.rows.append(row)
            log(f"{model.key}/{path}: {morph} {row['from']} -> {row['to']}: time lost {row['time_lost_s']:.2f} s "
                f"(decision -> first step {row['decision_to_first_step_s']:.2f} s)")
        os.kill(launch.proc.pid, signal.SIGINT)
        launch.deadline = time.monotonic() + 120
        code = launch.wait()
        if code != 130:
            log(f"{model.key}/{path}: the launcher exited with {code} on SIGINT (expected 130)")
    except Exception as exc:  # noqa: BLE001 - one failed run is reported; the others still run
        sc.error = f"{type(exc).__name__}: {exc}"
        log(f"{model.key}/{path} FAILED: {sc.error[-3000:]}")
        traceback.print_exc(file=sys.stderr)
    finally:
        launch.close()
        _reap(job, job_processes)
        if keep is not None:
            shutil.copytree(where, keep / where.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("step_*"))
            launcher_log = run.parent / f"{run.name}.launcher.log"
            if launcher_log.exists():
                shutil.copy(launcher_log, keep / where.name / launcher_log.name)
        shutil.rmtree(where / "store", ignore_errors=True)


def _reap(job: str | None, job_processes) -> None:
    """Wait (bounded) until no process of ``job`` is left on any host; SIGKILL what is left then."""
    if job is None:
        return
    deadline = time.monotonic() + 30
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in job_processes(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------------------------------------
# Profiles and plans


def prepare(model: Model, work: Path) -> Path:
    """A fresh profile of ``model`` (network included) and its plan: pp=2 × dp=1 over 2 hosts × 1 slot."""
    from devtools.launching import VARUNA, make_plan

    profile = work / f"{model.key}-profile.json"
    done = subprocess.run([str(VARUNA), "profile", model.spec, "--microbatch-sizes", str(model.microbatch),
                           "--repeats", "2", "--warmup", "1", "--nproc", "2", "-o", str(profile)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"profiling {model.label} failed: {done.stderr[-3000:]}")
    return make_plan(profile, work / f"{model.key}-plan.yaml", pp=2, dp=1, mbs=model.microbatch,
                     batch_size=model.batch, per_node=1)


# ----------------------------------------------------------------------------------------------------------
# Report


def target_of(model: Model, row: dict, link: dict | None) -> float | None:
    if model.key == "small":
        return BASE_TARGET_S
    if link is None:
        return None
    return BASE_TARGET_S + row["bytes_remote"] / (link["rate_MBps"] * 1e6)


PHASES = ("ask", "finish", "state out", "relaunch", "take", "first step")


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def _bytes(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _mb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e6:.1f}"


def tables(report: dict) -> str:
    out = []
    for info in report["models"].values():
        size = info["size"]
        out.append(f"{info['label']}: {size['params'] / 1e6:.2f} M parameters = {_bytes(size['param_bytes'])} fp32; "
                   f"state with Adam: {_bytes(size['checkpoint_bytes'])} checkpointed (parameters and two moments), "
                   f"{_bytes(size['training_bytes'])} in training (and gradients); batch {info['batch']}, "
                   f"micro-batch {info['microbatch']}")
    link = report.get("link")
    if link:
        out.append(f"link {link['from']} -> {link['to']} (shelf wire, {link['bytes'] / 2**20:.0f} MiB, median of "
                   f"{len(link['seconds'])}): {link['rate_MBps']:.0f} MB/s in {link.get('streams', 1)} requests at "
                   f"once, as a take asks a holder ({link.get('rate_one_MBps', link['rate_MBps']):.0f} MB/s in one)")
    elif report.get("link_error"):
        out.append(f"link not measured: {report['link_error']}")
    out.append("")
    head = ["model", "morph", "path", "layout", "warm-up", *PHASES, "decision→1st", "step new", "time lost",
            "target", ""]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for sc in report["scenarios"]:
        for row in sc["rows"]:
            warm = _f(row["warm_up_s"], ".1f") + (" (on path)" if row["warm_up_on_path"] else "")
            cells = [sc["model"], row["morph"], row["path"], f"{row['from']} → {row['to']}", warm,
                     *(_f(row["phases_s"][p]) for p in PHASES), _f(row["decision_to_first_step_s"]),
                     _f(row["step_new_s"]), f"**{_f(row['time_lost_s'])}**", _f(row.get("target_s")),
                     row.get("verdict", "")]
            out.append("| " + " | ".join(cells) + " |")
        if sc["error"]:
            out.append(f"| {sc['model']} | — | {sc['path']} | ERROR: {sc['error'][:300]} |")
    out.append("")
    head = ["model", "morph", "path", "state (MB)", "publish (s)", "same host (MB)", "across hosts (MB)",
            "take/load (s)", "rate (MB/s)", "step old (s)", "step old while warming (s)"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for sc in report["scenarios"]:
        for row in sc["rows"]:
            cells = [sc["model"], row["morph"], row["path"], _mb(row["published_bytes"]), _f(row.get("publish_s")),
                     _mb(row["bytes_local"]),
                     _mb(row["bytes_remote"]), _f(row["phases_s"]["take"]), _f(row["rate_MBps"], ".0f"),
                     _f(row["step_old_s"]), _f(row.get("step_old_warming_s"))]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["small", "big", "both"], default="both")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated: restart, handover (default both)")
    p.add_argument("--preempt-in", type=float, default=30.0,
                   help="seconds the preemption notice gives (default 30, as Azure and GCP; the launcher's "
                        "--preempt-margin is 30)")
    p.add_argument("--link-mib", type=int, default=256, help="MiB fetched to measure the link (default 256)")
    p.add_argument("--json", action="store_true", help="print one JSON document (the tables go to stderr)")
    p.add_argument("--keep", default=None, help="copy the run directories and launcher logs here")
    p.add_argument("--serve-link", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fetch-link", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_link is not None:
        serve_link(args.serve_link)
        return 0
    if args.fetch_link is not None:
        fetch_link(args.fetch_link[0], int(args.fetch_link[1]), args.repeats)
        return 0
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - set(PATHS):
        p.error(f"--paths takes a comma-separated subset of {','.join(PATHS)}")
    models = [SMALL, BIG] if args.model == "both" else [MODELS[args.model]]

    from devtools.testhosts import start_cluster

    work = Path(tempfile.mkdtemp(prefix="morph-bench-"))
    private_store = Path(tempfile.mkdtemp(prefix="varuna-morphbench-store-", dir="/var/tmp"))
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()}, "models": {},
                              "scenarios": [], "paths": paths, "preempt_in_s": args.preempt_in}
    scenarios: list[Scenario] = []
    cluster = None
    try:
        cluster = start_cluster(2, work / "hosts", private=(private_store, "/dev/shm"), private_size="12g")
        log(f"2 SSH hosts ({cluster.mode}, private tmpfs at /dev/shm and {private_store}): "
            f"{', '.join(h.address for h in cluster.hosts)}")
        report["hosts_mode"] = cluster.mode
        try:
            report["link"] = measure_link(cluster, args.link_mib)
            log(f"link: {report['link']['rate_MBps']:.0f} MB/s over the shelf wire "
                f"({report['link']['rate_one_MBps']:.0f} MB/s in one request)")
        except Exception as exc:  # noqa: BLE001 - the morphs can still be measured
            report["link_error"] = f"{type(exc).__name__}: {exc}"
            log(f"link not measured: {report['link_error']}")
        for model in models:
            report["models"][model.key] = {"label": model.label, "config": model.config, "batch": model.batch,
                                           "microbatch": model.microbatch, "size": model_size(model)}
            try:
                log(f"profiling {model.label} and planning pp=2 x dp=1 over 2 hosts x 1 slot")
                plan = prepare(model, work)
            except Exception as exc:  # noqa: BLE001 - the other model still runs
                scenarios += [Scenario(model, path, error=f"{type(exc).__name__}: {exc}") for path in paths]
                log(f"{model.key}: {exc}")
                continue
            for path in paths:
                sc = Scenario(model, path)
                scenarios.append(sc)
                run_scenario(sc, plan, cluster, work, private_store, keep, args.preempt_in)
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private_store, ignore_errors=True)
    link = report.get("link")
    for sc in scenarios:
        for row in sc.rows:
            target = target_of(sc.model, row, link)
            row["target_s"] = target
            row["verdict"] = "—" if target is None else "PASS" if row["time_lost_s"] <= target else "FAIL"
        report["scenarios"].append({"model": sc.model.key, "path": sc.path, "rows": sc.rows, "error": sc.error})
    text = tables(report)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(text)
    return 1 if any(sc.error for sc in scenarios) else 0


if __name__ == "__main__":
    sys.exit(main())
