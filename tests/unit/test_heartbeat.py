"""The heartbeat channel under hostile input: no datagram stops the manager's listener, replays and other
attempts' beats are dropped, notices are queued once and acknowledged every time. Real UDP sockets on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import time

import pytest

from varuna_core.env import WorkerEnv
from varuna_core.launch import heartbeat
from varuna_core.launch.heartbeat import Listener, send_notice
from varuna_core.launch.protocol import decode
from varuna_core.worker.beacon import Beacon

JOB, TOKEN = "job", "tok"


def sign(payload: str, token: str = TOKEN) -> bytes:
    """A datagram carrying ``payload`` as it is, signed with ``token``: correctly signed, whatever it holds."""
    mac = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}).encode()


def beat_body(**fields) -> dict:
    body = {"job": JOB, "kind": "beat", "ts": time.time(), "sender": secrets.token_hex(8), "seq": 1, "attempt": 0,
            "rank": 0, "host": "h", "step": 1, "loss": 2.5, "steps": [[0, 2.5, 0.1]]}
    return {**body, **fields}


def signed_beat(**fields) -> bytes:
    return sign(json.dumps(beat_body(**fields)))


def notice_body(**fields) -> dict:
    return {"job": JOB, "kind": "preempt", "ts": time.time(), "id": secrets.token_hex(16), "host": "h",
            "seconds": 5.0, **fields}


def wait_for(condition, timeout: float = 30.0) -> bool:
    """Poll until ``condition()`` holds; the deadline only bounds a failure (a loaded machine may deliver late)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def listener():
    listener = Listener(JOB, TOKEN, bind="127.0.0.1")
    yield listener
    listener.close()


@pytest.fixture
def udp():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(5)
        yield sock


def deliver(sock: socket.socket, listener: Listener, data: bytes) -> None:
    sock.sendto(data, ("127.0.0.1", listener.port))


def assert_still_listening(sock: socket.socket, listener: Listener, rank: int = 7) -> None:
    """A valid beat sent after whatever came before is received."""
    deliver(sock, listener, signed_beat(rank=rank, step=42))
    assert wait_for(lambda: rank in listener.snapshot()), listener.stats()
    assert listener.alive and listener.snapshot()[rank].step == 42


