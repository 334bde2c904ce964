"""``varuna launch PLAN -- SCRIPT ARGS`` and ``varuna notify-preempt HOST``."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from varuna_cli.flags import named_as_options
from varuna_core.env import LAUNCHER_SET
from varuna_core.errors import ConfigError, FieldError, VarunaError
from varuna_core.launch.exclusion import RECHECK_FIRST
from varuna_core.launch.hosts import MAX_SLOTS
from varuna_core.launch.options import (
    DEFAULTS,
    HostRuntime,
    LaunchOptions,
    SpotConfig,
    SSHConfig,
    check_ckpt_local,
    check_numbers,
)
from varuna_core.util.checks import integer
from varuna_core.util.text import printable

HELP = (
    "Run SCRIPT on every device of PLAN: local processes, or the hosts of --hosts over SSH.\n\n"
    "Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
    "MASTER_PORT) and VARUNA_PLAN, VARUNA_CKPT_DIR and, when resuming, VARUNA_RESUME_STEP, which Varuna(...) picks "
    "up by itself. Logs go to RUN_DIR/logs/rank<R>.log; Ctrl-C stops every worker on every host.\n\n"
    "With --morph the job survives machines coming and going: when the hosts file changes, or `varuna "
    "notify-preempt HOST` says a host goes away, the plan is made again for the new device count (same global "
    "batch), the new configuration's workers start and warm up beside the running ones, and the state is handed "
    "over through the hosts' memory at one step (no shared file system needed; --no-handover checkpoints to the "
    "store and restarts instead); after a crash it restarts from the last complete checkpoint it can load. A "
    "listed host that does not answer (SSH fails, or its node agent does not start) is left out, checked again in "
    "the background (--recheck-max), and taken back once it answers.\n\n"
    "SIGTERM or SIGUSR1 (a scheduler's warning) makes every worker checkpoint, then the launcher exits with 143. A "
    "checkpoint store that already holds checkpoints is refused unless --resume continues its run.\n\n"
    "Inside a Slurm job (sbatch, salloc) the nodes and devices are the allocation's and the workers start with "
    "srun (--slurm; the default when SLURM_JOB_ID is set and --hosts is not given). The job's run is named after it: "
    "a requeued job resumes from its latest checkpoint by itself, and after Slurm's warning signal "
    "(--signal=B:USR1@60) a requeueable job is requeued once it has checkpointed.\n\n"
    "On spot VMs, --preemption-source azure|aws|gcp makes every node ask its cloud's metadata service for eviction "
    "notices, which act as `varuna notify-preempt` does.\n\n"
    "Put -- before SCRIPT so that its options are not read as the launcher's: "
    "varuna launch plan.yaml --hosts hosts.txt --morph -- examples/gpt/train.py --steps 400"
)


ENV_FILE_LIMIT = 256 * 2**10
MAX_ENV_STRING = 128 * 2**10 - 1  # Linux refuses to start a process with a longer KEY=VALUE (MAX_ARG_STRLEN)
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV = LAUNCHER_SET  # variables the launcher sets for every worker; the option that sets each


def _env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export`` allowed, ``#`` comments, values may be quoted); every line counts.

    The file must be a regular UTF-8 text file of at most :data:`ENV_FILE_LIMIT` bytes without NUL bytes (no
    process environment can hold one), and may not set what the launcher sets for each worker
    (:data:`RESERVED_ENV`): a worker with another worker's RANK, or another job's token, would hang the job or
    have its messages refused.
    """
    from varuna_core.util.fs import read_regular

    data = read_regular(path, ENV_FILE_LIMIT, what="env file")
    line_of = lambda offset: data.count(b"\n", 0, offset) + 1  # noqa: E731
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"env file {path} line {line_of(nul)} holds a NUL byte",
                          hint="an environment variable cannot hold one; is it the right file?")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"env file {path} line {line_of(exc.start)} is not UTF-8 text",
                          hint="is it the right file?") from None
    env = {}
    for number, raw in enumerate(text.splitlines(), 1):
        key, value = _env_line(raw, f"env file {path} line {number}")
        if key is not None:
            env[key] = value
    return env


