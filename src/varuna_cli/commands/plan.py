"""``varuna plan PROFILE --gpus N --batch-size B -o plan.yaml`` and ``varuna plan show PLAN``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from varuna_cli.flags import named_as_options
from varuna_core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import JustifyMethod

    from varuna_core.ir.schedule import ScheduleName

OPTIONS = {"gpus": "--gpus", "batch_size": "--batch-size", "gpus_per_node": "--gpus-per-node",
           "gpu_memory": "--gpu-memory", "schedules": "--schedule", "headroom": "--headroom", "top": "--top",
           "host_memory": "--host-memory",
           "shard_optimizer": "--shard-optimizer", "wire_dtype": "--wire-dtype", "pp": "--pp", "dp": "--dp",
           "microbatch_sizes": "--microbatch-size", "link_rate": "--link-rate", "link_latency": "--link-latency"}


def plan(
    profile: Annotated[Path, typer.Argument(help="A profile from `varuna profile`.")],
    gpus: Annotated[int | None, typer.Option("--gpus", help="Devices available.")] = None,
    *,  # typer passes every option by name: a required option may follow those with defaults
    batch_size: Annotated[int, typer.Option("--batch-size", help="Global batch (kept fixed).")],
    gpus_per_node: Annotated[int | None, typer.Option(
        "--gpus-per-node", help="Devices per node (default: all on one node).")] = None,
    gpu_memory: Annotated[str | None, typer.Option(
        "--gpu-memory", help="Memory per device, e.g. 80GiB (default: unlimited).")] = None,
    host_memory: Annotated[str | None, typer.Option(
        "--host-memory", help="Memory per node, e.g. 512GiB: says whether in-memory snapshots fit.")] = None,
    schedule: Annotated[str | None, typer.Option(
        "--schedule", help="Schedules to consider, comma-separated (default: all; zb and varuna-zb only with a "
                           "profile that measured their B and W).")] = None,
    pp: Annotated[int | None, typer.Option(
        "--pp", help="Pin the pipeline depth (stages); it must divide --gpus unless --dp is pinned too.")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="Pin the data-parallel width (replicas).")] = None,
    microbatch_size: Annotated[int | None, typer.Option(
        "--microbatch-size", help="Pin the micro-batch size (default: search the profiled ones).")] = None,
    link_rate: Annotated[str | None, typer.Option(
        "--link-rate", help="Rate of the link between nodes, each way, e.g. 50mbit, 1gbit or 100MB/s: messages and "
        "all-reduces crossing nodes are charged at it (default: the profile's inter-node fit).")] = None,
    link_latency: Annotated[str | None, typer.Option(
        "--link-latency", help="Latency per message on that link, e.g. 200us (default: the profile's).")] = None,
    top: Annotated[int, typer.Option("--top", help="Alternatives to show and keep in the plan.")] = 5,
    headroom: Annotated[float, typer.Option("--headroom", help="Fraction of memory kept free.")] = 0.1,
    shard_optimizer: Annotated[bool | None, typer.Option(
        "--shard-optimizer/--no-shard-optimizer",
        help="Shard the optimizer state over the data-parallel replicas, or never (default: consider both; "
             "sharded wins where the whole state does not fit, or when it is predicted >1% faster).")] = None,
    wire_dtype: Annotated[str | None, typer.Option(
        "--wire-dtype", help="bf16 or fp16: activations and gradients cross cuts in it (Varuna(..., wire_dtype=...)), "
                             "charged at its bytes; the plan carries it (default: exact).")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the plan (.yaml or .json).")] = Path(
        "plan.yaml"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.")] = False,
    slurm: Annotated[bool, typer.Option(
        "--slurm", help="Take --gpus and --gpus-per-node from the Slurm allocation this runs in.")] = False,
) -> None:
    """Simulate every (pipeline depth, data-parallel width, micro-batch size, schedule) and write the best.

    --pp, --dp, --microbatch-size and --schedule pin any of them; the search varies the rest.

    `varuna plan show PLAN` draws a plan's schedule.
    """
    import time

    from pydantic import ValidationError
    from rich.console import Console
    from rich.text import Text

    from varuna_core.ir.units import parse_bytes, parse_rate, parse_seconds
    from varuna_core.planning.artifacts import load_profile, save_plan
    from varuna_core.planning.planner import PlanRequest, make_plan
    from varuna_core.util.text import printable
    from varuna_core.util.versioned_io import check_writable, first_problem

    gpus, gpus_per_node = _devices(gpus, gpus_per_node, slurm)
    memory = parse_bytes(gpu_memory) if gpu_memory is not None else None
    node_memory = parse_bytes(host_memory) if host_memory is not None else None
    if node_memory is not None and node_memory < 1:
        raise ConfigError(f"--host-memory must be ≥ 1, got {node_memory}", hint="give a node's memory, e.g. 512GiB")
    with named_as_options(OPTIONS):  # the request checks its numbers and names; the errors name our options
        req = PlanRequest(gpus=gpus, batch_size=batch_size, gpus_per_node=gpus_per_node, gpu_memory=memory,
                          schedules=_schedules(schedule), top=top, headroom=headroom,
                          shard_optimizer=shard_optimizer, wire_dtype=wire_dtype, pp=pp, dp=dp,
                          microbatch_sizes=None if microbatch_size is None else (microbatch_size,),
                          link_rate=None if link_rate is None else _named("--link-rate", parse_rate, link_rate),
                          link_latency=None if link_latency is None else _named("--link-latency", parse_seconds,
                                                                                link_latency))
    check_writable(output, "plan")
    prof = load_profile(profile)
    started = time.perf_counter()
    try:
        with named_as_options(OPTIONS):
            result = make_plan(prof, req)
    except ValidationError as exc:
        raise ConfigError(f"the best configuration for {profile} cannot be written as a plan: {first_problem(exc)}",
                          hint="use more devices, a smaller --batch-size, or profile larger micro-batch sizes"
                          ) from None
    result.profile_path = str(profile.resolve())
    elapsed = time.perf_counter() - started
    save_plan(result, output)
    err = Console(stderr=True)
    for note in result.assumptions:
        err.print(Text(f"note: {printable(note)}", style="dim"))
    problem = snapshot_problem(result.snapshot_bytes_per_node, node_memory)
    if problem:
        err.print(Text(f"warning: {problem}", style="yellow"))
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
        return
    _table(result)
    err.print(f"searched in {elapsed:.2f} s; wrote {printable(output)}", markup=False, highlight=False)


def _named(option: str, parse, text: str):
    """``parse(text)``; its error names the option."""
    try:
        return parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc.message}", hint=exc.hint) from None


def _print_traffic(out, result) -> None:
    """The bytes each rank sends per step on each flow, the link it crosses, and its time at --link-rate."""
    from varuna_core.ir.units import format_bytes
    from varuna_core.planning.traffic import link_loads

    loads = link_loads(result)
    if not loads:
        return
    parts = []
    for load in loads:
        where = "between nodes" if load.inter else "inside a node"
        rate = f", {load.seconds * 1e3:.4g} ms at {result.link_rate * 8 / 1e6:.4g} Mbit/s" \
            if load.seconds is not None else ""
        parts.append(f"{load.what}: {format_bytes(load.bytes_per_step)} {where}{rate}")
    out.print("bytes per step, each rank and direction: " + "; ".join(parts), markup=False, highlight=False)


def snapshot_problem(need: int, node_memory: int | None) -> str | None:
    """Why the in-memory snapshots of a plan would not fit a node of ``node_memory`` bytes (None: they fit, or
    no memory was given). A snapshot leaves ``MIN_FREE`` of the host's memory free, as the workers check."""
    from varuna_core.ir.units import format_bytes
    from varuna_core.worker.snapshots import MIN_FREE

    if node_memory is None or not need:
        return None
    room = int(node_memory * (1 - MIN_FREE))
    if need <= room:
        return None
    return (f"in-memory snapshots need {format_bytes(need)} on a node, more than the {format_bytes(room)} a node of "
            f"{format_bytes(node_memory)} gives them ({MIN_FREE:.0%} stays free): `varuna launch --morph` would skip "
            "them, and a host lost without notice would cost the steps since the last checkpoint (use more nodes "
            "or larger ones; --snapshot-every 0 turns snapshots off)")


