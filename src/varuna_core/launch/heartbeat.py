"""Heartbeats and notices between the workers, ``varuna notify-preempt`` and the launcher's manager.

One UDP socket on the manager receives JSON datagrams. Why UDP: a worker must never block or fail because the
manager is slow or gone, and a lost heartbeat is harmless (the next one follows within seconds); a notice is
acknowledged and retried.

A datagram (at most ``_MAX_DATAGRAM`` bytes) is ``{"p": PAYLOAD, "mac": HEX}``: ``PAYLOAD`` is the text of a JSON
object, ``HEX`` the HMAC-SHA256 of its UTF-8 bytes keyed by the job's token (a secret made per launch, handed to
the workers in their environment over SSH, to ``varuna notify-preempt`` through a 0600 file in the run
directory). Everything in the payload is signed; the token itself never crosses the network. Every payload holds
``job`` (the job id), ``kind`` and ``ts`` (the sender's ``time.time()``). Kinds of message:

* ``beat`` (worker → manager, after every step and every ``interval`` seconds): ``sender`` (a random id per
  :class:`Beacon`), ``seq`` (1, 2, ... per datagram of that sender), ``attempt`` (the worker's
  ``VARUNA_ATTEMPT``), ``rank``, ``host``, ``step``, ``steps`` (``[step, loss, step time]`` of the steps finished
  since the previous datagram, at most ``_MAX_STEPS``) and the rank's state: loss, step time, compute time (the
  time the rank spent in its own forward/backward work), samples per step, timings (see ``_BEAT_FIELDS``; any
  other field must be a short scalar);
* ``preempt`` (notify-preempt → manager): ``id`` (random), ``host`` and ``seconds`` until it goes away;
* ``ack`` (manager → notify-preempt): the ``id`` of the notice it received.

The manager (:class:`Listener`) drops, and counts by reason (:meth:`Listener.stats`), every datagram that is not
exactly what an honest sender of this job sends now:

* ``oversize``, ``malformed`` (not the JSON above), ``bad_mac`` (another token: someone else, or an earlier job
  on the same port), ``other_job``, ``wrong_kind``, ``bad_fields`` (signed, but a field of the wrong type or out
  of range: nothing unchecked reaches the manager's state);
* ``stale``: its ``ts`` differs from the manager's clock by more than ``max_skew`` seconds (120 by default). A
  captured datagram cannot be replayed later; the price is that the clocks of the manager's and the workers'
  hosts must agree within ``max_skew`` (NTP does), or the workers are never heard and are declared silent;
* ``replayed``: a beat whose ``seq`` is not above the last one seen from its ``sender`` (the manager remembers
  the last ``_MAX_SENDERS`` senders). A datagram overtaken by a later one of the same sender is dropped too,
  which is harmless: the later one carries the newer state. A notice whose ``id`` was seen within the freshness
  window is acknowledged again (the sender may have missed the first ack) but not queued again;
* ``other_attempt``: a beat of another attempt than the one :meth:`Listener.reset` started, e.g. a late beat of
  a worker of the previous attempt, which would otherwise count as a sign of life of the new one. Notices come
  from outside the attempts and are not bound to one.

No datagram, whatever its content, stops the manager's receiving thread (:attr:`Listener.alive`), and its memory
stays bounded however many datagrams arrive.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import env

__all__ = ["encode", "decode", "Beacon", "Listener", "send_notice", "Beat", "DEFAULT_MAX_SKEW"]

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 8192
_MAX_STEPS = 40  # step records per datagram (a datagram stays well under _MAX_DATAGRAM)
_MAX_RANK = 2**20  # ranks are 0 .. _MAX_RANK - 1
_MAX_INT = 2**63 - 1
_MAX_TEXT = 255  # host names, other string fields
_MAX_KEY = 64  # field names, sender and notice ids
_MAX_SENDERS = 4096  # senders whose last sequence number the listener remembers
_MAX_NOTICE_IDS = 4096
_MAX_PENDING_NOTICES = 1024  # notices not yet taken by the launcher
_MAX_PENDING_STEPS = 16384  # step records not yet taken by the launcher
DEFAULT_MAX_SKEW = 120.0

_DROPS = ("oversize", "malformed", "bad_mac", "other_job", "wrong_kind", "bad_fields", "stale", "replayed",
          "other_attempt", "error")


class _Bad(ValueError):
    """A field of the wrong type or out of range."""


def _count(value: Any, limit: int = _MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise _Bad(value)
    return int(value)


def _real(value: Any) -> float:
    """A finite number, as a float (JSON has no NaN or infinity; Python's decoder accepts them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(value)
    if isinstance(value, int) and abs(value) > _MAX_INT:
        raise _Bad(value)
    value = float(value)
    if not math.isfinite(value):
        raise _Bad(value)
    return value


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise _Bad(value)
    return str(value)


def _ident(value: Any) -> str:
    if not value:
        raise _Bad(value)
    return _text(value, _MAX_KEY)


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _scalar(value: Any) -> Any:
    """A field the manager does not know: kept if it is a short scalar."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise _Bad(value)
        return int(value)
    return _real(value)


def _record(value: Any) -> tuple[int, float, float | None]:
    """One ``[step, loss, step time]`` record."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise _Bad(value)
    return _count(value[0]), _real(value[1]), _optional(_real)(value[2])


def _records(value: Any) -> list[tuple[int, float, float | None]]:
    if not isinstance(value, list) or len(value) > _MAX_STEPS:
        raise _Bad(value)
    return [_record(r) for r in value]


_COMMON_FIELDS: dict[str, Callable[[Any], Any]] = {"job": _text, "kind": _text, "ts": _real}
_BEAT_FIELDS: dict[str, Callable[[Any], Any]] = {
    **_COMMON_FIELDS,
    "sender": _ident, "seq": _count, "attempt": _count, "steps": _records,
    "rank": lambda v: _count(v, _MAX_RANK - 1), "host": _text, "step": _count,
    "loss_step": _optional(_count), "loss": _optional(_real), "step_time": _optional(_real),
    "compute_time": _optional(_real), "samples": _optional(_count), "total_steps": _optional(_count),
    "stage": _optional(_count), "replica": _optional(_count), "checkpointed": _optional(_count),
    "t_start": _optional(_real), "t_ready": _optional(_real), "t_resumed": _optional(_real),
    "t_checkpointed": _optional(_real),
}
_BEAT_REQUIRED = ("ts", "sender", "seq", "attempt", "rank")


def _seconds(value: Any) -> float:
    value = _real(value)
    if value < 0:
        raise _Bad(value)
    return value


_NOTICE_FIELDS: dict[str, Callable[[Any], Any]] = {
    **_COMMON_FIELDS, "id": _ident, "host": _text, "seconds": _optional(_seconds),
}
_NOTICE_REQUIRED = ("ts", "id", "host")


def _validate(body: dict, fields: dict[str, Callable[[Any], Any]], required: tuple[str, ...]) -> dict[str, Any]:
    """``body`` with every known field checked (and normalised); raises :class:`_Bad` at the first wrong one."""
    out = {}
    for key, value in body.items():
        if len(key) > _MAX_KEY:
            raise _Bad(key)
        out[key] = fields.get(key, _scalar)(value)
    if any(key not in out for key in required):
        raise _Bad(required)
    return out


def encode(job: str, token: str, kind: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps({**body, "job": job, "kind": kind, "ts": time.time()}, separators=(",", ":"),
                         allow_nan=False)
    mac = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}, separators=(",", ":")).encode()


