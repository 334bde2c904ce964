"""Parsing and printing byte sizes (``80GiB``, ``500MB``, ``1e9``)."""

from __future__ import annotations

import re

from ..errors import ConfigError

__all__ = ["parse_bytes", "parse_rate", "parse_seconds", "format_bytes", "MAX_BYTES"]

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


_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """A link's rate in bytes per second: ``"50mbit"`` (or ``50Mbit/s``, tc's decimal bit units: 6.25e6) or a
    size per second, ``"100MB/s"``, ``"1.5GiB/s"``.

    Raises:
        ConfigError: not a positive rate with a known unit.
    """
    hint = "give a rate such as 50mbit, 1gbit or 100MB/s"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]+)(/s)?\s*", text) \
        if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"cannot read {str(text)[:80]!r} as a rate", hint=hint)
    unit = match.group(2).lower()
    if match.group(2).endswith("b") and unit not in ("b", *_BITS):  # "Mb/s": megabits or megabytes?
        raise ConfigError(f"{text[:80]!r} is ambiguous: bits or bytes?",
                          hint="write 50mbit for bits or 50MB/s for bytes")
    if unit in _BITS:
        value = float(match.group(1)) * _BITS[unit] / 8
    elif match.group(3) and unit in _UNITS:
        value = float(match.group(1)) * _UNITS[unit]
    else:
        raise ConfigError(f"cannot read {text[:80]!r} as a rate", hint=hint)
    if not 0 < value <= MAX_BYTES:
        raise ConfigError(f"rate {text[:80]} is not above 0 and at most {MAX_BYTES:,} bytes/s", hint=hint)
    return value


def parse_seconds(text: str) -> float:
    """A duration: ``"200us"``, ``"1.5ms"``, ``"2s"`` (a plain number is seconds).

    Raises:
        ConfigError: not a finite duration ≥ 0 with a known unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-zµ]*)\s*", text) \
        if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in (*_TIMES, ""):
        raise ConfigError(f"cannot read {str(text)[:80]!r} as a duration", hint="give e.g. 200us, 1ms or 0.5s")
    value = float(match.group(1)) * _TIMES.get(match.group(2).lower(), 1.0)
    if not 0 <= value < float("inf"):
        raise ConfigError(f"duration {text[:80]} is not finite", hint="give e.g. 200us, 1ms or 0.5s")
    return value


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: ``1.50 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