def _env_line(raw: str, where: str) -> tuple[str | None, str]:
    """The ``(KEY, VALUE)`` of one line of an env file, ``(None, "")`` for a blank or comment line."""
    import shlex

    line = raw.strip()
    if not line or line.startswith("#"):
        return None, ""
    if line.startswith("export "):
        line = line[len("export "):].strip()
    key, sep, value = line.partition("=")
    key = key.strip()
    shown = _shown(raw.strip())
    if not sep or not _ENV_KEY.fullmatch(key):
        raise ConfigError(f"{where}: not KEY=VALUE: {shown}", hint="a KEY is letters, digits and _")
    if key in RESERVED_ENV:
        option = RESERVED_ENV[key]
        raise ConfigError(f"{where}: {key} is set by the launcher for every worker", hint=(
            f"use {option} instead" if option else "remove the line; each worker gets its own value"))
    try:
        words = shlex.split(value, comments=True)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}: {shown}") from None
    value = " ".join(words)
    if len(key) + 1 + len(value.encode()) > MAX_ENV_STRING:
        raise ConfigError(f"{where}: {key} is {len(value.encode()):,} bytes long; a process cannot be started with "
                          f"an environment string over {MAX_ENV_STRING:,} bytes")
    return key, value


def _shown(value: object, limit: int = 120) -> str:
    """``value`` quoted for a message (its repr), cut to ``limit`` characters."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# The option that sets each field the library checks (a FieldError names the field; the message names the option).
OPTION_OF = {"ckpt_every": "--ckpt-every", "ckpt_keep": "--ckpt-keep", "total_steps": "--steps",
             "max_restarts": "--max-restarts", "heartbeat_timeout": "--heartbeat-timeout",
             "morph_timeout": "--morph-timeout", "preempt_margin": "--preempt-margin", "grace": "--grace",
             "straggler_threshold": "--straggler-threshold", "recheck_max": "--recheck-max",
             "shelf_dir": "--shelf-dir", "shelf_budget": "--shelf-budget", "snapshot_every": "--snapshot-every",
             "gpus_per_node": "--gpus-per-node", "user": "--ssh-user", "port": "--ssh-port",
             "source": "--preemption-source", "endpoint": "--preemption-endpoint", "interval": "--preemption-interval",
             "resume_or_start": "--resume-or-start", "ckpt_local": "--ckpt-local"}


def _check_places(python: str | None, dirs: dict[str, Path | None], identity: str | None = None) -> None:
    """The places the options name: directories are directories (``--code-dir`` must exist; the others are
    made), and ``--ssh-identity``, which ssh reads on this machine, is a file here (ssh would only warn and go
    on without it, and the job would fail as if the hosts were unreachable)."""
    if python is not None and not python.strip():
        raise ConfigError("--python is empty", hint="give the interpreter's path on the hosts")
    for name, path in dirs.items():
        if path is None:
            continue
        if name == "--code-dir" and not os.path.lexists(path):
            raise ConfigError(f"--code-dir {_printable(str(path))} does not exist",
                              hint="give the directory SCRIPT runs in (the same path on every host)")
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{name} {path} is not a directory")
    if identity is not None and not os.path.isfile(os.path.expanduser(identity)):  # ssh expands ~ too
        what = "is not a file" if os.path.lexists(os.path.expanduser(identity)) else "does not exist"
        raise ConfigError(f"--ssh-identity {identity} {what}", hint="give the private key ssh should use (ssh -i)")


def _check_script(script: list[str], code_dir: str) -> None:
    if not script:
        raise ConfigError("no SCRIPT to run", hint="varuna launch plan.yaml -- train.py [ARGS...]")
    first = script[0]
    if first.endswith(".py") or os.sep in first:
        path = Path(first) if os.path.isabs(first) else Path(code_dir) / first
        if not path.is_file():
            raise ConfigError(f"SCRIPT {first} does not exist in {code_dir}",
                              hint="give the path relative to --code-dir (default: the current directory)")
    elif shutil.which(first) is None:
        raise ConfigError(f"SCRIPT {first!r} is neither a file nor a command on PATH")


# The options of `varuna launch`. A default that the launcher also has is read from LaunchOptions, its one source.
PlanFile = Annotated[Path, typer.Argument(metavar="PLAN", help="The plan from `varuna plan`.")]
Script = Annotated[list[str] | None, typer.Argument(
    metavar="-- SCRIPT ARGS", help="The training script and its arguments (after --).", show_default=False)]
Hosts = Annotated[Path | None, typer.Option("--hosts", help="Hosts file: one '\\[user@]host\\[:port] \\[slots=N]' "
                                                "per line; without it, local processes.")]
GpusPerNode = Annotated[int | None, typer.Option(
    "--gpus-per-node", help="Workers per host without slots=N (default: the plan's).")]
CodeDir = Annotated[Path | None, typer.Option(
    "--code-dir", help="Directory SCRIPT runs in on every host (default: the current one).")]
EnvFile = Annotated[Path | None, typer.Option("--env-file", help="KEY=VALUE lines set for every worker.")]
CkptDir = Annotated[Path | None, typer.Option(
    "--ckpt-dir", help="Checkpoint store shared by all hosts (default: RUN_DIR/checkpoints).")]
RunDir = Annotated[Path | None, typer.Option(
    "--run-dir", help="Logs, events and metrics (default: runs/launch-<time>).")]
Morph = Annotated[bool, typer.Option("--morph", help="Follow host changes and preemptions; restart after crashes.")]
MorphAnyMicrobatch = Annotated[bool, typer.Option(
    "--morph-any-microbatch", help="Let a morph change the micro-batch size (faster, but the losses then "
    "differ from an uninterrupted run's by rounding).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the run whose checkpoints are in --ckpt-dir (or "
                                      "RUN_DIR/checkpoints), from its latest complete one (without it, a store that "
                                      "holds checkpoints is refused). With --run-id, a store that holds nothing of "
                                      "that run but other runs' checkpoints is refused.")]
ResumeOrStart = Annotated[bool, typer.Option(
    "--resume-or-start", help="As --resume, but start the run of --run-id from scratch when the store holds "
    "nothing of it, beside other runs' checkpoints.")]
RunId = Annotated[str | None, typer.Option(
    "--run-id", help="The run to continue with --resume when the store holds several, or the id of a new run "
    "(default: found, or made).")]
LegacyArgs = Annotated[bool, typer.Option(
    "--legacy-args", help="Also pass the original's --rank --local_rank --stage_to_rank_map --chunk_size "
    "--batch-size.")]
CkptEvery = Annotated[int, typer.Option("--ckpt-every", help="Checkpoint every N steps (0: only on demand).")]
CkptKeep = Annotated[int | None, typer.Option("--ckpt-keep", help="Keep the newest K checkpoints.")]
CkptTempdir = Annotated[str | None, typer.Option(
    "--ckpt-tempdir", help="Fast local directory for background periodic checkpoints.")]
CkptLocal = Annotated[bool, typer.Option(
    "--ckpt-local", help="With --morph: --ckpt-dir is a directory on each host's own disk (the same path on every "
    "host; no shared file system): each host keeps the checkpoint files its workers wrote and a copy of another "
    "host's, so losing any one host loses no checkpoint; a restart reads each file from a host that has it, and "
    "`varuna ckpt assemble` gathers a whole checkpoint from the hosts' directories.")]
Steps = Annotated[int | None, typer.Option("--steps", help="Total steps, for the ETA (if the script does not set "
                                              "model.total_steps).")]
Python = Annotated[str | None, typer.Option("--python", help="Interpreter on the hosts (default: this one).")]
SshUser = Annotated[str | None, typer.Option("--ssh-user", help="SSH user (a host's user@ wins).")]
SshPort = Annotated[int | None, typer.Option("--ssh-port", help="SSH port (a host's :port wins).")]
SshIdentity = Annotated[str | None, typer.Option("--ssh-identity", help="SSH private key.")]
SshOption = Annotated[list[str] | None, typer.Option(
    "--ssh-option", help="Extra ssh -o option, e.g. StrictHostKeyChecking=accept-new (repeatable).")]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Restarts without a new checkpoint before giving up "
                                          "(--morph).")]
HeartbeatTimeout = Annotated[float, typer.Option(
    "--heartbeat-timeout", help="Seconds without a worker's heartbeat that count as a crash.")]
MorphTimeout = Annotated[float, typer.Option("--morph-timeout", help="Seconds the on-demand checkpoint may take.")]
PreemptMargin = Annotated[float, typer.Option(
    "--preempt-margin", help="Morph this many seconds before a notified preemption.")]
Grace = Annotated[float, typer.Option(
    "--grace", help="Seconds workers get to exit after SIGTERM when the job stops, before SIGKILL.")]
RecheckMax = Annotated[float, typer.Option(
    "--recheck-max", help=f"With --morph, a host that does not answer is left out and checked again after "
    f"{RECHECK_FIRST:g} s, then after twice as long each time: at most this many seconds apart.")]
Handover = Annotated[bool, typer.Option(
    "--handover/--no-handover", help="With --morph: start the new configuration's workers while the old ones train, "
    "then hand the state over through the hosts' memory (no shared file system needed); --no-handover restarts "
    "through the checkpoint store.")]
Regroup = Annotated[bool, typer.Option(
    "--regroup/--no-regroup", help="With a handover under data parallelism: when a host is lost without notice and "
    "every stage keeps a whole replica elsewhere, the workers of the whole replicas left go on in their own "
    "processes (the step in flight redone, the lost replicas' examples taken over); --no-regroup recovers the job "
    "as after any crash.")]
ForkServer = Annotated[bool, typer.Option(
    "--fork-server/--no-fork-server", help="A host that runs several workers starts an interpreter with torch and "
    "varuna imported that forks them (and node 0's store): torch is imported once per host, not once per worker. "
    "With a handover, once the job trains, every host keeps one that forks the workers of the job's later "
    "configurations, so a recovery or morph does not wait ~2.5 s for imports; about 0.3 GB of memory per host.")]
ShelfDir = Annotated[str, typer.Option(
    "--shelf-dir", help="A tmpfs directory on every host where a handover keeps the published state.")]
HandoverCopies = Annotated[bool, typer.Option(
    "--handover-copies/--no-handover-copies", help="With a handover under data parallelism: each host also keeps a "
    "copy of its stage's files that its replicas on other hosts publish (a lost host then costs nothing, and a new "
    "worker finds its stage on its own host); --no-handover-copies publishes each file once, which is faster for a "
    "large model on a fast network.")]
SnapshotEvery = Annotated[str, typer.Option(
    "--snapshot-every", metavar="N|auto", help="With --morph: every N steps each worker copies its state into its "
    "host's memory (the shelf) and the next host keeps a copy, so a host lost without notice costs at most N steps "
    "and no store read. auto: as often as that costs at most 2% of the training time, measured at each snapshot; "
    "0: none.")]
ShelfBudget = Annotated[int | None, typer.Option(
    "--shelf-budget", help="Bytes a host's shelf may hold (default: the tmpfs's free space); state that does not "
    "fit goes through the checkpoint store.")]
StragglerThreshold = Annotated[float, typer.Option(
    "--straggler-threshold", help="Compute time over the median that makes a straggler (0.3 = 30%).")]
Slurm = Annotated[bool | None, typer.Option(
    "--slurm/--no-slurm", help="Run on the nodes of the Slurm allocation, agents started by srun (default: when "
    "SLURM_JOB_ID is set and --hosts is not given).", show_default=False)]
PreemptionSource = Annotated[str | None, typer.Option(
    "--preemption-source", help="Ask each node's cloud metadata service for spot eviction notices: azure, aws or "
    "gcp.")]
PreemptionEndpoint = Annotated[str | None, typer.Option(
    "--preemption-endpoint", help="The metadata service as http://host\\[:port] (default: the cloud's own).")]
PreemptionInterval = Annotated[float, typer.Option(
    "--preemption-interval", help="Seconds between two questions to the metadata service.")]


def launch(
    plan: PlanFile, script: Script = None, hosts: Hosts = None, gpus_per_node: GpusPerNode = None,
    code_dir: CodeDir = None, env_file: EnvFile = None, ckpt_dir: CkptDir = None, run_dir: RunDir = None,
    morph: Morph = DEFAULTS["morph"], morph_any_microbatch: MorphAnyMicrobatch = DEFAULTS["morph_any_microbatch"],
    resume: Resume = DEFAULTS["resume"], resume_or_start: ResumeOrStart = DEFAULTS["resume_or_start"],
    run_id: RunId = DEFAULTS["run_id"],
    legacy_args: LegacyArgs = DEFAULTS["legacy_args"], ckpt_every: CkptEvery = DEFAULTS["ckpt_every"],
    ckpt_keep: CkptKeep = DEFAULTS["ckpt_keep"], ckpt_tempdir: CkptTempdir = DEFAULTS["ckpt_tempdir"],
    ckpt_local: CkptLocal = DEFAULTS["ckpt_local"], steps: Steps = DEFAULTS["total_steps"], python: Python = None,
    ssh_user: SshUser = None,
    ssh_port: SshPort = None, ssh_identity: SshIdentity = None, ssh_option: SshOption = None,
    max_restarts: MaxRestarts = DEFAULTS["max_restarts"],
    heartbeat_timeout: HeartbeatTimeout = DEFAULTS["heartbeat_timeout"],
    morph_timeout: MorphTimeout = DEFAULTS["morph_timeout"], preempt_margin: PreemptMargin = DEFAULTS["preempt_margin"],
    grace: Grace = DEFAULTS["grace"], straggler_threshold: StragglerThreshold = DEFAULTS["straggler_threshold"],
    recheck_max: RecheckMax = DEFAULTS["recheck_max"], handover: Handover = DEFAULTS["handover"],
    regroup: Regroup = DEFAULTS["regroup"], fork_server: ForkServer = DEFAULTS["fork_server"],
    shelf_dir: ShelfDir = DEFAULTS["shelf_dir"], shelf_budget: ShelfBudget = DEFAULTS["shelf_budget"],
    handover_copies: HandoverCopies = DEFAULTS["handover_copies"],
    snapshot_every: SnapshotEvery = "auto" if DEFAULTS["snapshot_every"] is None else str(DEFAULTS["snapshot_every"]),
    slurm: Slurm = None, preemption_source: PreemptionSource = None, preemption_endpoint: PreemptionEndpoint = None,
    preemption_interval: PreemptionInterval = SpotConfig.interval,
) -> None:
    from varuna_core.launch.manager import Manager, choose_run
    from varuna_core.planning.artifacts import load_plan

    script = list(script or [])
    with named_as_options(OPTION_OF):  # the library's rules, before anything slow; named as the options
        check_numbers({"ckpt_every": ckpt_every, "ckpt_keep": ckpt_keep, "total_steps": steps,
                       "max_restarts": max_restarts, "heartbeat_timeout": heartbeat_timeout,
                       "morph_timeout": morph_timeout, "preempt_margin": preempt_margin, "grace": grace,
                       "straggler_threshold": straggler_threshold, "recheck_max": recheck_max,
                       "shelf_budget": shelf_budget})
        every = _snapshot_every(snapshot_every)
        if every and not (morph and handover):
            raise FieldError("snapshot_every", "needs --morph with the handover (snapshots live on the shelves)",
                             hint="add --morph, or drop --no-handover, or leave snapshots off (0)")
        check_ckpt_local(ckpt_local, morph=morph, handover=handover, tempdir=ckpt_tempdir)
        if gpus_per_node is not None:
            integer("gpus_per_node", gpus_per_node, low=1, high=MAX_SLOTS)
        ssh_config = SSHConfig(user=ssh_user, port=ssh_port, identity=ssh_identity, options=tuple(ssh_option or ()))
        spot = _spot(preemption_source, preemption_endpoint, preemption_interval)
    _check_places(python, {"--run-dir": run_dir, "--ckpt-dir": ckpt_dir, "--code-dir": code_dir},
                  ssh_identity)
    resume = _check_resume(resume, resume_or_start, run_dir, ckpt_dir)
    the_plan = load_plan(plan)
    code = str((code_dir or Path.cwd()).resolve())
    _check_script(script, code)
    env = _env_file(env_file) if env_file else {}
    slots = gpus_per_node or the_plan.gpus_per_node
    run = (run_dir or Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S")).resolve()
    store = (ckpt_dir or run / "checkpoints").resolve()
    reporter = None
    job = _slurm_job(slurm, hosts, gpus_per_node, the_plan.pp * the_plan.dp)
    if job is not None:
        host_list, slots = job.hosts(), min(job.slots)
        resume, run_id, why = _slurm_run(job, store, resume, run_id)
        reporter = _reporter()
        reporter.event(job.describe() + (f"; {why}" if why else ""))
    else:
        host_list = _hosts(hosts, slots, the_plan.pp * the_plan.dp, gpus_per_node)
    if not (ckpt_local and resume):  # (the hosts' own stores are not here: the run directory's events say)
        choose_run(store, resume, run_id, or_start=resume_or_start)  # another run's store: refused before anything
    runtime = HostRuntime(python=python or sys.executable, code_dir=code)
    ssh = ssh_config if host_list is not None and job is None else None
    reporter = reporter or _reporter()
    _preflight(reporter, host_list if job is None else None, ssh, runtime)
    with named_as_options(OPTION_OF):
        opts = LaunchOptions(
            script=script, run_dir=run, ckpt_dir=store, runtime=runtime, ssh=ssh, run_id=run_id,
            slurm=job.config() if job is not None else None, spot=spot, env=env, legacy_args=legacy_args,
            morph=morph, morph_any_microbatch=morph_any_microbatch, resume=resume, resume_or_start=resume_or_start,
            ckpt_every=ckpt_every, ckpt_keep=ckpt_keep, ckpt_tempdir=ckpt_tempdir, ckpt_local=ckpt_local,
            total_steps=steps, max_restarts=max_restarts, heartbeat_timeout=heartbeat_timeout,
            morph_timeout=morph_timeout, preempt_margin=preempt_margin, grace=grace,
            straggler_threshold=straggler_threshold,
            recheck_max=recheck_max, handover=handover, regroup=regroup, fork_server=fork_server,
            shelf_dir=shelf_dir,
            shelf_budget=shelf_budget,
            handover_copies=handover_copies, snapshot_every=every if (morph and handover) or every else 0)
    run.mkdir(parents=True, exist_ok=True)
    opts.ckpt_dir.mkdir(parents=True, exist_ok=True)
    reporter.event(f"run directory {run}")
    manager = Manager(opts, the_plan, host_list, hosts.resolve() if (hosts is not None and morph and job is None)
                      else None, slots, reporter)
    try:
        code_ = manager.run()
    finally:
        reporter.close()
    if code_:
        raise typer.Exit(code_)


def _hosts(hosts: Path | None, slots: int, world: int, gpus_per_node: int | None):
    """The hosts of ``--hosts`` (None: local processes), checked against the plan's ``world`` devices."""
    from varuna_core.launch.attempt import place
    from varuna_core.launch.hosts import is_loopback, read_hosts

    if hosts is None:
        if gpus_per_node is not None and gpus_per_node < world:
            raise ConfigError(f"the plan needs {world} devices (pp × dp); --gpus-per-node gives {gpus_per_node} on "
                              f"this machine", hint="add --hosts, or plan for fewer devices")
        return None
    host_list = read_hosts(hosts, slots)
    place(world, host_list)  # exit 2 with the numbers if the plan does not fit
    if len(host_list) > 1 and is_loopback(host_list[0].address) and not all(
            is_loopback(h.address) for h in host_list):
        raise ConfigError(f"the first host, {host_list[0].name}, is the master and resolves to loopback, which "
                          f"the other hosts cannot reach", hint="list it by an address the others reach")
    return host_list


