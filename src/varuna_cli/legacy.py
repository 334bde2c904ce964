"""``python -m varuna.run_varuna``: the original launcher's command line, run by ``varuna launch``.

A job started the original's way keeps its command line::

    python -m varuna.run_varuna --machine_list machines.txt --gpus_per_node 4 --batch_size 512 \\
        --nstages 4 --chunk_size 8 --code_dir /work/code train.py --lr 1e-4

It becomes a plan and a ``varuna launch --legacy-args`` of it: the machine list is the hosts file (one address per
line, as before; ``user@host:port slots=N`` lines work too), a single loopback machine means local processes
(inside a Slurm job too: the list asked for this machine, so its processes run here, not on the job's nodes by
srun), morphing is on unless ``--no_morphing``, and every worker gets the original's ``--rank --local_rank
--stage_to_rank_map --chunk_size --batch-size`` before the script's own arguments. ``--code_dir`` must exist
when the processes are local (on SSH machines each is checked before anything starts).

The plan is made the way the original documents it:

* ``--nstages`` and ``--chunk_size`` given: that layout, with ``dp`` = devices // ``nstages`` replicas and the
  global batch rounded down to a multiple of ``dp`` (each worker's ``--batch-size`` is its replica's share, and
  scripts multiply it back). With a profile (``--profile_folder``) the partition and schedule come from it;
  without, ``Varuna(...)`` balances parameter bytes (a *layout given by hand*).
* neither given and a profile given: the planner searches every configuration (``AutoConfig`` of the original;
  ``--nstages`` alone or ``--chunk_size`` alone narrows the search).

Each run gets a run directory (logs, the plan, and the checkpoint store ``RUN_DIR/checkpoints``): ``--run-dir``, or
a new ``runs/run_varuna-<time>`` (recording the script and code directory in ``run_varuna.json``).

What the original did and this does not: ``--manager_ip`` is accepted and not needed (the launcher finds the
address the hosts reach it by); ``--resume`` continues the previous run instead of re-reading
``/tmp/varuna/launch_args``, so the other arguments are given again. The previous run is the newest
``runs/run_varuna-*`` of the same script and code directory whose store holds a complete checkpoint (or the run
of ``--run-dir`` / the store of ``--ckpt-dir`` when given); when there is none, ``--resume`` is refused. Any
``varuna launch`` option not listed here may follow, spelled as there (``--ssh-identity KEY``, ``--ckpt-every
100`` ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from varuna_core.errors import ConfigError
from varuna_core.util.text import printable

__all__ = ["main", "parser", "make_plan_for"]

MACHINE_LIST = "available_machines.out"  # the original's defaults
ENV_FILE = "varuna.env"
GPUS_PER_NODE = 4
RUNS = Path("runs")  # where each run gets its directory, run_varuna-<time>
RUN_PREFIX = "run_varuna-"
RUN_RECORD = "run_varuna.json"  # in a run directory: the script and code directory it ran
RECORD_LIMIT = 64 * 2**10

# `varuna launch` options that may follow the original's: name -> takes a value (True) or is a flag (False).
LAUNCH_OPTIONS = {
    "--run-dir": True, "--ckpt-dir": True, "--ckpt-every": True, "--ckpt-keep": True, "--ckpt-tempdir": True,
    "--steps": True, "--python": True, "--ssh-user": True, "--ssh-port": True, "--ssh-identity": True,
    "--ssh-option": True, "--max-restarts": True, "--heartbeat-timeout": True, "--morph-timeout": True,
    "--preempt-margin": True, "--grace": True, "--straggler-threshold": True, "--run-id": True,
    "--morph-any-microbatch": False, "--resume-or-start": False,
}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose mistakes are the toolkit's one-line errors (exit 2), not a usage dump."""

    def error(self, message: str):  # argparse's hook
        raise ConfigError(f"run_varuna: {message}", hint="see `python -m varuna.run_varuna --help`")


