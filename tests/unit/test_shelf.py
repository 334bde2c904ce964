"""The shelf (a job's blobs in host memory) and its wire: round trips, and every hostile peer we can think of
refused, timed out and named, on either end.

Servers run in this process on 127.0.0.1 and free ports; a misbehaving server is a small thread below that speaks
the wire by hand. Timeouts are short and every wait has a bound, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from varuna_core.errors import HandoverError, ShelfFullError
from varuna_core.launch import shelf as shelf_mod
from varuna_core.launch.shelf import MAX_HEADER, MAX_META, MAX_NAME, WINDOW, Shelf, ShelfServer, fetch, fetch_into
from varuna_core.util.digest import of_bytes

ZERO = "blake3:" + "0" * 64  # a well-formed digest of no bytes sent here

JOB, TOKEN = "job-1", "s3cret-token"
BIG = 3 * 2**20 + 17  # bytes: more than one chunk, not a multiple of it

pytestmark = pytest.mark.timeout(120)


_BLOBS = {
    "blocks.0.attn.weight": os.urandom(1000),
    "blocks.0.attn.weight/exp_avg": os.urandom(BIG),
    "empty": b"",
    "../x": b"not a path",
}


def _blobs() -> dict[str, bytes]:
    return dict(_BLOBS)


@pytest.fixture
def shelf(tmp_path) -> Shelf:
    s = Shelf(JOB, root=tmp_path)
    for name, data in _blobs().items():
        s.put(name, data, {"dtype": "float32", "shape": [len(data) // 4]})
    return s


@pytest.fixture
def server(shelf):
    with ShelfServer(shelf, TOKEN, timeout=2.0) as srv:
        yield srv


def _request(names, *, token=TOKEN, job=JOB, nonce=None, ts=None, max_bytes=2**40) -> bytes:
    return shelf_mod._signed(token, shelf_mod._REQUEST, {
        "kind": "shelf-request", "job": job, "ts": time.time() if ts is None else ts,
        "nonce": nonce or os.urandom(16).hex(), "names": names, "max_bytes": max_bytes})


def _exchange(port: int, data: bytes, *, shut: bool = False) -> object:
    """Sends ``data`` to the server, returns the frame it answers (its JSON) and checks it then closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        frame = shelf_mod._read_frame(sock, time.monotonic() + 10)
        if isinstance(frame, dict) and "error" in frame:
            try:  # a refusal ends the connection (reset if the server left some of what was sent unread)
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        return frame


def _fetch(port, names, **kw):
    kw = {"job": JOB, "token": TOKEN, "timeout": 5.0, "max_bytes": 2**40, **kw}
    return fetch("127.0.0.1", port, names=names, **kw)


# ------------------------------------------------------------------------------------------------------------
# The shelf

