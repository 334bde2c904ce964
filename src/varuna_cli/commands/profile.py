"""``varuna profile SPEC -o profile.json``: measure a model's segments and the network."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from varuna_cli.flags import named_as_options
from varuna_core.errors import ConfigError

OPTIONS = {"microbatch_sizes": "--microbatch-sizes", "nproc": "--nproc", "precision": "--precision",
           "device": "--device", "repeats": "--repeats", "warmup": "--warmup", "memory_limit": "--memory-limit"}


def _sizes(microbatch_sizes: str | None, max_microbatch: int | None) -> list[int] | None:
    """The micro-batch sizes to measure (None: the default) as ``--microbatch-sizes`` or ``--max-microbatch``
    give them; the options check their range."""
    from varuna_core.planning.artifacts import MAX_MICROBATCH_SIZE
    from varuna_core.profiling.options import MAX_SIZES
    from varuna_core.util.checks import integer

    if microbatch_sizes is not None and max_microbatch is not None:
        raise ConfigError("give either --microbatch-sizes or --max-microbatch, not both")
    if max_microbatch is not None:
        integer("--max-microbatch", max_microbatch, low=1, high=MAX_MICROBATCH_SIZE)
        sizes, n = [], 1
        while n < max_microbatch:
            sizes.append(n)
            n *= 2
        return sizes + [max_microbatch]
    if microbatch_sizes is None:
        return None
    hint = "e.g. --microbatch-sizes 1,2,4,8"
    words = [x.strip() for x in microbatch_sizes.split(",") if x.strip()]
    if not words or len(words) > MAX_SIZES or not all(w.isascii() and w.isdigit() and len(w) <= 9 for w in words):
        raise ConfigError(f"--microbatch-sizes must be 1 to {MAX_SIZES} positive integers separated by commas, got "
                          f"{microbatch_sizes[:80]!r}", hint=hint)
    return [int(w) for w in words]


def profile(
    spec: Annotated[str, typer.Argument(help="The model: 'package.module:attr' or 'path/file.py:attr' (a ModelSpec).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the profile (JSON).")] = Path(
        "profile.json"),
    microbatch_sizes: Annotated[str | None, typer.Option(
        "--microbatch-sizes", help="Micro-batch sizes to measure, e.g. 1,2,4,8 (default 1,2,4,8).")] = None,
    max_microbatch: Annotated[int | None, typer.Option(
        "--max-microbatch", help="Measure 1, 2, 4, ... up to N instead.")] = None,
    nproc: Annotated[int, typer.Option("--nproc", help="Local processes to spread the segments over; ≥2 also "
                                       "measures the network.")] = 1,
    precision: Annotated[str, typer.Option(
        "--precision", help="fp32, bf16 or fp16 (autocast, as in training).")] = "fp32",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repetitions per measurement (median kept).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed repetitions before them.")] = 2,
    memory_limit: Annotated[str | None, typer.Option(
        "--memory-limit", help="Bytes a segment may use, e.g. 16GiB; the first micro-batch size over it ends the "
        "sweep (recorded, not an error).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON on stdout.")] = False,
) -> None:
    """Measure each segment's forward, backward and recompute time and memory per micro-batch size, and the
    point-to-point and all-reduce cost of the network (with --nproc ≥ 2)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from varuna_core.ir.units import parse_bytes
    from varuna_core.profiling.options import DEFAULT_MICROBATCH_SIZES, ProfileOptions
    from varuna_core.profiling.run import profile_with
    from varuna_core.util.versioned_io import check_writable, save_artifact

    sizes = _sizes(microbatch_sizes, max_microbatch)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    with named_as_options(OPTIONS):  # the options check their numbers; the errors name ours
        options = ProfileOptions(microbatch_sizes=tuple(sizes or DEFAULT_MICROBATCH_SIZES), nproc=nproc,
                                 precision=precision, device=device, repeats=repeats, warmup=warmup,
                                 memory_limit=limit)
    check_writable(output, "output")
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=as_json or not err.is_terminal) as bar:
        task = bar.add_task("measuring", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        result = profile_with(spec, options, progress=progress)
    save_artifact(result, output)
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
        return
    _summary(result, output)


def _summary(result, output: Path) -> None:
    """The measurements as a table of plain-text cells, control characters escaped (the model and cut names
    come from user code)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from varuna_core.ir.units import format_bytes
    from varuna_core.util.text import printable

    out = Console()
    table = Table(title=Text(f"{printable(result.model)}: {result.num_segments} segments"), title_justify="left")
    table.add_column("segment", justify="right")
    table.add_column("ends at")
    table.add_column("params", justify="right")
    table.add_column("optimizer", justify="right")
    for n in result.microbatch_sizes:
        table.add_column(f"mb {n}: fwd/bwd ms", justify="right")
    table.add_column(f"out / saved (mb {result.microbatch_sizes[-1]})", justify="right")
    for seg in result.segments:
        cells = [str(seg.index), printable(seg.output_cut or "(loss)"), format_bytes(seg.param_bytes),
                 format_bytes(seg.optimizer_bytes)]
        cells.extend(f"{m.forward.median * 1e3:.2f} / {m.backward.median * 1e3:.2f}" for m in seg.measures)
        last = seg.measures[-1]
        cells.append(f"{format_bytes(last.output_bytes)} / {format_bytes(last.saved_bytes)}")
        table.add_row(*map(Text, cells))
    out.print(table)
    for seg in result.segments:
        if seg.skips:
            out.print(Text(printable(f"{seg.output_cut} also carries {format_bytes(seg.measures[-1].skip_bytes)} of "
                                     f"values skipping it (mb {seg.measures[-1].microbatch_size}): "
                                     f"{'; '.join(seg.skips)}")))
    for curve in result.comm:
        what = "point-to-point" if curve.op == "p2p" else f"all-reduce over {curve.group_size}"
        out.print(f"{what} ({curve.link}-node): latency {curve.fit.latency * 1e6:.0f} µs, "
                  f"bandwidth {format_bytes(curve.fit.bandwidth)}/s, fit error {curve.fit.rel_error:.0%}", markup=False)
    idle = result.idle_penalty
    if idle is not None:
        after = ", ".join(f"{f:+.0%} after {g * 1e3:g} ms" for g, f in zip(idle.gaps_s, idle.fractions, strict=True))
        out.print(f"after a wait (the planner charges it): a {idle.action_s * 1e3:.2f} ms forward ran {after}",
                  markup=False)
    if result.stopped:
        out.print(f"stopped at micro-batch {result.stopped.microbatch_size}: {printable(result.stopped.reason)}",
                  markup=False)
    typer.echo(f"wrote {printable(output)}", err=True)
