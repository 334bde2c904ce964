"""The hosts a ``--morph`` job has left out because they did not answer, and when to check each of them again.

A host of the job (a line of the hosts file, a node of the Slurm allocation) is *left out* when its pre-flight
check fails (SSH does not reach it, its interpreter cannot import varuna or finds no torch in the code directory) or its
node agent does not start in an attempt. A host that is listed but left out is not a change of the job's hosts:
the job keeps training on the others. (Counted as one, it made every new attempt see the host "added", morph
before its first step, check it, leave it out again and start the next attempt, without end and without
training.)

It is checked again in the background (the pre-flight check, then a node agent started without workers):
:data:`RECHECK_FIRST` seconds after it was left out, then each time twice as long after a check that fails
again, at most :data:`RECHECK_MAX` seconds apart (``--recheck-max``). The first check that passes takes it back:
the job grows onto it (a morph). A host taken back whose agent then does not start in the attempt is *held out*:
its check cannot tell when it would work, so it is not checked again until the hosts file changes (an operator's
edit, or ``touch``), rather than costing the job a morph at every check. Leaving a host out, or checking it
again, is never a restart.

:class:`Exclusions` is the bookkeeping only (no processes, no threads, a clock that tests can replace); the
manager runs the checks and reports each change once: left out, still not answering (with the wait until the
next check), back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .hosts import Host

__all__ = ["RECHECK_FIRST", "RECHECK_MAX", "Excluded", "Exclusions"]

RECHECK_FIRST = 5.0  # seconds from leaving a host out to its first check
RECHECK_MAX = 60.0  # the longest wait between two checks of a host left out (default of --recheck-max)


@dataclass
class Excluded:
    """A host left out: why (the last failure), since when, how many failures in a row, and when it may be
    checked next (monotonic seconds; infinite while it is held out)."""

    host: Host
    reason: str
    since: float
    failures: int
    due: float
    checking: bool = False  # a check has been handed out (:meth:`Exclusions.due`) and has not answered yet

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def held(self) -> bool:
        """Not checked again until the hosts file changes."""
        return math.isinf(self.due)


class Exclusions:
    """The hosts left out, by name, and the back-off of their checks (see the module docstring)."""

    def __init__(self, first: float = RECHECK_FIRST, longest: float = RECHECK_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first = min(first, longest)
        self.longest = longest
        self.clock = clock
        self._out: dict[str, Excluded] = {}
        self._strikes: dict[str, int] = {}  # failures of the hosts taken back whose agent has not started since

    def delay(self, failures: int) -> float:
        """Seconds from the ``failures``-th failure in a row to the next check."""
        return min(self.longest, self.first * 2.0 ** min(max(failures - 1, 0), 64))

    def __contains__(self, name: object) -> bool:
        return name in self._out

    def __len__(self) -> int:
        return len(self._out)

    def records(self) -> list[Excluded]:
        return list(self._out.values())

    def leave_out(self, host: Host, reason: str, *, at_start: bool = False) -> Excluded:
        """Leave ``host`` out after a failure: of a check, or of its agent in an attempt's start (``at_start``).
        A host taken back whose agent has not started since continues its back-off where it stopped, or, if its
        agent failed to start (the check passed, the start did not), is held out."""
        record = self._out.get(host.name)
        if record is not None:
            return self.failed(host, reason)
        now = self.clock()
        relapse = host.name in self._strikes and at_start
        failures = self._strikes.pop(host.name, 0) + 1
        due = math.inf if relapse else now + self.delay(failures)
        record = self._out[host.name] = Excluded(host, reason, now, failures, due)
        return record

    def due(self) -> list[Host]:
        """The hosts whose next check is due; each is handed out once, until :meth:`failed` or :meth:`answered`
        reports the check's result."""
        now = self.clock()
        hosts = []
        for record in self._out.values():
            if not record.checking and now >= record.due:
                record.checking = True
                hosts.append(record.host)
        return hosts

    def failed(self, host: Host, reason: str) -> Excluded:
        """A check of ``host`` (left out) failed again: the next one waits twice as long (up to the longest)."""
        record = self._out[host.name]
        record.failures += 1
        record.reason, record.checking = reason, False
        if not record.held:
            record.due = self.clock() + self.delay(record.failures)
        return record

    def answered(self, host: Host) -> Excluded:
        """A check of ``host`` passed: it is no longer left out (its failures are kept until :meth:`started`)."""
        record = self._out.pop(host.name)
        self._strikes[host.name] = record.failures
        return record

    def started(self, names: Iterable[str]) -> None:
        """The agents of these hosts started in an attempt: their past failures are forgotten."""
        for name in names:
            self._strikes.pop(name, None)

    def listed(self, hosts: list[Host]) -> None:
        """The hosts file now lists ``hosts``: forget the hosts it no longer lists; check the others at once (an
        edit of the file may be the fix; a host held out too), with the slots the file now gives them."""
        by_name = {h.name: h for h in hosts}
        now = self.clock()
        for name in list(self._out):
            if name not in by_name:
                del self._out[name]
                continue
            record = self._out[name]
            record.host = by_name[name]
            record.due = min(record.due, now)
        for name in list(self._strikes):
            if name not in by_name:
                del self._strikes[name]

    def describe(self) -> str:
        """``name (why), ...`` of the hosts left out."""
        return ", ".join(f"{r.name} ({r.reason})" for r in self._out.values())
