"""CPU accounting for the benchmarks: how busy the whole machine was while a phase ran, and how much of that was
the benchmark itself, so a timing taken while other processes loaded the machine can be told apart (and
reported, or waited out). Linux only (``/proc/stat``); elsewhere the machine-wide figures are None."""

from __future__ import annotations

import os
import resource
import time

__all__ = ["busy_cpu_s", "own_cpu_s", "tree_cpu_s", "Load", "wait_idle"]


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores, from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(children: bool = True) -> float:
    """CPU seconds of this process (all its threads) and, with ``children``, of its finished (waited-for)
    children."""
    usage = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        usage.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usage)


def tree_cpu_s() -> float:
    """CPU seconds of this process and of every descendant, live or finished: its own and its waited-for
    children's (:func:`own_cpu_s`), plus each live descendant's own and waited-for children's (``/proc``). A
    descendant that ends orphaned (reaped by init) is missed."""
    from devtools.procs import live_processes

    children: dict[int, list[int]] = {}
    for p in live_processes():
        children.setdefault(p.ppid, []).append(p.pid)
    total, todo, tick = own_cpu_s(), list(children.get(os.getpid(), [])), os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total


class Load:
    """Cores that other processes kept busy while a phase ran: the machine's busy CPU time minus this process's
    and its finished children's (with ``tree``: minus every descendant's, live or finished, e.g. the workers a
    benchmark started over SSH on test hosts it runs), over the wall time since the object was made."""

    def __init__(self, tree: bool = False) -> None:
        self._own = tree_cpu_s if tree else own_cpu_s
        self.busy, self.own, self.t = busy_cpu_s(), self._own(), time.perf_counter()

    def other_cores(self) -> float | None:
        busy = busy_cpu_s()
        if busy is None or self.busy is None:
            return None
        wall = time.perf_counter() - self.t
        return max(0.0, ((busy - self.busy) - (self._own() - self.own)) / wall) if wall > 0 else None


def wait_idle(limit_s: float, threshold: float = 0.2) -> float:
    """Wait (up to ``limit_s``) until other processes keep fewer than ``threshold`` cores busy over 2 s; returns
    the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        probe = Load()
        time.sleep(2.0)
        other = probe.other_cores()
        if other is None or other < threshold:
            break
    return time.perf_counter() - start
