"""Checks of user-given numbers: the one place that says what an integer, a count or a duration must be.

Why not ``int(x)`` / ``float(x)``: they accept ``2.7`` (truncated to 2), ``True`` (1), ``"nan"`` and
``float("inf")``, and comparisons such as ``x < 1`` are false for NaN, so a bound check written that way lets
NaN through. Every check here names the argument, shows the value and raises
:class:`~varuna_core.errors.FieldError` (a :class:`~varuna_core.errors.ConfigError` that says which field, so that
the CLI can name the option that sets it). A range with both ends is said whole (``must be in 1..64``), an
integer exactly (``2**64 - 1`` is not shown as ``1.84467e+19``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

from ..errors import ConfigError, FieldError

__all__ = ["integer", "real", "env_integer", "env_real"]


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` (ints and integer-like objects such as numpy integers; not bools, floats or
    strings), within ``[low, high]``."""
    if isinstance(value, (bool, float)):
        raise FieldError(name, f"must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise FieldError(name, f"must be an integer, got {type(value).__name__} {value!r}") from None
    _bounds(name, number, low, high)
    return number


def real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite ``float`` within ``[low, high]`` (``(low, ...`` with ``low_open``, ``..., high)``
    with ``high_open``). With both ends given, a refusal says the whole interval (``must be a number in
    (0, 100], got nan``)."""
    if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
        raise FieldError(name, f"must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    inside = (math.isfinite(number)
              and (low is None or (number > low if low_open else number >= low))
              and (high is None or (number < high if high_open else number <= high)))
    if inside:
        return number
    if low is not None and high is not None:
        interval = f"{'(' if low_open else '['}{_shown(low)}, {_shown(high)}{')' if high_open else ']'}"
        raise FieldError(name, f"must be a number in {interval}, got {number:g}")
    if not math.isfinite(number):
        raise FieldError(name, f"must be a finite number, got {number}")
    if low is not None and (number <= low if low_open else number < low):
        raise FieldError(name, f"must be {'greater than' if low_open else '≥'} {_shown(low)}, got {number:g}")
    assert high is not None  # inside otherwise
    raise FieldError(name, f"must be {'less than' if high_open else '≤'} {_shown(high)}, got {number:g}")


def env_integer(name: str, text: str | None, *, low: int | None = None, high: int | None = None) -> int | None:
    """The integer in environment variable ``name`` (``text``: its value), None when unset or empty."""
    if text is None or not text.strip():
        return None
    try:
        number = int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None
    return integer(name, number, low=low, high=high)


def env_real(name: str, text: str | None, *, low: float | None = None, high: float | None = None,
             low_open: bool = False) -> float | None:
    """The number in environment variable ``name`` (``text``: its value), None when unset or empty."""
    if text is None or not text.strip():
        return None
    try:
        number = float(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number") from None
    return real(name, number, low=low, high=high, low_open=low_open)


def _bounds(name: str, number: float, low: float | None, high: float | None) -> None:
    if (low is None or number >= low) and (high is None or number <= high):
        return
    if isinstance(number, int) and low is not None and high is not None:
        raise FieldError(name, f"must be in {low}..{high}, got {number}")
    if low is not None and number < low:
        raise FieldError(name, f"must be ≥ {_shown(low)}, got {_shown(number)}")
    assert high is not None  # within low, so above high
    raise FieldError(name, f"must be ≤ {_shown(high)}, got {_shown(number)}")


def _shown(number: float) -> str:
    """An integer as it is (``:g`` rounds 2**64 - 1 to 1.84467e+19), anything else in ``:g``."""
    return str(number) if isinstance(number, int) else f"{number:g}"
