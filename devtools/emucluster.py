"""An emulated commodity cluster: ``H`` hosts of ``G`` worker slots, fast inside a host, a slow link between hosts.

The hosts are the SSH test hosts of :mod:`devtools.testhosts` (one network namespace each, with its own sshd,
reached by the real ``ssh`` client; ``varuna launch --hosts`` runs on them as on machines). The workers of one
host share its namespace, so what they send each other crosses its loopback, at memory speed. Between hosts
every frame crosses the host's ``eth0`` and the switch's port towards the host; both are limited to the link's
rate by ``tc``'s token bucket (``tbf``, as the slow-network benchmark limits its pair of ranks, see
:func:`tc_commands`), so each host's network card sends and receives at most ``rate`` each way, as a host behind
a switch does, and two flows out of one host share its card. An optional one-way ``delay`` is added with netem
on the host's side.

::

    root namespace (the launcher) --veth-- [switch: bridge] --p0 (tbf)-- eth0 (tbf) h0: slots 0..G-1, sshd
                                                            --p1 (tbf)-- eth0 (tbf) h1: slots 0..G-1, sshd

The link can be changed while the cluster stands (:meth:`EmuCluster.set_link`), so one cluster serves several
rates. Clean-up is testhosts': ``close()`` (also at exit, and on SIGTERM where the caller asks for it with
:func:`close_on_signals`) kills every process in the hosts' namespaces and deletes them with their
interfaces (their queueing disciplines go with them); a cluster whose creating process was killed outright is
removed by the next :func:`~devtools.testhosts.start_cluster` (``cleanup_stale``).

Needs root (network namespaces, ``tc``): :func:`start_emucluster` raises :class:`ClusterUnavailable` with the
reason where they cannot be had, so callers can skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (the link probe's ranks)
    sys.path.insert(0, str(ROOT))

from devtools.testhosts import HostCluster, start_cluster  # noqa: E402

__all__ = ["EmuCluster", "ClusterUnavailable", "LinkProbe", "start_emucluster", "tc_commands", "parse_rate",
           "parse_delay", "format_rate", "close_on_signals"]

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built on this machine (no root, no namespaces, no tc); says why."""


def parse_rate(text: str) -> int:
    """A tc rate such as ``200mbit`` -> bits per second (> 0). Decimal prefixes, as tc reads them."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?bit)", text.strip().lower())
    if not m or float(m[1]) <= 0:
        raise ValueError(f"--rate {text!r}: expected a positive number with bit, kbit, mbit or gbit (e.g. 200mbit)")
    return round(float(m[1]) * _RATE_UNITS[m[2]])


def parse_delay(text: str) -> float:
    """A delay such as ``1ms`` -> seconds (>= 0)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", text.strip().lower())
    if not m:
        raise ValueError(f"--delay {text!r}: expected a number with us, ms or s (e.g. 1ms, 0ms)")
    return float(m[1]) * _DELAY_UNITS[m[2]]


