"""Reaching the hosts of a job: SSH command lines, the pre-flight check of every host, and the handle of one
node agent (:mod:`varuna_core.launch.agent`) started locally, over SSH, or as a Slurm job step (``srun``).

SSH runs with ``BatchMode=yes`` (never a password prompt that would hang the launcher), a connect timeout and
keep-alives (a dead host is noticed in seconds), and the remote command built from shell-quoted words. The
agent's spec (environment, token, plan) travels on the agent's stdin, not its command line, so no secret shows
in ``ps`` on either side.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, TypeAlias

from ..env import JOB_ID
from .hosts import Host
from .options import HostRuntime, SlurmConfig, SSHConfig
from .protocol import (
    MAX_EVENT,
    AgentEvent,
    AgentSpec,
    ErrorEvent,
    ForkServerCommand,
    GoneEvent,
    HandoverCommand,
    ReadyEvent,
    SignalCommand,
    StopCommand,
    parse_event,
)

__all__ = ["AgentHandle", "AgentEvents", "check_hosts", "probe_agents", "HostProblem", "parse_event", "MAX_EVENT"]

# what the agents of a job report, on one queue: (node, event)
AgentEvents: TypeAlias = "queue.Queue[tuple[int, AgentEvent | GoneEvent]]"


@dataclass(frozen=True)
class HostProblem:
    host: Host
    message: str


# Run by the host's interpreter in --code-dir: varuna imports (it imports no torch), and torch is installed there,
# found without importing it. Importing torch costs 1-2 s of CPU here (more with CUDA's libraries) on every host at
# every check, and the check runs before a job starts and again before it grows onto a host; a torch that is installed
# but does not import then fails in the worker, whose error the crash's one line quotes (attempt.error_line).
_CHECK = ("import sys, importlib.util, importlib.metadata as m, varuna_core\n"
          "if importlib.util.find_spec('torch') is None:\n"
          "    sys.exit(\"ModuleNotFoundError: No module named 'torch'\")\n"
          "try:\n"
          "    torch = m.version('torch')\n"
          "except m.PackageNotFoundError:\n"
          "    torch = 'unknown'\n"
          "print('varuna-ok', sys.version.split()[0], torch, varuna_core.__version__)\n")


def check_hosts(hosts: list[Host], ssh: SSHConfig, runtime: HostRuntime, timeout: float = 60) -> list[HostProblem]:
    """Check every host at once: SSH reaches it, the code directory exists, the interpreter imports varuna and finds
    torch (see :data:`_CHECK`). Returns the problems (empty: all good), one per failing host, in host order."""

    def one(host: Host) -> HostProblem | None:
        argv = ssh.argv(host, runtime.command("-c", _CHECK))
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return HostProblem(host, f"no answer within {timeout:g}s")
        except FileNotFoundError:
            return HostProblem(host, "the ssh client is not installed here")
        if done.returncode == 0 and "varuna-ok" in done.stdout:
            return None
        lines = [ln for ln in (done.stderr.strip() or done.stdout.strip()).splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"exit code {done.returncode}"
        if done.returncode == 255:
            detail = f"unreachable over SSH: {detail}"
        return HostProblem(host, detail)

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        return [p for p in pool.map(one, hosts) if p is not None]


def probe_agents(hosts: list[Host], runtime: HostRuntime, remote: SSHConfig | SlurmConfig | None, job: str,
                 timeout: float = 60, cancel: threading.Event | None = None) -> list[HostProblem]:
    """Start a node agent without workers on every host at once, the way an attempt starts one (same command,
    over SSH or as a Slurm job step), and wait for it to report ``ready``; then let it go. What
    :func:`check_hosts` cannot see (the agent's own modules, its temporary directory, srun's answer on a node)
    fails here. Returns the problems, one per failing host, in host order. ``cancel`` set: give up at once."""

    def one(host: Host) -> HostProblem | None:
        events: AgentEvents = queue.Queue()
        spec = AgentSpec(job=job, node=0, host=host.name, store=False, master_addr=host.address, master_port=1,
                         world=1, workers=[], argv=["true"], grace=0.0)
        try:
            agent = AgentHandle(0, host, spec, events, runtime, remote)
        except OSError as exc:
            return HostProblem(host, f"its node agent did not start: {exc.strerror or exc}")
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
                try:
                    _, event = events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(event, ReadyEvent):
                    return None
                if isinstance(event, ErrorEvent):
                    detail = event.message or agent.last_words() or "it reported an error without a message"
                    return HostProblem(host, f"its node agent did not start: {detail}")
                if isinstance(event, GoneEvent):
                    detail = agent.last_words() or f"exit code {event.code}"
                    if event.code == 255 and not isinstance(remote, SlurmConfig):
                        detail = f"unreachable over SSH: {detail}"
                    return HostProblem(host, f"its node agent did not start: {detail}")
            return HostProblem(host, f"its node agent did not report ready within {timeout:g}s")
        finally:
            agent.close()
            if not agent.wait(5):
                agent.kill()

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        return [p for p in pool.map(one, hosts) if p is not None]


def _lines(stream: IO[bytes], limit: int = MAX_EVENT) -> Iterator[bytes]:
    """The lines of a binary stream, each at most ``limit`` bytes: the rest of a longer line is dropped."""
    while True:
        line = stream.readline(limit)
        if not line:
            return
        if not line.endswith(b"\n") and len(line) == limit:
            while (rest := stream.readline(limit)) and not rest.endswith(b"\n"):
                pass
        yield line


class AgentHandle:
    """One node agent: its process (``python -m varuna_core.launch.agent`` locally, ``ssh HOST ...`` or ``srun
    --nodelist=HOST ...``: ``remote``'s command line), a writer for
    its commands, and a thread that puts its events (:mod:`~varuna_core.launch.protocol` models) on a shared queue as
    ``(node, event)``. An agent whose output ends (it exited, or SSH lost the host) yields a
    :class:`~varuna_core.launch.protocol.GoneEvent`."""

    def __init__(self, node: int, host: Host, spec: AgentSpec, events: AgentEvents, runtime: HostRuntime,
                 remote: SSHConfig | SlurmConfig | None) -> None:
        self.node, self.host = node, host
        # the job id marks every process of the job (the agent's and, through the spec, the workers')
        command = runtime.command("-m", "varuna_core.launch.agent", env={JOB_ID: spec.job})
        argv = ["/bin/sh", "-c", command] if remote is None else remote.argv(host, command)
        # a session of its own: a ^C in the launcher's terminal reaches the launcher only, which stops the job
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None  # all three are pipes
        self._stdin, self._stdout, self._stderr = stdin, stdout, stderr
        self.srun = isinstance(remote, SlurmConfig)
        self._events = events
        self._lock = threading.Lock()
        self.stderr: list[str] = []
        self.ready: ReadyEvent | None = None  # the agent's ReadyEvent, once it came
        self.send(spec)
        threading.Thread(target=self._read, name=f"agent{node}", daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, name=f"agent{node}-err", daemon=True)
        self._stderr_reader.start()

    def send(self, message: AgentSpec | SignalCommand | StopCommand | HandoverCommand | ForkServerCommand) -> bool:
        """Write one message to the agent as a JSON line; False if it is gone."""
        line = message.model_dump_json() + "\n"
        with self._lock:
            try:
                self._stdin.write(line.encode())
                self._stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def _read(self) -> None:
        for raw in _lines(self._stdout):
            event = parse_event(raw)
            if event is None:  # not ours (a shell's banner, a warning, a stray "42"): kept for diagnosis
                self.stderr.append(raw[:300].decode(errors="replace").rstrip())
                del self.stderr[:-20]
                continue
            self._events.put((self.node, event))
        self._events.put((self.node, GoneEvent(code=self.proc.wait())))

    def _read_stderr(self) -> None:
        for raw in _lines(self._stderr, 4096):
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.stderr.append(line)
                del self.stderr[:-20]

    def last_words(self, wait: float = 1.0) -> str:
        """The last line the agent (or ssh, or srun) printed on stderr, once its stderr is read to the end (at most
        ``wait`` seconds): after a traceback, the exception."""
        self._stderr_reader.join(timeout=wait)
        return next((line.strip() for line in reversed(self.stderr) if line.strip()), "")

    def close(self) -> None:
        """Close the agent's stdin: it stops its workers (if any are left) and exits."""
        with self._lock:
            try:
                self._stdin.close()
            except OSError:
                pass

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        """Kill the local end (the agent itself, or the ssh client: the remote agent then sees its stdin close).
        A killed srun would leave its job step running, unseen: srun is asked to cancel the step instead (two
        SIGINTs within a second), and killed only if it does not."""
        if self.srun and self.proc.poll() is None:
            try:
                for _ in range(2):
                    os.killpg(self.proc.pid, signal.SIGINT)
                    time.sleep(0.2)
            except (ProcessLookupError, PermissionError):
                pass
            self.wait(5)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
