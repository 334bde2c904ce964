"""The node agent: ``python -m varuna_core.launch.agent``, one per host of a launched job, started by the launcher
directly (local jobs) or over SSH, and driven through its stdin and stdout (JSON lines).

Why an agent rather than one SSH session per worker: it owns every worker process of its host, so nothing of
the job can outlive it. Workers run in their own process groups with ``PR_SET_PDEATHSIG``; when the agent's
stdin closes (the launcher stopped, was killed, or its SSH connection dropped) it stops them (SIGTERM to each
group, SIGKILL after a grace period) and exits. The agent of node 0 also hosts the job's ``TCPStore``, as
torchrun's agent does, so the store outlives any worker.

Protocol (:mod:`varuna_core.launch.protocol`). The first stdin line is the node's
:class:`~varuna_core.launch.protocol.AgentSpec`; a line that is not one is answered with one ``error`` event and
exit code 2. Then commands: ``{"cmd": "signal", "signal": "SIGUSR1"}`` (to every worker's main process),
``{"cmd": "handover", "message": GO}`` (node 0: put a handover's signed go into the job's store, where the warm
workers wait for it), ``{"cmd": "stop", "grace": s}``. Events on stdout, one JSON line each: ``ready`` (pid,
interface, address, and the shelf server's port),
``store`` (port), ``started`` (rank, pid), ``log`` (rank, line), ``exit`` (rank, code), ``error`` (message),
``preempt`` (source, seconds, detail), ``signalled`` (signal), ``stopped``.

Signals the agent gets from outside. SIGUSR1 is passed on to every worker (which checkpoints and stops). SIGTERM
stops the workers and the agent, unless the spec says the node runs under a scheduler (``scheduler_signals``):
Slurm signals every process of the job at once before a preemption or the time limit, so the workers got the
signal too and are checkpointing (``VARUNA_ON_SIGTERM=checkpoint``); the agent then only reports a ``signalled``
event, and the launcher ends the attempt once the checkpoint is written. With a ``spot`` watch the agent asks the
cloud's metadata service whether its VM goes away (:mod:`varuna_core.launch.spot`) and reports a notice as a
``preempt`` event.

A morph by handover (the spec's ``shelf``): the agent serves its attempt's shelf
(:class:`~varuna_core.launch.shelf.ShelfServer`, on the address that routes to the master, authenticated with the
job's token) where its workers publish their state before they exit, and keeps serving it after they exited,
until the launcher stops it once the next configuration has taken a step; then it clears the shelf. So the
published state lives in host memory that outlives the workers, owned by a process of the job. With a ``store``
(``--ckpt-local``: checkpoints on each host's own disk) it also serves that directory's checkpoint files, read
only (:mod:`varuna_core.launch.local_store`), to ranks that resume from a checkpoint part of which is here.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from ..env import HOST, JOB_TOKEN, PLAN, SHELF_SERVER
from ..errors import HandoverError
from .protocol import (
    GO_KEY,
    MAX_LINE,
    MAX_NOTICE_SECONDS,
    MAX_SPEC,
    AgentSpec,
    ErrorEvent,
    ExitEvent,
    ForkServerCommand,
    ForkServerEvent,
    HandoverCommand,
    LogEvent,
    PreemptEvent,
    ReadyEvent,
    SignalCommand,
    SignalledEvent,
    StartedEvent,
    StopCommand,
    StoppedEvent,
    StoreEvent,
    WorkerSlot,
    parse_command,
    parse_spec,
)

if TYPE_CHECKING:
    import socket

    import torch.distributed as dist

    from .forkserver import ForkClient, ForkedProcess, ForkedStore
    from .protocol import SpotWatch
    from .shelf import Shelf, ShelfServer
    from .spot import Notice, SpotWatcher

__all__ = ["main", "worker_env", "MAX_LINE"]

_PR_SET_PDEATHSIG = 1
IDLE_EXIT = 600.0  # seconds an agent whose workers have all exited waits for the launcher before leaving
_out_lock = threading.Lock()


def emit(event: BaseModel) -> None:
    """Write one event (a model of :mod:`~varuna_core.launch.protocol`) as a JSON line."""
    line = event.model_dump_json()
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _error(message: str) -> None:
    emit(ErrorEvent.of(message))


def worker_env(spec: AgentSpec, worker: WorkerSlot, master_port: int, interface: str | None,
               plan_path: str | None, shelf_server: str | None = None) -> dict[str, str]:
    """The environment of one worker: the launcher's, the spec's, and the torchrun-style variables (and
    ``shelf_server``, ``address:port`` of this agent's shelf server, which a snapshot's copy is pulled from)."""
    env = dict(os.environ)
    env.update(spec.env)
    env.update(
        RANK=str(worker.rank), LOCAL_RANK=str(worker.local_rank), WORLD_SIZE=str(spec.world),
        LOCAL_WORLD_SIZE=str(len(spec.workers)), GROUP_RANK=str(spec.node),
        MASTER_ADDR=spec.master_addr, MASTER_PORT=str(master_port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store lives in node 0's agent, not in rank 0
        PYTHONUNBUFFERED="1",
    )
    env[HOST] = spec.host
    env.setdefault("OMP_NUM_THREADS", "1")
    # a worker killed by a fatal signal (SIGSEGV, or SIGABRT from C++) leaves every thread's Python stack in its log
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if interface:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    if plan_path:
        env[PLAN] = plan_path
    if shelf_server:
        env[SHELF_SERVER] = shelf_server
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the agent dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Agent:
    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec
        self.procs: dict[int, subprocess.Popen[bytes] | ForkedProcess] = {}
        self.store: dist.TCPStore | ForkedStore | None = None  # (the latter: hosted by the fork server)
        self.listen: socket.socket | None = None  # the store's listening socket (node 0)
        self.forks: ForkClient | None = None  # the host's fork server, if the spec asks for it and one runs
        self.no_fork: str | None = None  # why the fork server does not start this attempt's other workers
        self.preparing: threading.Thread | None = None  # starting the fork server
        self.base_env: dict[str, str] = {}  # the workers' environment but for their ranks (a fork server's)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"varuna-agent-{spec.job[:8]}-"))
        self.stopping = threading.Event()
        self.pumps: list[threading.Thread] = []
        self.spot: SpotWatcher | None = None  # if the spec asks for one
        self.shelf: Shelf | None = None  # the workers' published state (the spec asks for a shelf)
        self.shelf_server: ShelfServer | None = None
        self.shelf_problem: str | None = None

    def start(self) -> None:
        from .netinfo import route_to

        spec = self.spec
        interface, address = route_to(spec.master_addr)
        shelf_port = self._serve_shelf(address) if spec.shelf is not None else None
        emit(ReadyEvent(pid=os.getpid(), interface=interface, address=address, shelf_port=shelf_port))
        server = None  # where the other hosts reach this shelf: the address that routes to the master
        if shelf_port is not None and address:
            server = f"[{address}]:{shelf_port}" if ":" in address else f"{address}:{shelf_port}"
        if spec.fork_server or spec.fork_now:
            self.forks = self._fork_client()
        if spec.store:
            self.listen = _store_socket(spec.master_addr, int(spec.master_port or 0))
            port = int(self.listen.getsockname()[1])
        else:
            assert spec.master_port is not None  # the spec's own check: only the store's host may lack it
            port = spec.master_port
        plan_path = None
        if spec.plan is not None:
            plan_path = str(self.tmp / "plan.json")
            Path(plan_path).write_text(json.dumps(spec.plan))
        if spec.fork_now and self.forks is None and spec.workers:
            env = worker_env(spec, spec.workers[0], port, interface, plan_path, server)
            self.base_env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "GROUP_RANK")}
            self.prepare_fork_server(reap=False)  # (no thread yet: see below)
        if spec.store:
            self._host_store()
            emit(StoreEvent(port=port))
        # every worker is started before any thread exists here (the fork server's reader starts after), so
        # preexec_fn is safe
        for worker in spec.workers:
            env = worker_env(spec, worker, port, interface, plan_path, server)
            if not self.base_env:
                self.base_env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "GROUP_RANK")}
            proc: subprocess.Popen[bytes] | ForkedProcess | None = self._fork(worker, env)
            if proc is None:
                try:
                    proc = subprocess.Popen(self._argv(worker), cwd=spec.cwd or None, env=env,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_die_with_parent)
                except OSError as exc:
                    _error(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}")
                    if self.forks is not None:  # (the exit codes of those it forked come through it)
                        self.forks.start_reader()
                    self.stop(0)
                    return
            self.procs[worker.rank] = proc
            emit(StartedEvent(rank=worker.rank, pid=proc.pid, forked=not isinstance(proc, subprocess.Popen)))
        if self.forks is not None:
            self.forks.start_reader()
        for rank, proc in self.procs.items():
            pump = threading.Thread(target=self._pump, args=(rank, proc), name=f"rank{rank}", daemon=True)
            pump.start()
            self.pumps.append(pump)
        if spec.spot is not None:
            self._watch_spot(spec.spot)
        if self.shelf_problem:  # not before: an error while starting is the agent's failure to start
            _error(self.shelf_problem)

    def _serve_shelf(self, address: str | None) -> int | None:
        """Serve this attempt's shelf to the job's other hosts (on the address that routes to the master); its
        port, or None (an ``error`` event says why once the workers run: a publish then falls back to the
        store)."""
        from .local_store import StoreFiles
        from .shelf import Shelf, ShelfServer

        spec = self.spec
        assert spec.shelf is not None
        token = spec.env.get(JOB_TOKEN)
        try:
            self.shelf = Shelf(spec.shelf.key, root=spec.shelf.root, budget=spec.shelf.budget)
            if not token:
                raise HandoverError("the spec carries no job token")
            files = StoreFiles(spec.shelf.store).open if spec.shelf.store is not None else None
            self.shelf_server = ShelfServer(self.shelf, token, host=address or "0.0.0.0", files=files)
        except (HandoverError, OSError) as exc:
            self.shelf_problem = f"no shelf server: {getattr(exc, 'message', None) or exc}"
            return None
        return self.shelf_server.port

    def handover(self, message: str, key: str = GO_KEY) -> None:
        """Put the launcher's go (or regroup) message where the workers wait for it (node 0 hosts the job's
        store)."""
        if self.store is None:
            _error("a handover message reached an agent that does not host the job's store")
            return
        try:
            self.store.set(key, message)
        except Exception as exc:  # noqa: BLE001  (the store's host is gone: the workers time out and say so)
            _error(f"cannot put the {key} message into the job's store: {exc}")

    def _watch_spot(self, watch: SpotWatch) -> None:
        """Report the cloud's notices for this VM as ``preempt`` events (the launcher checkpoints and morphs)."""
        from .spot import SpotWatcher

        def report(notice: Notice) -> None:
            emit(PreemptEvent(source=notice.source, seconds=min(notice.seconds, MAX_NOTICE_SECONDS),
                              detail=notice.detail[:1024]))

        try:
            self.spot = SpotWatcher(watch.source, report, base=watch.endpoint, interval=watch.interval,
                                    vm_name=watch.vm_name).start()
        except ValueError as exc:
            _error(f"no spot notices: {exc}")

    def _host_store(self) -> None:
        """Host the job's TCPStore (node 0) on the socket bound in ``self.listen``: in a child of the fork server
        if there is one (torch is imported there already), else here."""
        import datetime

        assert self.listen is not None
        if self.forks is not None:
            from .forkserver import ForkServerError

            try:
                self.store = self.forks.store(self.listen, self.spec.master_addr, 600.0)
                return
            except (ForkServerError, OSError) as exc:
                _error(f"the fork server cannot host the job's store ({exc}): the agent hosts it")
        import torch.distributed as dist

        self.store = dist.TCPStore(
            self.spec.master_addr, self.listen.getsockname()[1], len(self.spec.workers), is_master=True,
            wait_for_workers=False, timeout=datetime.timedelta(seconds=600), master_listen_fd=self.listen.fileno())

    def _fork_client(self) -> ForkClient | None:
        """The connection to this job's fork server on this host, if one runs and serves this job."""
        from .forkserver import ForkClient, ForkServerError, socket_path

        token = self.spec.env.get(JOB_TOKEN)
        if not token:
            return None
        try:
            return ForkClient.connect(socket_path(self.spec.job, self.spec.host), token)
        except (ForkServerError, OSError) as exc:
            _error(f"the fork server does not serve this job ({exc}): the workers start as new interpreters")
            return None

    def _fork(self, worker: WorkerSlot, env: dict[str, str]) -> ForkedProcess | None:
        """``worker`` forked by the host's fork server; None when there is none or it cannot (said once)."""
        if self.forks is None or self.no_fork is not None:
            return None
        from .forkserver import ForkServerError

        argv = self._argv(worker)
        why = self.forks.usable_for(argv, env)
        if why is None:
            try:
                return self.forks.spawn(argv, env, self.spec.cwd, f"varuna-r{worker.rank}")
            except (ForkServerError, OSError) as exc:
                why = str(exc)
        # (the connection stays: the server ends what it forked for this agent when it closes)
        self.no_fork = why
        _error(f"the fork server cannot start rank {worker.rank} ({why}): the workers from here on start as new "
               f"interpreters")
        return None

    def prepare_fork_server(self, reap: bool = True) -> None:
        """Make sure this job's fork server runs on this host and keep a connection to it (which keeps it alive);
        report it (``forkserver`` event). In a thread once the workers train (the server's imports take seconds),
        or before the workers start (``fork_now``: with ``reap=False``, no thread is started)."""
        from .forkserver import ForkServerError, socket_path, start_server

        if self.forks is not None:
            emit(ForkServerEvent(pid=self.forks.pid))
            return
        token = self.spec.env.get(JOB_TOKEN)
        argv = self._argv(self.spec.workers[0]) if self.spec.workers else list(self.spec.argv)
        began = time.monotonic()
        try:
            if not token or not self.base_env:
                raise ForkServerError("the spec carries no job token" if not token else "no worker ran here")
            self.forks = start_server(socket_path(self.spec.job, self.spec.host), token, argv, self.base_env,
                                      self.spec.cwd, reap=reap)
        except (ForkServerError, OSError) as exc:
            emit(ForkServerEvent(message=f"no fork server: {exc}"[:MAX_LINE]))
            return
        emit(ForkServerEvent(pid=self.forks.pid, seconds=round(time.monotonic() - began, 3)))

    def _argv(self, worker: WorkerSlot) -> list[str]:
        argv = list(self.spec.argv)
        legacy = self.spec.legacy_args
        if legacy is not None:  # the original launcher's arguments, for scripts written for it
            argv += [f"--rank={worker.rank}", f"--local_rank={worker.local_rank}",
                     f"--stage_to_rank_map={legacy.stage_to_rank_map}", f"--chunk_size={legacy.chunk_size}",
                     f"--batch-size={legacy.batch_size}"]
        return argv

    def _pump(self, rank: int, proc: subprocess.Popen[bytes] | ForkedProcess) -> None:
        """Forward the worker's output line by line (a line longer than :data:`MAX_LINE` bytes in pieces of that
        size, so that output without newlines cannot grow memory), then its exit code (after the last line)."""
        stdout = proc.stdout
        assert stdout is not None  # a pipe
        for raw in iter(lambda: stdout.readline(MAX_LINE), b""):
            emit(LogEvent(rank=rank, line=raw.decode(errors="replace").rstrip("\n")))
        stdout.close()
        emit(ExitEvent(rank=rank, code=proc.wait()))

    def signal(self, name: str, leaving: bool = False, alone: bool = False) -> None:
        sig = getattr(signal, name, None) if name in ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGKILL") else None
        if not isinstance(sig, signal.Signals):
            _error(f"unknown signal {name!r}")
            return
        if (leaving or alone) and sig is signal.SIGUSR2 and self.shelf is not None:
            try:  # before the signal: the workers read the mark when they publish, at the next step's end
                if leaving:
                    self.shelf.mark_leaving()
                else:
                    self.shelf.mark_alone()
            except (OSError, HandoverError) as exc:  # a publish without it is only slower
                what = "a host that leaves" if leaving else "the next configuration's only host"
                _error(f"cannot mark the shelf of {what}: {getattr(exc, 'message', exc)}")
        if sig is signal.SIGKILL:  # the workers end now, wherever they are (blocked in a collective too); the
            for proc in self.procs.values():  # agent stays and serves its shelf: their snapshot is on it
                if proc.poll() is None:
                    _killpg(proc.pid, signal.SIGKILL)
            return
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)  # the main process only: its data-loader children keep running
                except ProcessLookupError:
                    pass

    def stop(self, grace: float, last: bool = False) -> None:
        """SIGTERM every worker's process group, SIGKILL whatever is left after ``grace`` seconds. Under a
        scheduler a worker's first SIGTERM only asks for a checkpoint: it gets a second one. ``last``: the job
        ends, and the host's fork server leaves too."""
        if not self.stopping.is_set():
            self.stopping.set()
            self._stop_workers(grace)
        if last or not self.spec.fork_server:  # (after the workers: it takes the workers it forked with it)
            if self.preparing is not None:  # a server coming up now would stay for its linger
                self.preparing.join(timeout=30)
            if self.forks is not None:
                self.forks.quit()

    def _stop_workers(self, grace: float) -> None:
        if self.spot is not None:
            self.spot.stop(timeout=0)
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            _killpg(proc.pid, signal.SIGTERM)
        if self.spec.scheduler_signals and live:
            time.sleep(0.5)  # two SIGTERMs sent at once could arrive as one
            for proc in live:
                if proc.poll() is None:
                    _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _killpg(proc.pid, signal.SIGKILL)  # also any child a worker left behind in its group
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _store_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket for the job's store on ``address`` only (a local job's store on the loopback is
    then unreachable from the network; torch's own server would listen on every interface). Falls back to every
    interface when ``address`` is not one of this machine's (e.g. behind NAT)."""
    import socket

    for host in (address, ""):
        try:
            family = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            return sock
        except OSError as exc:
            if not host:
                raise
            _error(f"the job's store cannot listen on {address} only ({exc.strerror or exc}); "
                   f"it listens on every interface")
    raise AssertionError("unreachable")