def format_rate(bps: int) -> str:
    """Bits per second as tc would write them: ``1gbit``, ``200mbit``, ``50mbit``."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale and bps % scale == 0:
            return f"{bps // int(scale)}{unit}"
    return f"{bps}bit"


def tc_commands(dev: str, rate_bps: int, delay_s: float, *, burst: str = "32kbit") -> list[list[str]]:
    """``tc`` arguments that limit what ``dev`` sends to ``rate_bps``, after a delay of ``delay_s`` if > 0.

    Token bucket (tbf) with a ``burst`` of 32 kbit (4 KB) by default, so the link never runs faster than the rate
    for more than a few packets, and a 50 ms queue. A delay needs netem, as the root with tbf as its child
    (netem's own documented way to combine the two).
    """
    tbf = ["tbf", "rate", f"{rate_bps}bit", "burst", burst, "latency", "50ms"]
    if delay_s <= 0:
        return [["qdisc", "add", "dev", dev, "root", *tbf]]
    return [["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{round(delay_s * 1e6)}us"],
            ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]


def _burst_for(rate_bps: int) -> str:
    """The token bucket's depth: 4 KB up to 200 Mbit/s (the slow-network benchmark's), above it 200 µs worth of
    the rate, in bytes (at 1 Gbit/s a 4 KB bucket is empty after 33 µs, shorter than the kernel's timers fire
    reliably, and the link would run well below its rate)."""
    return "32kbit" if rate_bps <= 200_000_000 else str(max(4_000, rate_bps // 40_000))


@dataclass(frozen=True)
class LinkProbe:
    """The link between two hosts as measured: one-way seconds per message size, and their fit."""

    sizes: list[int]
    times: list[float]
    latency: float | None  # seconds (None: not measured)
    bandwidth: float  # bytes per second
    rel_error: float

    @classmethod
    def nominal(cls, rate_bps: int) -> LinkProbe:
        """The link as its nominal rate says, unmeasured (what ``varuna plan --link-rate`` alone tells)."""
        return cls(sizes=[], times=[], latency=None, bandwidth=rate_bps / 8, rel_error=0.0)

    def describe(self) -> str:
        if self.latency is None:
            return f"{self.bandwidth * 8 / 1e6:.0f} Mbit/s (nominal)"
        return (f"{self.bandwidth * 8 / 1e6:.0f} Mbit/s, {self.latency * 1e6:.0f} us per message (fit error "
                f"{self.rel_error:.0%})")


@dataclass
class EmuCluster:
    """``hosts`` hosts of ``slots`` worker slots each, with the link between them at ``rate_bps`` (None: not
    limited, the veths' own speed) and ``delay_s`` one way."""

    cluster: HostCluster
    slots: int
    rate_bps: int | None = None
    delay_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    @property
    def num_hosts(self) -> int:
        return len(self.cluster.hosts)

    @property
    def devices(self) -> int:
        return self.num_hosts * self.slots

    def describe(self) -> str:
        link = "unlimited" if self.rate_bps is None else f"{format_rate(self.rate_bps)} each way (tc tbf)"
        delay = f", {self.delay_s * 1e3:g} ms one-way delay (netem)" if self.delay_s > 0 else ""
        return f"{self.num_hosts} hosts x {self.slots} slots; between hosts {link}{delay}"

    def hosts_file(self, path: Path) -> Path:
        """Write the ``varuna launch --hosts`` file of the cluster (every host with its slots) to ``path``."""
        path.write_text("".join(line + "\n" for line in self.cluster.hosts_file_lines(self.slots)))
        return path

    def launcher_args(self) -> list[str]:
        """The ``varuna launch`` flags that reach the hosts (key, known_hosts)."""
        return self.cluster.launcher_args()

    def set_link(self, rate_bps: int | None, delay_s: float = 0.0) -> None:
        """Limit every host's link (both directions) to ``rate_bps`` with ``delay_s`` one way, replacing what was
        there; ``rate_bps=None`` removes the limits. ClusterUnavailable if tc refuses (e.g. no netem)."""
        for i, host in enumerate(self.cluster.hosts):
            assert host.netns is not None
            for ns, dev in ((host.netns, "eth0"), (f"{self.cluster.tag}-sw", f"p{i}")):
                _tc(["-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # none yet: fine
                if rate_bps is None:
                    continue
                # the delay on the host's side only: a round trip between two hosts then takes 2 x delay
                for argv in tc_commands(dev, rate_bps, delay_s if dev == "eth0" else 0.0,
                                        burst=_burst_for(rate_bps)):
                    _tc(["-n", ns, *argv])
        self.rate_bps, self.delay_s = rate_bps, delay_s

    def link_stats(self) -> dict[str, dict[str, int]]:
        """Per host: bytes sent and dropped by its eth0's queueing discipline (tc -s), for sanity checks."""
        out = {}
        for host in self.cluster.hosts:
            text = _tc(["-n", str(host.netns), "-s", "qdisc", "show", "dev", "eth0"], check=False).stdout
            sent = re.search(r"Sent (\d+) bytes", text)
            dropped = re.search(r"dropped (\d+)", text)
            out[host.name] = {"sent": int(sent[1]) if sent else 0, "dropped": int(dropped[1]) if dropped else 0}
        return out

    def probe_link(self, workdir: Path, *, repeats: int = 5, timeout: float = 120.0) -> LinkProbe:
        """Measure the link between the first two hosts as the profiler measures a link: one rank on each (gloo over
        their ``eth0``), one-way time of a message by ping-pong (half the round trip, median of ``repeats`` after 2
        untimed), for sizes from 1 KiB up to what the rate sends in ~0.25 s (at most 16 MiB, the profiler's
        largest), fitted to ``latency + bytes / bandwidth`` by the profiler's own fit. What ``varuna plan
        --link-rate/--link-latency`` is then told: the link as a user's measurement of it would find it (TCP and
        gloo's framing cost some of the nominal rate)."""
        if self.num_hosts < 2:
            raise ValueError("the link between hosts needs two hosts")
        rate = (self.rate_bps or 10_000_000_000) / 8
        sizes = [s for s in (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24) if s <= max(1 << 17, rate / 4)]
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / "link.json"
        out.unlink(missing_ok=True)
        hosts = self.cluster.hosts[:2]
        port = 29000 + os.getpid() % 1000
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        procs = []
        try:
            for rank, host in enumerate(hosts):
                argv = ["ip", "netns", "exec", str(host.netns), sys.executable, str(Path(__file__).resolve()),
                        "--probe", str(rank), hosts[0].address, str(port), str(out), ",".join(map(str, sizes)),
                        str(repeats)]
                log = open(workdir / f"probe{rank}.log", "w")  # noqa: SIM115 - closed below
                procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL), log))
            deadline = time.monotonic() + timeout
            for proc, _ in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        if not out.exists():
            logs = "\n".join((workdir / f"probe{r}.log").read_text()[-1500:] for r in range(2))
            raise RuntimeError(f"the link probe between {hosts[0].name} and {hosts[1].name} failed:\n{logs}")
        data = json.loads(out.read_text())
        from varuna_core.profiling.run import fit_linear

        fit = fit_linear(data["sizes"], data["times"])
        return LinkProbe(sizes=data["sizes"], times=data["times"], latency=fit.latency, bandwidth=fit.bandwidth,
                         rel_error=fit.rel_error)

    def close(self) -> None:
        """Kill every process on the hosts and remove them (idempotent, never raises)."""
        if not self._closed:
            self._closed = True
            self.cluster.close()


