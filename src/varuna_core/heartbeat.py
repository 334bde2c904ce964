"""Heartbeats and notices between the workers, ``varuna notify-preempt`` and the launcher's manager.

One UDP socket on the manager receives JSON datagrams. Each carries the job id and an HMAC-SHA256 of its body
keyed by the job's token (a secret made per launch, handed to the workers in their environment over SSH, to
``varuna notify-preempt`` through a 0600 file in the run directory), so a datagram from anyone else, or from
an earlier job on the same port, is dropped and counted. The token itself never crosses the network.

Why UDP: a worker must never block or fail because the manager is slow or gone, and a lost heartbeat is
harmless (the next one follows within seconds); a notice is acknowledged and retried.

Kinds of message:

* ``beat`` (worker → manager, after every step and every ``interval`` seconds): rank, host, step, loss,
  step time, compute time (the time the rank spent in its own forward/backward work), samples per step;
* ``preempt`` (notify-preempt → manager): a host and when it goes away; the manager answers ``ack``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["encode", "decode", "Beacon", "Listener", "send_notice", "Beat"]

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 8192
_MAX_STEPS = 40  # step records per datagram (a datagram stays well under _MAX_DATAGRAM)


def encode(job: str, token: str, kind: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps({"job": job, "kind": kind, "ts": time.time(), **body}, separators=(",", ":"))
    mac = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}, separators=(",", ":")).encode()


def decode(data: bytes, job: str, token: str) -> dict[str, Any] | None:
    """The message's body if it is well formed, of this job and signed with its token; else None."""
    try:
        outer = json.loads(data)
        payload, mac = outer["p"], outer["mac"]
        want = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            return None
        body = json.loads(payload)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return body if body.get("job") == job else None


@dataclass
class Beat:
    """The latest heartbeat of one rank, as the manager keeps it (``fields``: everything the worker sent)."""

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
    during a long step or a checkpoint.
    """

    def __init__(self, address: tuple[str, int], job: str, token: str, rank: int, host: str,
                 interval: float = 2.0) -> None:
        self.address, self.job, self.token, self.rank, self.host = address, job, token, rank, host
        self.interval = interval
        self._state: dict[str, Any] = {"rank": rank, "host": host, "step": 0}
        self._steps: list[list] = []  # [step, loss, step time] of every step since the last datagram
        self._lock = threading.Lock()
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

    def _send(self) -> None:
        with self._lock:
            body, self._steps = {**self._state, "steps": self._steps}, []
        try:
            self._sock.sendto(encode(self.job, self.token, "beat", body), self.address)
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
        ``VARUNA_JOB_TOKEN`` set), else None."""
        where, job, token = (os.environ.get(k) for k in ("VARUNA_MANAGER", "VARUNA_JOB_ID", "VARUNA_JOB_TOKEN"))
        if not (where and job and token):
            return None
        host, _, port = where.rpartition(":")
        try:
            return cls((host.strip("[]"), int(port)), job, token, rank, os.environ.get("VARUNA_HOST", socket.gethostname()))
        except (ValueError, OSError) as exc:
            log.warning("heartbeats disabled: VARUNA_MANAGER=%s: %s", where, exc)
            return None


@dataclass
class Listener:
    """Manager side: receives the job's datagrams on a UDP port of ``bind`` (port 0: any free port)."""

    job: str
    token: str
    bind: str = "0.0.0.0"
    port: int = 0
    beats: dict[int, Beat] = field(default_factory=dict)
    notices: list[dict] = field(default_factory=list)
    steps: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # step -> (loss, step time)
    rejected: int = 0

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.bind, self.port))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="varuna-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data, sender = self._sock.recvfrom(_MAX_DATAGRAM)
            except OSError:
                return
            body = decode(data, self.job, self.token)
            if body is None:
                self.rejected += 1
                continue
            with self._lock:
                if body.get("kind") == "beat":
                    self._beat(body)
                elif body.get("kind") == "preempt":
                    self.notices.append(body)
                    try:
                        self._sock.sendto(encode(self.job, self.token, "ack", {"id": body.get("id")}), sender)
                    except OSError:
                        pass

    def _beat(self, body: dict) -> None:
        try:
            rank = int(body["rank"])
        except (KeyError, TypeError, ValueError):
            self.rejected += 1
            return
        self.beats[rank] = Beat(rank=rank, host=str(body.get("host", "?")), step=int(body.get("step") or 0),
                                received=time.monotonic(), fields=body)
        for record in body.get("steps") or []:  # the loss is the same on every rank: keep the first report
            if isinstance(record, list) and len(record) == 3 and isinstance(record[0], int):
                self.steps.setdefault(record[0], (record[1], record[2]))

    def take_notices(self) -> list[dict]:
        with self._lock:
            out, self.notices = self.notices, []
        return out

    def snapshot(self) -> dict[int, Beat]:
        with self._lock:
            return dict(self.beats)

    def reset(self) -> None:
        """Forget the heartbeats (a new attempt's workers start from scratch); the step history stays."""
        with self._lock:
            self.beats = {}

    def take_steps(self) -> dict[int, tuple[float, float | None]]:
        """The steps reported since the last call: ``step -> (loss, step time)``."""
        with self._lock:
            out, self.steps = self.steps, {}
        return out

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def send_notice(address: tuple[str, int], job: str, token: str, body: dict, *, tries: int = 5,
                timeout: float = 1.0) -> bool:
    """Send a ``preempt`` notice and wait for the manager's ``ack``; True once acknowledged."""
    import uuid

    body = {**body, "id": uuid.uuid4().hex}
    with socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        for _ in range(tries):
            sock.sendto(encode(job, token, "preempt", body), address)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    data, _ = sock.recvfrom(_MAX_DATAGRAM)
                except (socket.timeout, OSError):
                    break
                reply = decode(data, job, token)
                if reply is not None and reply.get("kind") == "ack" and reply.get("id") == body["id"]:
                    return True
    return False
