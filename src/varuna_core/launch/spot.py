"""Spot and preemptible VM notices: ask the cloud's instance metadata service whether this VM goes away.

Each cloud announces an eviction on a link-local HTTP endpoint of the VM. :func:`check` asks once and returns a
:class:`Notice` (seconds until the VM goes away) or ``None``; :class:`SpotWatcher` asks every few seconds in a
thread and calls back once per announced event. What is read, exactly:

* **azure** — Scheduled Events, ``GET {base}/metadata/scheduledevents?api-version=2020-07-01`` with header
  ``Metadata: true``. The JSON object's ``Events`` list; of each event ``EventType`` (only ``Preempt`` and
  ``Terminate`` count; ``Reboot``, ``Redeploy``, ``Freeze`` do not take the VM away), ``Resources`` (a list of VM
  names: when ``vm_name`` is given, an event must name it), ``EventId`` (one callback per id) and
  ``NotBefore`` (an RFC 1123 date such as ``Mon, 19 Sep 2016 18:29:47 GMT``; empty once the event started: 0 s).
  The watcher learns its VM's name from ``GET {base}/metadata/instance/compute/name?api-version=2021-02-01
  &format=text`` (same header; a name of letters, digits, ``-``, ``_`` and ``.``) so that only events naming this
  VM count (the events of a scale set list every VM they affect); without an answer every eviction counts.
* **aws** — the spot instance-action document through IMDSv2: ``PUT {base}/latest/api/token`` with header
  ``X-aws-ec2-metadata-token-ttl-seconds: 300`` gives a token, then ``GET
  {base}/latest/meta-data/spot/instance-action`` with header ``X-aws-ec2-metadata-token``: 404 while no
  interruption is scheduled, else a JSON object whose ``action`` (``terminate``, ``stop`` or ``hibernate``) and
  ``time`` (ISO 8601 UTC, ``2017-09-18T08:22:00Z``) are read.
* **gcp** — ``GET {base}/computeMetadata/v1/instance/preempted`` with header ``Metadata-Flavor: Google``: the body
  ``TRUE`` once the VM is being preempted (about 30 s before it stops; no time is given: 0 s), ``FALSE`` before.

``base`` defaults to the cloud's metadata address (``http://169.254.169.254``; GCP's
``http://metadata.google.internal``) and may be any ``http://host[:port]`` (the tests serve the documented
responses on 127.0.0.1), checked by :func:`check_endpoint` before anything starts. Whatever the endpoint
answers is untrusted: bodies are capped at :data:`MAX_BODY` bytes, redirects are not followed, every request
has a timeout, and an answer that is not in the documented form is no notice (the watcher keeps asking; a VM
that is not on that cloud just never gets one).
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import http.client
import ipaddress
import json
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Callable

__all__ = ["Notice", "SOURCES", "check", "check_endpoint", "shown_endpoint", "azure_vm_name", "SpotWatcher",
           "MAX_BODY"]

log = logging.getLogger(__name__)

MAX_BODY = 64 * 2**10
SOURCES = ("azure", "aws", "gcp")
DEFAULT_BASE = {"azure": "http://169.254.169.254", "aws": "http://169.254.169.254",
                "gcp": "http://metadata.google.internal"}
AZURE_EVICTIONS = frozenset({"Preempt", "Terminate"})
AWS_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
_VM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")


@dataclasses.dataclass(frozen=True)
class Notice:
    """An announced eviction: ``seconds`` until the VM goes away (0: now), and what the cloud said."""

    source: str
    event: str
    seconds: float
    detail: str


class _Unusable(Exception):
    """The endpoint did not answer in the documented form."""


def check(source: str, base: str | None = None, *, timeout: float = 2.0, vm_name: str | None = None,
          now: float | None = None) -> Notice | None:
    """Ask ``source``'s metadata endpoint once. ``None``: no eviction announced, or no usable answer."""
    if source not in SOURCES:
        raise ValueError(f"unknown preemption source {source!r} (one of {', '.join(SOURCES)})")
    host, port = check_endpoint(base or DEFAULT_BASE[source])
    now = time.time() if now is None else now
    try:
        if source == "azure":
            return _azure(host, port, timeout, vm_name, now)
        if source == "aws":
            return _aws(host, port, timeout, now)
        return _gcp(host, port, timeout)
    except (OSError, http.client.HTTPException, _Unusable) as exc:
        log.debug("%s metadata endpoint %s:%s: %s", source, host, port, exc)
        return None