def _slurm_job(slurm: bool | None, hosts: Path | None, gpus_per_node: int | None, world: int):
    """The Slurm allocation to run on (None: --hosts or local processes); see ``--slurm``."""
    from varuna_core.launch.attempt import place
    from varuna_core.launch.slurm import allocation, in_allocation

    if slurm is None:
        slurm = hosts is None and in_allocation()
    if not slurm:
        return None
    if hosts is not None:
        raise ConfigError("--slurm and --hosts both say where to run", hint="give one of them")
    job = allocation(gpus_per_node=gpus_per_node)
    place(world, job.hosts())  # exit 2 with the numbers if the plan does not fit
    return job


def _slurm_run(job, store: Path, resume: bool, run_id: str | None) -> tuple[bool, str | None, str]:
    """``(resume, run id, what was decided)`` for a job in ``store``: unless told otherwise, the run is named
    after the Slurm job, and continued when the store holds its checkpoints (the job was requeued; a requeue
    before its first checkpoint starts the run from scratch). ``--resume`` without ``--run-id`` prefers the
    job's own run when the store holds it beside others."""
    from varuna_core.checkpoint.layout import scan

    own = job.run_id()
    mine = [e for e in scan(store) if e.run == own]
    if run_id is not None:
        return resume, run_id, ""
    if resume:
        return True, (own if any(e.complete for e in mine) else None), ""
    if mine:
        return True, own, f"run {own} has checkpoints in {store}: resuming it (restart {job.restarts} of the job)"
    return False, own, f"run {own}"


