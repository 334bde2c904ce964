"""Text from outside (names read from files, the environment, the command line) made safe to show.

A model name in a profile, a run id in a store or a host name in a hosts file may hold a line break or a
terminal escape (``ESC [2J`` clears the screen, ``ESC ]0;`` retitles the window); printed as it is, it breaks a
one-line message or reaches the terminal. :func:`printable` is the one way the CLI and the library show such
text; :func:`one_line` makes a whole message one line of it, :func:`short_repr` quotes a value in one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["printable", "one_line", "short_repr"]


def printable(text: object) -> str:
    """``text`` with every character that is not printable (control characters, line breaks, bidirectional
    overrides) escaped as Python writes it in a string literal: ``\\x1b``, ``\\n``, ``\\u202e``."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(text: object, limit: int) -> str:
    """``text`` as one printable line of at most ``limit`` characters: line breaks become spaces, other control
    characters escapes (:func:`printable`), and a longer text is cut, ending in ``...``."""
    flat = printable(" ".join(part.strip() for part in str(text).splitlines() if part.strip()))
    return _cut(flat, limit)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` (control characters escaped, as repr does), cut to ``limit`` characters: a message quotes
    what it found, never a whole file."""
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
