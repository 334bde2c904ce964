"""Text from outside (names read from files, the environment, the command line) made safe to show.

A model name in a profile, a run id in a store or a host name in a hosts file may hold a line break or a
terminal escape (``ESC [2J`` clears the screen, ``ESC ]0;`` retitles the window); printed as it is, it breaks a
one-line message or reaches the terminal. :func:`printable` is the one way the CLI and the library show such
text.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: object) -> str:
    """``text`` with every character that is not printable (control characters, line breaks, bidirectional
    overrides) escaped as Python writes it in a string literal: ``\\x1b``, ``\\n``, ``\\u202e``."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