def _snapshot_every(text: str) -> int | None:
    """``--snapshot-every``: a number of steps (0: none), or ``auto`` (None)."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if not value.isdigit():
        raise FieldError("snapshot_every", f"{printable(text)[:40]!r} is neither a number of steps nor 'auto'",
                         hint="e.g. --snapshot-every 50, or auto (the default with --morph), or 0 for none")
    return integer("snapshot_every", int(value), low=0, high=10**9)


def _check_resume(resume: bool, resume_or_start: bool, run_dir: Path | None, ckpt_dir: Path | None) -> bool:
    """Whether to resume. Without --run-dir and --ckpt-dir the store is the new RUN_DIR's (a new directory under
    runs/ each time): nothing to resume could be there, and the run would start from scratch unnoticed."""
    resume = resume or resume_or_start
    if resume and run_dir is None and ckpt_dir is None:
        option = "--resume-or-start" if resume_or_start else "--resume"
        raise ConfigError(f"{option} needs the checkpoint store of the run to continue, but neither --ckpt-dir nor "
                          f"--run-dir is given (the default run directory is a new one under runs/)",
                          hint="give --ckpt-dir STORE (or the earlier run's --run-dir)")
    return resume


def _spot(source: str | None, endpoint: str | None, interval: float) -> SpotConfig | None:
    """The spot watch of ``--preemption-source`` (None without it), checked by :class:`SpotConfig` itself."""
    from varuna_core.launch.spot import SOURCES

    if source is None:
        for option, given in (("--preemption-endpoint", endpoint is not None),
                              ("--preemption-interval", interval != SpotConfig.interval)):
            if given:
                raise ConfigError(f"{option} needs --preemption-source", hint=f"one of {', '.join(SOURCES)}")
        return None
    return SpotConfig(source=source, endpoint=endpoint, interval=interval)


def _preflight(reporter, host_list, ssh, runtime) -> None:
    """Check every host over SSH before anything starts (nothing to check for local processes)."""
    if host_list is None:
        return
    from varuna_core.launch.attempt import LaunchError
    from varuna_core.launch.ssh import check_hosts

    reporter.event(f"checking {len(host_list)} host(s) over SSH")
    problems = check_hosts(host_list, ssh, runtime)
    if problems:
        names = ", ".join(p.host.name for p in problems)
        raise LaunchError(f"cannot use {names}: " + "; ".join(f"{p.host.name}: {p.message}" for p in problems),
                          hint="nothing was started; fix SSH access (BatchMode, keys) or the hosts file")


MANAGER_FILE_LIMIT = 64 * 2**10
MAX_NOTICE_SECONDS = 7 * 86400.0  # as varuna_core.launch.protocol's (not imported here: it loads pydantic)


def notify_preempt(
    host: Annotated[str, typer.Argument(help="The host that goes away, as written in the hosts file.")],
    seconds: Annotated[float, typer.Option("--in", help="Seconds until it goes away.")] = 0.0,
    run_dir: Annotated[Path, typer.Option(
        "--run-dir", help="The job's run directory (holds manager.json).")] = Path("."),
    address: Annotated[str, typer.Option(
        "--address", help="The manager's address, if not this machine.")] = "127.0.0.1",
) -> None:
    """Tell a running `varuna launch --morph` that HOST will be preempted: the job checkpoints and continues
    without it. Authenticated with the job's token from RUN_DIR/manager.json."""
    from varuna_core.launch.heartbeat import send_notice

    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_NOTICE_SECONDS:
        raise ConfigError(f"--in must be a number of seconds in [0, {MAX_NOTICE_SECONDS:g}], got {seconds}")
    if not host.strip() or len(host) > 255 or not host.isprintable():
        raise ConfigError(f"HOST {_shown(host)} is not a host name",
                          hint="give the host as the hosts file names it, e.g. alice@10.0.0.6:2222")
    job, token, port = _manager_file(run_dir / "manager.json")
    _check_address(address, port)
    if not send_notice((address, port), job, token, {"host": host, "seconds": seconds}):
        raise VarunaError(f"the manager at {address}:{port} did not acknowledge", hint="is the job still running?")
    typer.echo(f"notified: {_printable(host)} goes away in {seconds:g}s")


