"""Checks of user-given numbers: the one place that says what an integer, a count or a duration must be.

Why not ``int(x)`` / ``float(x)``: they accept ``2.7`` (truncated to 2), ``True`` (1), ``"nan"`` and
``float("inf")``, and comparisons such as ``x < 1`` are false for NaN, so a bound check written that way lets
NaN through. Every check here names the argument, shows the value and raises
:class:`~varuna_core.errors.ConfigError`.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from ..errors import ConfigError

__all__ = ["integer", "real", "env_integer", "env_real"]


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` (ints and integer-like objects such as numpy integers; not bools, floats or
    strings), within ``[low, high]``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    _bounds(name, number, low, high)
    return number


def real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
         low_open: bool = False) -> float:
    """``value`` as a finite ``float`` within ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, got {number}")
    if low_open and low is not None and number <= low:
        raise ConfigError(f"{name} must be greater than {low:g}, got {number:g}")
    _bounds(name, number, low, high)
    return number


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
    if low is not None and number < low:
        raise ConfigError(f"{name} must be ≥ {low:g}, got {number:g}")
    if high is not None and number > high:
        raise ConfigError(f"{name} must be ≤ {high:g}, got {number:g}")
