"""``varuna ckpt list|inspect|verify|merge|assemble``: look into checkpoint stores without a cluster.

``DIR`` is a checkpoint store (the latest complete ``step_N`` is used) or one ``DIR/step_N``. Tables go to
stdout; ``--json`` prints one JSON document instead. ``verify`` exits 1 naming the first problem.

Everything shown that comes from the checkpoint or its path (names, manifest fields, problems) passes through
:func:`_plain` before it meets Rich: a ``[/]`` in a directory name or a model name is text, not markup (it would
crash the command), emoji codes are not expanded, and control characters are escaped (a terminal escape in a
manifest never reaches the terminal). Plain lines (``verify``) pass through ``printable``.

``assemble`` builds one complete checkpoint from the parts the hosts of a job hold in their own directories
(local, or ``[user@]host:PATH`` over SSH); see :mod:`varuna_core.checkpoint.assemble`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import JustifyMethod

app = typer.Typer(
    name="ckpt",
    help="List, inspect, verify, merge and assemble checkpoints (a store DIR, or one DIR/step_N).",
    no_args_is_help=True,
    rich_markup_mode="rich",
)

_Json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]


def _plain(value: object) -> str:
    """``value`` as Rich markup that shows it literally, control characters escaped (a terminal escape in a
    model name would otherwise reach the terminal)."""
    from rich.markup import escape

    from varuna_core.util.text import printable

    return escape(printable(value))


def _console(**kwargs):
    from rich.console import Console

    return Console(emoji=False, **kwargs)


@app.command("list")
def list_(
    store: Annotated[Path, typer.Argument(metavar="DIR", help="A checkpoint store (holding step_N/).")],
    as_json: _Json = False,
) -> None:
    """Every checkpoint of a store, incomplete ones included."""
    import json

    from rich.table import Table

    from varuna_core.checkpoint.layout import latest, runs, scan
    from varuna_core.checkpoint.tools import list_checkpoints
    from varuna_core.ir.units import format_bytes

    infos = list_checkpoints(store)
    entries = scan(store)
    newest: dict[str | None, int] = {  # run -> its latest complete step
        run: found.step for run in runs([e for e in entries if e.complete])
        if (found := latest(entries, of_runs={run})) is not None}
    only_run_latest = next(iter(newest.values())) if len(newest) == 1 else None
    if as_json:
        doc = {"store": str(store), "latest_complete": only_run_latest,
               "latest_by_run": {run or "": step for run, step in newest.items()},
               "checkpoints": [i.model_dump(mode="json") for i in infos]}
        typer.echo(json.dumps(doc, indent=2))
        return
    err = _console(stderr=True)
    if not infos:
        err.print(f"no checkpoints in {_plain(store)}")
        return
    models = sorted({i.model for i in infos if i.model})
    title = f"{_plain(store)}: {len(infos)} checkpoint{'s' if len(infos) != 1 else ''}"
    if len(models) == 1:
        title += f" of {_plain(models[0])}"
    table = Table(title=title, title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("step", "right"), ("status", "left"), ("run", "left"), ("size", "right"), ("pp×dp", "right"),
        ("rank map", "left"), ("plan", "left"), ("created", "left"))
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=col != "rank map", overflow="fold")
    if len(models) > 1:
        table.add_column("model", overflow="fold")
    for i in infos:
        if i.manifest_error is not None and i.complete:
            status = "[red]bad manifest[/red]"
        elif i.complete:
            status = "latest" if newest.get(i.run) == i.step else "complete"
        else:
            status = "[yellow]incomplete[/yellow]"
        world = f"{i.pp}×{i.dp}" if i.pp is not None else "-"
        created = (i.created or "-").replace("T", " ")[:16]
        row = [str(i.step), status, _plain(i.run or "-"), format_bytes(i.bytes), world,
               _plain(i.stage_to_rank_map or "-"),
               "yes" if i.plan else "no", _plain(created)]
        if len(models) > 1:
            row.append(_plain(i.model or "-"))
        table.add_row(*row, style="bold" if i.complete and newest.get(i.run) == i.step else None)
    _console().print(table)


@app.command("inspect")
def inspect(
    path: Annotated[Path, typer.Argument(metavar="DIR[/step_N]", help="A store or one checkpoint.")],
    max_keys: Annotated[int, typer.Option("--max-keys", help="Tensor rows to print (0: all).")] = 50,
    as_json: _Json = False,
) -> None:
    """Every tensor of a checkpoint (shape, dtype, bytes) and the bytes by kind, stage and module."""
    from rich.table import Table

    from varuna_core.checkpoint.tools import KINDS
    from varuna_core.checkpoint.tools import inspect as inspect_checkpoint
    from varuna_core.ir.units import format_bytes

    rep = inspect_checkpoint(path)
    if as_json:
        typer.echo(rep.model_dump_json(indent=2))
        return
    out = _console()
    status = "complete" if rep.complete else "[yellow]incomplete[/yellow]"
    world = f", pp={rep.pp} dp={rep.dp} map {_plain(repr(rep.stage_to_rank_map))}" if rep.pp is not None else ""
    out.print(f"{_plain(rep.path)}: step {rep.step}, {status}, {_plain(rep.model or 'unknown model')}{world}; "
              f"{len(rep.tensors)} tensors, {format_bytes(rep.total_bytes)} ({format_bytes(rep.file_bytes)} on disk)")
    if rep.tied:
        out.print("tied: " + "; ".join(" = ".join(_plain(n) for n in g) for g in rep.tied))

    kinds = Table(title="by kind", title_justify="left")
    for col in ("kind", "tensors", "bytes"):
        kinds.add_column(col, justify="left" if col == "kind" else "right", no_wrap=True)
    for kind in KINDS:
        total = rep.totals[kind]
        kinds.add_row(kind, str(total.tensors), format_bytes(total.bytes))
    kinds.add_row("total", str(len(rep.tensors)), format_bytes(rep.total_bytes), style="bold")
    out.print(kinds)
    for title, groups in (("by stage", rep.by_stage), ("by top-level module", rep.by_prefix)):
        if not groups:
            continue
        table = Table(title=title, title_justify="left")
        for col in ("", "tensors", "model", "buffer", "optim", "other", "total"):
            table.add_column(col, justify="left" if not col else "right", no_wrap=True)
        for g in groups:
            table.add_row(_plain(g.name), str(g.tensors), *(format_bytes(getattr(g, k)) for k in KINDS),
                          format_bytes(g.bytes))
        out.print(table)

    tensors = Table(title="tensors", title_justify="left")
    tensor_columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("key", "left"), ("shape", "left"), ("dtype", "left"), ("bytes", "right"))
    for col, just in tensor_columns:
        tensors.add_column(col, justify=just, overflow="fold")
    shown = rep.tensors if max_keys <= 0 else rep.tensors[:max_keys]
    for t in shown:
        tensors.add_row(_plain(t.key), "×".join(map(str, t.shape)) or "scalar",
                        _plain(t.dtype.removeprefix("torch.")), format_bytes(t.bytes))
    out.print(tensors)
    if len(shown) < len(rep.tensors):
        out.print(f"... {len(rep.tensors) - len(shown)} more tensors (--max-keys 0 shows all)")
    for note in rep.notes:
        out.print(f"[dim]note: {_plain(note)}[/dim]")


@app.command("verify")
def verify(
    path: Annotated[Path, typer.Argument(metavar="DIR[/step_N]", help="A store or one checkpoint.")],
    finite: Annotated[bool, typer.Option("--finite", help="Also load every model and optimizer tensor and check "
                                                          "that it holds no NaN or inf.")] = False,
    as_json: _Json = False,
) -> None:
    """Check a checkpoint: COMPLETE marker, manifest, file sizes and digests, parameters, tied weights.

    Exits 0 printing "ok" and a summary, or 1 naming the first problem (every problem is listed).
    """
    from varuna_core.checkpoint.tools import verify as verify_checkpoint
    from varuna_core.errors import VarunaError
    from varuna_core.ir.units import format_bytes
    from varuna_core.util.text import printable

    rep = verify_checkpoint(path, finite=finite)
    name = Path(rep.path).name
    if as_json:
        typer.echo(rep.model_dump_json(indent=2))
    elif rep.ok:
        summary = (f"{name}: {rep.files_checked} files ({format_bytes(rep.bytes_hashed)}) match their digests, "
                   f"{rep.parameters_checked} parameters present, {rep.tied_groups_checked} tied groups")
        if finite:
            summary += f", {rep.tensors_checked_finite} tensors finite"
        typer.echo(f"ok: {printable(summary)}")
    else:
        typer.echo(f"{printable(name)}: {len(rep.problems)} problem{'s' if len(rep.problems) != 1 else ''}")
        for problem in rep.problems:
            typer.echo(f"- {printable(problem)}")
    if not as_json:
        for note in rep.notes:
            typer.echo(f"note: {printable(note)}", err=True)
    if not rep.ok:
        raise VarunaError(rep.first_problem or "verification failed",
                          hint="load or merge an earlier checkpoint (`varuna ckpt list DIR` shows them)")


@app.command("merge")
def merge(
    path: Annotated[Path, typer.Argument(metavar="DIR[/step_N]", help="A store or one checkpoint.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The safetensors file to write.")] = Path(
        "model.safetensors"),
    optimizer: Annotated[bool, typer.Option(
        "--optimizer", help="Also write the optimizer state to <stem>.optim.safetensors beside it.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Merge even an incomplete checkpoint or one that fails verification.")] = False,
    as_json: _Json = False,
) -> None:
    """Write one checkpoint as a single safetensors file for the unpartitioned model.

    Keys are the model's own names (tied weights under every name), so
    `model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)` works.
    """
    from varuna_core.checkpoint.tools import merge as merge_checkpoint
    from varuna_core.ir.units import format_bytes

    rep = merge_checkpoint(path, output, optimizer=optimizer, force=force)
    err = _console(stderr=True)
    for problem in rep.problems:
        err.print(f"[yellow]warning[/yellow]: merged despite: {_plain(problem)}", highlight=False)
    if as_json:
        typer.echo(rep.model_dump_json(indent=2))
        return
    out = _console(highlight=False)
    out.print(f"wrote {_plain(rep.output)}: {rep.tensors} tensors, {format_bytes(rep.bytes)} from "
              f"{_plain(rep.source)} (step {rep.step})")
    if rep.tied_copies:
        out.print("tied copies: " + ", ".join(_plain(c) for c in rep.tied_copies))
    if rep.optimizer_output:
        out.print(f"wrote {_plain(rep.optimizer_output)}: {rep.optimizer_tensors} tensors, "
                  f"{format_bytes(rep.optimizer_bytes)} (keys <parameter>/<state>)")


@app.command("assemble")
def assemble(
    sources: Annotated[list[str], typer.Argument(
        metavar="SOURCE", show_default=False,
        help="Each host's checkpoint directory: a store (holding step_N/) or one step_N, local or "
             "\\[user@]host:PATH over SSH.")],
    out: Annotated[Path, typer.Option("-o", "--out", show_default=False,
                                      help="The store to write <out>/step_N into (created if missing).")],
    step: Annotated[int | None, typer.Option("--step", min=0, help="The step to assemble (default: the newest "
                                                                   "the sources hold every file of).")] = None,
    run: Annotated[str | None, typer.Option("--run", help="The run (needed when the sources hold several).")] = None,
    ssh_port: Annotated[int | None, typer.Option("--ssh-port", min=1, max=65535, metavar="P",
                                                 help="SSH port of the remote sources.")] = None,
    ssh_identity: Annotated[Path | None, typer.Option("--ssh-identity", metavar="FILE",
                                                      help="SSH private key for the remote sources.")] = None,
    ssh_option: Annotated[list[str] | None, typer.Option(
        "--ssh-option", metavar="KEY=VALUE", help="Extra ssh -o option, e.g. UserKnownHostsFile=FILE "
        "(repeatable).")] = None,
    as_json: _Json = False,
) -> None:
    """Build one complete checkpoint from the parts the hosts hold in their own directories.

    Every file the manifest lists is copied into OUT/step_N from a source that holds it, its digest checked.
    A bad copy is reported and the next source tried; COMPLETE is written last.
    Any host may be missing as long as the others hold every file; exits 1 naming the files none holds.
    """
    from rich.table import Table

    from varuna_core.checkpoint.assemble import SSHOptions
    from varuna_core.checkpoint.assemble import assemble as assemble_checkpoint
    from varuna_core.ir.units import format_bytes

    err = _console(stderr=True)

    def warn(warning: str) -> None:  # as found: the warnings of a failed assemble say why; one line each
        err.print(f"[yellow]warning[/yellow]: {_plain(warning)}", highlight=False, soft_wrap=True)

    ssh = SSHOptions(port=ssh_port, identity=None if ssh_identity is None else str(ssh_identity),
                     options=tuple(ssh_option or ()))
    rep = assemble_checkpoint(sources, out, step=step, run=run, ssh=ssh, on_warning=warn)
    if as_json:
        typer.echo(rep.model_dump_json(indent=2))
        return
    console = _console(highlight=False)
    console.print(f"assembled {_plain(rep.output)}: step {rep.step} of run {_plain(rep.run or '(unrecorded)')}, "
                  f"{len(rep.files)} files, {format_bytes(rep.bytes)}", soft_wrap=True)
    table = Table()
    for col in ("source", "files", "bytes"):
        table.add_column(col, justify="left" if col == "source" else "right", overflow="fold")
    for source in rep.sources:
        files = str(source.files) if source.reachable else "[yellow]unreachable[/yellow]"
        table.add_row(_plain(source.source), files, format_bytes(source.bytes))
    console.print(table)
