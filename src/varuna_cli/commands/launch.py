"""``varuna launch PLAN -- SCRIPT ARGS`` and ``varuna notify-preempt HOST``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from varuna_core.errors import ConfigError

HELP = (
    "Run SCRIPT on every device of PLAN: local processes, or the hosts of --hosts over SSH.\n\n"
    "Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
    "MASTER_PORT) and VARUNA_PLAN, VARUNA_CKPT_DIR and, when resuming, VARUNA_RESUME_STEP, which Varuna(...) picks "
    "up by itself. Logs go to RUN_DIR/logs/rank<R>.log; Ctrl-C stops every worker on every host.\n\n"
    "With --morph the job survives machines coming and going: when the hosts file changes, or `varuna "
    "notify-preempt HOST` says a host goes away, the workers checkpoint and stop, the plan is made again for the "
    "new device count (same global batch) and the job continues from that checkpoint; after a crash it restarts "
    "from the last complete checkpoint.\n\n"
    "Put -- before SCRIPT so that its options are not read as the launcher's: "
    "varuna launch plan.yaml --hosts hosts.txt --morph -- examples/gpt/train.py --steps 400"
)


def _env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``export`` allowed, ``#`` comments, values may be quoted); every line counts."""
    import shlex

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read env file {path}: {exc.strerror or exc}") from None
    env = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"env file {path} line {number}: not KEY=VALUE: {raw.strip()!r}")
        try:
            words = shlex.split(value, comments=True)
        except ValueError as exc:
            raise ConfigError(f"env file {path} line {number}: {exc}: {raw.strip()!r}") from None
        env[key.strip()] = " ".join(words)
    return env


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