def check_endpoint(base: str) -> tuple[str, int]:
    """``(host, port)`` of a metadata endpoint ``http://host[:port]``; ValueError for anything else.

    Refused: another scheme, no host, a port outside 1..65535 (``:0`` too, which would otherwise mean the
    default), a path, query or fragment, whitespace or control characters (``urllib`` drops a newline without a
    word), credentials (``user:password@``: a metadata service needs none, and they would travel in every
    agent's spec and show in its errors), and more than the agents' protocol carries
    (:data:`~varuna_core.launch.protocol.MAX_ENDPOINT` characters). The message never shows credentials: see
    :func:`shown_endpoint`."""
    from .protocol import MAX_ENDPOINT  # loads pydantic: not at import, the CLI imports this module early

    if not isinstance(base, str):
        raise ValueError(f"a metadata endpoint is a string http://host[:port], got {type(base).__name__}")
    shown = shown_endpoint(base)
    if len(base) > MAX_ENDPOINT:
        raise _bad_endpoint(shown, f"{len(base):,} characters, more than the {MAX_ENDPOINT:,} the node agents take")
    if "@" in base:
        raise _bad_endpoint(shown, "it holds credentials (user:password@), which a metadata service does not take")
    if any(c.isspace() or not c.isprintable() for c in base):
        raise _bad_endpoint(shown, "it holds whitespace or control characters")
    try:
        parts = urllib.parse.urlsplit(base)
        port = parts.port
    except ValueError as exc:  # "Port out of range 0-65535", "Port could not be cast...", bad IPv6 brackets
        problem = "the port is not a number in 1..65535" if "port" in str(exc).lower() else str(exc)
        raise _bad_endpoint(shown, problem) from None
    if parts.scheme != "http":
        raise _bad_endpoint(shown, f"the scheme is {parts.scheme!r}, not 'http'" if parts.scheme else "no scheme")
    if not parts.hostname:
        raise _bad_endpoint(shown, "it names no host")
    if not _is_host(parts.hostname):
        raise _bad_endpoint(shown, f"{parts.hostname[:80]!r} is not a host name or address")
    if port is not None and not 1 <= port <= 65535:
        raise _bad_endpoint(shown, f"port {port} is not in 1..65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment or base.endswith(("?", "#")):
        raise _bad_endpoint(shown, "it has a path, query or fragment")
    return parts.hostname, port or 80


def shown_endpoint(base: str, limit: int = 100) -> str:
    """``base`` quoted for a message, with whatever stands before an ``@`` (``user:password``) masked as ``***``
    and cut to ``limit`` characters."""
    text = str(base)
    if "@" in text:
        scheme, sep, rest = text.partition("://")
        text = f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if sep else f"***@{text.rpartition('@')[2]}"
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _bad_endpoint(shown: str, problem: str) -> ValueError:
    return ValueError(f"a metadata endpoint is http://host[:port], got {shown}: {problem}")


def _is_host(name: str) -> bool:
    """A DNS name or an IPv4/IPv6 address (``urlsplit`` gives IPv6 without its brackets)."""
    if _HOST_NAME.fullmatch(name):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _request(host: str, port: int, method: str, path: str, headers: dict[str, str],
             timeout: float) -> tuple[int, bytes]:
    """``(status, body)``: the body read up to :data:`MAX_BODY` bytes and within ``2 * timeout`` seconds in all
    (more, or a server trickling bytes, is an unusable answer)."""
    deadline = time.monotonic() + 2 * timeout
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        body = b""
        while True:
            chunk = response.read1(8192)
            if not chunk:
                return response.status, body
            body += chunk
            if len(body) > MAX_BODY:
                raise _Unusable(f"answer of more than {MAX_BODY} bytes")
            if time.monotonic() > deadline:
                raise _Unusable(f"answer not complete within {2 * timeout:g} s")
    finally:
        conn.close()


def _json(body: bytes) -> object:
    try:
        return json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _Unusable(f"not JSON: {str(exc)[:80]}") from None


def _azure(host: str, port: int, timeout: float, vm_name: str | None, now: float) -> Notice | None:
    status, body = _request(host, port, "GET", "/metadata/scheduledevents?api-version=2020-07-01",
                            {"Metadata": "true"}, timeout)
    if status != 200:
        raise _Unusable(f"HTTP {status}")
    doc = _json(body)
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise _Unusable("no Events list")
    found = []
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("EventType"), str) \
                or event["EventType"] not in AZURE_EVICTIONS:
            continue
        resources = event.get("Resources")
        if vm_name is not None and not (isinstance(resources, list) and vm_name in resources):
            continue
        event_id = event.get("EventId")
        not_before = event.get("NotBefore")
        if not isinstance(event_id, str) or not isinstance(not_before, str) or len(event_id) > 200:
            continue
        if not_before.strip():
            try:
                when = email.utils.parsedate_to_datetime(not_before).timestamp()
            except (TypeError, ValueError, IndexError, OverflowError):
                continue
        else:
            when = now  # started
        found.append(Notice("azure", event_id, max(0.0, when - now), f"{event['EventType']} {not_before}".strip()))
    return min(found, key=lambda n: n.seconds) if found else None