def start_emucluster(hosts: int, slots: int, workdir: Path, rate_bps: int | None = None,
                     delay_s: float = 0.0) -> EmuCluster:
    """Start ``hosts`` emulated hosts of ``slots`` slots, the link between them limited to ``rate_bps``.

    Raises ClusterUnavailable when this machine cannot make network namespaces or limit a link (not root, no
    ``tc``): the loopback hosts testhosts falls back to share one network stack, so no link could be limited.
    """
    if hosts < 1 or slots < 1:
        raise ValueError(f"need at least one host and one slot, got {hosts} x {slots}")
    if not shutil.which("tc"):
        raise ClusterUnavailable("tc (iproute2) is not installed: the link between hosts cannot be limited")
    try:
        cluster = start_cluster(hosts, workdir)
    except (RuntimeError, OSError) as exc:
        raise ClusterUnavailable(f"the SSH test hosts could not start: {exc}") from exc
    emu = EmuCluster(cluster, slots)
    try:
        if cluster.mode != "netns":
            raise ClusterUnavailable("network namespaces cannot be created here (not root?): the hosts would share "
                                     "one network stack and no link between them could be limited")
        emu.set_link(rate_bps, delay_s)
    except BaseException:
        emu.close()
        raise
    return emu


def close_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit in this process, so that a benchmark stopped by them unwinds
    through its ``finally`` (and the cluster's close) instead of leaving namespaces behind. (SIGINT already
    raises KeyboardInterrupt; atexit closes the cluster after an uncaught exception; SIGKILL leaves it to the next
    start's stale clean-up.)"""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _tc(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        what = "netem (a delay)" if "netem" in args else "tbf"
        raise ClusterUnavailable(f"tc cannot set up {what} on the emulated link (`tc {' '.join(args)}`: "
                                 f"{proc.stderr.strip()})")
    return proc


def _probe_rank(rank: int, master: str, port: int, out: str, sizes: list[int], repeats: int) -> None:
    """One rank of :meth:`EmuCluster.probe_link` (run in its host's namespace)."""
    import datetime
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    times = []
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        samples = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                samples.append((time.perf_counter() - start) / 2)
        times.append(statistics.median(samples))
    if rank == 0:
        Path(out).write_text(json.dumps({"sizes": sizes, "times": times}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "--probe":
    _probe_rank(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5],
                [int(x) for x in sys.argv[6].split(",")], int(sys.argv[7]))