def test_put_get_manifest_remove_clear(shelf, tmp_path) -> None:
    blobs = _blobs()
    for name, data in blobs.items():
        assert shelf.get(name) == data
    manifest = shelf.manifest()
    assert sorted(manifest) == shelf.names() == sorted(blobs)
    entry = manifest["blocks.0.attn.weight/exp_avg"]
    assert (entry.size, entry.digest) == (BIG, of_bytes(blobs[entry.name]))
    assert entry.meta == {"dtype": "float32", "shape": [BIG // 4]}
    shelf.put("empty", b"now full", {"v": 2})  # a re-put replaces
    assert shelf.get("empty") == b"now full" and shelf.manifest()["empty"].meta == {"v": 2}
    shelf.remove(["empty", "never put"])
    assert "empty" not in shelf.names()
    with pytest.raises(HandoverError, match="no blob"):
        shelf.get("empty")
    shelf.clear()
    assert not shelf.path.exists() and shelf.names() == []
    assert list(tmp_path.iterdir()) == []


def test_get_into_a_buffer_of_the_caller(shelf) -> None:
    name = "blocks.0.attn.weight/exp_avg"
    buffer = bytearray(BIG)
    entry = shelf.get_into(name, lambda e: memoryview(buffer))
    assert buffer == _BLOBS[name] and entry == shelf.manifest()[name]
    for wrong in (bytearray(BIG - 1), bytes(BIG)):  # too small; read only
        with pytest.raises(HandoverError, match="must be a writable"):
            shelf.get_into(name, lambda e, w=wrong: memoryview(w))


def test_names_are_never_paths(shelf, tmp_path) -> None:
    assert shelf.get("../x") == b"not a path"
    assert [p.name for p in tmp_path.iterdir()] == [shelf.path.name]  # nothing outside the job's directory
    assert all(p.name == ".lock" or p.suffix == ".blob" for p in shelf.path.iterdir())


def test_a_planted_shelf_directory_is_refused(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shelf = Shelf(JOB, root=tmp_path)
    shelf.path.symlink_to(elsewhere)  # another user's link where the job's directory goes
    with pytest.raises(HandoverError, match="only this user can write"):
        shelf.put("a", b"data")
    with pytest.raises(HandoverError, match="only this user can write"):
        shelf.get("a")
    assert list(elsewhere.iterdir()) == []
    shelf.path.unlink()
    shelf.path.mkdir(mode=0o777)
    shelf.path.chmod(0o777)
    with pytest.raises(HandoverError, match="only this user can write"):
        shelf.manifest()


def test_a_host_marked_as_leaving_is_seen_so_by_every_writer_and_only_through_a_plain_file(tmp_path) -> None:
    shelf, other = Shelf(JOB, root=tmp_path), Shelf(JOB, root=tmp_path)
    assert not shelf.leaving and not shelf.path.exists()  # asking makes nothing
    other.put("a", b"data")
    other.mark_leaving()
    other.mark_leaving()  # twice is once
    assert shelf.leaving and Shelf("another job", root=tmp_path).leaving is False
    assert shelf.names() == ["a"] and shelf.get("a") == b"data"  # the mark is no blob
    mark = shelf.path / ".leaving"
    mark.unlink()
    mark.symlink_to(tmp_path / "anything")  # a link is no mark, and marking does not write through it
    assert not shelf.leaving
    with pytest.raises(OSError):
        shelf.mark_leaving()
    assert not (tmp_path / "anything").exists()
    mark.unlink()
    mark.mkdir()
    assert not shelf.leaving
    mark.rmdir()
    shelf.mark_leaving()
    shelf.path.chmod(0o777)  # a directory others could have written: its mark is nobody's word
    assert not shelf.leaving
    with pytest.raises(HandoverError, match="only this user can write"):
        shelf.mark_leaving()
    shelf.path.chmod(0o700)
    shelf.clear()
    assert not shelf.leaving


def test_a_host_marked_alone_is_seen_so_unless_it_is_marked_as_leaving_too_and_only_through_a_plain_file(
        tmp_path) -> None:
    """The next configuration's only host (``mark_alone``): its writers leave their live files unhashed. Hosts that
    share one tmpfs share the marks: one marked leaving and one alone, and no writer there may skip the hash."""
    shelf = Shelf(JOB, root=tmp_path)
    assert not shelf.alone and not shelf.path.exists()
    shelf.mark_alone()
    assert shelf.alone and not shelf.leaving and Shelf("another job", root=tmp_path).alone is False
    shelf.mark_leaving()
    assert shelf.leaving and not shelf.alone
    (shelf.path / ".leaving").unlink()
    mark = shelf.path / ".alone"
    mark.unlink()
    mark.symlink_to(tmp_path / "anything")
    assert not shelf.alone
    with pytest.raises(OSError):
        shelf.mark_alone()
    assert not (tmp_path / "anything").exists()
    mark.unlink()
    shelf.mark_alone()
    shelf.path.chmod(0o777)
    assert not shelf.alone
    shelf.path.chmod(0o700)
    shelf.clear()
    assert not shelf.alone


def test_a_blob_adopted_without_a_hash_is_linked_or_read_unverified_never_verified_and_hashed_when_served(
        tmp_path) -> None:
    """[Note: a lone host's files are not hashed]: an entry with a null digest is the writer's word that only a
    link on this host should read it. It round-trips through the blob's file; a read that verifies refuses it, the
    server hashes it before it sends it (its reader checks every byte, as ever), and a peer's entry with a null
    digest is refused."""
    shelf = Shelf(JOB, root=tmp_path / "shm")
    data = os.urandom(BIG)
    with shelf.reserve(BIG + 4096) as space:
        (space.directory / "f").write_bytes(data)
        entry = space.adopt("step_1/f", space.directory / "f", {"rank": 0}, digest=None)
        (space.directory / "g").write_bytes(b"hashed")
        space.adopt("step_1/g", space.directory / "g", digest=of_bytes(b"hashed"))
    assert entry.digest is None and shelf.manifest()["step_1/f"].digest is None
    linked = tmp_path / "shm" / "linked"
    assert shelf.link("step_1/f", linked).digest is None and linked.read_bytes()[:BIG] == data
    with pytest.raises(HandoverError, match="never hashed"):
        shelf.get("step_1/f")
    into = bytearray(BIG)
    assert shelf.get_into("step_1/f", lambda e: memoryview(into), verify=False).digest is None and into == data
    with ShelfServer(shelf, TOKEN, timeout=2.0) as server:
        got = fetch("127.0.0.1", server.port, job=JOB, token=TOKEN, names=["step_1/g", "step_1/f"], max_bytes=2 * BIG)
    assert got["step_1/f"][0].digest == of_bytes(data) and bytes(got["step_1/f"][1]) == data
    assert bytes(got["step_1/g"][1]) == b"hashed" and shelf.manifest()["step_1/f"].digest is None  # (not written)
    with pytest.raises(ValueError, match="bad digest"):
        shelf_mod._entry({"name": "a", "size": 0, "digest": None, "meta": {}})  # as a peer's reply holds it
    with pytest.raises(HandoverError, match="or None"), shelf.reserve(10) as space:
        (space.directory / "h").write_bytes(b"x")
        space.adopt("h", space.directory / "h", digest="unhashed")


@pytest.mark.parametrize("name", ["", "a\0b", "line\nbreak", "x" * (MAX_NAME + 1), 7, None])
def test_bad_names_are_refused(shelf, name) -> None:
    with pytest.raises(HandoverError, match="bad blob name"):
        shelf.put(name, b"data")
    with pytest.raises(HandoverError, match="bad blob name"):
        shelf.get(name)


@pytest.mark.parametrize("meta", [[1, 2], {"x": float("nan")}, {"x": object()}, {"x": "y" * MAX_META}])
def test_bad_meta_is_refused(shelf, meta) -> None:
    with pytest.raises(HandoverError, match="meta"):
        shelf.put("m", b"data", meta)
    assert "m" not in shelf.names()


def test_two_shelf_objects_share_one_directory(shelf, tmp_path) -> None:
    other = Shelf(JOB, root=tmp_path)
    assert other.path == shelf.path and other.names() == shelf.names()
    other.put("from other", b"hello")
    assert shelf.get("from other") == b"hello"
    assert Shelf("another job", root=tmp_path).names() == []


def test_concurrent_puts_from_two_processes_leave_every_blob_whole(tmp_path) -> None:
    code = textwrap.dedent("""
        import os, sys
        from varuna_core.launch.shelf import Shelf
        s = Shelf("job-1", root=sys.argv[1])
        for i in range(40):
            s.put(f"shared.{i % 5}", os.urandom(1000 + i), {"who": sys.argv[2]})
            s.put(f"own.{sys.argv[2]}.{i}", os.urandom(i))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), who]) for who in "ab"]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    shelf = Shelf(JOB, root=tmp_path)
    names = shelf.names()
    assert len(names) == 5 + 80
    for name in names:
        shelf.get(name)  # raises if an entry describes other bytes
    assert not list(shelf.path.glob("*.part"))


def test_a_put_over_the_budget_is_refused_and_leaves_nothing(tmp_path) -> None:
    shelf = Shelf(JOB, root=tmp_path, budget=10_000)
    shelf.put("a", b"x" * 6000)
    with pytest.raises(ShelfFullError, match="does not fit"):
        shelf.put("b", b"y" * 6000)
    assert shelf.names() == ["a"] and not list(shelf.path.glob("*.part"))
    shelf.put("a", b"z" * 9000)  # a replacement counts without the blob it replaces
    assert shelf.get("a") == b"z" * 9000


def test_a_put_the_file_system_cannot_hold_is_refused(tmp_path, monkeypatch) -> None:
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    shelf = Shelf(JOB, root=tmp_path)
    with pytest.raises(ShelfFullError):
        shelf.put("a", b"data")
    assert shelf.names() == [] and not list(shelf.path.glob("*.part"))


def _damage(shelf: Shelf, name: str, *, cut: bool = False) -> None:
    """Flips the blob's first data byte, or (``cut``) takes it out: the data is then shorter than its entry."""
    path = shelf._file(name)
    data = bytearray(path.read_bytes())
    if cut:
        del data[0]
    else:
        data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_blob_is_refused_by_get_and_by_the_client(shelf, server) -> None:
    name = "blocks.0.attn.weight/exp_avg"
    _damage(shelf, name)
    with pytest.raises(HandoverError, match="damaged"):
        shelf.get(name)
    with pytest.raises(HandoverError, match="does not match its digest") as info:
        _fetch(server.port, [name])
    assert f"127.0.0.1:{server.port}" in info.value.message and name in info.value.message


def test_a_cut_blob_is_refused_by_the_shelf_and_the_server(shelf, server) -> None:
    _damage(shelf, "blocks.0.attn.weight", cut=True)
    with pytest.raises(HandoverError, match="damaged"):
        shelf.get("blocks.0.attn.weight")
    with pytest.raises(HandoverError, match="refused"):
        _fetch(server.port, ["blocks.0.attn.weight"])


# ------------------------------------------------------------------------------------------------------------
# The server and the client together

def test_fetch_round_trip(shelf, server) -> None:
    blobs = _blobs()
    got = _fetch(server.port, list(blobs))
    assert list(got) == list(blobs)
    for name, (entry, data) in got.items():
        assert data == blobs[name] and data.readonly and entry == shelf.manifest()[name]
    # straight into buffers the caller owns
    buffers = {n: bytearray(len(d)) for n, d in blobs.items()}
    entries = fetch_into("127.0.0.1", server.port, job=JOB, token=TOKEN, names=list(blobs),
                         into=lambda e: memoryview(buffers[e.name]), max_bytes=2**40)
    assert {n: bytes(b) for n, b in buffers.items()} == blobs and entries.keys() == blobs.keys()
    # the server counts a reply once its last byte is handed to the socket, which may be after the client has read
    # it: wait for the count (bounded), do not race it
    deadline = time.monotonic() + 10
    while server.served < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.served == 2 and server.refused == {}


def test_concurrent_clients(shelf, server) -> None:
    blobs = _blobs()
    results, errors = [], []

    def one() -> None:
        try:
            results.append({n: bytes(d) for n, (_, d) in _fetch(server.port, list(blobs)).items()})
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [blobs] * 8


@pytest.mark.parametrize(("kw", "reason"), [
    ({"token": "wrong"}, "bad_mac"),
    ({"max_bytes": BIG}, "over_max_bytes"),
])
def test_the_server_refuses_and_the_client_names_it(server, kw, reason) -> None:
    names = ["blocks.0.attn.weight", "blocks.0.attn.weight/exp_avg"]
    with pytest.raises(HandoverError, match="refused the request") as info:
        _fetch(server.port, names, **kw)
    assert reason in info.value.message and f"127.0.0.1:{server.port}" in info.value.message
    assert server.refused == {reason: 1}


@pytest.mark.parametrize(("request_kw", "reason"), [
    ({"job": "job-2"}, "other_job"),
    ({"ts": -WINDOW - 60}, "stale"),  # seconds from now, when the request is made (not when the tests are collected)
    ({"ts": WINDOW + 60}, "stale"),
    ({"max_bytes": 999}, "over_max_bytes"),
])
def test_signed_requests_the_server_refuses(server, request_kw, reason) -> None:
    if "ts" in request_kw:
        request_kw = {**request_kw, "ts": time.time() + request_kw["ts"]}
    assert _exchange(server.port, _request(["blocks.0.attn.weight"], **request_kw)) == {"error": reason}
    assert server.refused == {reason: 1}


def test_an_unknown_name_is_refused(server) -> None:
    with pytest.raises(HandoverError, match=r"refused the request.*no blob nope"):
        _fetch(server.port, ["blocks.0.attn.weight", "nope"])


def test_a_reply_over_the_header_bound_is_refused_before_it_is_sent(shelf, server) -> None:
    meta = {"k": "v" * (MAX_META - 20)}
    names = [f"{i:04d}." + "n" * (MAX_NAME - 5) for i in range(MAX_HEADER // MAX_META + 1)]
    for name in names:
        shelf.put(name, b"", meta)
    with pytest.raises(HandoverError, match="reply_oversize"):
        _fetch(server.port, names)
    assert len(_fetch(server.port, names[:100])) == 100  # fewer at once


def test_a_replayed_request_is_refused(server) -> None:
    request = _request(["blocks.0.attn.weight"], nonce="ab" * 16)
    first = _exchange(server.port, request)
    assert isinstance(first, dict) and "mac" in first
    assert _exchange(server.port, request) == {"error": "replayed"}


@pytest.mark.parametrize(("data", "reason"), [
    (struct.pack(">4sI", b"VSH1", 100) + b"x" * 10, "truncated"),  # then the client closes its side
    (struct.pack(">4sI", b"VSH1", 2**31), "oversize"),  # refused before reading (or allocating) that much
    (struct.pack(">4sI", b"VSH1", MAX_HEADER + 1), "oversize"),
    (struct.pack(">4sI", b"HTTP", 4) + b"GET ", "bad_magic"),
    (struct.pack(">4sI", b"VSH1", 5) + b"{nope", "malformed"),
    (shelf_mod._frame({"p": "{}", "mac": "00"}), "bad_mac"),
])
def test_bad_frames_are_refused(server, data, reason) -> None:
    assert _exchange(server.port, data, shut=True) == {"error": reason}


def test_a_silent_peer_is_cut_off_and_others_are_served_meanwhile(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as silent:
        assert _fetch(server.port, ["empty"])["empty"][1] == b""  # served while the silent peer waits
        frame = shelf_mod._read_frame(silent, time.monotonic() + 30)  # server.timeout is 2 s
        assert frame == {"error": "timed_out"} and silent.recv(1) == b""
    assert server.refused == {"timed_out": 1}


def test_a_peer_over_the_connection_limit_is_refused(shelf) -> None:
    with ShelfServer(shelf, TOKEN, timeout=30.0, max_connections=1) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30):  # takes the one connection
        with pytest.raises(HandoverError, match="refused the request: 'busy'"):
            _fetch(server.port, ["empty"])
        assert server.refused == {"busy": 1}


def test_close_while_peers_are_connected(shelf) -> None:
    server = ShelfServer(shelf, TOKEN, timeout=600.0)
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes nothing: the server blocks sending
    slow.settimeout(30)
    slow.connect(("127.0.0.1", server.port))
    slow.sendall(_request(["blocks.0.attn.weight/exp_avg"]))
    closer = threading.Thread(target=server.close)
    closer.start()
    closer.join(60)  # well under the server's own timeout: close() cut the peers off
    assert not closer.is_alive()
    for peer in (silent, slow):
        _assert_ended(peer)
        peer.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).recv(1)
    assert server.refused == {}  # peers cut off by close() are not counted as refused


def _assert_ended(sock: socket.socket) -> None:
    """The server ended the connection: what it sent before (if anything) then the end, or a reset."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass


# ------------------------------------------------------------------------------------------------------------
# Hostile servers: the client refuses what a server without the token, or a broken one, sends

class _FakeServer:
    """Accepts one connection, reads its request and answers as ``behave(sock, request body)`` does."""

    def __init__(self, behave) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(behave,), daemon=True)
        self.thread.start()

    def _run(self, behave) -> None:
        self.listener.settimeout(30)
        sock, _ = self.listener.accept()
        with sock:
            outer = shelf_mod._read_frame(sock, time.monotonic() + 30)
            try:
                behave(self, sock, shelf_mod._opened(outer, TOKEN, shelf_mod._REQUEST))
            except (ConnectionResetError, BrokenPipeError):
                pass  # the client refused what it got so far and hung up

    def close(self) -> None:
        self.release.set()
        self.thread.join(30)
        self.listener.close()


DATA = os.urandom(BIG)


def _reply(body, *, token=TOKEN, size=BIG, nonce=None, name=None) -> bytes:
    entry = {"name": name or body["names"][0], "size": size, "digest": of_bytes(DATA), "meta": {}}
    return shelf_mod._signed(token, shelf_mod._REPLY, {"kind": "shelf-reply", "job": JOB,
                                                        "nonce": nonce or body["nonce"], "blobs": [entry]})


def _stall(fake, sock, body) -> None:
    sock.sendall(_reply(body) + DATA[:1000])
    fake.release.wait(30)


@pytest.mark.parametrize(("behave", "expected"), [
    (_stall, "stalled after 1000 of"),
    (lambda f, s, b: s.sendall(_reply(b) + DATA[:-1]), "cut short"),
    (lambda f, s, b: s.sendall(_reply(b) + DATA[:-1] + b"\0"), "does not match its digest"),
    (lambda f, s, b: s.sendall(_reply(b, token="rogue") + DATA), "could not sign with the job's token"),
    (lambda f, s, b: s.sendall(_reply(b, nonce="00" * 16) + DATA), "reply to another request"),
    (lambda f, s, b: s.sendall(_reply(b, name="other") + DATA), "other blobs than the ones asked for"),
    (lambda f, s, b: s.sendall(_reply(b, size=2 * BIG) + DATA), "over the"),
    (lambda f, s, b: s.sendall(struct.pack(">4sI", b"VSH1", 2**31)), "bad reply: oversize"),
    (lambda f, s, b: f.release.wait(30), "no reply within"),
])
def test_the_client_refuses_a_hostile_server(behave, expected) -> None:
    fake = _FakeServer(behave)
    try:
        with pytest.raises(HandoverError, match=expected) as info:
            _fetch(fake.port, ["blob"], timeout=1.0, max_bytes=BIG + 100)
        assert f"127.0.0.1:{fake.port}" in info.value.message
    finally:
        fake.close()


@pytest.mark.parametrize(("behave", "expected"), [
    (lambda f, s, b: s.sendall(_reply(b) + DATA), None),
    (_stall, "stalled after 1000 of"),
    (lambda f, s, b: s.sendall(_reply(b) + DATA[:-1]), "cut short"),
    (lambda f, s, b: s.sendall(_reply(b) + DATA[:-1] + b"\0"), "does not match its digest"),
])
def test_a_blob_hashed_on_its_own_thread_is_checked_alike(behave, expected, monkeypatch) -> None:
    """A blob larger than a hashing span is hashed by a thread a span behind the socket: the same bytes are
    accepted, and a stall, a cut and a damaged byte are refused the same way, without a hang."""
    monkeypatch.setattr(shelf_mod, "_HASH_SPAN", 2**20)  # BIG is then three spans and a bit
    threads = threading.active_count()
    fake = _FakeServer(behave)
    try:
        if expected is None:
            ((entry, data),) = _fetch(fake.port, ["blob"], timeout=5.0, max_bytes=BIG).values()
            assert data == DATA and entry.size == BIG
        else:
            with pytest.raises(HandoverError, match=expected):
                _fetch(fake.port, ["blob"], timeout=1.0, max_bytes=BIG + 100)
    finally:
        fake.close()
    assert threading.active_count() <= threads  # the hashing thread ended with the blob


def test_a_peer_that_is_not_there_is_named(tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(HandoverError, match=f"127.0.0.1:{port}"):
        _fetch(port, ["blob"])


def test_the_client_checks_its_own_request(server) -> None:
    with pytest.raises(HandoverError, match="bad blob name"):
        _fetch(server.port, ["a\0"])
    with pytest.raises(HandoverError, match="each blob once"):
        _fetch(server.port, ["empty", "empty"])
    for bad in ({"max_bytes": -1}, {"max_bytes": True}, {"timeout": 0}):
        with pytest.raises(HandoverError, match="fetch needs"):
            _fetch(server.port, ["empty"], **bad)
    assert server.refused == {} and server.served == 0  # nothing was sent


def test_the_module_needs_no_torch() -> None:
    code = "import sys, varuna_core.launch.shelf; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0



def test_a_writers_hash_is_recorded_and_every_read_still_checks_the_bytes(shelf) -> None:
    """A checkpoint's files are hashed while written: put() records that hash instead of hashing again; a hash
    that does not match the bytes cannot get past a reader that verifies (a load verifies every file)."""
    data = os.urandom(3000)
    entry = shelf.put("right", data, digest=of_bytes(data))
    assert entry.digest == of_bytes(data) and bytes(shelf.get("right")) == data
    shelf.put("wrong", data, digest=ZERO)
    with pytest.raises(HandoverError, match="damaged"):
        shelf.get("wrong")
    got = bytearray(3000)
    assert shelf.get_into("wrong", lambda e: memoryview(got), verify=False).size == 3000 and bytes(got) == data
    for bad in ("0" * 63, "G" * 64, 5, "A" * 64, "0" * 64, "md5:" + "0" * 64, "blake3:" + "0" * 63):
        with pytest.raises(HandoverError, match="64 lower-case hex digits"):
            shelf.put("bad", data, digest=bad)


# ------------------------------------------------------------------------------------------------------------
# Blobs written in place (reserve, adopt) and read in place (link)

def _staged(space, name: str, data: bytes):
    path = space.directory / name
    path.write_bytes(data)
    return path, of_bytes(data)


def test_a_file_written_in_reserved_room_becomes_a_blob_without_a_copy(tmp_path) -> None:
    shelf = Shelf(JOB, root=tmp_path, budget=10_000)
    data = os.urandom(3000)
    with shelf.reserve(6000) as space:
        assert space.directory.parent == shelf.path and oct(space.directory.stat().st_mode & 0o777) == "0o700"
        path, digest = _staged(space, "f", data)
        inode = path.stat().st_ino
        entry = space.adopt("step_1/__0_0.distcp", path, {"rank": 0}, digest=digest)
        assert not path.exists() and shelf._file("step_1/__0_0.distcp").stat().st_ino == inode  # renamed, not copied
        assert (entry.size, entry.digest, entry.meta) == (3000, digest, {"rank": 0})
        with pytest.raises(ShelfFullError):  # 6000 reserved (3000 of it now a blob) + 5000 > 10_000
            shelf.put("other", b"x" * 5000)
        (space.directory / "left-over").write_bytes(b"never adopted")
    assert bytes(shelf.get("step_1/__0_0.distcp")) == data
    assert sorted(p.name for p in shelf.path.iterdir()) == sorted([".lock", shelf._file("step_1/__0_0.distcp").name])
    shelf.put("other", b"x" * 5000)  # the unused room was given back


def test_a_reservation_over_the_budget_or_the_free_space_is_refused(tmp_path, monkeypatch) -> None:
    shelf = Shelf(JOB, root=tmp_path, budget=10_000)
    shelf.put("a", b"x" * 6000)
    with pytest.raises(ShelfFullError, match="do not fit"), shelf.reserve(5000):
        pass
    with shelf.reserve(3000) as space, pytest.raises(ShelfFullError, match="more than were reserved"):
        space.adopt("b", _staged(space, "b", b"y" * 5000)[0], digest=ZERO)  # 2000 over the room, not in budget
    assert shelf.names() == ["a"] and [p.suffix for p in shelf.path.iterdir() if p.suffix != ".blob"] == [""]
    usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(shelf_mod.shutil, "disk_usage", lambda path: usage(100, 100, 10))
    with pytest.raises(ShelfFullError, match="10 bytes free"), Shelf("job-2", root=tmp_path).reserve(11):
        pass


def test_only_a_regular_file_of_the_room_can_be_adopted(tmp_path) -> None:
    shelf = Shelf(JOB, root=tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    with shelf.reserve(100) as space:
        with pytest.raises(HandoverError, match="only a file of"):
            space.adopt("a", outside, digest=ZERO)
        (space.directory / "link").symlink_to(outside)
        with pytest.raises(HandoverError, match="cannot adopt"):
            space.adopt("a", space.directory / "link", digest=ZERO)
        (space.directory / "dir").mkdir()
        with pytest.raises(HandoverError):
            space.adopt("a", space.directory / "dir", digest=ZERO)
        path, _ = _staged(space, "f", b"data")
        for bad in ("0" * 63, "G" * 64, "0" * 64, "sha256:" + "A" * 64, b"x" * 64):  # (None: unhashed, tested above)
            with pytest.raises(HandoverError, match="64 lower-case hex digits"):
                space.adopt("a", path, digest=bad)
        with pytest.raises(HandoverError, match="bad blob name"):
            space.adopt("", path, digest=ZERO)
    assert shelf.names() == [] and outside.read_bytes() == b"secret"


def test_link_gives_the_blobs_own_file_which_outlives_the_blob(shelf, tmp_path) -> None:
    name = "blocks.0.attn.weight/exp_avg"
    dest = shelf.path.parent / "taken"
    entry = shelf.link(name, dest)
    assert entry == shelf.manifest()[name] and dest.stat().st_ino == shelf._file(name).stat().st_ino
    assert dest.read_bytes()[:entry.size] == _BLOBS[name]  # the data first, its entry after it
    shelf.clear()
    assert dest.read_bytes()[:entry.size] == _BLOBS[name]
    with pytest.raises(HandoverError, match="no blob"):
        shelf.link(name, tmp_path / "again")


def test_link_refuses_a_missing_or_damaged_blob_and_leaves_nothing(shelf, tmp_path) -> None:
    with pytest.raises(HandoverError, match="no blob"):
        shelf.link("not-there", tmp_path / "x")
    _damage(shelf, "blocks.0.attn.weight", cut=True)
    with pytest.raises(HandoverError, match="damaged"):
        shelf.link("blocks.0.attn.weight", tmp_path / "y")
    assert not (tmp_path / "y").exists()
    with pytest.raises(FileExistsError):  # the caller's own problem: it copies instead
        shelf.link("empty", shelf._file("empty"))


@pytest.mark.parametrize("tail", [
    b"",  # nothing at all
    b"VSHB",  # shorter than a trailer
    struct.pack(">I4s", 2**31, b"VSHB"),  # an entry longer than any entry can be
    struct.pack(">I4s", 10**6, b"VSHB"),  # an entry longer than the file
    b"{}" + struct.pack(">I4s", 2, b"VSHB"),  # not an entry
    b"[" * 5000 + struct.pack(">I4s", 5000, b"VSHB"),  # nested past any parser's depth
    json_entry := b'{"name":"x","size":5,"digest":"blake3:' + b"0" * 64 + b'","meta":{}}'
    + struct.pack(">I4s", 89, b"VSHB"),  # the right blob name, but 0 bytes of data where it says 5
    b"data!" + json_entry[:-8] + struct.pack(">I4s", 89, b"XSHB"),  # a wrong magic
])
def test_a_hostile_blob_file_is_refused_by_name_and_left_out_of_the_manifest(tmp_path, tail) -> None:
    shelf = Shelf(JOB, root=tmp_path)
    shelf.put("y", b"fine")
    shelf._file("x").write_bytes(tail)
    with pytest.raises(HandoverError, match="damaged"):
        shelf.get("x")
    with pytest.raises(HandoverError, match="damaged"):
        shelf.link("x", tmp_path / "taken")
    assert shelf.names() == ["y"] and not (tmp_path / "taken").exists()


def test_reservations_from_many_processes_never_overrun_the_budget(tmp_path) -> None:
    """Processes that reserve room and adopt files at once (the ranks of a host publishing together): the budget
    holds at every moment, and whatever a process reserved and did not use is given back."""
    code = textwrap.dedent("""
        import os, sys
        from varuna_core.errors import ShelfFullError
        from varuna_core.launch.shelf import Shelf
        from varuna_core.util.digest import of_bytes
        s = Shelf("job-1", root=sys.argv[1], budget=100_000)
        got = 0
        for i in range(30):
            try:
                with s.reserve(30_000) as space:
                    data = os.urandom(20_000)
                    path = space.directory / "f"
                    path.write_bytes(data)
                    space.adopt(f"{sys.argv[2]}.{i}", path, digest=of_bytes(data))
                    got += 1
                    assert s._used() <= 100_000, s._used()
                    s.remove([f"{sys.argv[2]}.{i}"])
            except ShelfFullError:
                pass
        print(got)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), who], stdout=subprocess.PIPE, text=True)
             for who in "abcd"]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    assert sum(int(out) for out, _ in outs) > 0
    shelf = Shelf(JOB, root=tmp_path)
    assert shelf.names() == [] and not [p for p in shelf.path.iterdir() if p.suffix in (".resv", ".staging", ".part")]
