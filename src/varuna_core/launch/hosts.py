"""The hosts file of ``varuna launch --hosts FILE``: which machines a job may use, and how many workers each.

One host per line::

    # comments and blank lines are ignored
    10.0.0.5                  # --gpus-per-node workers, SSH as the current user on port 22
    alice@10.0.0.6:2222 slots=4
    node7 slots=8

A line is ``[user@]host[:port] [slots=N]``. The file is re-read while a job runs (``--morph``): a line that does
not parse is reported with its number and text, and never guessed at.

Every name ends up on an ``ssh`` command line, so a user or host name may not start with ``-`` (ssh would read
it as an option: ``-oProxyCommand=...`` runs a command), ports are 1-65535, ``slots`` is at most
:data:`MAX_SLOTS` and the file at most :data:`MAX_HOSTS_BYTES` of UTF-8 text.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..util.fs import MiB, read_regular, read_text

__all__ = ["Host", "parse_hosts", "read_hosts", "HostsWatcher", "is_loopback", "MAX_SLOTS", "MAX_HOSTS_BYTES"]

MAX_SLOTS = 4096  # workers on one host
MAX_HOSTS_BYTES = MiB

_HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._][A-Za-z0-9._-]{0,63})@)?"
                      r"(?P<host>\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9._][A-Za-z0-9._-]{0,252})(?::(?P<port>[0-9]{1,5}))?$")
_SLOTS_RE = re.compile(r"slots=(?P<n>[0-9]{1,9})")


@dataclass(frozen=True)
class Host:
    """A machine of the job: where to SSH to and how many workers (devices) it runs."""

    address: str
    slots: int
    user: str | None = None
    port: int | None = None

    @property
    def name(self) -> str:
        """How the host is named to the user: the address (with ``user@`` and ``:port`` when given)."""
        text = self.address
        if self.user:
            text = f"{self.user}@{text}"
        if self.port:
            text = f"{text}:{self.port}"
        return text


def parse_hosts(text: str, default_slots: int, source: str = "hosts file") -> list[Host]:
    """Hosts from the text of a hosts file (see the module docstring), in file order.

    Raises:
        ConfigError: a line that is not a host, a bad ``slots``, or a host listed twice; the message names the
            line number and repeats the line.
    """
    hosts: list[Host] = []
    seen: dict[tuple[str, int | None], int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        match = _HOST_RE.match(fields[0])
        slots = default_slots
        problem = _problem(fields[0], match)
        for extra in fields[1:]:
            given = _SLOTS_RE.fullmatch(extra)
            if given and 1 <= int(given["n"]) <= MAX_SLOTS:
                slots = int(given["n"])
            else:
                problem = problem or f"unknown field {_shown(extra)} (only slots=N with 1 <= N <= {MAX_SLOTS})"
        if problem or match is None:  # no match is always a problem
            raise ConfigError(f"{source} line {number}: {problem}: {_shown(raw.strip())}",
                              hint="each line is [user@]host[:port] [slots=N]; # starts a comment")
        host = Host(address=match.group("host").strip("[]"), slots=slots, user=match.group("user"),
                    port=int(match.group("port")) if match.group("port") else None)
        key = (host.address, host.port)
        if key in seen:
            raise ConfigError(f"{source} line {number}: {host.name} is already listed on line {seen[key]}",
                              hint="give each host once, with slots=N for several workers")
        seen[key] = number
        hosts.append(host)
    return hosts


def _shown(text: str, limit: int = 120) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def _problem(word: str, match: re.Match[str] | None) -> str | None:
    """What is wrong with the ``[user@]host[:port]`` of a line, if anything."""
    if match is None:
        if word.startswith("-") or "@-" in word:
            return f"{_shown(word)} starts with '-', which ssh would read as an option"
        return f"{_shown(word)} is not a host name or address"
    if match.group("port") is not None and not 1 <= int(match.group("port")) <= 65535:
        return f"port {match.group('port')} is not in 1-65535"
    return None


def _read_text(path: Path) -> str:
    return read_text(path, MAX_HOSTS_BYTES, what="hosts file")


def read_hosts(path: str | os.PathLike[str], default_slots: int) -> list[Host]:
    """:func:`parse_hosts` of a file; an unreadable, oversized, non-UTF-8 or empty file is a
    :class:`ConfigError` too."""
    p = Path(path)
    hosts = parse_hosts(_read_text(p), default_slots, source=str(p))
    if not hosts:
        raise ConfigError(f"hosts file {p} lists no host", hint="one host per line: [user@]host[:port] [slots=N]")
    return hosts


class HostsWatcher:
    """Notices changes of a hosts file by content (not only mtime: editors may keep it)."""

    def __init__(self, path: str | os.PathLike[str], default_slots: int) -> None:
        self.path = Path(path)
        self.default_slots = default_slots
        self._digest = self._read_digest()

    def _read_digest(self) -> str | None:
        """The digest of the content; None while the file is missing (an editor replacing it). A file that
        cannot be read (a FIFO, a directory, too large) counts as a change, which :meth:`poll` then reports."""
        if not os.path.lexists(self.path):
            return None
        try:
            return hashlib.sha256(read_regular(self.path, MAX_HOSTS_BYTES, what="hosts file")).hexdigest()
        except ConfigError as exc:
            return f"unreadable: {exc.message}"

    def poll(self) -> list[Host] | None:
        """The new host list if the file changed since the last poll, else None.

        Raises:
            ConfigError: the file changed and no longer parses (the change is then remembered, so the same bad
                content is reported once).
        """
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return None
        self._digest = digest
        return read_hosts(self.path, self.default_slots)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a name or an IP) resolves to this machine's loopback interface."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)