def _devices(gpus: int | None, gpus_per_node: int | None, slurm: bool) -> tuple[int, int | None]:
    """``(--gpus, --gpus-per-node)``: as given, or the Slurm allocation's (``--gpus-per-node`` still says how
    many devices a node has, when Slurm cannot tell)."""
    if not slurm:
        if gpus is None:
            raise ConfigError("--gpus is required", hint="give the device count, or --slurm inside a Slurm allocation")
        return gpus, gpus_per_node
    if gpus is not None:
        raise ConfigError("--gpus and --slurm both give the device count", hint="give one of them")
    from rich.console import Console

    from varuna_core.launch.slurm import allocation

    found = allocation(gpus_per_node=gpus_per_node)
    Console(stderr=True).print(f"{found.describe()}", markup=False, highlight=False)
    return found.total, min(found.slots)


def _schedules(text: str | None) -> tuple[ScheduleName, ...] | None:
    """The schedule names ``--schedule`` lists, comma-separated (the request checks them, after its numbers);
    ``None`` without the option: every schedule the profile allows."""
    if text is None:
        return None
    return cast("tuple[ScheduleName, ...]", tuple(x.strip() for x in text.split(",") if x.strip()))


def _table(result) -> None:
    """The plan and its alternatives. Every text cell is plain text, control characters escaped: the model name
    comes from the profile."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from varuna_core.ir.units import format_bytes
    from varuna_core.util.text import printable

    out = Console()
    p = result.prediction
    table = Table(title=Text(f"{printable(result.model)}: {result.gpus} devices, global batch {result.batch_size}"),
                  title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("", "left"), ("pp×dp", "right"), ("mb×M", "right"), ("schedule", "left"), ("step ms", "right"),
        ("samples/s", "right"), ("bubble", "right"), ("memory", "right"))
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=True)
    table.add_row(*map(Text, ("plan", _layout(result), f"{result.microbatch_size}×{result.num_microbatches}",
                              result.schedule, f"{p.step_time * 1e3:.4g}", f"{p.samples_per_second:.4g}",
                              f"{p.bubble_fraction:.0%}", format_bytes(max(s.memory_bytes for s in result.stages)))),
                  style="bold")
    for i, alt in enumerate(result.alternatives, 1):
        table.add_row(*map(Text, (f"#{i + 1}", _layout(alt), f"{alt.microbatch_size}×{alt.num_microbatches}",
                                  alt.schedule, f"{alt.step_time * 1e3:.4g}", f"{alt.samples_per_second:.4g}",
                                  f"{alt.bubble_fraction:.0%}", format_bytes(alt.peak_memory_bytes))))
    out.print(table)
    for i, alt in enumerate(result.alternatives, 1):
        out.print(f"  #{i + 1}: {printable(alt.reason)}", markup=False)
    stages = ", ".join(f"{a}-{b - 1}" for a, b in result.partition)
    out.print(f"partition (segments per stage): {stages}; stage_to_rank_map {result.stage_to_rank_map!r}",
              markup=False)
    if _placement(result) == "stage":
        out.print("placement (s): each stage's replicas on consecutive ranks, so on one node where they fit: their "
                  "all-reduce stays inside it and the stage boundaries cross the nodes", markup=False)
    _print_skips(out, result)
    _print_split(out, result)
    _print_sharding(out, result)
    _print_traffic(out, result)
    _print_wire(out, result)
    if result.snapshot_bytes_per_node:
        out.print(f"in-memory snapshots (`varuna launch --morph`): {format_bytes(result.snapshot_bytes_per_node)} of "
                  "host memory on the fullest node", markup=False)
    if result.alternatives:
        out.print(f"why this plan: {printable(_why(result))}", markup=False)


def _layout(row) -> str:
    """``pp×dp``, marked ``z`` where the optimizer state is sharded over the replicas and ``s`` where a stage's
    replicas are on consecutive ranks (a plan or a candidate)."""
    return f"{row.pp}×{row.dp}{' z' if row.shard_optimizer else ''}{' s' if _placement(row) == 'stage' else ''}"


def _placement(row) -> str:
    """A candidate's placement, or a plan's as its map reads (``"stage"``: each stage's replicas together)."""
    if hasattr(row, "placement"):
        return row.placement
    from varuna_core.ir.topology import Topology

    by_stage = row.pp > 1 and row.dp > 1 and Topology.parse(row.stage_to_rank_map) == Topology.by_stage(row.pp, row.dp)
    return "stage" if by_stage else "pipeline"


def _print_sharding(out, result) -> None:
    """Whether the plan shards the optimizer state over the replicas, and what a rank then holds of it."""
    if result.shard_optimizer:
        out.print(f"optimizer state sharded over the {result.dp} replicas of each stage (z: Varuna(..., "
                  f"shard_optimizer=True)): each rank holds 1/{result.dp} of its stage's", markup=False)


def _print_wire(out, result) -> None:
    """With a wire dtype, what crosses each stage boundary per micro-batch in it."""
    from varuna_core.ir.units import format_bytes

    if result.wire_dtype is None:
        return
    sent = ", ".join(f"{st.stage} → {st.stage + 1}: {format_bytes(st.activation_bytes)}" for st in result.stages[:-1])
    out.print(f"activations and gradients cross cuts in {result.wire_dtype} (Varuna(..., wire_dtype="
              f"{result.wire_dtype!r})){f'; per micro-batch each way, {sent}' if sent else ''}", markup=False,
              highlight=False)


def _print_split(out, result) -> None:
    """Under a schedule that splits the backward, what B and W cost per stage and what W keeps meanwhile."""
    from varuna_core.ir.units import format_bytes

    if not any(st.pending_weights for st in result.stages):
        return
    out.print(f"{result.schedule} splits the backward into B (input gradient) and W (weights' gradients); per "
              f"micro-batch, and what a micro-batch keeps from its B to its W:", markup=False, highlight=False)
    for st in result.stages:
        out.print(f"  stage {st.stage}: B {st.backward * 1e3:.3g} ms, W {st.weight * 1e3:.3g} ms; keeps "
                  f"{format_bytes(st.weight_bytes)}, up to {st.pending_weights} at once", markup=False, highlight=False)


def _print_skips(out, result) -> None:
    """Per stage boundary where tensors skip over the cut, what is sent and how much of it skips."""
    from varuna_core.ir.units import format_bytes

    for st in result.stages:
        if st.skip_bytes:
            out.print(f"stage {st.stage} → {st.stage + 1} sends {format_bytes(st.activation_bytes)} per micro-batch, "
                      f"of which {format_bytes(st.skip_bytes)} are values skipping the cut for later stages",
                      markup=False, highlight=False)


def _why(result) -> str:
    runner = result.alternatives[0]
    gain = runner.step_time / result.prediction.step_time - 1
    who = f"pp={runner.pp}, dp={runner.dp}, micro-batch {runner.microbatch_size}, {runner.schedule}"
    if gain < 0.005:
        return f"the fastest, tied with {who} ({runner.reason}); ties go to the shallower pipeline and fewer stages"
    return f"{gain:.1%} faster than the runner-up ({who}: {runner.reason.split(': ', 1)[-1]})"


def show(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan from `varuna plan`.")],
    png: Annotated[Path | None, typer.Option("--png", help="Draw the simulated timeline to this PNG.")] = None,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="A Chrome trace recorded by the runtime (Varuna(trace=...)): drawn beside the "
        "simulation (needs --png).")] = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Rows of the grid to print (0: all).")] = 60,
) -> None:
    """Print a plan's schedule as a step × stage grid; optionally draw the simulated timeline."""
    from varuna_core.ir.schedule import generate
    from varuna_core.planning.artifacts import load_plan
    from varuna_core.util.checks import integer
    from varuna_core.util.versioned_io import check_writable

    integer("--max-steps", max_steps, low=0)
    if measured and not png:
        raise ConfigError("--measured needs --png FILE to draw into")
    if png:
        check_writable(png, "--png")
    if measured:
        _check_trace(measured)
    result = load_plan(plan_path)
    if png:
        from varuna_core.planning.timeline import check_drawable

        check_drawable(result)
    sched = generate(result.schedule, result.pp, result.num_microbatches)
    lines = sched.grid().splitlines()
    if max_steps and len(lines) > max_steps + 1:
        hidden = len(lines) - max_steps - 1
        lines = lines[: max_steps + 1] + [f"... {hidden} more steps (--max-steps 0 shows all)"]
    typer.echo(f"{result.schedule}: {result.pp} stages, {result.num_microbatches} micro-batches per replica"
               f"{f', optimizer state sharded over the {result.dp} replicas' if result.shard_optimizer else ''}"
               f"{f', {result.wire_dtype} on the wire' if result.wire_dtype else ''}")
    typer.echo("\n".join(lines))
    from rich.console import Console

    if any(st.skip_bytes or st.pending_weights for st in result.stages):
        _print_skips(Console(), result)
        _print_split(Console(), result)
    _print_traffic(Console(), result)
    if png:
        from varuna_core.planning.timeline import draw_plan

        draw_plan(result, png, measured=measured)
        from varuna_core.util.text import printable

        typer.echo(f"wrote {printable(png)}", err=True)
    if measured:
        _print_comparison(result, measured)


