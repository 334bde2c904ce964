"""The fork server: one pre-imported interpreter per job and host that forks the job's next workers.

Why: a worker spends its first ~2.5 s importing torch, ``torch.distributed``, numpy and varuna before it does
anything of its own, and node 0's agent spends ~1.2 s importing torch to host the job's store. After a sudden
loss that leaves a stage without a live copy, that start is most of the recovery (detection → first step);
in a morph it is most of the warm start. So once a job's first configuration trains, each host's agent starts
(``{"cmd": "forkserver"}``) a server that imports all of that once and then waits; every later attempt's agent
on that host asks it for its workers (and node 0's for the store host) instead of starting interpreters. An
agent starts one before its workers (``fork_now``, not under Slurm) where it has several (one import per host
instead of one per worker; without a handover, the server then leaves with that attempt) or the job hands over
(the server's import then replaces the first worker's, instead of running beside the first steps). A forked
worker begins where a fresh one would be after its imports, and behaves as a fresh one:

* its own session and process group (the agent ends it by group, as any worker; it leads them before its pid
  is told), ``PR_SET_PDEATHSIG`` to the server, and the server kills every process an agent asked for when that
  agent's connection closes — so nothing outlives the agent that owns it, as with ``subprocess``;
* the environment (with what the preloaded imports put there, as they would in the worker), argv
  (``sys.orig_argv`` too), working directory, stdin (``/dev/null``) and stdout/stderr (the agent's pipe, passed
  over the socket) of a fresh ``python SCRIPT ARGS``; ``sys.path[0]`` the script's real directory, ``__main__``
  and ``__file__`` (absolute) as the interpreter sets them; ``sys.stdin``/``stdout``/``stderr`` made as the
  interpreter made the server's (``PYTHONUNBUFFERED``, ``PYTHONIOENCODING``, ...); ``PYTHONFAULTHANDLER`` as the
  interpreter's start applies it; every signal's handler as the server's start found it (SIGINT and SIGHUP
  ignored where the agent ignores them); an uncaught exception told from the script's frames;
* fresh random states: Python's ``random``, numpy's global one and torch's default generators are reseeded from
  the OS (an unseeded fresh process would not share them with its siblings). What stays shared is
  ``str`` hashing's seed (``PYTHONHASHSEED``), the same in every worker forked by one server;
* its exit code (``-N`` for a signal, as ``subprocess`` says it) comes back to the agent over the socket.

The server is used only where that equivalence holds: it refuses a request whose interpreter or whose
import-time environment (:data:`IMPORT_TIME`: ``PYTHON*``, the thread-count variables, ``LD_*``, ...) differs
from its own, and the agent then starts that worker as before. A worker's own modules (the script and what it
imports beyond :data:`PRELOAD`) are imported in the worker, as always.

Lifetime: the server has its own session, so it outlives the agent that started it and the attempts that come
and go; it leaves when told to (the launcher's last stop: the job ends), or when no agent has been connected
for :data:`LINGER` seconds. It has one thread (it forks), and forks nothing but on an authenticated request.

Access: a Unix socket in a directory only this user can enter, at a path named by the job and host
(:func:`socket_path`); the server checks the peer's uid (``SO_PEERCRED``) and a challenge answered with the
job's token (HMAC), and reads every message with a size limit (``SOCK_SEQPACKET``: one JSON object per message,
file descriptors beside it). A message that is not a valid request closes that connection, never the server.

Memory: one interpreter with torch imported per host and job (~0.3-0.4 GB resident, shared copy-on-write with
the workers it forks). What its imports made is frozen out of the garbage collector (``gc.freeze``) before it forks:
otherwise a worker's first collection walks all of it and writes to every object's header, which copies those pages
into each worker and costs seconds of CPU (measured: a local pp=2 run of the example GPT for 30 steps took 11.2-12.3 s
of CPU, 8.3-8.9 s frozen). This is the one thing a forked worker has that a fresh one has not: objects that are
never collected (``gc.get_freeze_count()``), the long-lived module state of its imports.
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import hmac
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "IMPORT_TIME", "LINGER", "ForkClient", "ForkedProcess", "ForkedStore", "ForkServerError",
           "socket_path", "import_environ", "start_server", "main"]

# what a worker imports before anything of its own (the facade pulls in the rest of varuna); by name, so that
# this module ties itself to none of them
PRELOAD = ("numpy", "torch", "torch.distributed", "varuna_core.varuna")
# variables that act when an interpreter starts or when the preloaded modules are imported: a worker forked by
# a server started with other values would not be the worker a fresh interpreter is
IMPORT_TIME = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "GOTO_", "KMP_", "GOMP_", "BLIS_", "VECLIB_",
               "NUMEXPR_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "MALLOC_", "GLIBC_",
               "VIRTUAL_ENV", "PATH", "LANG", "LC_", "TZ", "TMP", "TEMP")  # (tempfile keeps its directory)
LINGER = 60.0  # seconds the server waits for an agent when none is connected
MAX_MESSAGE = 192 * 1024  # one request's JSON (argv and environment); a bigger one is refused by the agent
MAX_FDS = 2
MAX_ERROR = 1000  # characters of a refusal's reason (it may quote the request): every reply fits a message
READY_TIMEOUT = 120.0  # seconds an agent waits for a server it started to listen (its imports included)
READY_CHILD = 10.0  # seconds the server waits for a child it forked to lead its own process group
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_CHALLENGE = b"varuna-fork-server-v1\0"
_PER_RANK = ("RANK", "LOCAL_RANK", "GROUP_RANK")


class ForkServerError(Exception):
    """The fork server cannot serve this request (the agent starts the worker itself); one line."""


def socket_path(job: str, host: str) -> Path:
    """Where the server of ``job`` on ``host`` listens: a 0700 directory of this user's under the temporary
    directory. The host is in the name because test hosts (and hosts sharing ``/tmp`` over a network file
    system) may share the directory while each must fork in its own namespaces."""
    digest = hashlib.sha256(f"{job}\0{host}".encode()).hexdigest()[:24]
    return _private_dir() / f"fork-{digest}.sock"


def _private_dir() -> Path:
    base = Path(tempfile.gettempdir()) / f"varuna-{os.getuid()}"
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = base.lstat()
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ForkServerError(f"{base} is not a directory only this user can enter")
    return base


def import_environ(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that acts at an interpreter's start or at the preloaded imports (:data:`IMPORT_TIME`)."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(IMPORT_TIME)}


# ----------------------------------------------------------------------------------------------------------
# Messages: one JSON object per SOCK_SEQPACKET message, file descriptors beside it


def _send(sock: socket.socket, message: Mapping[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ForkServerError(f"a message of {len(data)} bytes is over the fork server's {MAX_MESSAGE}")
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it; None when the peer closed. Raises ValueError for
    anything that is not one JSON object within the limits (the descriptors that came with it are closed)."""
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds += list(got)
    try:
        if not data and not fds:
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise ValueError("a message over the limits")
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("a message that is not an object")
    except (ValueError, RecursionError) as exc:
        for fd in fds:
            os.close(fd)
        raise ValueError(str(exc)[:200]) from None
    return message, fds


