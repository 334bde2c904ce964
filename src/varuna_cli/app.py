"""The ``varuna`` root command and the process entry point :func:`main`.

:func:`main` turns failures into the exit codes of the toolkit: 0 ok, 1 failed, 2 bad usage or input,
130 interrupted. A :class:`~varuna_core.errors.VarunaError` becomes ``error: <message>`` (and
``hint: <hint>``) on stderr, and so does a usage error (an unknown option, ``--gpus abc``); a traceback is shown
only with ``VARUNA_DEBUG=1``. Anything else that escapes a command, even a ``BaseException`` that is not an
``Exception`` (torch's distributed-checkpoint errors are), is one ``error:`` line and exit code 1. The line is
always one line of printable text: messages quote file contents, host names and paths, which may hold newlines
or terminal escapes.

Subcommands live in :mod:`varuna_cli.commands`, one module each, and import torch only when they run, so
``varuna --help`` and ``varuna --version`` stay fast.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import TYPE_CHECKING, Annotated

import typer

from varuna_cli.commands import ckpt as ckpt_command
from varuna_cli.commands import env as env_command
from varuna_cli.commands import launch as launch_command
from varuna_cli.commands import plan as plan_command
from varuna_cli.commands import profile as profile_command
from varuna_core.env import DEBUG, debug
from varuna_core.errors import VarunaError
from varuna_core.util.text import one_line

if TYPE_CHECKING:  # checked against the typer installed, which carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
else:
    try:  # recent typer releases carry their own copy of click
        from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click.exceptions import ClickException, UsageError

        try:
            from click.exceptions import NoArgsIsHelpError
        except ImportError:  # click before 8.2 shows the help without raising

            class NoArgsIsHelpError(UsageError):
                """Never raised by this click."""

__all__ = ["app", "main", "version"]


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
    return debug()


MAX_LINE = 2000  # characters of one error or hint line


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _fail(message: str, hint: str | None, code: int) -> None:
    _say(f"error: {one_line(message, MAX_LINE)}")
    if hint:
        _say(f"hint: {one_line(hint, MAX_LINE)}")
    sys.exit(code)


def _report(err: BaseException) -> None:
    """Exit with the one-line report of ``err`` and its exit code."""
    if isinstance(err, UsageError):  # a mistake on the command line: what is wrong, and where the help is
        if isinstance(err, NoArgsIsHelpError):  # `varuna` alone: the help was printed
            sys.exit(err.exit_code)
        command = (err.ctx.command_path if err.ctx is not None else "varuna").replace("plan-show", "plan show")
        _fail(err.format_message(), f"see `{command} --help`", 2)
    if isinstance(err, KeyboardInterrupt):  # Typer maps interrupts inside a command to 130; this catches the rest
        _fail("interrupted", None, 130)
    if isinstance(err, typer.Abort):
        _fail("aborted", None, 1)
    if isinstance(err, ClickException):
        _fail(err.format_message(), None, err.exit_code)
    if isinstance(err, VarunaError):
        _fail(err.message, err.hint, err.exit_code)
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    _fail(f"{type(err).__name__}" + (f": {detail}" if detail else ""),
          f"this is unexpected; set {DEBUG}=1 for a traceback", 1)


def main(argv: list[str] | None = None) -> None:
    """Run the ``varuna`` command line (the console script). Exits the process with the command's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["plan", "show"]:  # `varuna plan show PLAN`: a verb of its own under `plan`
        args = ["plan-show", *args[2:]]
    try:
        code = app(args=args, prog_name="varuna", standalone_mode=False)
    except SystemExit:
        raise
    except BaseException as err:  # the last line of defence: one line, not a traceback
        if _debug() and not isinstance(err, UsageError):
            raise
        _report(err)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