def _print_comparison(result, measured: Path) -> None:
    """The simulated step against the measured one in numbers: per stage and action kind, the simulated time of
    one action, the measured median compute (the action less its wait for a message) and the total wait."""
    from rich.console import Console
    from rich.table import Table

    from varuna_core.planning.timeline import compare

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:.3g}"

    table = Table(title="simulated vs measured (replica 0)", title_justify="left")
    for col in ("stage", "action", "n", "simulated ms", "measured ms", "error", "waited ms (all)"):
        table.add_column(col, justify="left" if col in ("stage", "action") else "right", no_wrap=True)
    for row in compare(result, measured):
        sim, got = row["simulated_s"], row["measured_s"]
        error = f"{got / sim - 1:+.0%}" if sim and got is not None else "—"
        table.add_row("all" if row["stage"] < 0 else str(row["stage"]), row["op"], str(row["count"]), ms(sim),
                      ms(got), error, ms(row["waited_s"]))
    Console().print(table)


MAX_TRACE_BYTES = 256 * 2**20


def _check_trace(path: Path) -> None:
    """A measured trace is a regular file (or a directory of them) of bounded size: a FIFO would block the
    reader forever, and a huge file is not a trace of one step."""
    import stat

    from varuna_core.util.fs import describe_mode

    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    for f in files:
        try:
            info = f.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read trace {f}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"trace {f} is {describe_mode(info.st_mode)}, not a regular file")
        if info.st_size > MAX_TRACE_BYTES:
            raise ConfigError(f"trace {f} is {info.st_size:,} bytes, more than the {MAX_TRACE_BYTES:,} a trace "
                              f"may have", hint="is it the right file?")