# ----------------------------------------------------------------------------------------------------------
# The server


@dataclass
class _Conn:
    sock: socket.socket
    nonce: bytes
    authed: bool = False
    children: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Order:
    """What a forked child is to become: ``kind`` "worker" (argv, env, cwd; fds: stdout) or "store" (host, timeout;
    fds: the listening socket, the control socket)."""

    kind: str
    fds: list[int]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    name: str | None = None
    host: str = ""
    timeout: float = 600.0


def _check_worker(message: dict[str, Any], fds: list[int], python: str, imports: dict[str, str]) -> _Order:
    argv, env, cwd, name = message.get("argv"), message.get("env"), message.get("cwd"), message.get("name")
    if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) and "\0" not in a for a in argv)):
        raise ForkServerError("argv must be [python, script, args...] of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) and "=" not in k
                                          and "\0" not in k + v and k for k, v in env.items())):
        raise ForkServerError("env must map names to strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ForkServerError("cwd must be a string")
    if name is not None and not isinstance(name, str):
        raise ForkServerError("name must be a string")
    if len(fds) != 1:
        raise ForkServerError("a worker needs exactly one descriptor: its output")
    if argv[0] != python:
        raise ForkServerError(f"this server runs {python}, not {argv[0]}")
    if not argv[1].endswith(".py"):
        raise ForkServerError("only a .py script can be forked")
    differ = sorted(set(import_environ(env).items()) ^ set(imports.items()))
    if differ:
        raise ForkServerError(f"the import-time environment differs ({', '.join(sorted({k for k, _ in differ}))})")
    return _Order("worker", fds, argv=argv, env=env, cwd=cwd, name=name)


def _check_store(message: dict[str, Any], fds: list[int]) -> _Order:
    host, timeout = message.get("host"), message.get("timeout", 600.0)
    if not isinstance(host, str) or not host or len(host) > 256:
        raise ForkServerError("host must be a name")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 1 <= timeout <= 86400:
        raise ForkServerError("timeout must be 1 to 86400 seconds")
    if len(fds) != 2:
        raise ForkServerError("a store needs two descriptors: its listening socket and its control socket")
    return _Order("store", fds, host=host, timeout=float(timeout))


class _Server:
    """The server's loop: one thread, a selector over the listening socket, the agents' connections and a wakeup
    pipe for SIGCHLD. :meth:`serve` returns only in a forked child, with what that child is to become."""

    def __init__(self, listener: socket.socket, token: str, python: str, imports: dict[str, str],
                 linger: float = LINGER, dispositions: dict[int, Any] | None = None) -> None:
        self.listener, self.key, self.python, self.imports = listener, token.encode(), python, imports
        self.linger = linger
        # every signal's handler as the interpreter's start left them (SIGINT and SIGHUP ignored when the agent
        # that started the server ignores them, as the workers it starts then do): what a forked child gets back
        self.dispositions = dispositions if dispositions is not None else _dispositions()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.owner: dict[int, _Conn] = {}  # child pid -> the connection that asked for it
        self.wake_r, self.wake_w = socket.socketpair()
        self.idle_since: float | None = time.monotonic()
        self.done = False
        self.pid = os.getpid()

    def serve(self) -> _Order | None:
        for s in (self.listener, self.wake_r, self.wake_w):
            s.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "done", True))
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        while not self.done:
            for key, _ in self.sel.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wake_r:
                    try:
                        while self.wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    order = self._message(self.conns[key.fd])
                    if order is not None:
                        return order
            self._reap()
            if self.conns or self.owner:
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = time.monotonic()
            elif time.monotonic() - self.idle_since > self.linger:
                self.done = True
        self._close()
        return None

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # (none waiting, or out of descriptors: it stays queued until there is room)
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            sock.close()
            return
        sock.setblocking(True)
        sock.settimeout(5.0)  # a reply to a stalled agent must not stall every other one
        conn = _Conn(sock, secrets.token_bytes(32))
        try:
            _send(sock, {"challenge": conn.nonce.hex(), "pid": os.getpid()})
            self.sel.register(sock, selectors.EVENT_READ)
        except OSError:
            sock.close()
            return
        self.conns[sock.fileno()] = conn

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn`` and kill what it asked for: its agent is gone (or spoke nonsense)."""
        self.sel.unregister(conn.sock)
        del self.conns[conn.sock.fileno()]
        conn.sock.close()
        for pid in conn.children:
            _killpg(pid, signal.SIGKILL)

    def _message(self, conn: _Conn) -> _Order | None:
        try:
            got = _recv(conn.sock)
        except (ValueError, OSError):
            got = None
        if got is None:
            self._drop(conn)
            return None
        message, fds = got
        op = message.get("op")
        if not conn.authed:
            for fd in fds:
                os.close(fd)
            mac = message.get("mac")
            want = hmac.new(self.key, _CHALLENGE + conn.nonce, hashlib.sha256).hexdigest()
            if op != "hello" or not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), want.encode()):
                self._drop(conn)
                return None
            conn.authed = True
            self._reply(conn, {"ok": True, "python": self.python, "imports": self.imports})
            return None
        ident = message.get("id")
        if op == "quit":
            for fd in fds:
                os.close(fd)
            self.done = True
            return None
        if op not in ("fork", "store") or not isinstance(ident, int) or isinstance(ident, bool):
            for fd in fds:
                os.close(fd)
            self._drop(conn)
            return None
        try:
            order = _check_worker(message, fds, self.python, self.imports) if op == "fork" else \
                _check_store(message, fds)
        except ForkServerError as exc:
            for fd in fds:
                os.close(fd)
            self._reply(conn, {"id": ident, "error": str(exc)[:MAX_ERROR]})
            return None
        try:
            pid, ready_r, ready_w = _fork()
        except OSError as exc:  # (out of descriptors or processes: this request fails, the server goes on)
            for fd in fds:
                os.close(fd)
            self._reply(conn, {"id": ident, "error": f"the fork server cannot fork now ({exc.strerror or exc})"})
            return None
        if pid == 0:
            os.close(ready_r)
            self._in_child(order, ready_w)
            return order
        os.close(ready_w)
        # the child leads its own process group before its pid is told to anyone, so that ending it by group (as
        # the agent and _drop do) cannot miss it; it closes the pipe's end when it does (or when it dies)
        _wait_closed(ready_r, READY_CHILD)
        for fd in fds:
            os.close(fd)
        conn.children.add(pid)
        self.owner[pid] = conn
        self._reply(conn, {"id": ident, "pid": pid})
        return None

    def _reply(self, conn: _Conn, message: dict[str, Any]) -> None:
        """Answer ``conn``; a reply that cannot go (the agent is gone or stalled, or the reply is over the size
        limit) closes that connection, never the server."""
        try:
            _send(conn.sock, message)
        except (OSError, ForkServerError):
            self._drop(conn)

    def _reap(self) -> None:
        while self.owner:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.owner.pop(pid, None)
            if conn is not None and conn.sock.fileno() in self.conns:
                conn.children.discard(pid)
                self._reply(conn, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _in_child(self, order: _Order, ready: int) -> None:
        """In a forked child: its own session and process group, dying with the server (then the server may go on:
        ``ready`` is closed); leave nothing of the server open but what the order needs."""
        os.setsid()
        _die_with_parent(self.pid)
        os.close(ready)
        signal.set_wakeup_fd(-1)
        for sig, handler in self.dispositions.items():  # (as the interpreter's start left them)
            if handler is not None and signal.getsignal(sig) != handler:
                signal.signal(sig, handler)
        self.sel.close()
        for conn in self.conns.values():
            conn.sock.close()
        for s in (self.listener, self.wake_r, self.wake_w):
            s.close()

    def _close(self) -> None:
        for conn in list(self.conns.values()):
            self._drop(conn)
        for pid in list(self.owner):
            _killpg(pid, signal.SIGKILL)
        self.sel.close()
        self.listener.close()


def _killpg(pid: int, sig: int) -> None:
    """Signal the process group ``pid`` leads, or the process alone if it leads none (it did not get that far)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    except PermissionError:
        pass


