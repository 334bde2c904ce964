"""The worker's side of the heartbeat channel: :class:`Beacon` sends the rank's progress to the launcher's manager
(:class:`varuna_core.launch.heartbeat.Listener`) as signed UDP datagrams (their format and checks:
:mod:`varuna_core.launch.protocol`, shared with the manager so that both ends agree on what is accepted)."""

from __future__ import annotations

import logging
import math
import secrets
import socket
import threading
from typing import Any

from ..env import WorkerEnv
from ..launch.protocol import (
    MAX_DATAGRAM,
    MAX_KEY,
    MAX_STEPS,
    BadField,
    check_beat_field,
    check_step_record,
    encode,
)

__all__ = ["Beacon"]

log = logging.getLogger(__name__)


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
        self._steps: list[list[Any]] = []  # [step, loss, step time] of every step since the last datagram
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one datagram at a time, in the order of their sequence numbers
        self._warned: set[str] = set()
        self._silent = False
        self._wake = threading.Event()
        self._sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_DGRAM)
        self._thread = threading.Thread(target=self._run, name="varuna-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, **state: Any) -> None:
        with self._lock:
            self._state = {**self._state, **state}
            if state.get("loss") is not None:
                self._steps.append([state.get("loss_step", state.get("step")), state["loss"], state.get("step_time")])
                del self._steps[:-MAX_STEPS]
        self._wake.set()

    def regrouped(self, rank: int) -> None:
        """This worker is ``rank`` of a regrouped process group: its beats say so from now on."""
        with self._lock:
            self.rank = rank
            self._state = {**self._state, "rank": rank}

    def flush(self) -> None:
        """Send the current state now, from the caller's thread (before the process exits)."""
        self._send()

    def _warn(self, what: str) -> None:
        if what not in self._warned and len(self._warned) < 64:
            self._warned.add(what)
            log.warning("heartbeat: %s", what)

    def _clean(self, state: dict[str, Any], records: list[list[Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {}
        for key, value in state.items():
            try:
                body[key] = check_beat_field(key, value)
            except BadField:
                if isinstance(value, float) and not math.isfinite(value) and len(key) <= MAX_KEY:
                    body[key] = None
                else:
                    self._warn(f"field {key}={value!r:.80} is not sent (the manager would refuse it)")
        steps = []
        for record in records:
            step, loss, step_time = record
            if isinstance(step_time, float) and not math.isfinite(step_time):
                step_time = None
            try:
                steps.append(list(check_step_record([step, loss, step_time])))
            except BadField:
                self._warn(f"step record {record!r:.80} is not sent (the manager would refuse it)")
        body["steps"] = steps
        return body

    def silence(self) -> None:
        """Send nothing more: this worker left the job (a regroup), and its rank is another worker's now."""
        with self._lock:
            self._silent = True

    def _send(self) -> None:
        with self._lock:
            if self._silent:
                return
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
            if len(data) > MAX_DATAGRAM:
                self._warn(f"a heartbeat of {len(data)} bytes exceeds {MAX_DATAGRAM}: not sent")
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
    def launched(cls, told: WorkerEnv, rank: int) -> Beacon | None:
        """A beacon if the launcher said where its manager listens (``told.manager``, ``job_id`` and
        ``job_token`` set: the worker runs under ``varuna launch``), else None. Its beats name the attempt
        ``told.attempt`` (0 if unset) and the host ``told.host`` (this machine's name if unset). ``told`` is checked
        already (:meth:`WorkerEnv.from_environ`); a socket that cannot be made only costs the heartbeats."""
        address = told.manager_address
        if address is None or not (told.job_id and told.job_token):
            return None
        try:
            return cls(address, told.job_id, told.job_token, rank, told.host or socket.gethostname(),
                       attempt=told.attempt or 0)
        except OSError as exc:
            log.warning("heartbeats disabled: cannot send to the manager at %s: %s", told.manager, exc)
            return None