def _read_spec() -> AgentSpec | None:
    """The spec on the first stdin line; None if stdin is empty. Anything else: one ``error`` event, exit 2."""
    first = sys.stdin.readline(MAX_SPEC)
    if not first:
        return None
    try:
        return parse_spec(first)
    except ValueError as exc:
        _error(f"the launcher sent an invalid node spec: {exc}")
        sys.stdout.flush()
        os._exit(2)


SignalHandler = Callable[[int, FrameType | None], None]


def sigterm_handler(agent: Agent, grace: float) -> SignalHandler:
    """The agent's SIGTERM handler: stop the workers and leave. Python runs a handler in the main thread between
    two bytecodes, possibly inside :func:`emit` holding its (non-reentrant) lock; stopping inline would then wait
    for that lock forever. So the handler only starts a thread that stops."""

    def stop() -> None:
        agent.stop(grace)
        _finish(agent)

    def on_term(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=stop, name="sigterm", daemon=True).start()

    return on_term


def signalled_handler(agent: Agent) -> SignalHandler:
    """The handler of a signal that asks for a checkpoint rather than a stop (SIGUSR1; SIGTERM under a
    scheduler): pass SIGUSR1 on to the workers and, under a scheduler, tell the launcher. In a thread, for the
    reason given at :func:`sigterm_handler`."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # installed for SIGUSR1, and for SIGTERM under a scheduler
        name: Literal["SIGTERM", "SIGUSR1"] = "SIGTERM" if signum == signal.SIGTERM else "SIGUSR1"

        def act() -> None:
            agent.signal("SIGUSR1")
            if agent.spec.scheduler_signals:
                emit(SignalledEvent(signal=name))

        threading.Thread(target=act, name="signalled", daemon=True).start()

    return on_signal


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when to stop; a terminal's ^C is its
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    spec = _read_spec()
    if spec is None:
        return
    agent = Agent(spec)
    signal.signal(signal.SIGUSR1, signalled_handler(agent))
    signal.signal(signal.SIGTERM, signalled_handler(agent) if spec.scheduler_signals
                  else sigterm_handler(agent, spec.grace))
    agent.start()
    threading.Thread(target=_watchdog, args=(agent,), name="watchdog", daemon=True).start()
    for line in iter(lambda: sys.stdin.readline(MAX_LINE), ""):
        try:
            cmd = parse_command(line)
        except ValueError:
            _error(f"not a command: {line.strip()[:80]!r}")
            continue
        if isinstance(cmd, SignalCommand):
            agent.signal(cmd.signal, cmd.leaving, cmd.alone)
        elif isinstance(cmd, HandoverCommand):
            agent.handover(cmd.message, cmd.key)
        elif isinstance(cmd, ForkServerCommand):
            if spec.fork_server and agent.preparing is None:
                agent.preparing = threading.Thread(target=agent.prepare_fork_server, name="forkserver", daemon=True)
                agent.preparing.start()
        elif isinstance(cmd, StopCommand):
            agent.stop(cmd.grace_or(spec.grace), last=cmd.last)
            break
    else:  # stdin closed: the launcher is gone (the fork server goes too: nothing of the job outlives it)
        agent.stop(spec.grace, last=True)
    _finish(agent)


def _watchdog(agent: Agent) -> None:
    """Leave if the launcher stays silent long after every worker exited (a host cut off by a network
    partition may never see its SSH session close)."""
    idle_since = None
    while True:
        time.sleep(5)
        if agent.procs and all(p.poll() is not None for p in agent.procs.values()):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > IDLE_EXIT:
                agent.stop(0)
                _finish(agent)
        else:
            idle_since = None


def _finish(agent: Agent) -> None:
    import shutil

    for pump in agent.pumps:  # the last lines and exit codes of the workers go out before "stopped"
        pump.join(timeout=5)
    shutil.rmtree(agent.tmp, ignore_errors=True)
    if agent.shelf_server is not None:  # the published state is no longer needed: the job has moved on or ended
        agent.shelf_server.close()
    if agent.shelf is not None:
        agent.shelf.clear()
    if agent.forks is not None:  # (the store's host, a child of the server, leaves with the connection)
        agent.forks.close()
    emit(StoppedEvent())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
