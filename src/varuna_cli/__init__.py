"""The ``varuna`` command line: a thin Typer app over :mod:`varuna_core` (parse, call the core, render)."""
