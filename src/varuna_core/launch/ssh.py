"""Reaching the hosts of a job: SSH command lines, the pre-flight check of every host, and the handle of one
node agent (:mod:`varuna_core.launch.agent`) started locally or over SSH.

SSH runs with ``BatchMode=yes`` (never a password prompt that would hang the launcher), a connect timeout and
keep-alives (a dead host is noticed in seconds), and the remote command built from shell-quoted words. The
agent's spec (environment, token, plan) travels on the agent's stdin, not its command line, so no secret shows
in ``ps`` on either side.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..env import JOB_ID
from .hosts import Host

__all__ = ["SSHConfig", "Runtime", "AgentHandle", "check_hosts", "HostProblem", "parse_event"]


@dataclass(frozen=True)
class SSHConfig:
    """How to SSH: defaults for every host (a host's own ``user@``/``:port`` in the hosts file win)."""

    user: str | None = None
    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: int = 10

    def argv(self, host: Host, command: str) -> list[str]:
        argv = ["ssh"]
        for option in self.options:  # ssh keeps the first value of an option: the user's come first
            argv += ["-o", option]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}",
                 "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        user, port = host.user or self.user, host.port or self.port
        if port:
            argv += ["-p", str(port)]
        if user:
            argv += ["-l", user]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        return [*argv, "--", host.address, command]  # after --, a host named "-o..." is still a host


@dataclass(frozen=True)
class Runtime:
    """Where the job's code runs on every host: the Python interpreter and the working directory."""

    python: str = sys.executable
    code_dir: str = field(default_factory=os.getcwd)

    def command(self, *words: str, env: dict[str, str] | None = None) -> str:
        """A shell command that runs ``python WORDS`` in the code directory (each word quoted), with ``env``
        (names and values that are not secret: they show in ``ps``)."""
        assignments = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
        return f"cd {shlex.quote(self.code_dir)} && {assignments}exec {shlex.quote(self.python)} " + " ".join(
            shlex.quote(w) for w in words)


@dataclass(frozen=True)
class HostProblem:
    host: Host
    message: str


_CHECK = ("import sys, varuna_core, torch; "
          "print('varuna-ok', sys.version.split()[0], torch.__version__, varuna_core.__version__)")


def check_hosts(hosts: list[Host], ssh: SSHConfig, runtime: Runtime, timeout: float = 60) -> list[HostProblem]:
    """Check every host at once: SSH reaches it, the code directory exists, the interpreter imports varuna and
    torch. Returns the problems (empty: all good), one per failing host, in host order."""

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


MAX_EVENT = 256 * 2**10  # bytes of one line of an agent's output (a worker's line is at most 64 KiB before JSON)

# The events an agent sends (see varuna_core.launch.agent) and the type of each field; anything else on its stdout is
# not an event.
_EVENTS: dict[str, dict[str, tuple[type, ...]]] = {
    "ready": {"pid": (int,), "interface": (str, type(None)), "address": (str, type(None))},
    "store": {"port": (int,)},
    "started": {"rank": (int,), "pid": (int,)},
    "log": {"rank": (int,), "line": (str,)},
    "exit": {"rank": (int,), "code": (int,)},
    "error": {"message": (str,)},
    "stopped": {},
}


def parse_event(raw: bytes) -> dict | None:
    """The event in one line of an agent's output, or None if the line is not a well-formed event: a JSON
    object whose ``event`` is a known kind, with every field of that kind present and of its type (``bool`` is
    not an ``int``), ports and ranks in range."""
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return None
    fields = _EVENTS.get(event.get("event")) if isinstance(event.get("event"), str) else None
    if fields is None:
        return None
    for name, types in fields.items():
        value = event.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            return None
    if "rank" in fields and not 0 <= event["rank"] < 2**20:
        return None
    if "port" in fields and not 0 < event["port"] < 65536:
        return None
    return event


def _lines(stream, limit: int = MAX_EVENT):
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
    """One node agent: its process (``python -m varuna_core.launch.agent`` locally, or ``ssh HOST ...``), a writer for
    its commands, and a thread that puts its events on a shared queue as ``(node, event dict)``. An agent whose
    output ends (it exited, or SSH lost the host) yields ``{"event": "gone", "code": ...}``."""

    def __init__(self, node: int, host: Host, spec: dict, events: "queue.Queue[tuple[int, dict]]",
                 runtime: Runtime, ssh: SSHConfig | None) -> None:
        self.node, self.host = node, host
        # the job id marks every process of the job (the agent's and, through the spec, the workers')
        command = runtime.command("-m", "varuna_core.launch.agent", env={JOB_ID: spec["job"]})
        if ssh is None:
            argv = ["/bin/sh", "-c", command]
        else:
            argv = ssh.argv(host, command)
        # a session of its own: a ^C in the launcher's terminal reaches the launcher only, which stops the job
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self._events = events
        self._lock = threading.Lock()
        self.stderr: list[str] = []
        self.ready: dict | None = None  # the agent's "ready" event, once it came
        self.send(spec)
        threading.Thread(target=self._read, name=f"agent{node}", daemon=True).start()
        threading.Thread(target=self._read_stderr, name=f"agent{node}-err", daemon=True).start()

    def send(self, message: dict) -> bool:
        """Write one JSON line to the agent; False if it is gone."""
        with self._lock:
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def _read(self) -> None:
        for raw in _lines(self.proc.stdout):
            event = parse_event(raw)
            if event is None:  # not ours (a shell's banner, a warning, a stray "42"): kept for diagnosis
                self.stderr.append(raw[:300].decode(errors="replace").rstrip())
                del self.stderr[:-20]
                continue
            self._events.put((self.node, event))
        self._events.put((self.node, {"event": "gone", "code": self.proc.wait()}))

    def _read_stderr(self) -> None:
        for raw in _lines(self.proc.stderr, 4096):
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.stderr.append(line)
                del self.stderr[:-20]

    def close(self) -> None:
        """Close the agent's stdin: it stops its workers (if any are left) and exits."""
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        """Kill the local end (the agent itself, or the ssh client: the remote agent then sees its stdin close)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
