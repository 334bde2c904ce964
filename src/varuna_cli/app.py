"""The ``varuna`` root command and the process entry point :func:`main`.

:func:`main` turns failures into the exit codes of the toolkit: 0 ok, 1 failed, 2 bad usage or input,
130 interrupted. A :class:`~varuna_core.errors.VarunaError` becomes ``error: <message>`` (and
``hint: <hint>``) on stderr; a traceback is shown only with ``VARUNA_DEBUG=1``.

Subcommands live in :mod:`varuna_cli.commands`, one module each, and import torch only when they run, so
``varuna --help`` and ``varuna --version`` stay fast.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Annotated

import typer

from varuna_cli.commands import ckpt as ckpt_command
from varuna_cli.commands import env as env_command
from varuna_cli.commands import launch as launch_command
from varuna_cli.commands import plan as plan_command
from varuna_cli.commands import profile as profile_command
from varuna_core.errors import VarunaError

__all__ = ["app", "main", "version"]

DEBUG_ENV = "VARUNA_DEBUG"

app = typer.Typer(
    name="varuna",
    help="Pipeline + data parallel training of large PyTorch models on commodity and preemptible machines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    add_completion=False,
)


def version() -> str:
    """The installed version of the ``varuna`` distribution."""
    try:
        return metadata.version("varuna")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"varuna {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Pipeline + data parallel training of large PyTorch models on commodity and preemptible machines.

    Set VARUNA_DEBUG=1 to see a traceback when a command fails.
    """


app.command("profile", rich_help_panel="Workflow")(profile_command.profile)
app.command("plan", rich_help_panel="Workflow")(plan_command.plan)
app.command("plan-show", hidden=True)(plan_command.show)
app.command("launch", rich_help_panel="Workflow", help=launch_command.HELP)(launch_command.launch)
app.command("notify-preempt", rich_help_panel="Workflow")(launch_command.notify_preempt)
app.add_typer(ckpt_command.app, name="ckpt", rich_help_panel="Workflow")
app.command("env", rich_help_panel="Help")(env_command.env)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    """Run the ``varuna`` command line (the console script). Exits the process with the command's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["plan", "show"]:  # `varuna plan show PLAN`: a verb of its own under `plan`
        args = ["plan-show", *args[2:]]
    try:
        app(args=args, prog_name="varuna")
    except KeyboardInterrupt:  # Typer maps interrupts inside a command to 130; this catches the rest
        if _debug():
            raise
        _say("error: interrupted")
        sys.exit(130)
    except VarunaError as err:
        if _debug():
            raise
        _say(f"error: {err.message}")
        if err.hint:
            _say(f"hint: {err.hint}")
        sys.exit(err.exit_code)
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if _debug():
            raise
        detail = str(err).strip()
        _say(f"error: {type(err).__name__}" + (f": {detail}" if detail else ""))
        _say(f"hint: this is unexpected; set {DEBUG_ENV}=1 for a traceback")
        sys.exit(1)


if __name__ == "__main__":
    main()