def parser() -> argparse.ArgumentParser:
    """The original's flags (both ``--batch_size`` and the README's ``--batch-size``), a profile, and the
    pass-through ``varuna launch`` options."""
    p = _Parser(prog="python -m varuna.run_varuna", allow_abbrev=False,
                description="Launch a training script written for the original Varuna (its launcher's command line), "
                            "by `varuna launch --legacy-args`.")
    p.add_argument("--machine_list", default=MACHINE_LIST,
                   help="one machine per line (address, or user@host:port slots=N); a single loopback address runs "
                        "local processes (default: %(default)s)")
    p.add_argument("--gpus_per_node", type=int, default=GPUS_PER_NODE, help="workers per machine (default: 4)")
    p.add_argument("--manager_ip", default=None, help="accepted for compatibility; not needed")
    p.add_argument("--no_morphing", action="store_true", help="do not follow machines coming and going")
    p.add_argument("--env_file", default=None,
                   help=f"KEY=VALUE lines for every worker (default: {ENV_FILE} when it exists)")
    p.add_argument("--nstages", type=int, default=None, help="pipeline stages")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=int, default=None,
                   help="global batch (all replicas)")
    p.add_argument("--chunk_size", type=int, default=None, help="micro-batch size")
    p.add_argument("--code_dir", default=None, help="directory the script runs in (default: the current one)")
    p.add_argument("--resume", action="store_true",
                   help="continue the previous run: the newest runs/run_varuna-* of this script and code directory "
                        "with a complete checkpoint (or the run of --run-dir, the store of --ckpt-dir); refused when "
                        "there is none (--resume-or-start: start afresh then)")
    p.add_argument("--profile_folder", "--profile", dest="profile", default=None,
                   help="a profile (profile.json, or the folder holding it) to plan from")
    launch = p.add_argument_group("varuna launch options", "before the script; passed on as given (see `varuna "
                                  "launch --help`): " + " ".join(LAUNCH_OPTIONS))
    for name, takes_value in LAUNCH_OPTIONS.items():
        action = "store_true" if not takes_value else "append" if name == "--ssh-option" else "store"
        launch.add_argument(name, action=action, dest=_dest(name), help=argparse.SUPPRESS)
    p.add_argument("training_script", help="the training script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _dest(option: str) -> str:
    return "launch_" + option.lstrip("-").replace("-", "_")


def make_plan_for(nstages: int | None, chunk_size: int | None, batch_size: int, devices: int, per_node: int,
                  profile_path: Path | None, model: str):
    """The plan of a run_varuna command line (see the module's docstring for the rules)."""
    from varuna_core.planning.planner import layout_plan

    if profile_path is not None:
        return _planned(nstages, chunk_size, batch_size, devices, per_node, profile_path)
    if nstages is None or chunk_size is None:
        missing = [name for name, value in (("--nstages", nstages), ("--chunk_size", chunk_size)) if value is None]
        raise ConfigError(f"{' and '.join(missing)} not given, and no profile to plan from",
                          hint="give --nstages and --chunk_size, or --profile_folder DIR holding a profile.json "
                               "(`varuna profile`, or the Profiler class)")
    if nstages > devices:
        raise ConfigError(f"--nstages {nstages} needs at least {nstages} devices; the machine list gives {devices}",
                          hint="add machines, raise --gpus_per_node, or use fewer stages")
    dp = min(devices // nstages, batch_size)
    batch = batch_size // dp * dp
    note = (f"global batch {batch_size} rounded down to {batch}, a multiple of the {dp} replicas (as the original "
            f"launcher did: each worker gets --batch-size={batch // dp})") if batch != batch_size else ""
    return layout_plan(pp=nstages, dp=dp, microbatch_size=chunk_size, batch_size=batch, gpus=devices,
                       gpus_per_node=per_node, model=model, note=note)


def _planned(nstages, chunk_size, batch_size, devices, per_node, profile_path: Path):
    """A plan from the profile: searched, or at ``nstages`` stages; the batch then rounded to the replicas."""
    import dataclasses

    from varuna_core.ir.schedule import check_schedule
    from varuna_core.planning.artifacts import load_profile
    from varuna_core.planning.planner import PlanRequest, make_plan

    profile = load_profile(profile_path)
    request = PlanRequest(gpus=devices, batch_size=batch_size, gpus_per_node=per_node,
                          microbatch_sizes=(chunk_size,) if chunk_size else None)
    plan = make_plan(profile, request) if nstages is None else _at_depth(profile, request, nstages)
    if plan.batch_size % plan.dp:  # each worker gets --batch-size = batch // dp: keep the plan equal to that
        batch = plan.batch_size // plan.dp * plan.dp
        plan = _at_depth(profile, dataclasses.replace(request, batch_size=batch, microbatch_sizes=(
            plan.microbatch_size,), schedules=(check_schedule(plan.schedule),)), plan.pp)
        plan.assumptions.append(f"global batch {batch_size} rounded down to {batch}, a multiple of the {plan.dp} "
                                f"replicas (as the original launcher did)")
    plan.profile_path = str(profile_path.resolve())
    return plan


def _at_depth(profile, request, pp: int):
    """The fastest plan with ``pp`` stages over the request's micro-batch sizes and schedules."""
    from varuna_core.errors import VarunaError
    from varuna_core.planning.planner import plan_for, schedules_for

    if pp > min(request.gpus, profile.num_segments):
        raise ConfigError(f"--nstages {pp} is more than the {request.gpus} devices or the profile's "
                          f"{profile.num_segments} segments allow")
    dp = min(request.gpus // pp, request.batch_size)
    best, why = None, None
    for mbs in request.microbatch_sizes or profile.microbatch_sizes:
        for schedule in schedules_for(profile, request):
            try:
                plan = plan_for(profile, request, pp=pp, dp=dp, microbatch_size=mbs, schedule=schedule)
            except VarunaError as exc:
                why = exc.message
                continue
            if best is None or plan.predicted().step_time < best.predicted().step_time:
                best = plan
    if best is None:
        raise ConfigError(f"no plan with --nstages {pp} on {request.gpus} devices: {why}",
                          hint="try other --nstages or --chunk_size, or leave them out to search")
    return best


def _machines(path: Path, gpus_per_node: int):
    """The machines of the list, and whether they mean local processes (one loopback machine, no user/port)."""
    from varuna_core.launch.hosts import is_loopback, read_hosts

    if not path.exists():
        raise ConfigError(f"machine list {path} does not exist",
                          hint="give --machine_list FILE: one machine address per line (127.0.0.1 for this one)")
    hosts = read_hosts(path, gpus_per_node)
    local = len(hosts) == 1 and is_loopback(hosts[0].address) and hosts[0].user is None and hosts[0].port is None
    return hosts, local


def _check_numbers(ns: argparse.Namespace) -> None:
    from varuna_core.launch.hosts import MAX_SLOTS
    from varuna_core.util.checks import integer

    for name, value, high in (("--gpus_per_node", ns.gpus_per_node, MAX_SLOTS), ("--nstages", ns.nstages, 10**6),
                              ("--batch_size", ns.batch_size, 10**9), ("--chunk_size", ns.chunk_size, 10**9)):
        if value is not None:
            integer(name, value, low=1, high=high)
    if ns.batch_size is None:
        raise ConfigError("--batch_size is required: the global batch of all replicas",
                          hint="the original's --batch-size spelling works too")


def _profile_file(given: str | None) -> Path | None:
    """``profile.json`` in the folder given, or the file given."""
    if given is None:
        return None
    path = Path(given)
    return path / "profile.json" if path.is_dir() else path


def run(argv: list[str]) -> None:
    """Parse ``argv`` (the original's command line), make the plan, and run ``varuna launch`` on it."""
    from varuna_cli.commands.launch import launch
    from varuna_core.planning.artifacts import save_plan

    ns = parser().parse_args(argv)
    _check_numbers(ns)
    hosts, local = _machines(Path(ns.machine_list), ns.gpus_per_node)
    code_dir = Path(ns.code_dir or ".").resolve()
    if local and not code_dir.is_dir():
        raise ConfigError(f"--code_dir {printable(ns.code_dir)} is not a directory",
                          hint="give the directory the training script runs in (default: the current one)")
    devices = sum(h.slots for h in hosts)
    per_node = max(h.slots for h in hosts)
    record = {"script": str(code_dir / ns.training_script), "code_dir": str(code_dir)}
    run_dir = _run_dir(ns, record)
    plan = make_plan_for(ns.nstages, ns.chunk_size, ns.batch_size, devices, per_node, _profile_file(ns.profile),
                         model=Path(ns.training_script).stem)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / RUN_RECORD).exists():
        (run_dir / RUN_RECORD).write_text(json.dumps(record) + "\n")
    plan_file = _free_name(run_dir, "plan", ".yaml")  # a reused run directory keeps its earlier plans
    save_plan(plan, plan_file)
    env_file = ns.env_file or (ENV_FILE if Path(ENV_FILE).is_file() else None)
    print(f"run_varuna: pp={plan.pp} × dp={plan.dp}, micro-batch {plan.microbatch_size}, global batch "
          f"{plan.batch_size} on {devices} device(s){' (local processes)' if local else ''}; plan "
          f"{printable(plan_file)}", file=sys.stderr)
    launch(plan_file, [ns.training_script, *ns.training_script_args], hosts=None if local else Path(ns.machine_list),
           gpus_per_node=hosts[0].slots if local else ns.gpus_per_node,
           code_dir=Path(ns.code_dir) if ns.code_dir else None, env_file=Path(env_file) if env_file else None,
           run_dir=run_dir, morph=not ns.no_morphing, resume=ns.resume, legacy_args=True,
           slurm=False if local else None, **_launch_options(ns))


def _run_dir(ns: argparse.Namespace, record: dict) -> Path:
    """The run directory: ``--run-dir``; with ``--resume`` (and no ``--ckpt-dir``), the previous run's; else a
    new one under ``runs/`` (also for ``--resume-or-start`` when there is no previous run)."""
    if ns.launch_run_dir:
        return Path(ns.launch_run_dir).resolve()
    if (ns.resume or ns.launch_resume_or_start) and not ns.launch_ckpt_dir:
        try:
            return _previous_run(RUNS, record)
        except ConfigError:
            if not ns.launch_resume_or_start:
                raise
    return (RUNS / time.strftime(f"{RUN_PREFIX}%Y%m%d-%H%M%S")).resolve()


def _previous_run(runs: Path, record: dict) -> Path:
    """The newest ``runs/run_varuna-*`` that ran ``record``'s script in its code directory and whose checkpoint
    store holds a complete checkpoint: the run ``--resume`` continues (the original's ``--resume`` continued the
    previous launch).

    Raises:
        ConfigError: there is no such run.
    """
    from varuna_core.checkpoint.layout import scan

    same = [d for d in sorted(runs.glob(f"{RUN_PREFIX}*"), reverse=True) if _recorded(d) == record]
    for directory in same:
        if any(e.complete for e in scan(directory / "checkpoints")):
            return directory.resolve()
    script = printable(record["script"])
    if same:
        raise ConfigError(f"--resume: no run of {script} under {runs}/ holds a complete checkpoint (the newest, "
                          f"{printable(same[0])}, holds none)",
                          hint="leave out --resume to start afresh, or give --run-dir / --ckpt-dir of the run to "
                               "continue")
    raise ConfigError(f"--resume: no earlier run of {script} (code directory {printable(record['code_dir'])}) "
                      f"under {printable(runs.resolve())}/ to continue",
                      hint="leave out --resume to start afresh, or give --run-dir / --ckpt-dir of the run to continue")


def _recorded(directory: Path) -> dict | None:
    """The script and code directory a run directory recorded (None: none, or unreadable)."""
    from varuna_core.util.fs import read_regular

    try:
        data = json.loads(read_regular(directory / RUN_RECORD, RECORD_LIMIT, what="run record"))
    except (ConfigError, ValueError, OSError):
        return None
    return data if isinstance(data, dict) else None


def _free_name(directory: Path, stem: str, suffix: str) -> Path:
    """``directory/stem suffix``, or ``stem-2``, ``stem-3``, ... when taken."""
    path, n = directory / f"{stem}{suffix}", 1
    while path.exists() or path.is_symlink():
        n += 1
        path = directory / f"{stem}-{n}{suffix}"
    return path


def _launch_options(ns: argparse.Namespace) -> dict:
    """The pass-through ``varuna launch`` options that were given, as ``launch()``'s keyword arguments."""
    converters = {"--ckpt-every": int, "--ckpt-keep": int, "--steps": int, "--ssh-port": int, "--max-restarts": int,
                  "--heartbeat-timeout": float, "--morph-timeout": float, "--preempt-margin": float,
                  "--grace": float, "--straggler-threshold": float, "--ckpt-dir": Path}
    keyword = {"--steps": "steps"}
    options = {}
    for name in LAUNCH_OPTIONS:
        value = getattr(ns, _dest(name))
        if value is None or value is False or name == "--run-dir":
            continue
        convert = converters.get(name, lambda v: v)
        try:
            value = convert(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
        options[keyword.get(name, name.lstrip("-").replace("-", "_"))] = value
    return options


def main(argv: list[str] | None = None) -> None:
    """The ``python -m varuna.run_varuna`` entry point: exit codes and one-line errors as the ``varuna`` CLI's."""
    import typer

    from varuna_cli.app import _report
    from varuna_core.env import debug

    try:
        run(list(sys.argv[1:] if argv is None else argv))
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except SystemExit:
        raise
    except BaseException as err:  # one line, not a traceback (VARUNA_DEBUG=1 shows it)
        if debug():
            raise
        _report(err)
    sys.exit(0)
