"""This process's own sockets, found through ``/proc/self/fd`` (Linux), to cut the connections of a process group
that lost a peer (:mod:`varuna_core.worker.regroup`).

Why cut them by hand: a rank that loses a peer in a collective leaves its process group, but gloo keeps its
connections open while anything still holds the group (and a rank blocked on *this* rank would then wait for its
timeout, minutes). ``shutdown(2)`` on the group's sockets ends every transfer on them at once, on both sides: the
ranks waiting on this one fail within milliseconds too, and the survivors agree sooner on how to go on. The
group's sockets are told from the process's others (the job's store, a script's own connections) by what appeared
while the groups were built (:func:`socket_inodes` before and after), less the store's connection.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["socket_inodes", "shut_down"]

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, int]:
    """``{inode: fd}`` of this process's open sockets ({} where ``/proc`` cannot tell)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
            out[int(target[8:-1])] = int(name)
    return out


def shut_down(inodes: set[int], *, keep_port: int | None = None) -> int:
    """``shutdown(SHUT_RDWR)`` of this process's connected TCP sockets among ``inodes``, but those connected to
    port ``keep_port`` (the job's store); how many were shut."""
    count = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))  # the same socket under another descriptor
        except OSError:
            continue
        with contextlib.closing(sock):
            if sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue  # a listening socket, or not connected
            if keep_port is not None and peer[1] == keep_port:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count