def _fork() -> tuple[int, int, int]:
    """``os.fork()`` with a pipe the child closes once it leads its own process group: the pid and the pipe."""
    ready_r, ready_w = os.pipe()
    try:
        return os.fork(), ready_r, ready_w
    except OSError:
        os.close(ready_r)
        os.close(ready_w)
        raise


def _wait_closed(fd: int, timeout: float) -> None:
    """Wait until the other end of the pipe ``fd`` reads from is closed (at most ``timeout`` seconds); close it."""
    import select

    try:
        if select.select([fd], [], [], timeout)[0]:
            os.read(fd, 1)
    finally:
        os.close(fd)


def _dispositions() -> dict[int, Any]:
    """Every signal's handler now (None where Python does not know it)."""
    return {sig: signal.getsignal(sig) for sig in signal.valid_signals()}


def _die_with_parent(parent: int) -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the server died between the fork and the prctl
        os._exit(137)


def _set_name(name: str) -> None:
    """The process's name (``comm``: what ``top`` and ``ps -o comm`` show), at most 15 bytes."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become_worker(order: _Order, changes: Mapping[str, tuple[str | None, str | None]]) -> None:
    """Turn this forked child into ``python SCRIPT ARGS`` (see the module's docstring) and run the script as
    ``__main__``; returns when the script does (the interpreter then exits as a fresh one would)."""
    import faulthandler
    import random

    out = order.fds[0]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(_after_imports(order.env, changes))
    if order.cwd:
        os.chdir(order.cwd)
    if order.name:
        _set_name(order.name)
    _new_stdio()
    if order.env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    _run_script(order.argv)


def _after_imports(env: Mapping[str, str], changes: Mapping[str, tuple[str | None, str | None]]) -> dict[str, str]:
    """``env`` as the preloaded modules' imports leave it in a fresh interpreter (torch's sets
    ``TORCHINDUCTOR_CACHE_DIR``): each change they made to the server's environment (``key: (before, after)``, None
    for absent), where ``env`` had the value the server had before them."""
    result = dict(env)
    for key, (was, now) in changes.items():
        if result.get(key) == was:
            if now is None:
                result.pop(key, None)
            else:
                result[key] = now
    return result


def _new_stdio() -> None:
    """``sys.stdin``, ``stdout`` and ``stderr`` (and their ``__originals__``) new on descriptors 0 to 2, made as the
    interpreter's start made the server's own: buffered or not, encoding, error handler, line buffering, names and
    modes alike (the server's ``PYTHON*`` variables are the worker's, and its streams were pipes as the worker's
    are)."""
    import io

    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, f"__{name}__")
        buffered = not isinstance(old.buffer, io.RawIOBase)
        # (never closed: the interpreter's own, as the server's were; Any: the interpreter sets names and modes
        # that the type checker takes for read-only properties)
        buffer: Any = open(fd, "wb" if fd else "rb", buffering=-1 if buffered else 0, closefd=False)  # noqa: SIM115
        (buffer.raw if buffered else buffer).name = (old.buffer.raw if buffered else old.buffer).name
        stream: Any = io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors, newline="\n",
                                       line_buffering=old.line_buffering, write_through=old.write_through)
        stream.mode = old.mode
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_script(argv: list[str]) -> None:
    """Run ``argv[1]`` as the interpreter's start runs ``python SCRIPT ARGS``: in a new ``__main__`` module that
    stays ``sys.modules["__main__"]``, whose ``__file__`` is the script's absolute path (``sys.argv[0]`` as given),
    ``sys.path[0]`` its real directory, compiled without this module's ``__future__`` flags. An uncaught exception
    is told from the script's frames on (a SyntaxError in it without any) and ends the process with 1, a
    KeyboardInterrupt with SIGINT; a script that cannot be read ends it with 2."""
    import builtins
    import importlib.machinery
    import io
    import types

    script = argv[1]
    path = os.path.abspath(script)
    sys.argv = argv[1:]
    sys.orig_argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        with io.open_code(path) as file:
            source = file.read()
    except OSError as exc:
        sys.stderr.write(f"{argv[0]}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __annotations__={},
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    try:
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # (told as a fresh interpreter tells it)
        here = exc.__traceback__
        tb = here.tb_next if here is not None else None  # (the first frame is this function's)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # leaves by SIGINT once the interpreter is torn down
            sys.excepthook = lambda *_: None
            raise
        raise SystemExit(1) from None


def _become_store(order: _Order) -> None:
    """Host the job's TCPStore on the agent's listening socket; put what the agent sends on its control socket
    into it (``{"key", "value"}``, answered ``{"ok"}``); leave when the agent closes it."""
    import datetime

    import torch.distributed as dist

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    listen, control = order.fds
    listening = socket.socket(fileno=listen)
    store = dist.TCPStore(order.host, listening.getsockname()[1], 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=order.timeout), master_listen_fd=listen)
    ctl = socket.socket(fileno=control)
    ctl.setblocking(True)
    while True:
        try:
            got = _recv(ctl)
        except (ValueError, OSError):
            break
        if got is None:
            break
        message, fds = got
        for fd in fds:
            os.close(fd)
        key, value = message.get("key"), message.get("value")
        if isinstance(key, str) and isinstance(value, str):
            store.set(key, value)
            _send(ctl, {"ok": True})
        else:
            _send(ctl, {"ok": False})
    os._exit(0)


def main() -> None:
    """``python -m varuna_core.launch.forkserver SOCKET [--linger S] [--preload M,M...] -- PYTHON SCRIPT ...``
    (the job's command line: what the server forks, and what ``ps`` shows); the job's token on the first stdin
    line. Prints ``listening`` when it serves."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m varuna_core.launch.forkserver")
    parser.add_argument("socket", type=Path)
    parser.add_argument("--linger", type=float, default=LINGER)
    parser.add_argument("--preload", default=",".join(PRELOAD))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, job = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if not job or not 0 < args.linger <= 86400:
        parser.error("the job's command line (-- PYTHON SCRIPT ...) and a linger of (0, 86400] s are needed")
    path, python = args.socket, job[0]
    token = sys.stdin.readline(4096).strip()
    if not token:
        parser.error("no job token on stdin")
    dispositions = _dispositions()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import importlib

    before = dict(os.environ)
    imports = import_environ(before)  # (before the imports: torch puts variables of its own there)
    for name in filter(None, args.preload.split(",")):
        importlib.import_module(name)
    # What the imports made lives as long as the server: out of the garbage collector's reach from now on (what
    # gc.freeze is for, before a fork without exec). A worker's collections (``Varuna`` collects at its start) would
    # otherwise walk the ~300k objects it inherits and write to each one's header, copying the server's heap into
    # every worker; frozen, they are skipped, and what the worker makes itself is collected as in a fresh process.
    gc.collect()
    gc.freeze()
    changes = {k: (before.get(k), os.environ.get(k))  # what the imports did to the environment (see _after_imports)
               for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)}
    listener = _bind(path)
    if listener is None:
        return  # another server of this job already listens there
    server = _Server(listener, token, python, imports, linger=args.linger, dispositions=dispositions)
    sys.stdout.write("listening\n")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the agent that started us may be gone any time: nothing may block on its pipes
        os.dup2(null, fd)
    os.close(null)
    me = os.getpid()
    try:
        order = server.serve()
    finally:
        if os.getpid() == me:  # (a forked child returns here too, and leaves the socket to the server)
            try:
                path.unlink()
            except OSError:
                pass
    if order is None:
        os._exit(0)  # (no teardown of torch's modules: the agent waits for this process to be gone)
    if order.kind == "store":
        _become_store(order)
    else:
        _become_worker(order, changes)