NESTED = b'{"p":' + b"[" * 50000
JUNK = [
    ("nested_huge", NESTED, "oversize"),
    ("nested", b'{"p":' + b"[" * 8000, "malformed"),
    ("random_10k", os.urandom(10_000), "oversize"),
    ("empty", b"", "malformed"),
    ("not_utf8", b'{"p": "\xe9\xff", "mac": "00"}', "malformed"),
    ("number", b"42", "malformed"),
    ("list", b"[1, 2]", "malformed"),
    ("no_p", b'{"mac": "00"}', "malformed"),
    ("p_not_str", b'{"p": 5, "mac": "00"}', "malformed"),
    ("mac_not_str", b'{"p": "{}", "mac": 5}', "malformed"),
    ("lone_surrogate", b'{"p": "\\ud800", "mac": "00"}', "malformed"),
    ("mac_not_ascii", b'{"p": "{}", "mac": "\\u00e9"}', "bad_mac"),
    ("wrong_token", sign(json.dumps(beat_body()), token="other"), "bad_mac"),
    ("signed_not_json", sign("{not json"), "bad_fields"),
    ("signed_nested", sign('{"a":' + "[" * 3000 + "]" * 3000 + "}"), "bad_fields"),
    ("signed_list", sign("[1, 2, 3]"), "bad_fields"),
    ("signed_number", sign("1e999"), "bad_fields"),
    ("other_job", signed_beat(job="another"), "other_job"),
    ("ack_kind", signed_beat(kind="ack"), "wrong_kind"),
    ("no_kind", sign(json.dumps({"job": JOB, "ts": time.time()})), "wrong_kind"),
    ("step_str", signed_beat(step="x"), "bad_fields"),
    ("step_negative", signed_beat(step=-1), "bad_fields"),
    ("step_float", signed_beat(step=1.5), "bad_fields"),
    ("step_bool", signed_beat(step=True), "bad_fields"),
    ("step_huge", signed_beat(step=2**64), "bad_fields"),
    ("rank_inf", sign(json.dumps(beat_body()).replace('"rank": 0', '"rank": 1e999')), "bad_fields"),
    ("rank_negative", signed_beat(rank=-1), "bad_fields"),
    ("rank_too_big", signed_beat(rank=2**20), "bad_fields"),
    ("rank_str", signed_beat(rank="0"), "bad_fields"),
    ("rank_missing", sign(json.dumps({k: v for k, v in beat_body().items() if k != "rank"})), "bad_fields"),
    ("host_dict", signed_beat(host={}), "bad_fields"),
    ("host_long", signed_beat(host="h" * 1000), "bad_fields"),
    ("steps_bad_record", signed_beat(steps=[[1, "a", {}]]), "bad_fields"),
    ("steps_short_record", signed_beat(steps=[[1, 2.0]]), "bad_fields"),
    ("steps_not_list", signed_beat(steps={"1": 2}), "bad_fields"),
    ("steps_huge", signed_beat(steps=[[i, 1.0, None] for i in range(300)]), "bad_fields"),
    ("loss_nan", signed_beat(loss=float("nan")), "bad_fields"),
    ("loss_1e999", sign(json.dumps(beat_body()).replace('"loss": 2.5', '"loss": 1e999')), "bad_fields"),
    ("step_time_inf", signed_beat(step_time=float("inf")), "bad_fields"),
    ("record_nan", signed_beat(steps=[[1, float("nan"), None]]), "bad_fields"),
    ("compute_time_str", signed_beat(compute_time="fast"), "bad_fields"),
    ("extra_dict", signed_beat(extra={"a": [1]}), "bad_fields"),
    ("extra_long_key", signed_beat(**{"k" * 100: 1}), "bad_fields"),
    ("ts_str", signed_beat(ts="now"), "bad_fields"),
    ("seq_str", signed_beat(seq="1"), "bad_fields"),
    ("sender_empty", signed_beat(sender=""), "bad_fields"),
    ("attempt_negative", signed_beat(attempt=-1), "bad_fields"),
    ("notice_seconds_str", sign(json.dumps(notice_body(seconds="soon"))), "bad_fields"),
    ("notice_seconds_negative", sign(json.dumps(notice_body(seconds=-1))), "bad_fields"),
    ("notice_no_host", sign(json.dumps({k: v for k, v in notice_body().items() if k != "host"})), "bad_fields"),
    ("notice_id_dict", sign(json.dumps(notice_body(id={}))), "bad_fields"),
]


@pytest.mark.parametrize(("data", "reason"), [(d, r) for _, d, r in JUNK], ids=[name for name, _, _ in JUNK])
def test_no_datagram_stops_the_listener(listener, udp, data, reason) -> None:
    deliver(udp, listener, data)
    assert wait_for(lambda: listener.rejected == 1), listener.stats()
    assert_still_listening(udp, listener)
    stats = listener.stats()
    assert stats[reason] == 1 and stats["rejected"] == listener.rejected == 1 and stats["beats"] == 1, stats
    assert set(listener.snapshot()) == {7} and listener.take_notices() == []


def test_a_flood_of_junk_is_counted_and_keeps_nothing(listener, udp) -> None:
    for _, data, _ in JUNK:
        deliver(udp, listener, data)
    assert wait_for(lambda: listener.rejected == len(JUNK)), listener.stats()
    stats = listener.stats()
    for reason in {r for _, _, r in JUNK}:
        assert stats[reason] == sum(r == reason for _, _, r in JUNK), (reason, stats)
    for batch in range(1, 11):  # in batches: the kernel's receive buffer holds a few hundred datagrams
        for _ in range(20):
            deliver(udp, listener, os.urandom(1 + secrets.randbelow(2000)))
            deliver(udp, listener, signed_beat(ts=time.time() - 3600))
        want = len(JUNK) + 40 * batch
        assert wait_for(lambda: listener.rejected == want), listener.stats()  # noqa: B023 - waited for here
    assert listener.stats()["stale"] == 200
    assert_still_listening(udp, listener)
    assert listener.take_steps() == {0: (2.5, 0.1)} and listener._notice_ids == {}
    assert len(listener._senders) == 1  # only accepted beats' senders are remembered


