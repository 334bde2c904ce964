"""``varuna env``: a copy-paste description of this machine and installation for bug reports."""

from __future__ import annotations

import json
from typing import Annotated

import typer

HEADER = "Copy and paste the block below into your bug report:"


def env(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the text block.")] = False,
) -> None:
    """Describe this machine and installation: versions, devices, threads, distributed settings.

    Paste the output into bug reports. The values of variables named like secrets (TOKEN, SECRET, PASSWORD, KEY,
    CREDENTIAL, ...) are shown as <redacted>.
    """
    from varuna_core.util.envinfo import collect  # imports torch: keep it out of `varuna --help`
    from varuna_core.util.text import printable  # a value may hold a newline or a terminal escape

    info = collect()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(HEADER + "\n", err=True)
    width = max(len(key) for key in info)
    for key, value in info.items():
        typer.echo(f"- {key + ':':<{width + 1}} {printable(value)}")