def _open(data: bytes, job: str, token: str) -> tuple[dict[str, Any] | None, str]:
    """The message's body and "ok", or None and why it is dropped."""
    if len(data) > _MAX_DATAGRAM:
        return None, "oversize"
    try:
        outer = json.loads(data)
    except (ValueError, RecursionError):
        return None, "malformed"
    if not isinstance(outer, dict) or not isinstance(outer.get("p"), str) or not isinstance(outer.get("mac"), str):
        return None, "malformed"
    try:
        payload = outer["p"].encode()
    except UnicodeEncodeError:
        return None, "malformed"
    mac = outer["mac"]
    want = hmac.new(token.encode(), payload, hashlib.sha256).hexdigest()
    if not mac.isascii() or not hmac.compare_digest(want, mac):
        return None, "bad_mac"
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return None, "bad_fields"
    if not isinstance(body, dict):
        return None, "bad_fields"
    return (body, "ok") if body.get("job") == job else (None, "other_job")


def decode(data: bytes, job: str, token: str) -> dict[str, Any] | None:
    """The message's body (a dict) if it is well formed, of this job and signed with its token; else None.

    Checks neither the body's fields nor its freshness: :class:`Listener` does."""
    return _open(data, job, token)[0]


@dataclass
class Beat:
    """The latest heartbeat of one rank, as the manager keeps it (``fields``: every checked field it sent)."""

    rank: int
    host: str
    step: int
    received: float
    fields: dict = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class Beacon:
    """Worker side: sends heartbeats to the manager (``VARUNA_MANAGER=host:port``) from a daemon thread.

    :meth:`progress` records a finished step (called by the library after every ``step``); the thread sends the
    latest state right away and then every ``interval`` seconds, so the manager hears from a live worker even
    during a long step or a checkpoint. The state is checked as the manager checks it before it is sent: a
    non-finite number becomes None (a diverged loss must not silence the rank) and any other field the manager
    would refuse is left out with a warning, so that one odd value never costs the rank its heartbeats.
    """

    def __init__(self, address: tuple[str, int], job: str, token: str, rank: int, host: str,
                 interval: float = 2.0, *, attempt: int = 0) -> None:
        self.address, self.job, self.token, self.rank, self.host = address, job, token, rank, host
        self.interval, self.attempt = interval, attempt
        self.sender = secrets.token_hex(8)
        self._seq = 0
        self._state: dict[str, Any] = {"rank": rank, "host": host, "step": 0}
        self._steps: list[list] = []  # [step, loss, step time] of every step since the last datagram
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one datagram at a time, in the order of their sequence numbers
        self._warned: set[str] = set()
        self._wake = threading.Event()
        self._sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_DGRAM)
        self._thread = threading.Thread(target=self._run, name="varuna-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, **state: Any) -> None:
        with self._lock:
            self._state = {**self._state, **state}
            if state.get("loss") is not None:
                self._steps.append([state.get("loss_step", state.get("step")), state["loss"], state.get("step_time")])
                del self._steps[:-_MAX_STEPS]
        self._wake.set()

    def flush(self) -> None:
        """Send the current state now, from the caller's thread (before the process exits)."""
        self._send()

    def _warn(self, what: str) -> None:
        if what not in self._warned and len(self._warned) < 64:
            self._warned.add(what)
            log.warning("heartbeat: %s", what)

    def _clean(self, state: dict[str, Any], records: list[list]) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for key, value in state.items():
            try:
                if len(key) > _MAX_KEY:
                    raise _Bad(key)
                body[key] = _BEAT_FIELDS.get(key, _scalar)(value)
            except _Bad:
                if isinstance(value, float) and not math.isfinite(value):
                    body[key] = None
                else:
                    self._warn(f"field {key}={value!r:.80} is not sent (the manager would refuse it)")
        steps = []
        for record in records:
            step, loss, step_time = record
            if isinstance(step_time, float) and not math.isfinite(step_time):
                step_time = None
            try:
                steps.append(list(_record([step, loss, step_time])))
            except _Bad:
                self._warn(f"step record {record!r:.80} is not sent (the manager would refuse it)")
        body["steps"] = steps
        return body

    def _send(self) -> None:
        with self._lock:
            state, records, self._steps = self._state, self._steps, []
        body = self._clean(state, records)
        with self._send_lock:
            self._seq += 1
            body.update(sender=self.sender, seq=self._seq, attempt=self.attempt)
            try:
                data = encode(self.job, self.token, "beat", body)
            except (TypeError, ValueError) as exc:
                self._warn(f"cannot encode the heartbeat: {exc}")
                return
            if len(data) > _MAX_DATAGRAM:
                self._warn(f"a heartbeat of {len(data)} bytes exceeds {_MAX_DATAGRAM}: not sent")
                return
            try:
                self._sock.sendto(data, self.address)
            except OSError:  # the manager is gone or unreachable: training goes on regardless
                pass

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            self._send()

    @classmethod
    def from_env(cls, rank: int) -> "Beacon | None":
        """A beacon if this process runs under ``varuna launch`` (``VARUNA_MANAGER``, ``VARUNA_JOB_ID``,
        ``VARUNA_JOB_TOKEN`` set), else None. Its beats name the attempt ``VARUNA_ATTEMPT`` (0 if unset)."""
        where, job, token = (os.environ.get(k) for k in (env.MANAGER, env.JOB_ID, env.JOB_TOKEN))
        if not (where and job and token):
            return None
        try:
            attempt = int(os.environ.get(env.ATTEMPT) or 0)
        except ValueError:
            log.warning("heartbeats disabled: %s=%s is not an integer", env.ATTEMPT, os.environ[env.ATTEMPT])
            return None
        host, _, port = where.rpartition(":")
        try:
            return cls((host.strip("[]"), int(port)), job, token, rank,
                       os.environ.get(env.HOST, socket.gethostname()), attempt=attempt)
        except (ValueError, OSError) as exc:
            log.warning("heartbeats disabled: %s=%s: %s", env.MANAGER, where, exc)
            return None


class Listener:
    """Manager side: receives the job's datagrams on a UDP port of ``bind`` (port 0: any free port).

    ``max_skew``: how far (seconds) a message's signed time may be from this machine's clock (see the module's
    documentation). ``attempt``: the attempt whose beats count, None for any (as after :meth:`reset` without one).
    """

    def __init__(self, job: str, token: str, bind: str = "0.0.0.0", port: int = 0, *,
                 max_skew: float = DEFAULT_MAX_SKEW, attempt: int | None = None) -> None:
        self.job, self.token, self.bind, self.max_skew, self.attempt = job, token, bind, max_skew, attempt
        self.beats: dict[int, Beat] = {}
        self.notices: list[dict] = []
        self.steps: dict[int, tuple[float, float | None]] = {}  # step -> (loss, step time)
        self._counts = dict.fromkeys(("beats", "notices", "notice_repeats", "recv_errors", *_DROPS), 0)
        self._senders: OrderedDict[str, int] = OrderedDict()  # sender -> last sequence number, least recent first
        self._notice_ids: dict[str, float] = {}  # id -> the time.time() after which a copy of it would be stale
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((bind, port))
        self._sock.settimeout(0.5)  # close() is noticed even if its wake-up datagram is lost
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="varuna-listener", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the receiving thread runs (it stops only at :meth:`close`)."""
        return self._thread.is_alive()

    @property
    def rejected(self) -> int:
        """How many datagrams were dropped, for any reason."""
        with self._lock:
            return sum(self._counts[k] for k in _DROPS)

    def stats(self) -> dict[str, int]:
        """The counters: ``beats`` and ``notices`` accepted, ``notice_repeats`` (acknowledged again, not queued),
        ``recv_errors`` (of the socket), the drops by reason (see the module's documentation) and ``rejected``,
        their total."""
        with self._lock:
            out = dict(self._counts)
        out["rejected"] = sum(out[k] for k in _DROPS)
        return out

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data, sender = self._sock.recvfrom(_MAX_DATAGRAM + 1)
            except socket.timeout:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                with self._lock:
                    self._counts["recv_errors"] += 1
                self._note("recv_error", f"receiving: {exc}")
                time.sleep(0.01)  # a persistent error must not spin
                continue
            if self._closed.is_set():
                return
            try:
                why = self._handle(data, sender)
            except Exception as exc:  # noqa: BLE001 - no datagram may stop the listener
                why = "error"
                self._note("error", f"handling a datagram from {sender}: {exc!r}")
            if why is not None:
                with self._lock:
                    self._counts[why] += 1
                self._note(why, f"dropped a datagram from {sender}: {why}"
                           + (f" (the clocks must agree within {self.max_skew:g}s)" if why == "stale" else ""))

    def _note(self, what: str, message: str) -> None:
        """The first time of each kind as a warning (a flood of junk must not flood the log), then at debug."""
        if what in self._warned:
            log.debug("heartbeat listener: %s", message)
        else:
            self._warned.add(what)
            log.warning("heartbeat listener: %s", message)

    def _handle(self, data: bytes, sender: Any) -> str | None:
        """Take one datagram in; the reason it is dropped, or None."""
        body, why = _open(data, self.job, self.token)
        if body is None:
            return why
        kind = body.get("kind")
        try:
            if kind == "beat":
                body = _validate(body, _BEAT_FIELDS, _BEAT_REQUIRED)
            elif kind == "preempt":
                body = _validate(body, _NOTICE_FIELDS, _NOTICE_REQUIRED)
            else:
                return "wrong_kind"
        except _Bad:
            return "bad_fields"
        now = time.time()
        if abs(now - body["ts"]) > self.max_skew:
            return "stale"
        if kind == "preempt":
            return self._notice(body, now, sender)
        return self._beat(body)

    def _beat(self, body: dict) -> str | None:
        with self._lock:
            last = self._senders.get(body["sender"])
            if last is not None and body["seq"] <= last:
                return "replayed"
            self._senders[body["sender"]] = body["seq"]
            self._senders.move_to_end(body["sender"])
            while len(self._senders) > _MAX_SENDERS:
                self._senders.popitem(last=False)
            if self.attempt is not None and body["attempt"] != self.attempt:
                return "other_attempt"
            rank = body["rank"]
            records = body.pop("steps", [])
            self.beats[rank] = Beat(rank=rank, host=body.get("host") or "?", step=body.get("step") or 0,
                                    received=time.monotonic(), fields=body)
            for step, loss, step_time in records:  # the loss is the same on every rank: keep the first report
                self.steps.setdefault(step, (loss, step_time))
            while len(self.steps) > _MAX_PENDING_STEPS:
                del self.steps[next(iter(self.steps))]
            self._counts["beats"] += 1
        return None

    def _notice(self, body: dict, now: float, sender: Any) -> str | None:
        with self._lock:
            self._notice_ids = {i: until for i, until in self._notice_ids.items() if until >= now}
            until = body["ts"] + self.max_skew  # a later copy (a retry) keeps the id longer
            if body["id"] in self._notice_ids:
                self._notice_ids[body["id"]] = max(self._notice_ids[body["id"]], until)
                self._counts["notice_repeats"] += 1
            else:
                while len(self._notice_ids) >= _MAX_NOTICE_IDS:
                    del self._notice_ids[next(iter(self._notice_ids))]
                self._notice_ids[body["id"]] = until
                self.notices.append(body)
                del self.notices[:-_MAX_PENDING_NOTICES]
                self._counts["notices"] += 1
        try:
            self._sock.sendto(encode(self.job, self.token, "ack", {"id": body["id"]}), sender)
        except OSError:
            pass
        return None

    def take_notices(self) -> list[dict]:
        with self._lock:
            out, self.notices = self.notices, []
        return out

    def snapshot(self) -> dict[int, Beat]:
        with self._lock:
            return dict(self.beats)

    def reset(self, *, attempt: int | None = None) -> None:
        """Start attempt ``attempt``: forget the heartbeats (a new attempt's workers start from scratch) and from
        now on count only the beats of that attempt (None: of any). The step history stays."""
        with self._lock:
            self.beats = {}
            self.attempt = attempt

    def take_steps(self) -> dict[int, tuple[float, float | None]]:
        """The steps reported since the last call: ``step -> (loss, step time)``."""
        with self._lock:
            out, self.steps = self.steps, {}
        return out

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        here = self._sock.getsockname()[0]
        here = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(here, here)
        try:
            with socket.socket(self._sock.family, socket.SOCK_DGRAM) as waker:  # wakes the blocked recvfrom
                waker.sendto(b"", (here, self.port))
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._sock.close()


def send_notice(address: tuple[str, int], job: str, token: str, body: dict, *, tries: int = 5,
                timeout: float = 1.0) -> bool:
    """Send a ``preempt`` notice and wait for the manager's ``ack``; True once acknowledged.

    Every try carries the same ``id`` (the manager queues the notice once however many copies arrive) and a fresh
    ``ts``. Raises ValueError if the manager would refuse ``body`` (see ``_NOTICE_FIELDS``): it would never answer.
    """
    import uuid

    body = {**body, "id": uuid.uuid4().hex}
    try:
        _validate({**body, "job": job, "kind": "preempt", "ts": time.time()}, _NOTICE_FIELDS, _NOTICE_REQUIRED)
    except _Bad:
        raise ValueError(f"not a valid preemption notice (host: a string of at most {_MAX_TEXT} characters, "
                         f"seconds: a finite number ≥ 0): {body}") from None
    with socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(tries):
            deadline = time.monotonic() + timeout
            try:
                sock.sendto(encode(job, token, "preempt", body), address)
            except OSError:
                time.sleep(timeout)
                continue
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(_MAX_DATAGRAM + 1)
                except OSError:  # the timeout, or an ICMP error of the previous try
                    break
                reply = decode(data, job, token)
                if reply is not None and reply.get("kind") == "ack" and reply.get("id") == body["id"]:
                    return True
    return False
