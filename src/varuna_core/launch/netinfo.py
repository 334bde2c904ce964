"""Which network interface and source address reach a given address (what gloo and NCCL must bind to).

A user's notes (``seeds/``) show gloo binding to 127.0.0.1 because the host name mapped to loopback, fixed by
hand with ``GLOO_SOCKET_IFNAME``. The launcher's agent sets ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` to
the interface that routes to the master instead, found here without external tools: a UDP socket
``connect`` makes the kernel pick the route (nothing is sent), and the interface holding that source address
is looked up with ``SIOCGIFADDR`` (Linux).
"""

from __future__ import annotations

import socket
import struct

__all__ = ["route_to", "interface_of"]

_SIOCGIFADDR = 0x8915


def route_to(address: str) -> tuple[str | None, str | None]:
    """``(interface, source address)`` this machine uses to reach ``address``; ``(None, None)`` if unknown.

    If ``address`` is one of this machine's own (the master's host itself), that is its interface: the route
    to one's own address goes through ``lo``, which the other hosts cannot reach.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, None)[0]
        ip = str(sockaddr[0])  # an address string for the IP families
        own = interface_of(ip)
        if own is not None:
            return own, ip
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            source = s.getsockname()[0]
    except OSError:
        return None, None
    return interface_of(source), source


def interface_of(ip: str) -> str | None:
    """The name of the interface holding IPv4 address ``ip`` (None if none does, or not on Linux)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Unix
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None
