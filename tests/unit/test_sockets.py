"""Cutting a process group's connections by hand (util.sockets): only the connected TCP sockets named, never the
one to the job's store, and the peer sees the end at once."""

from __future__ import annotations

import socket

from varuna_core.util.sockets import shut_down, socket_inodes


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname(), timeout=5)
    accepted, _ = server.accept()
    accepted.settimeout(5)
    return client, accepted


def test_the_named_connections_are_cut_and_the_others_left_alone() -> None:
    with socket.create_server(("127.0.0.1", 0)) as group_server, socket.create_server(("127.0.0.1", 0)) as store:
        before = set(socket_inodes())
        mine, theirs = _pair(group_server)  # a connection of the group: made after `before`
        to_store, store_side = _pair(store)  # made after `before` too, but to the store's port
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made = set(socket_inodes()) - before
        assert len(made) >= 5  # (the accepted ends are sockets of this process as well)
        cut = shut_down(made - {_inode(theirs), _inode(store_side)}, keep_port=store.getsockname()[1])
        assert cut == 1
        assert theirs.recv(16) == b""  # the peer sees the end at once
        to_store.sendall(b"ok")
        assert store_side.recv(16) == b"ok"  # the store's connection still works
        for s in (mine, theirs, to_store, store_side, udp):
            s.close()
        assert shut_down(set()) == 0


def _inode(sock: socket.socket) -> int:
    return next(inode for inode, fd in socket_inodes().items() if fd == sock.fileno())
