"""The manager's side of the heartbeat channel: :class:`Listener` receives the heartbeats of the workers
(:class:`varuna_core.worker.beacon.Beacon`) and the preemption notices of ``varuna notify-preempt``
(:func:`send_notice`), as signed UDP datagrams (their format: :mod:`varuna_core.launch.protocol`).

Why UDP: a worker must never block or fail because the manager is slow or gone, and a lost heartbeat is harmless
(the next one follows within seconds); a notice is acknowledged and retried.

The manager (:class:`Listener`) drops, and counts by reason (:meth:`Listener.stats`), every datagram that is not
exactly what an honest sender of this job sends now:

* ``oversize``, ``malformed`` (not the JSON of the protocol), ``bad_mac`` (another token: someone else, or an
  earlier job on the same port), ``other_job``, ``wrong_kind``, ``bad_fields`` (signed, but a field of the wrong
  type or out of range: nothing unchecked reaches the manager's state);
* ``stale``: its ``ts`` differs from the manager's clock by more than ``max_skew`` seconds (120 by default). A
  captured datagram cannot be replayed later; the price is that the clocks of the manager's and the workers'
  hosts must agree within ``max_skew`` (NTP does), or the workers are never heard and are declared silent;
* ``replayed``: a beat whose ``seq`` is not above the last one seen from its ``sender`` (the manager remembers
  the last ``_MAX_SENDERS`` senders). A datagram overtaken by a later one of the same sender is dropped too,
  which is harmless: the later one carries the newer state. A notice whose ``id`` was seen within the freshness
  window is acknowledged again (the sender may have missed the first ack) but not queued again;
* ``other_attempt``: a beat of another attempt than the one :meth:`Listener.reset` started (or the warm one that
  :meth:`Listener.expect` announced), e.g. a late beat of a worker of the previous attempt, which would otherwise
  count as a sign of life of the new one. Notices come from outside the attempts and are not bound to one.

A morph by handover runs two attempts at once for a while: the old one trains while the new one warms up. The
new one's beats are kept apart (:meth:`Listener.snapshot` of that attempt) until :meth:`Listener.promote` makes it
the current one.

No datagram, whatever its content, stops the manager's receiving thread (:attr:`Listener.alive`), and its memory
stays bounded however many datagrams arrive.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .protocol import MAX_DATAGRAM, MAX_TEXT, BadField, check_beat, check_notice, decode, encode, open_datagram

__all__ = ["Listener", "send_notice", "Beat", "DEFAULT_MAX_SKEW"]

log = logging.getLogger(__name__)

_MAX_SENDERS = 4096  # senders whose last sequence number the listener remembers
_MAX_NOTICE_IDS = 4096
_MAX_PENDING_NOTICES = 1024  # notices not yet taken by the launcher
_MAX_PENDING_STEPS = 16384  # step records not yet taken by the launcher
DEFAULT_MAX_SKEW = 120.0

_DROPS = ("oversize", "malformed", "bad_mac", "other_job", "wrong_kind", "bad_fields", "stale", "replayed",
          "other_attempt", "error")


@dataclass
class Beat:
    """The latest heartbeat of one rank, as the manager keeps it (``fields``: every checked field it sent)."""

    rank: int
    host: str
    step: int
    received: float
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class Listener:
    """Manager side: receives the job's datagrams on a UDP port of ``bind`` (port 0: any free port).

    ``max_skew``: how far (seconds) a message's signed time may be from this machine's clock (see the module's
    documentation). ``attempt``: the attempt whose beats count, None for any (as after :meth:`reset` without one).
    """

    def __init__(self, job: str, token: str, bind: str = "0.0.0.0", port: int = 0, *,
                 max_skew: float = DEFAULT_MAX_SKEW, attempt: int | None = None) -> None:
        self.job, self.token, self.bind, self.max_skew, self.attempt = job, token, bind, max_skew, attempt
        self.beats: dict[int, Beat] = {}
        self.warm: int | None = None  # a second attempt whose beats are kept apart (a morph by handover)
        self.warm_beats: dict[int, Beat] = {}
        self.notices: list[dict[str, Any]] = []
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
                data, sender = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except TimeoutError:
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
        body, why = open_datagram(data, self.job, self.token)
        if body is None:
            return why
        kind = body.get("kind")
        try:
            if kind == "beat":
                body = check_beat(body)
            elif kind == "preempt":
                body = check_notice(body)
            else:
                return "wrong_kind"
        except BadField:
            return "bad_fields"
        now = time.time()
        if abs(now - body["ts"]) > self.max_skew:
            return "stale"
        if kind == "preempt":
            return self._notice(body, now, sender)
        return self._beat(body)

    def _beat(self, body: dict[str, Any]) -> str | None:
        with self._lock:
            last = self._senders.get(body["sender"])
            if last is not None and body["seq"] <= last:
                return "replayed"
            self._senders[body["sender"]] = body["seq"]
            self._senders.move_to_end(body["sender"])
            while len(self._senders) > _MAX_SENDERS:
                self._senders.popitem(last=False)
            warm = self.warm is not None and body["attempt"] == self.warm
            if self.attempt is not None and body["attempt"] != self.attempt and not warm:
                return "other_attempt"
            rank = body["rank"]
            records = body.pop("steps", [])
            (self.warm_beats if warm else self.beats)[rank] = Beat(
                rank=rank, host=body.get("host") or "?", step=body.get("step") or 0,
                received=time.monotonic(), fields=body)
            for step, loss, step_time in records:  # the loss is the same on every rank: keep the first report
                self.steps.setdefault(step, (loss, step_time))
            while len(self.steps) > _MAX_PENDING_STEPS:
                del self.steps[next(iter(self.steps))]
            self._counts["beats"] += 1
        return None

    def _notice(self, body: dict[str, Any], now: float, sender: Any) -> str | None:
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

    def add_notice(self, host: str, seconds: float, source: str) -> None:
        """Queue a notice that did not come as a datagram (a node agent's ``preempt`` event, reported over its
        authenticated channel), to be taken with the others."""
        with self._lock:
            self.notices.append({"host": host, "seconds": seconds, "source": source})
            del self.notices[:-_MAX_PENDING_NOTICES]
            self._counts["notices"] += 1

    def take_notices(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self.notices = self.notices, []
        return out

    def snapshot(self, attempt: int | None = None) -> dict[int, Beat]:
        """The latest beat of each rank of the current attempt (or of the warm attempt ``attempt``)."""
        with self._lock:
            if attempt is not None and attempt == self.warm and attempt != self.attempt:
                return dict(self.warm_beats)
            return dict(self.beats)

    def reset(self, *, attempt: int | None = None) -> None:
        """Start attempt ``attempt``: forget the heartbeats (a new attempt's workers start from scratch) and from
        now on count only the beats of that attempt (None: of any). The step history stays."""
        with self._lock:
            self.beats = {}
            self.attempt = attempt
            self.warm, self.warm_beats = None, {}

    def expect(self, attempt: int | None) -> None:
        """Keep the beats of attempt ``attempt`` too, apart from the current one's (None: no longer)."""
        with self._lock:
            self.warm, self.warm_beats = attempt, {}

    def promote(self, attempt: int) -> None:
        """The warm attempt ``attempt`` becomes the current one, with the beats it sent so far."""
        with self._lock:
            beats = self.warm_beats if attempt == self.warm else {}
            self.attempt, self.beats = attempt, beats
            self.warm, self.warm_beats = None, {}

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


def send_notice(address: tuple[str, int], job: str, token: str, body: dict[str, Any], *, tries: int = 5,
                timeout: float = 1.0) -> bool:
    """Send a ``preempt`` notice and wait for the manager's ``ack``; True once acknowledged.

    Every try carries the same ``id`` (the manager queues the notice once however many copies arrive) and a fresh
    ``ts``. Raises ValueError if the manager would refuse ``body`` (see ``NOTICE_FIELDS`` of the protocol): it
    would never answer.
    """
    import uuid

    body = {**body, "id": uuid.uuid4().hex}
    try:
        check_notice({**body, "job": job, "kind": "preempt", "ts": time.time()})
    except BadField:
        raise ValueError(f"not a valid preemption notice (host: a string of at most {MAX_TEXT} characters, "
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
                    data, _ = sock.recvfrom(MAX_DATAGRAM + 1)
                except OSError:  # the timeout, or an ICMP error of the previous try
                    break
                reply = decode(data, job, token)
                if reply is not None and reply.get("kind") == "ack" and reply.get("id") == body["id"]:
                    return True
    return False