def test_receive_errors_do_not_end_the_loop(listener, udp) -> None:
    class Flaky:
        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.failed = sock, 0

        def recvfrom(self, size: int):
            if self.failed < 3:
                self.failed += 1
                raise OSError(errno.ECONNRESET, "reset by an ICMP error")
            return self.sock.recvfrom(size)

        def __getattr__(self, name: str):
            return getattr(self.sock, name)

    real = listener._sock
    listener._sock = flaky = Flaky(real)
    try:
        assert wait_for(lambda: flaky.failed == 3)
        assert_still_listening(udp, listener)
        assert listener.stats()["recv_errors"] == 3
    finally:
        listener._sock = real


@pytest.mark.timeout(30)  # a close that waited on a blocked socket would hang here
def test_close_stops_the_thread() -> None:
    listener = Listener(JOB, TOKEN, bind="127.0.0.1")
    assert listener.alive
    listener.close()
    assert not listener.alive


def drain(sock: socket.socket, wait: float = 0.3) -> list[tuple[bytes, dict]]:
    """Every datagram that reaches ``sock`` within ``wait`` seconds of the last one, with its body."""
    out = []
    sock.settimeout(wait)
    try:
        while True:
            data, _ = sock.recvfrom(65536)
            out.append((data, decode(data, JOB, TOKEN)))
    except TimeoutError:
        return out
    finally:
        sock.settimeout(5)


def test_a_captured_beat_counts_once(listener, udp) -> None:
    beacon = Beacon(udp.getsockname(), JOB, TOKEN, rank=3, host="h", interval=3600)
    beacon.progress(step=5, loss_step=4, loss=1.5, step_time=0.2)
    beacon.flush()
    data, body = next((d, b) for d, b in drain(udp) if b["steps"])  # the thread's datagram or flush's
    assert body["sender"] == beacon.sender and body["seq"] >= 1 and body["attempt"] == 0 and body["step"] == 5
    deliver(udp, listener, data)
    deliver(udp, listener, data)
    assert wait_for(lambda: listener.stats()["replayed"] == 1), listener.stats()
    assert listener.stats()["beats"] == 1 and listener.snapshot()[3].step == 5
    assert listener.take_steps() == {4: (1.5, 0.2)}
    beacon.progress(step=6)
    beacon.flush()
    later, newest = drain(udp)[-1]
    assert newest["seq"] > body["seq"] and newest["step"] == 6
    deliver(udp, listener, later)
    assert wait_for(lambda: listener.snapshot()[3].step == 6)
    deliver(udp, listener, data)  # an older one, after a newer one
    assert wait_for(lambda: listener.stats()["replayed"] == 2), listener.stats()
    assert listener.snapshot()[3].step == 6 and listener.stats()["beats"] == 2


def test_a_repeated_notice_is_acknowledged_again_but_queued_once(listener, udp) -> None:
    assert not send_notice(udp.getsockname(), JOB, TOKEN, {"host": "h", "seconds": 30}, tries=1, timeout=0.05)
    data, _ = udp.recvfrom(65536)
    notice_id = decode(data, JOB, TOKEN)["id"]
    deliver(udp, listener, data)
    deliver(udp, listener, data)
    acks = [decode(udp.recvfrom(65536)[0], JOB, TOKEN) for _ in range(2)]
    assert [(a["kind"], a["id"]) for a in acks] == [("ack", notice_id)] * 2
    notices = listener.take_notices()
    assert [(n["host"], n["seconds"], n["id"]) for n in notices] == [("h", 30.0, notice_id)]
    stats = listener.stats()
    assert stats["notices"] == 1 and stats["notice_repeats"] == 1 and stats["rejected"] == 0
    deliver(udp, listener, data)  # the id is remembered after the launcher took the notice
    decode(udp.recvfrom(65536)[0], JOB, TOKEN)
    assert listener.take_notices() == []


