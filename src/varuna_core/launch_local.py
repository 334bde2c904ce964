"""Small helpers for starting local worker processes."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