def azure_vm_name(base: str | None = None, *, timeout: float = 2.0) -> str | None:
    """This VM's name from Azure's instance metadata, or None without a usable answer."""
    host, port = check_endpoint(base or DEFAULT_BASE["azure"])
    try:
        status, body = _request(host, port, "GET", "/metadata/instance/compute/name?api-version=2021-02-01"
                                "&format=text", {"Metadata": "true"}, timeout)
    except (OSError, http.client.HTTPException, _Unusable):
        return None
    name = body.decode("ascii", errors="replace").strip()
    return name if status == 200 and _VM_NAME.fullmatch(name) else None


def _aws(host: str, port: int, timeout: float, now: float) -> Notice | None:
    status, token = _request(host, port, "PUT", "/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, timeout)
    if status != 200 or not token or len(token) > 4096 or not token.isascii() or b"\n" in token or b"\r" in token:
        raise _Unusable(f"no IMDSv2 token (HTTP {status})")
    status, body = _request(host, port, "GET", "/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": token.decode("ascii")}, timeout)
    if status == 404:
        return None
    if status != 200:
        raise _Unusable(f"HTTP {status}")
    doc = _json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or doc["action"] not in AWS_ACTIONS \
            or not isinstance(doc.get("time"), str):
        raise _Unusable("not an instance-action document")
    try:
        when = datetime.datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
    except ValueError:
        raise _Unusable(f"time {doc['time'][:40]!r} is not ISO 8601") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        raise _Unusable("time out of range")
    return Notice("aws", f"{doc['action']}@{doc['time']}", max(0.0, seconds), f"{doc['action']} at {doc['time']}")


def _gcp(host: str, port: int, timeout: float) -> Notice | None:
    status, body = _request(host, port, "GET", "/computeMetadata/v1/instance/preempted",
                            {"Metadata-Flavor": "Google"}, timeout)
    if status != 200:
        raise _Unusable(f"HTTP {status}")
    text = body.strip()
    if text == b"TRUE":
        return Notice("gcp", "preempted", 0.0, "preempted")
    if text == b"FALSE":
        return None
    raise _Unusable("neither TRUE nor FALSE")


class SpotWatcher:
    """Asks ``source`` every ``interval`` seconds in a daemon thread and calls ``on_notice`` once per announced
    event (an event announced again with a new time is not announced twice)."""

    def __init__(self, source: str, on_notice: Callable[[Notice], None], *, base: str | None = None,
                 interval: float = 5.0, timeout: float = 2.0, vm_name: str | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown preemption source {source!r} (one of {', '.join(SOURCES)})")
        check_endpoint(base or DEFAULT_BASE[source])  # a bad address fails here, not silently in the thread
        self.source, self.base, self.interval, self.timeout, self.vm_name = source, base, interval, timeout, vm_name
        self.on_notice = on_notice
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"spot-{source}", daemon=True)

    def start(self) -> SpotWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.source == "azure" and self.vm_name is None:
            self.vm_name = azure_vm_name(self.base, timeout=self.timeout)
        while not self._stop.is_set():
            notice = check(self.source, self.base, timeout=self.timeout, vm_name=self.vm_name)
            if notice is not None and notice.event not in self.seen:
                self.seen.add(notice.event)
                try:
                    self.on_notice(notice)
                except Exception:  # a failing callback must not end the watch
                    log.exception("spot notice callback failed")
            self._stop.wait(self.interval)
