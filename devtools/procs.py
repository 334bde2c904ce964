"""This machine's live processes, read from ``/proc``: what the tests use to find every process of a job, of a
test cluster or of a test host (network namespaces share the machine's process table)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Proc", "live_processes"]


@dataclass(frozen=True)
class Proc:
    """One process; its environment and command line are read when asked (empty once it is gone)."""

    pid: int
    ppid: int

    def environ(self) -> list[bytes]:
        """The ``KEY=VALUE`` entries of its environment."""
        try:
            return Path(f"/proc/{self.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return []

    def comm(self) -> str:
        """Its name (what ``top`` shows; a worker forked by a fork server is named ``varuna-r<rank>``)."""
        try:
            return Path(f"/proc/{self.pid}/comm").read_text().strip()
        except OSError:
            return ""

    def cmdline(self) -> str:
        """Its command line, arguments joined by spaces."""
        try:
            return Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""


def live_processes() -> list[Proc]:
    """Every process but zombies (a zombie holds nothing) and those gone while the table was read."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            found.append(Proc(int(entry.name), int(ppid)))
    return found
