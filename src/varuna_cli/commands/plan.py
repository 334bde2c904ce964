"""``varuna plan PROFILE --gpus N --batch-size B -o plan.yaml`` and ``varuna plan show PLAN``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from varuna_core.errors import ConfigError


def plan(
    profile: Annotated[Path, typer.Argument(help="A profile from `varuna profile`.")],
    gpus: Annotated[int, typer.Option("--gpus", help="Devices available.")] = ...,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Global batch (kept fixed).")] = ...,
    gpus_per_node: Annotated[Optional[int], typer.Option(
        "--gpus-per-node", help="Devices per node (default: all on one node).")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(
        "--gpu-memory", help="Memory per device, e.g. 80GiB (default: unlimited).")] = None,
    schedule: Annotated[Optional[str], typer.Option(
        "--schedule", help="Schedules to consider, comma-separated (default: varuna,1f1b,gpipe).")] = None,
    top: Annotated[int, typer.Option("--top", help="Alternatives to show and keep in the plan.")] = 5,
    headroom: Annotated[float, typer.Option("--headroom", help="Fraction of memory kept free.")] = 0.1,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the plan (.yaml or .json).")] = Path(
        "plan.yaml"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.")] = False,
) -> None:
    """Simulate every (pipeline depth, data-parallel width, micro-batch size, schedule) and write the best.

    `varuna plan show PLAN` draws a plan's schedule.
    """
    import time

    from rich.console import Console

    from varuna_core.artifacts import load_profile, save_plan
    from varuna_core.plan import PlanRequest, make_plan
    from varuna_core.schedule import SCHEDULE_NAMES
    from varuna_core.units import parse_bytes

    names = tuple(x.strip() for x in schedule.split(",") if x.strip()) if schedule else SCHEDULE_NAMES
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {headroom}")
    prof = load_profile(profile)
    req = PlanRequest(gpus=gpus, batch_size=batch_size, gpus_per_node=gpus_per_node,
                      gpu_memory=parse_bytes(gpu_memory) if gpu_memory else None, schedules=names, top=top,
                      headroom=headroom)
    started = time.perf_counter()
    result = make_plan(prof, req)
    result.profile_path = str(profile.resolve())
    elapsed = time.perf_counter() - started
    save_plan(result, output)
    err = Console(stderr=True)
    for note in result.assumptions:
        err.print(f"[dim]note: {note}[/dim]")
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
        return
    _table(result)
    err.print(f"searched in {elapsed:.2f} s; wrote {output}")


def _table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    from varuna_core.units import format_bytes

    out = Console()
    p = result.prediction
    table = Table(title=f"{result.model}: {result.gpus} devices, global batch {result.batch_size}",
                  title_justify="left")
    for col, just in (("", "left"), ("pp×dp", "right"), ("mb×M", "right"), ("schedule", "left"),
                      ("step ms", "right"), ("samples/s", "right"), ("bubble", "right"), ("memory", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    table.add_row("plan", f"{result.pp}×{result.dp}", f"{result.microbatch_size}×{result.num_microbatches}",
                  result.schedule, f"{p.step_time * 1e3:.4g}", f"{p.samples_per_second:.4g}",
                  f"{p.bubble_fraction:.0%}", format_bytes(max(s.memory_bytes for s in result.stages)),
                  style="bold")
    for i, alt in enumerate(result.alternatives, 1):
        table.add_row(f"#{i + 1}", f"{alt.pp}×{alt.dp}", f"{alt.microbatch_size}×{alt.num_microbatches}",
                      alt.schedule, f"{alt.step_time * 1e3:.4g}", f"{alt.samples_per_second:.4g}",
                      f"{alt.bubble_fraction:.0%}", format_bytes(alt.peak_memory_bytes))
    out.print(table)
    for i, alt in enumerate(result.alternatives, 1):
        out.print(f"  #{i + 1}: {alt.reason}")
    stages = ", ".join(f"{a}-{b - 1}" for a, b in result.partition)
    out.print(f"partition (segments per stage): {stages}; stage_to_rank_map {result.stage_to_rank_map!r}")
    if result.alternatives:
        out.print(f"why this plan: {_why(result)}")


def _why(result) -> str:
    runner = result.alternatives[0]
    gain = runner.step_time / result.prediction.step_time - 1
    who = f"pp={runner.pp}, dp={runner.dp}, micro-batch {runner.microbatch_size}, {runner.schedule}"
    if gain < 0.005:
        return f"the fastest, tied with {who} ({runner.reason}); ties go to the shallower pipeline and fewer stages"
    return f"{gain:.1%} faster than the runner-up ({who}: {runner.reason.split(': ', 1)[-1]})"


def show(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan from `varuna plan`.")],
    png: Annotated[Optional[Path], typer.Option("--png", help="Draw the simulated timeline to this PNG.")] = None,
    measured: Annotated[Optional[Path], typer.Option(
        "--measured", help="A Chrome trace recorded by the runtime (Varuna(trace=...)): drawn beside the "
        "simulation (needs --png).")] = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Rows of the grid to print (0: all).")] = 60,
) -> None:
    """Print a plan's schedule as a step × stage grid; optionally draw the simulated timeline."""
    from varuna_core.artifacts import load_plan
    from varuna_core.schedule import generate

    result = load_plan(plan_path)
    sched = generate(result.schedule, result.pp, result.num_microbatches)
    lines = sched.grid().splitlines()
    if max_steps and len(lines) > max_steps + 1:
        hidden = len(lines) - max_steps - 1
        lines = lines[: max_steps + 1] + [f"... {hidden} more steps (--max-steps 0 shows all)"]
    typer.echo(f"{result.schedule}: {result.pp} stages, {result.num_microbatches} micro-batches per replica")
    typer.echo("\n".join(lines))
    if measured and not png:
        raise ConfigError("--measured needs --png FILE to draw into")
    if png:
        from varuna_core.timeline import draw_plan

        draw_plan(result, png, measured=measured)
        typer.echo(f"wrote {png}", err=True)