def launch(
    plan: Annotated[Path, typer.Argument(help="The plan from `varuna plan`.")],
    script: Annotated[Optional[list[str]], typer.Argument(help="SCRIPT [ARGS...] (after --).", show_default=False)] = None,
    hosts: Annotated[Optional[Path], typer.Option("--hosts", help="Hosts file: one '\\[user@]host\\[:port] \\[slots=N]' "
                                                  "per line; without it, local processes.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(
        "--gpus-per-node", help="Workers per host without slots=N (default: the plan's).")] = None,
    code_dir: Annotated[Optional[Path], typer.Option(
        "--code-dir", help="Directory SCRIPT runs in on every host (default: the current one).")] = None,
    env_file: Annotated[Optional[Path], typer.Option("--env-file", help="KEY=VALUE lines set for every worker.")] = None,
    ckpt_dir: Annotated[Optional[Path], typer.Option(
        "--ckpt-dir", help="Checkpoint store shared by all hosts (default: RUN_DIR/checkpoints).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(
        "--run-dir", help="Logs, events and metrics (default: runs/launch-<time>).")] = None,
    morph: Annotated[bool, typer.Option("--morph", help="Follow host changes and preemptions; restart after "
                                        "crashes.")] = False,
    morph_any_microbatch: Annotated[bool, typer.Option(
        "--morph-any-microbatch", help="Let a morph change the micro-batch size (faster, but the losses then "
        "differ from an uninterrupted run's by rounding).")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Start from the latest complete checkpoint in "
                                         "--ckpt-dir.")] = False,
    legacy_args: Annotated[bool, typer.Option(
        "--legacy-args", help="Also pass the original's --rank --local_rank --stage_to_rank_map --chunk_size "
        "--batch-size.")] = False,
    ckpt_every: Annotated[int, typer.Option("--ckpt-every", help="Checkpoint every N steps (0: only on demand).")] = 0,
    ckpt_keep: Annotated[Optional[int], typer.Option("--ckpt-keep", help="Keep the newest K checkpoints.")] = None,
    ckpt_tempdir: Annotated[Optional[str], typer.Option(
        "--ckpt-tempdir", help="Fast local directory for background periodic checkpoints.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Total steps, for the ETA (if the script does "
                                                 "not set model.total_steps).")] = None,
    python: Annotated[Optional[str], typer.Option("--python", help="Interpreter on the hosts (default: this one).")] = None,
    ssh_user: Annotated[Optional[str], typer.Option("--ssh-user", help="SSH user (a host's user@ wins).")] = None,
    ssh_port: Annotated[Optional[int], typer.Option("--ssh-port", help="SSH port (a host's :port wins).")] = None,
    ssh_identity: Annotated[Optional[str], typer.Option("--ssh-identity", help="SSH private key.")] = None,
    ssh_option: Annotated[Optional[list[str]], typer.Option(
        "--ssh-option", help="Extra ssh -o option, e.g. StrictHostKeyChecking=accept-new (repeatable).")] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="Restarts without progress before giving "
                                              "up (--morph).")] = 3,
    heartbeat_timeout: Annotated[float, typer.Option(
        "--heartbeat-timeout", help="Seconds without a worker's heartbeat that count as a crash.")] = 60.0,
    morph_timeout: Annotated[float, typer.Option(
        "--morph-timeout", help="Seconds the on-demand checkpoint may take.")] = 300.0,
    preempt_margin: Annotated[float, typer.Option(
        "--preempt-margin", help="Morph this many seconds before a notified preemption.")] = 30.0,
    grace: Annotated[float, typer.Option(
        "--grace", help="Seconds workers get to exit after SIGTERM when the job stops, before SIGKILL.")] = 10.0,
    straggler_threshold: Annotated[float, typer.Option(
        "--straggler-threshold", help="Compute time over the median that makes a straggler (0.3 = 30%).")] = 0.3,
) -> None:
    from varuna_core.artifacts import load_plan
    from varuna_core.hosts import is_loopback, read_hosts
    from varuna_core.launch import LaunchError, LaunchOptions, place
    from varuna_core.morph import Manager
    from varuna_core.remote import Runtime, SSHConfig, check_hosts

    script = list(script or [])
    the_plan = load_plan(plan)
    world = the_plan.pp * the_plan.dp
    code = str((code_dir or Path.cwd()).resolve())
    _check_script(script, code)
    env = _env_file(env_file) if env_file else {}
    for name, value, low in (("--gpus-per-node", gpus_per_node, 1), ("--ckpt-every", ckpt_every, 0),
                             ("--max-restarts", max_restarts, 0), ("--ckpt-keep", ckpt_keep, 1),
                             ("--grace", grace, 0), ("--heartbeat-timeout", heartbeat_timeout, 1),
                             ("--morph-timeout", morph_timeout, 1), ("--preempt-margin", preempt_margin, 0)):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be ≥ {low}, got {value}")
    slots = gpus_per_node or the_plan.gpus_per_node
    host_list = None
    if hosts is not None:
        host_list = read_hosts(hosts, slots)
        place(world, host_list)  # exit 2 with the numbers if the plan does not fit
        if len(host_list) > 1 and is_loopback(host_list[0].address) and not all(
                is_loopback(h.address) for h in host_list):
            raise ConfigError(f"the first host, {host_list[0].name}, is the master and resolves to loopback, which "
                              f"the other hosts cannot reach", hint="list it by an address the others reach")
    elif gpus_per_node is not None and gpus_per_node < world:
        raise ConfigError(f"the plan needs {world} devices (pp × dp); --gpus-per-node gives {gpus_per_node} on "
                          f"this machine", hint="add --hosts, or plan for fewer devices")
    run = (run_dir or Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S")).resolve()
    runtime = Runtime(python=python or sys.executable, code_dir=code)
    ssh = SSHConfig(user=ssh_user, port=ssh_port, identity=ssh_identity, options=tuple(ssh_option or ())) \
        if host_list is not None else None
    reporter = _reporter()
    if host_list is not None:
        reporter.event(f"checking {len(host_list)} host(s) over SSH")
        problems = check_hosts(host_list, ssh, runtime)
        if problems:
            names = ", ".join(p.host.name for p in problems)
            raise LaunchError(f"cannot use {names}: " + "; ".join(f"{p.host.name}: {p.message}" for p in problems),
                              hint="nothing was started; fix SSH access (BatchMode, keys) or the hosts file")
    opts = LaunchOptions(
        script=script, run_dir=run, ckpt_dir=(ckpt_dir or run / "checkpoints").resolve(), runtime=runtime, ssh=ssh,
        env=env, legacy_args=legacy_args, morph=morph, morph_any_microbatch=morph_any_microbatch, resume=resume,
        ckpt_every=ckpt_every, ckpt_keep=ckpt_keep,
        ckpt_tempdir=ckpt_tempdir, total_steps=steps, max_restarts=max_restarts, heartbeat_timeout=heartbeat_timeout,
        morph_timeout=morph_timeout, preempt_margin=preempt_margin, grace=grace,
        straggler_threshold=straggler_threshold)
    run.mkdir(parents=True, exist_ok=True)
    opts.ckpt_dir.mkdir(parents=True, exist_ok=True)
    reporter.event(f"run directory {run}")
    manager = Manager(opts, the_plan, host_list, hosts.resolve() if (hosts is not None and morph) else None, slots,
                      reporter)
    try:
        code_ = manager.run()
    finally:
        reporter.close()
    if code_:
        raise typer.Exit(code_)



def notify_preempt(
    host: Annotated[str, typer.Argument(help="The host that goes away, as written in the hosts file.")],
    seconds: Annotated[float, typer.Option("--in", help="Seconds until it goes away.")] = 0.0,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="The job's run directory (holds manager.json).")] = Path("."),
    address: Annotated[str, typer.Option("--address", help="The manager's address, if not this machine.")] = "127.0.0.1",
) -> None:
    """Tell a running `varuna launch --morph` that HOST will be preempted: the job checkpoints and continues
    without it. Authenticated with the job's token from RUN_DIR/manager.json."""
    from varuna_core.heartbeat import send_notice

    path = run_dir / "manager.json"
    try:
        info = json.loads(path.read_text())
        job, token, port = info["job"], info["token"], int(info["port"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", hint="give --run-dir of a running `varuna launch`") from None
    if seconds < 0:
        raise ConfigError(f"--in must be ≥ 0, got {seconds}")
    if not send_notice((address, port), job, token, {"host": host, "seconds": seconds}):
        typer.echo(f"error: the manager at {address}:{port} did not acknowledge (is the job still running?)",
                   err=True)
        raise typer.Exit(1)
    typer.echo(f"notified: {host} goes away in {seconds:g}s")


# ----------------------------------------------------------------------------------------------------------
# Progress


class _Reporter:
    """Events as log lines on stderr; the live status as a Rich panel on a terminal, else a line every 10 s."""

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
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] [bold cyan]launch[/bold cyan] {message}",
                           highlight=False)

    def status(self, status) -> None:
        self._last = status
        if self.live is not None:
            self.live.update(_panel(status))
        elif time.monotonic() - self._last_line > 10:
            self._last_line = time.monotonic()
            self.console.print(_line(status), highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        elif self._last is not None:
            self.console.print(_line(self._last), highlight=False)


def _reporter() -> _Reporter:
    return _Reporter()


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def _line(s) -> str:
    total = f"/{s.total_steps}" if s.total_steps else ""
    loss = f"{s.loss:.4f}" if s.loss is not None else "-"
    rate = f"{s.samples_per_second:,.1f}" if s.samples_per_second else "-"
    extra = f", stragglers: {'; '.join(s.stragglers)}" if s.stragglers else ""
    return (f"attempt {s.attempt} ({s.state}, pp={s.pp}×dp={s.dp} on {s.hosts} host(s)): step {s.step}{total}, "
            f"loss {loss}, {rate} samples/s, ETA {_fmt_time(s.eta)}, restarts {s.restarts}, morphs {s.morphs}{extra}")


def _panel(s):
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    total = f" / {s.total_steps}" if s.total_steps else ""
    table.add_row("state", f"attempt {s.attempt}: {s.state}, pp={s.pp} × dp={s.dp} on {s.hosts} host(s)")
    table.add_row("step", f"{s.step}{total}")
    table.add_row("loss", f"{s.loss:.4f}" if s.loss is not None else "-")
    table.add_row("samples/s", f"{s.samples_per_second:,.1f}" if s.samples_per_second else "-")
    table.add_row("ETA", _fmt_time(s.eta))
    table.add_row("restarts / morphs", f"{s.restarts} / {s.morphs}")
    table.add_row("stragglers", "; ".join(s.stragglers) or "none")
    return table
