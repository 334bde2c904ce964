"""Parsing and printing byte sizes (``80GiB``, ``500MB``, ``1e9``)."""

from __future__ import annotations

import re

from ..errors import ConfigError

__all__ = ["parse_bytes", "format_bytes", "MAX_BYTES"]

_HINT = "write e.g. 80GiB, 16GB, 512MiB or a number of bytes"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


MAX_BYTES = 2**60  # one exbibyte: a larger size is a typo


def parse_bytes(text: str | int) -> int:
    """``"80GiB"`` → 85899345920; ``"1.5GB"`` → 1500000000; a plain number is bytes.

    Raises:
        ConfigError: not a number with a known unit (``nan``, ``-5GiB``, ``abc``), or more than
            :data:`MAX_BYTES` (``1e400`` would otherwise be infinity).
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigError(f"cannot read {text!r} as a size", hint=_HINT)
    if isinstance(text, int):
        value: float = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"cannot read {text[:80]!r} as a size", hint=_HINT)
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 0 <= value <= MAX_BYTES:  # also false for NaN
        raise ConfigError(f"size {str(text)[:80]} is not between 0 and {MAX_BYTES:,} bytes", hint=_HINT)
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: ``1.50 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