def test_a_notice_id_is_remembered_as_long_as_its_latest_copy_is_fresh(udp) -> None:
    listener = Listener(JOB, TOKEN, bind="127.0.0.1", max_skew=1.0)
    try:
        here = ("127.0.0.1", 9)  # the acks go nowhere
        first = notice_body(ts=time.time() - 0.9)
        retry = sign(json.dumps({**first, "ts": time.time()}))
        assert listener._handle(sign(json.dumps(first)), here) is None
        assert listener._handle(retry, here) is None
        time.sleep(0.3)  # the first copy is stale now, the retry is not
        assert listener._handle(retry, here) is None
        assert len(listener.take_notices()) == 1 and listener.stats()["notice_repeats"] == 2
    finally:
        listener.close()


def test_send_notice_refuses_what_the_manager_would_drop() -> None:
    for body in ({"host": "h", "seconds": float("inf")}, {"host": "h", "seconds": -1}, {"host": "h" * 300},
                 {"seconds": 5}):
        with pytest.raises(ValueError, match="not a valid preemption notice"):
            send_notice(("127.0.0.1", 9), JOB, TOKEN, body, tries=1, timeout=0.05)


@pytest.mark.parametrize("offset", [-3600, 3600])
def test_old_and_future_messages_are_stale(listener, udp, offset) -> None:
    deliver(udp, listener, signed_beat(ts=time.time() + offset, rank=1))
    deliver(udp, listener, sign(json.dumps(notice_body(ts=time.time() + offset))))
    assert wait_for(lambda: listener.stats()["stale"] == 2), listener.stats()
    assert listener.snapshot() == {} and listener.take_notices() == []
    with pytest.raises(socket.timeout):
        udp.settimeout(0.2)
        udp.recvfrom(65536)  # a stale notice is not acknowledged
    assert_still_listening(udp, listener)


def test_the_freshness_window_is_a_parameter(udp) -> None:
    listener = Listener(JOB, TOKEN, bind="127.0.0.1", max_skew=5)
    try:
        deliver(udp, listener, signed_beat(ts=time.time() - 30, rank=1))
        assert wait_for(lambda: listener.stats()["stale"] == 1), listener.stats()
        deliver(udp, listener, signed_beat(ts=time.time() - 2, rank=2))
        assert wait_for(lambda: 2 in listener.snapshot())
    finally:
        listener.close()


def test_beats_of_another_attempt_are_dropped(listener, udp) -> None:
    deliver(udp, listener, signed_beat(rank=0, attempt=1))
    assert wait_for(lambda: 0 in listener.snapshot())  # no attempt started: any counts
    listener.reset(attempt=2)
    assert listener.snapshot() == {}
    deliver(udp, listener, signed_beat(rank=0, attempt=1))
    assert wait_for(lambda: listener.stats()["other_attempt"] == 1), listener.stats()
    deliver(udp, listener, signed_beat(rank=1, attempt=2))
    assert wait_for(lambda: 1 in listener.snapshot())
    assert set(listener.snapshot()) == {1}

    told = WorkerEnv(manager=f"127.0.0.1:{listener.port}", job_id=JOB, job_token=TOKEN, host="worker")
    current = Beacon.launched(dataclasses.replace(told, attempt=2), 4)
    late = Beacon.launched(dataclasses.replace(told, attempt=1), 5)
    unnumbered = Beacon.launched(told, 6)
    assert (current.attempt, late.attempt, unnumbered.attempt) == (2, 1, 0)
    for beacon in (current, late, unnumbered):
        beacon.flush()
    assert wait_for(lambda: listener.stats()["other_attempt"] >= 3), listener.stats()
    assert set(listener.snapshot()) == {1, 4} and listener.snapshot()[4].host == "worker"