def _bind(path: Path) -> socket.socket | None:
    """A listening socket at ``path``; None if a live server already answers there (a stale file is replaced)."""
    import fcntl

    # one lock for the directory (held for the bind only), not one file per job and host left behind by each
    with open(path.parent / "fork.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(path))
            return None
        except OSError:
            pass
        finally:
            probe.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        _sweep(path.parent)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o077)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.listen(64)
        return sock


def _sweep(directory: Path) -> None:
    """Remove the sockets of servers that are gone (killed, or lost with their host's memory) from ``directory``
    (under its lock): nothing listens on them, and nothing would ever remove them."""
    for stale in directory.glob("fork-*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(1.0)
        try:
            probe.connect(str(stale))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                stale.unlink()
        except OSError:
            pass
        finally:
            probe.close()


# ----------------------------------------------------------------------------------------------------------
# The agent's side


class ForkedProcess:
    """A worker the server forked, as much of :class:`subprocess.Popen` as the agent uses: ``pid``, ``stdout``
    (the read end of its output pipe), ``poll``, ``wait``, ``returncode``."""

    def __init__(self, pid: int, stdout: Any, argv: list[str]) -> None:
        self.pid, self.stdout, self.args = pid, stdout, argv
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkedStore:
    """The job's store, hosted by a child of the server; :meth:`set` puts a key into it."""

    def __init__(self, pid: int, control: socket.socket) -> None:
        self.pid, self.control = pid, control
        self._lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self._lock:
            _send(self.control, {"key": key, "value": value})
            got = _recv(self.control)
        if got is None or not got[0].get("ok"):
            raise ForkServerError("the store host did not take the key")

    def close(self) -> None:
        self.control.close()


class ForkClient:
    """An agent's connection to its host's fork server. Requests are answered in order; the exit codes of the
    workers it forked arrive on the same connection, read by :meth:`start_reader`'s thread once every worker is
    started (before that, by the requests themselves: the agent starts its workers before any thread exists)."""

    def __init__(self, sock: socket.socket, pid: int, python: str, imports: dict[str, str]) -> None:
        self.sock, self.pid, self.python, self.imports = sock, pid, python, imports
        self.procs: dict[int, ForkedProcess] = {}
        self._next = 0
        self._reader: threading.Thread | None = None
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.closed = False
        # exit reports that came before their worker was filed (the reader's thread can read a worker's exit
        # between the reply with its pid and spawn's filing of it), and the lock that orders the two
        self._early: dict[int, int] = {}
        self._lock = threading.Lock()
        self.server: subprocess.Popen[bytes] | None = None  # the server, if this client started it unreaped

    @classmethod
    def connect(cls, path: Path, token: str, timeout: float = 5.0) -> ForkClient | None:
        """Connect and authenticate; None when no server listens at ``path``. Raises ForkServerError when one
        answers but refuses."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            return None
        try:
            hello = _recv(sock)
            if hello is None or not isinstance(hello[0].get("challenge"), str):
                raise ForkServerError("the fork server sent no challenge")
            nonce = bytes.fromhex(hello[0]["challenge"])
            mac = hmac.new(token.encode(), _CHALLENGE + nonce, hashlib.sha256).hexdigest()
            _send(sock, {"op": "hello", "mac": mac})
            got = _recv(sock)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ForkServerError(f"the fork server did not answer ({exc})") from None
        if got is None or not got[0].get("ok"):
            sock.close()
            raise ForkServerError("the fork server refused this job's token")
        info = got[0]
        sock.settimeout(None)
        got_imports = info.get("imports")
        imports = {str(k): str(v) for k, v in got_imports.items()} if isinstance(got_imports, dict) else {}
        return cls(sock, int(hello[0].get("pid") or 0), str(info.get("python")), imports)

    def usable_for(self, argv: list[str], env: Mapping[str, str]) -> str | None:
        """Why the server cannot fork ``argv`` with ``env`` (None: it can)."""
        if argv[0] != self.python or len(argv) < 2 or not argv[1].endswith(".py"):
            return f"it runs {self.python}, the workers {' '.join(argv[:2])}"
        differ = sorted({k for k, _ in set(import_environ(env).items()) ^ set(self.imports.items())})
        return f"the import-time environment differs ({', '.join(differ)})" if differ else None

    def _request(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        ident = self._next = self._next + 1
        _send(self.sock, {**message, "id": ident}, fds)
        if self._reader is not None:
            with self._cond:
                if not self._cond.wait_for(lambda: ident in self._replies or self.closed, timeout=30):
                    raise ForkServerError("the fork server did not answer within 30 s")
                if ident not in self._replies:
                    raise ForkServerError("the fork server is gone")
                return self._replies.pop(ident)
        while True:
            got = _recv(self.sock)
            if got is None:
                raise ForkServerError("the fork server is gone")
            if self._take(got[0]) == ident:
                return got[0]

    def _take(self, message: dict[str, Any]) -> int | None:
        """File an exit report; the id of a reply."""
        if "exit" in message:
            pid, code = message["exit"], message.get("code")
            if isinstance(pid, int) and isinstance(code, int):
                with self._lock:
                    proc = self.procs.get(pid)
                    if proc is None:
                        self._early[pid] = code
                if proc is not None:
                    proc._exited(code)
            return None
        return message.get("id") if isinstance(message.get("id"), int) else None

    def spawn(self, argv: list[str], env: Mapping[str, str], cwd: str | None, name: str | None) -> ForkedProcess:
        """Fork a worker running ``argv`` (``[python, script, args...]``) with ``env`` in ``cwd``; its output (stdout
        and stderr) on a new pipe, whose read end is the result's ``stdout``."""
        r, w = os.pipe()
        try:
            reply = self._request({"op": "fork", "argv": argv, "env": dict(env), "cwd": cwd, "name": name}, [w])
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        if "pid" not in reply:
            os.close(r)
            raise ForkServerError(str(reply.get("error", "refused"))[:300])
        proc = ForkedProcess(int(reply["pid"]), os.fdopen(r, "rb"), argv)
        with self._lock:
            self.procs[proc.pid] = proc
            code = self._early.pop(proc.pid, None)
            if code is None and self.closed:  # (the reader has told every worker filed before it ended)
                code = -signal.SIGKILL
        if code is not None:
            proc._exited(code)
        return proc

    def store(self, listening: socket.socket, host: str, timeout: float) -> ForkedStore:
        """A child hosting the job's TCPStore on ``listening``."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            reply = self._request({"op": "store", "host": host, "timeout": timeout},
                                  [listening.fileno(), theirs.fileno()])
        finally:
            theirs.close()
        if "pid" not in reply:
            mine.close()
            raise ForkServerError(str(reply.get("error", "refused"))[:300])
        return ForkedStore(int(reply["pid"]), mine)

    def start_reader(self) -> None:
        """From now on a thread reads the exit reports (and the replies to later requests)."""

        def read() -> None:
            while True:
                try:
                    got = _recv(self.sock)
                except (OSError, ValueError):
                    got = None
                if got is None:
                    break
                ident = self._take(got[0])
                if ident is not None:
                    with self._cond:
                        self._replies[ident] = got[0]
                        self._cond.notify_all()
            with self._cond:
                self.closed = True
                self._cond.notify_all()
            with self._lock:
                procs = list(self.procs.values())
            for proc in procs:  # the server's children die with it (PR_SET_PDEATHSIG)
                proc._exited(-signal.SIGKILL)

        self._reader = threading.Thread(target=read, name="forkserver", daemon=True)
        self._reader.start()
        if self.server is not None:  # started with reap=False: reap it whenever it leaves
            threading.Thread(target=self.server.wait, daemon=True).start()

    def quit(self, wait: float = 5.0) -> None:
        """Tell the server to leave (the job ends), and wait up to ``wait`` seconds until it is gone."""
        try:
            _send(self.sock, {"op": "quit"})
        except OSError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.01)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def start_server(path: Path, token: str, argv: list[str], env: Mapping[str, str], cwd: str | None,
                 timeout: float = READY_TIMEOUT, *, linger: float = LINGER,
                 preload: tuple[str, ...] = PRELOAD, reap: bool = True) -> ForkClient:
    """Start this job's server on this host (unless one already listens at ``path``) and connect to it. The
    server is started with the workers' interpreter (``argv[0]``) and environment ``env``, in its own session.
    ``reap``: a thread waits for it to leave; without, the caller starts :meth:`ForkClient.start_reader`, which
    does (a caller that may still start a subprocess with ``preexec_fn`` must have no thread yet).

    Raises:
        ForkServerError: it did not come up (its last words say why).
    """
    client = ForkClient.connect(path, token)
    if client is not None:
        return client
    proc = subprocess.Popen([argv[0], "-m", "varuna_core.launch.forkserver", str(path), "--linger", str(linger),
                             "--preload", ",".join(preload), "--", *argv],
                            env=dict(env), cwd=cwd or None, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.close()
    except OSError:
        pass
    import select

    # "listening", or end of file once it exited (another server may have been quicker)
    if select.select([proc.stdout], [], [], timeout)[0]:
        proc.stdout.readline()
    client = ForkClient.connect(path, token)
    if client is None:
        proc.kill()
        last = proc.stderr.read(4000).decode(errors="replace").strip().splitlines()
        raise ForkServerError(f"the fork server did not start: {last[-1] if last else 'no reason given'}")
    client.server = proc
    if reap:
        threading.Thread(target=proc.wait, daemon=True).start()  # reap it whenever it leaves
    return client


if __name__ == "__main__":
    main()