def _manager_file(path: Path) -> tuple[str, str, int]:
    """``(job, token, port)`` from a run directory's ``manager.json``, every field checked."""
    from varuna_core.util.fs import read_regular

    hint = "give --run-dir of a running `varuna launch`"
    if not os.path.lexists(path.parent):
        raise ConfigError(f"--run-dir {path.parent} does not exist", hint=hint)
    if not path.parent.is_dir():
        raise ConfigError(f"--run-dir {path.parent} is not a directory", hint=hint)
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist", hint=hint)
    data = read_regular(path, MANAGER_FILE_LIMIT, what="manager file")
    try:
        info = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"manager file {path} is nested too deeply", hint=hint) from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"manager file {path} is not JSON: {exc}", hint=hint) from None
    if not isinstance(info, dict):
        raise ConfigError(f"manager file {path} holds a {type(info).__name__}, not an object", hint=hint)
    job, token, port = info.get("job"), info.get("token"), info.get("port")
    for name, value in (("job", job), ("token", token)):
        if not isinstance(value, str) or not 1 <= len(value) <= 256:
            raise ConfigError(f"manager file {path}: {name} must be a string, got {_shown(value)}", hint=hint)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"manager file {path}: port must be an integer in 1..65535, got {_shown(port)}",
                          hint=hint)
    assert isinstance(job, str) and isinstance(token, str)  # checked above
    return job, token, port