def test_a_beacon_sends_only_what_the_listener_accepts(listener) -> None:
    beacon = Beacon(("127.0.0.1", listener.port), JOB, TOKEN, rank=2, host="h", interval=3600)
    beacon.progress(step=1, loss_step=0, loss=float("nan"), step_time=float("inf"), compute_time=0.5,
                    note=object(), flag=True)
    beacon.flush()
    assert wait_for(lambda: 2 in listener.snapshot()), listener.stats()
    beat = listener.snapshot()[2]
    assert beat.get("loss") is None and beat.get("step_time") is None and beat.get("compute_time") == 0.5
    assert beat.get("flag") is True and "note" not in beat.fields and listener.take_steps() == {}
    assert listener.rejected == 0


@pytest.mark.timeout(30)  # a notice without an answer that waited for one would hang here
def test_send_notice_needs_an_answer(listener, udp) -> None:
    assert send_notice(("127.0.0.1", listener.port), JOB, TOKEN, {"host": "h", "seconds": 5}, timeout=1.0)
    assert [n["host"] for n in listener.take_notices()] == ["h"]
    assert not send_notice(udp.getsockname(), JOB, TOKEN, {"host": "h"}, tries=3, timeout=0.1)
    assert not send_notice(("127.0.0.1", listener.port), JOB, "bad", {"host": "h"}, tries=2, timeout=0.1)


def test_the_tables_stay_bounded(listener, monkeypatch) -> None:
    monkeypatch.setattr(heartbeat, "_MAX_SENDERS", 8)
    monkeypatch.setattr(heartbeat, "_MAX_NOTICE_IDS", 8)
    monkeypatch.setattr(heartbeat, "_MAX_PENDING_NOTICES", 4)
    monkeypatch.setattr(heartbeat, "_MAX_PENDING_STEPS", 16)
    here = ("127.0.0.1", 9)  # the acks go nowhere
    for i in range(50):
        assert listener._handle(signed_beat(rank=i, steps=[[i, 1.0, None]]), here) is None
        assert listener._handle(sign(json.dumps(notice_body())), here) is None
    assert len(listener._senders) == 8 and len(listener._notice_ids) == 8
    assert len(listener.take_notices()) == 4 and sorted(listener.take_steps()) == list(range(34, 50))


def test_a_warm_attempts_beats_are_kept_apart_until_it_takes_over(listener, udp) -> None:
    """A morph by handover runs two attempts at once: the old one's beats stay the current ones, the warm one's
    are kept apart (a warm worker's beat must not pass for a sign of life of an old rank of the same number),
    a third attempt's are dropped, and promote() makes the warm one current with the beats it sent."""
    listener.reset(attempt=3)
    listener.expect(4)
    deliver(udp, listener, signed_beat(rank=0, attempt=3, step=7))
    deliver(udp, listener, signed_beat(rank=0, attempt=4, step=0, t_warm=1.0))
    deliver(udp, listener, signed_beat(rank=1, attempt=5))
    assert wait_for(lambda: 0 in listener.snapshot() and 0 in listener.snapshot(4))
    assert wait_for(lambda: listener.stats()["other_attempt"] == 1), listener.stats()
    assert listener.snapshot()[0].step == 7 and listener.snapshot(3)[0].step == 7
    assert listener.snapshot(4)[0].get("t_warm") == 1.0 and set(listener.snapshot(4)) == {0}
    listener.promote(4)
    assert listener.snapshot()[0].get("t_warm") == 1.0 and listener.snapshot(4) == listener.snapshot()
    deliver(udp, listener, signed_beat(rank=1, attempt=3))  # a late beat of the old attempt
    assert wait_for(lambda: listener.stats()["other_attempt"] == 2), listener.stats()
    assert set(listener.snapshot()) == {0}
    listener.expect(5)
    listener.expect(None)  # the warm attempt was given up: its beats are dropped again
    deliver(udp, listener, signed_beat(rank=1, attempt=5))
    assert wait_for(lambda: listener.stats()["other_attempt"] == 3), listener.stats()