def _check_address(address: str, port: int) -> None:
    import socket

    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise ConfigError(f"--address {_shown(address)} is not an address this machine can reach: {exc}") from None


def _printable(text: str) -> str:
    """``text`` with control characters escaped (a name from the command line or a hosts file may hold
    terminal escapes)."""

    return printable(text)


# ----------------------------------------------------------------------------------------------------------
# Progress


class _Reporter:
    """Events as log lines on stderr; the live status as a Rich panel on a terminal, else a line every 10 s.

    Messages quote host names, paths, hosts-file lines and workers' output: they are printed as plain text
    (control characters escaped), never as Rich markup, where a host named ``[/]`` would raise and stop the job.
    """

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.live = None
        self._last_line = 0.0
        self._last = None
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def event(self, message: str) -> None:
        from rich.text import Text

        line = Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", ("launch", "bold cyan"), " ",
                             _printable(str(message)))
        self.console.print(line, highlight=False)

    def status(self, status) -> None:
        self._last = status
        if self.live is not None:
            self.live.update(_panel(status))
        elif time.monotonic() - self._last_line > 10:
            self._last_line = time.monotonic()
            self.console.print(_line(status), highlight=False, markup=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        elif self._last is not None:
            self.console.print(_line(self._last), highlight=False, markup=False)


def _reporter() -> _Reporter:
    return _Reporter()


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def _line(s) -> str:
    """The status in one line of plain text (print it with ``markup=False``: straggler names are host names)."""
    total = f"/{s.total_steps}" if s.total_steps else ""
    loss = f"{s.loss:.4f}" if s.loss is not None else "-"
    rate = f"{s.samples_per_second:,.1f}" if s.samples_per_second else "-"
    extra = f", stragglers: {_printable('; '.join(s.stragglers))}" if s.stragglers else ""
    return (f"attempt {s.attempt} ({s.state}, pp={s.pp}×dp={s.dp} on {s.hosts} host(s)): step {s.step}{total}, "
            f"loss {loss}, {rate} samples/s, ETA {_fmt_time(s.eta)}, restarts {s.restarts}, morphs {s.morphs}{extra}")


def _panel(s):
    """The status as a table whose cells are plain text (straggler names are host names, not markup)."""
    from rich.table import Table
    from rich.text import Text

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    total = f" / {s.total_steps}" if s.total_steps else ""
    rows = (("state", f"attempt {s.attempt}: {s.state}, pp={s.pp} × dp={s.dp} on {s.hosts} host(s)"),
            ("step", f"{s.step}{total}"), ("loss", f"{s.loss:.4f}" if s.loss is not None else "-"),
            ("samples/s", f"{s.samples_per_second:,.1f}" if s.samples_per_second else "-"),
            ("ETA", _fmt_time(s.eta)), ("restarts / morphs", f"{s.restarts} / {s.morphs}"),
            ("stragglers", "; ".join(s.stragglers) or "none"))
    for name, value in rows:
        table.add_row(name, Text(_printable(str(value))))
    return table
