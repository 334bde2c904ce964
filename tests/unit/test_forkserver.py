"""The fork server (launch/forkserver.py): a worker it forks is the worker a fresh ``python SCRIPT ARGS`` would be
(compared side by side with one started by subprocess), it reports exit codes as subprocess does, it refuses what
it cannot fork the same, hostile input on its socket closes one connection and never the server, nothing it forks
outlives its owner, and it hosts the job's store.

Servers here preload ``json`` only (fast), but for one per module that preloads numpy and torch."""

from __future__ import annotations

import array
import contextlib
import datetime
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from varuna_core.launch import forkserver
from varuna_core.launch.forkserver import (
    MAX_MESSAGE,
    ForkClient,
    ForkedProcess,
    ForkServerError,
    socket_path,
    start_server,
)

pytestmark = pytest.mark.timeout(120)

PYTHON = sys.executable
TOKEN = "token-" + uuid.uuid4().hex
DEADLINE = 30.0  # seconds a guarantee may take to show on a loaded machine (never a timing under test)


def _env(**extra: str | None) -> dict[str, str]:
    """The workers' environment (and their server's): this process's, less pytest's own, with ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["OMP_NUM_THREADS"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _job() -> str:
    return f"forkserver-test-{uuid.uuid4().hex}"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    return fields[:1] != ["Z"]


def _wait_gone(pid: int, timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _until(check, timeout: float = DEADLINE) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a server names its socket there)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline and _alive(int(entry)):
                found.append(int(entry))
    return found


class Servers:
    """The servers one test starts; none is left running after it (each is told to quit, then killed)."""

    def __init__(self) -> None:
        self.started: list[tuple[ForkClient, Path]] = []

    def start(self, env: dict[str, str] | None = None, *, linger: float = 30.0, preload: tuple[str, ...] = ("json",),
              path: Path | None = None, cwd: str | None = None, reader: bool = True,
              reap: bool = True) -> tuple[ForkClient, Path]:
        path = path or socket_path(_job(), "host-a")
        client = start_server(path, TOKEN, [PYTHON, "train.py"], env or _env(), cwd, linger=linger, preload=preload,
                              reap=reap)
        self.started.append((client, path))
        if reader:
            client.start_reader()
        return client, path

    def close(self) -> None:
        for client, _ in self.started:
            with contextlib.suppress(OSError):
                client.quit()
            client.close()
        for client, path in self.started:
            if not _wait_gone(client.pid, 10):
                os.kill(client.pid, signal.SIGKILL)
                pytest.fail(f"the fork server {client.pid} at {path} did not leave when told to")


PRIVATE_DIR = forkserver._private_dir


@pytest.fixture(scope="module", autouse=True)
def _temporary_directory() -> Iterator[None]:
    """The servers' sockets and their lock in a directory of this module's, not in this user's shared one; a short
    path, as a socket's must be. (Not by moving the temporary directory: pytest's own would follow it here and be
    removed under the next module's tests.)"""
    base = tempfile.mkdtemp(prefix="vfs-", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(forkserver, "_private_dir", lambda: Path(base))
        yield
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[Servers]:
    made = Servers()
    yield made
    made.close()


@pytest.fixture(scope="module")
def torch_server() -> Iterator[Path]:
    """A server that preloads numpy and torch (as a job's does), shared by this module's tests; each test connects
    to it on its own (what a connection asked for ends with it)."""
    path = socket_path(_job(), "torch-host")
    client = start_server(path, TOKEN, [PYTHON, "train.py"], _env(), None, linger=60, preload=("numpy", "torch"))
    yield path
    client.quit()
    client.close()
    assert _wait_gone(client.pid, 10)
    assert not path.exists()


def _connect(path: Path) -> ForkClient:
    client = ForkClient.connect(path, TOKEN)
    assert client is not None
    client.start_reader()
    return client


def _script(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(body)
    return path


def _forked(client: ForkClient, argv: list[str], env: dict[str, str], cwd: Path | str | None = None,
            timeout: float = 60) -> tuple[str, int]:
    """Run ``argv`` forked by ``client``'s server: its output (stdout and stderr) and exit code."""
    proc = client.spawn(argv, env, str(cwd) if cwd else None, None)
    assert proc.stdout is not None
    out = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    return out, proc.wait(timeout)


def _fresh(argv: list[str], env: dict[str, str], cwd: Path | str | None = None, timeout: float = 60) -> tuple[str, int]:
    """Run ``argv`` as the agent starts a worker without a fork server: its output and exit code."""
    done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True, timeout=timeout)
    return done.stdout.decode(errors="replace"), done.returncode


# ----------------------------------------------------------------------------------------------------------
# A forked worker is a fresh interpreter

PROBE = r'''"""The probe's docstring."""
import faulthandler, json, os, signal, sys, warnings

def annotated(x: int) -> None:
    pass

def stream(name):
    s = getattr(sys, name)
    return {"buffer": type(s.buffer).__name__, "name": s.name, "mode": s.mode, "encoding": s.encoding,
            "errors": s.errors, "line_buffering": s.line_buffering, "write_through": s.write_through,
            "fileno": s.fileno(), "original": getattr(sys, "__%s__" % name) is s}

SIGNALS = ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXFSZ", "SIGALRM")
report = {
    "argv": sys.argv, "orig_argv": sys.orig_argv, "executable": sys.executable, "path": sys.path,
    "cwd": os.getcwd(), "name": __name__, "file": __file__, "package": __package__,
    "main": sys.modules["__main__"].__dict__ is globals(), "globals": sorted(globals()), "doc": __doc__,
    "loader": type(__loader__).__name__, "spec": repr(__spec__), "cached": __cached__,
    "builtins": type(__builtins__).__name__, "annotation": type(annotated.__annotations__["x"]).__name__,
    "flags": str(sys.flags), "warnings": [str(f) for f in warnings.filters],
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "environ": dict(os.environ), "stdin": sys.stdin.read(),
    "signals": {n: str(signal.getsignal(getattr(signal, n))) for n in SIGNALS},
    "faulthandler": faulthandler.is_enabled(),
    "streams": {n: stream(n) for n in ("stdin", "stdout", "stderr")},
}
sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
sys.stdout.flush()
print("printed, never flushed")
os._exit(0)
'''


@contextlib.contextmanager
def _ignoring(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """This process ignores ``signals`` meanwhile (as the node agent ignores SIGINT and SIGHUP): what it starts
    inherits that."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _probe_tree(tmp_path: Path) -> tuple[Path, str]:
    """The probe behind a symbolic link (``sys.path[0]`` is the real directory, ``__file__`` the given path made
    absolute): the working directory and the script's path relative to it."""
    real = _script(tmp_path / "real", "probe.py", PROBE)
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "probe.py").symlink_to(real)
    return tmp_path, "link/probe.py"


@pytest.mark.parametrize("as_agent", [False, True], ids=["plain", "as-the-agent-starts-workers"])
def test_a_forked_worker_is_the_fresh_interpreter_subprocess_starts(servers: Servers, tmp_path: Path,
                                                                    as_agent: bool) -> None:
    # as the agent: PYTHONUNBUFFERED and PYTHONFAULTHANDLER set, SIGINT and SIGHUP ignored by the parent
    env = _env(PYTHONUNBUFFERED="1" if as_agent else None, PYTHONFAULTHANDLER="1" if as_agent else None,
               RANK="3", PROBE_VALUE="a b\tc ünïcode")
    cwd, script = _probe_tree(tmp_path)
    argv = [PYTHON, script, "--flag=1", "two words", "ünï"]
    ignored = (signal.SIGINT, signal.SIGHUP) if as_agent else ()
    with _ignoring(ignored):
        client, _ = servers.start(env, cwd=str(tmp_path / "real"))  # (the server's own directory is another)
        fresh_out, fresh_code = _fresh(argv, env, cwd)
    forked_out, forked_code = _forked(client, argv, env, cwd)

    assert (fresh_code, forked_code) == (0, 0)
    fresh_lines, forked_lines = fresh_out.splitlines(), forked_out.splitlines()
    fresh, forked = json.loads(fresh_lines[0]), json.loads(forked_lines[0])
    # the environment is exactly what was passed, but for what the interpreter adds itself (the same in both)
    assert {k: v for k, v in forked["environ"].items() if k in env} == env
    assert forked["environ"] == fresh["environ"]
    assert forked["stdin"] == ""
    assert forked["name"] == "__main__" and forked["main"] and forked["session_leader"]
    assert forked["annotation"] == "type"  # (compiled without the server module's __future__ annotations)
    assert forked["file"] == str(cwd / script)
    assert forked["argv"] == argv[1:]
    assert forked["path"][0] == str(tmp_path / "real")
    assert forked["cwd"] == str(cwd)
    assert forked["faulthandler"] is as_agent
    assert forked["streams"]["stdout"]["write_through"] is as_agent
    if as_agent:  # unbuffered: a print without a flush arrives even when the process leaves by os._exit
        assert forked_lines[1:] == ["printed, never flushed"]
        assert forked["signals"]["SIGINT"] == forked["signals"]["SIGHUP"] == str(signal.SIG_IGN)
    assert forked == fresh
    assert forked_lines[1:] == fresh_lines[1:]



GC_PROBE = """
import gc, json, weakref
class Cycle:
    pass
made = Cycle()
made.self = made
ref = weakref.ref(made)
del made
gc.collect()
print(json.dumps({"frozen": gc.get_freeze_count(), "collected": ref() is None}))
"""


def test_a_forked_worker_leaves_what_the_server_imported_out_of_its_collections(servers: Servers,
                                                                               tmp_path: Path) -> None:
    """The server freezes what its imports made (``gc.freeze``) before it forks: a worker's collection neither walks
    nor copies it, and still collects the worker's own garbage; a fresh interpreter has nothing frozen."""
    script = _script(tmp_path, "gcprobe.py", GC_PROBE)
    client, _ = servers.start()
    forked_out, forked_code = _forked(client, [PYTHON, str(script)], _env())
    fresh_out, fresh_code = _fresh([PYTHON, str(script)], _env())
    assert (forked_code, fresh_code) == (0, 0), (forked_out, fresh_out)
    forked, fresh = json.loads(forked_out), json.loads(fresh_out)
    assert forked["frozen"] > 1000 and forked["collected"], forked
    assert fresh == {"frozen": 0, "collected": True}

ENV_TOUCH = '''
import os
os.environ.setdefault("PROBE_ADDED", "by the import")
os.environ["PROBE_CHANGED"] = os.path.abspath(os.environ["PROBE_CHANGED"])
os.environ.pop("PROBE_REMOVED", None)
'''

ENV_REPORT = '''
import json, os, sys
import envtouch
print(json.dumps(dict(os.environ), sort_keys=True))
'''


def test_what_the_preloaded_imports_put_in_the_environment_is_there_as_in_a_fresh_worker(servers: Servers,
                                                                                          tmp_path: Path) -> None:
    # torch's import sets TORCHINDUCTOR_CACHE_DIR (to an absolute path); a worker importing it itself has it
    _script(tmp_path / "mods", "envtouch.py", ENV_TOUCH)
    script = _script(tmp_path, "report.py", ENV_REPORT)
    env = _env(PYTHONPATH=str(tmp_path / "mods"), PROBE_CHANGED="relative", PROBE_REMOVED="x")
    client, _ = servers.start(env, cwd=str(tmp_path), preload=("json", "envtouch"))
    fresh_out, _ = _fresh([PYTHON, str(script)], env, tmp_path)
    forked_out, code = _forked(client, [PYTHON, str(script)], env, tmp_path)
    assert code == 0
    fresh, forked = json.loads(fresh_out), json.loads(forked_out)
    assert fresh["PROBE_ADDED"] == "by the import" and "PROBE_REMOVED" not in fresh
    assert forked == fresh
    # a worker that sets the variable itself keeps its own value
    own = {**env, "PROBE_ADDED": "mine"}
    forked_out, code = _forked(client, [PYTHON, str(script)], own, tmp_path)
    assert json.loads(forked_out)["PROBE_ADDED"] == "mine"


# ----------------------------------------------------------------------------------------------------------
# Exit codes and output

EXITS: dict[str, tuple[str | None, int]] = {
    "normal.py": ("print('to stdout')\nimport sys\nprint('to stderr', file=sys.stderr)\n", 0),
    "exit3.py": ("print('leaving')\nraise SystemExit(3)\n", 3),
    "raises.py": (("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n"
                   "def inner():\n    raise ValueError('boom')\ninner()\n"), 1),
    "syntax.py": ("print('never')\nx = (\n", 1),
    "interrupted.py": ("print('before')\nraise KeyboardInterrupt\n", -signal.SIGINT),
    "missing.py": (None, 2),
    "doc.py": (('"""The docstring."""\nimport sys\nprint(__doc__, __spec__, __package__, sys.argv)\n'
                'raise SystemExit("a message")\n'), 1),
}


@pytest.mark.parametrize("name", sorted(EXITS))
def test_exit_codes_and_output_are_those_of_a_fresh_interpreter(servers: Servers, tmp_path: Path, name: str) -> None:
    body, code = EXITS[name]
    (tmp_path / "scripts").mkdir()
    if body is not None:
        _script(tmp_path / "scripts", name, body)
    env = _env(PYTHONUNBUFFERED="1")  # (stdout and stderr interleave in one order)
    client, _ = servers.start(env)
    argv = [PYTHON, f"scripts/{name}"]
    fresh_out, fresh_code = _fresh(argv, env, tmp_path)
    forked_out, forked_code = _forked(client, argv, env, tmp_path)
    assert fresh_code == code
    assert forked_code == code
    assert "forkserver" not in forked_out and "runpy" not in forked_out
    assert forked_out == fresh_out
    if name == "raises.py":  # both streams arrive; the traceback starts at the script
        lines = forked_out.splitlines()
        assert lines[:3] == ["to stdout", "to stderr", "Traceback (most recent call last):"]
        assert lines[3].startswith(f'  File "{tmp_path / "scripts" / name}", line 6, in <module>')
        assert lines[-1] == "ValueError: boom"


def test_a_worker_killed_by_a_signal_reports_it_as_subprocess_does(servers: Servers, tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    client, _ = servers.start()
    proc = client.spawn([PYTHON, str(script)], _env(), None, None)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"up\n"
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(DEADLINE) == -signal.SIGKILL
    assert proc.stdout.read() == b""
    proc.stdout.close()


class _FiledLate(ForkedProcess):
    """A worker that spawn files only once it has exited and its exit report has had time to be read (the order
    a loaded machine may give the reader's thread and spawn)."""

    def __init__(self, pid: int, stdout: object, argv: list[str]) -> None:
        assert _wait_gone(pid)
        time.sleep(0.5)
        super().__init__(pid, stdout, argv)


def test_an_exit_reported_before_spawn_filed_its_worker_is_kept(servers: Servers, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(tmp_path, "quick.py", "raise SystemExit(7)\n")
    client, _ = servers.start()  # (its reader runs)
    monkeypatch.setattr(forkserver, "ForkedProcess", _FiledLate)
    proc = client.spawn([PYTHON, str(script)], _env(), None, None)
    assert proc.wait(DEADLINE) == 7
    assert proc.stdout is not None
    proc.stdout.close()


# ----------------------------------------------------------------------------------------------------------
# Fresh random states

RANDOMS = '''
import json, random, numpy, torch
print(json.dumps({"random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(1).item(),
                  "torch_seed": torch.initial_seed()}))
'''


def test_siblings_draw_different_random_numbers(torch_server: Path, tmp_path: Path) -> None:
    # the server imported numpy and torch and drew nothing: without reseeding, its children would share its states
    script = _script(tmp_path, "randoms.py", RANDOMS)
    client = _connect(torch_server)
    try:
        draws = []
        for _ in range(2):
            out, code = _forked(client, [PYTHON, str(script)], _env())
            assert code == 0, out
            draws.append(json.loads(out))
    finally:
        client.close()
    first, second = draws
    for source in ("random", "numpy", "torch", "torch_seed"):
        assert first[source] != second[source], source


# ----------------------------------------------------------------------------------------------------------
# Refusals


def test_a_request_the_server_cannot_fork_as_a_fresh_interpreter_is_refused_and_the_server_serves_on(
        servers: Servers, tmp_path: Path) -> None:
    script = str(_script(tmp_path, "ok.py", "print('ok')\n"))
    client, _ = servers.start()
    fds_before = len(os.listdir("/proc/self/fd"))
    refused = [
        ([sys.executable + "-other", script], _env(), "runs"),
        ([PYTHON, str(tmp_path / "run.sh")], _env(), "only a .py script"),
        ([PYTHON, script], _env(OMP_NUM_THREADS="7"), "OMP_NUM_THREADS"),
        ([PYTHON, script], _env(PYTHONHASHSEED="12"), "PYTHONHASHSEED"),
    ]
    for argv, env, says in refused:
        why = client.usable_for(argv, env)
        assert why is not None
        with pytest.raises(ForkServerError) as caught:
            client.spawn(argv, env, None, None)
        assert says in str(caught.value)
        assert says in why or argv[0] in why or argv[1] in why
    assert len(os.listdir("/proc/self/fd")) == fds_before  # (the refused requests' pipes are closed)
    assert client.usable_for([PYTHON, script], _env()) is None
    assert _forked(client, [PYTHON, script], _env()) == ("ok\n", 0)


# ----------------------------------------------------------------------------------------------------------
# Hostile input on the socket


def _raw(path: Path) -> tuple[socket.socket, bytes]:
    """A connection to the server that speaks for itself: the socket and the server's challenge."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(DEADLINE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sock.connect(str(path))
    hello = json.loads(sock.recv(MAX_MESSAGE + 1))
    return sock, bytes.fromhex(hello["challenge"])


def _mac(nonce: bytes, token: str = TOKEN) -> str:
    return hmac.new(token.encode(), forkserver._CHALLENGE + nonce, hashlib.sha256).hexdigest()


def _authed(path: Path) -> socket.socket:
    sock, nonce = _raw(path)
    _send_raw(sock, {"op": "hello", "mac": _mac(nonce)})
    assert json.loads(sock.recv(MAX_MESSAGE + 1))["ok"] is True
    return sock


def _send_raw(sock: socket.socket, message: object, fds: list[int] | None = None, *, ascii_only: bool = True) -> None:
    data = message if isinstance(message, bytes) else json.dumps(message, ensure_ascii=ascii_only).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection (rather than answering on it)."""
    try:
        return sock.recv(MAX_MESSAGE + 1) == b""
    except ConnectionResetError:
        return True


def _serves(path: Path, tmp_path: Path) -> None:
    """A good client still gets a worker."""
    client = _connect(path)
    try:
        script = _script(tmp_path, "alive.py", "print('alive')\n")
        assert _forked(client, [PYTHON, str(script)], _env()) == ("alive\n", 0)
    finally:
        client.close()


def _fork_request(**fields: object) -> dict[str, object]:
    return {"op": "fork", "id": 1, "argv": [PYTHON, "w.py"], "env": _env(), "cwd": None, "name": None, **fields}


BEFORE_HELLO = {
    "wrong-mac": None,  # (made with the connection's own challenge)
    "garbage": b"\xff\x00{not json",
    "not-an-object": b"[1, 2, 3]",
    "deep": b"[" * 100000,
    "over-the-limit": b"{" + b" " * (MAX_MESSAGE + 16) + b"}",
    "empty-object": b"{}",
    "mac-not-ascii": {"op": "hello", "mac": "é" * 64},
}


@pytest.mark.parametrize("case", sorted(BEFORE_HELLO))
def test_a_bad_hello_closes_that_connection_only(servers: Servers, tmp_path: Path, case: str) -> None:
    client, path = servers.start()
    sock, nonce = _raw(path)
    data = BEFORE_HELLO[case]
    _send_raw(sock, {"op": "hello", "mac": _mac(nonce, "another job's token")} if data is None else data)
    assert _closed(sock)
    sock.close()
    assert _alive(client.pid)
    _serves(path, tmp_path)


def test_a_hello_answered_for_another_connection_is_refused(servers: Servers, tmp_path: Path) -> None:
    _, path = servers.start()
    first, first_nonce = _raw(path)
    second, second_nonce = _raw(path)
    assert first_nonce != second_nonce
    _send_raw(second, {"op": "hello", "mac": _mac(first_nonce)})  # replayed: the first connection's answer
    assert _closed(second)
    _send_raw(first, {"op": "hello", "mac": _mac(first_nonce)})
    assert json.loads(first.recv(MAX_MESSAGE + 1))["ok"] is True
    for sock in (first, second):
        sock.close()
    _serves(path, tmp_path)


AFTER_HELLO_CLOSES = {
    "unknown-op": {"op": "exec", "id": 1},
    "hello-again": {"op": "hello", "id": 1, "mac": "0" * 64},
    "id-not-an-int": _fork_request(id="1"),
    "id-a-bool": _fork_request(id=True),
    "no-id": {"op": "fork", "argv": [PYTHON, "w.py"], "env": {}},
    "garbage": b"\x00\x01\x02",
    "deep": b"{\"a\":" * 50000,
}


@pytest.mark.parametrize("case", sorted(AFTER_HELLO_CLOSES))
def test_a_bad_request_closes_that_connection_only(servers: Servers, tmp_path: Path, case: str) -> None:
    client, path = servers.start()
    script = _script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    other = client.spawn([PYTHON, str(script)], _env(), None, None)  # another agent's worker, on another connection
    assert other.stdout is not None and other.stdout.readline() == b"up\n"
    sock = _authed(path)
    fd = os.open(os.devnull, os.O_RDONLY)
    _send_raw(sock, AFTER_HELLO_CLOSES[case], [fd])
    os.close(fd)
    assert _closed(sock)
    sock.close()
    assert other.poll() is None and _alive(other.pid)
    assert _forked(client, [PYTHON, str(_script(tmp_path, "ok.py", "print('ok')\n"))], _env()) == ("ok\n", 0)
    other.stdout.close()


AFTER_HELLO_REFUSED = {
    "env-value-not-a-string": (_fork_request(env={**_env(), "RANK": 3}), "env"),
    "env-name-with-equals": (_fork_request(env={**_env(), "A=B": "1"}), "env"),
    "argv-with-nul": (_fork_request(argv=[PYTHON, "w.py", "a\0b"]), "argv"),
    "argv-not-a-list": (_fork_request(argv="python w.py"), "argv"),
    "cwd-not-a-string": (_fork_request(cwd=7), "cwd"),
    "store-without-host": ({"op": "store", "id": 1, "timeout": 60}, "host"),
    "store-timeout-nan": ({"op": "store", "id": 1, "host": "127.0.0.1", "timeout": float("nan")}, "timeout"),
    # a reply that would be longer than a message may be: told in a bounded one
    "long-interpreter": (_fork_request(argv=["é" * 60000, "w.py"]), "runs"),
}


@pytest.mark.parametrize("case", sorted(AFTER_HELLO_REFUSED))
def test_an_invalid_request_is_answered_with_why(servers: Servers, tmp_path: Path, case: str) -> None:
    client, path = servers.start()
    message, says = AFTER_HELLO_REFUSED[case]
    sock = _authed(path)
    read, write = os.pipe()
    os.close(read)
    _send_raw(sock, message, [write], ascii_only=False)
    os.close(write)
    reply = json.loads(sock.recv(MAX_MESSAGE + 1))
    assert reply["id"] == 1 and "pid" not in reply
    assert says in reply["error"] and len(reply["error"]) <= 1000
    # the connection still serves
    read, write = os.pipe()
    _send_raw(sock, _fork_request(id=2, argv=[PYTHON, "w.sh"]), [write])
    for fd in (read, write):
        os.close(fd)
    assert json.loads(sock.recv(MAX_MESSAGE + 1)) == {"id": 2, "error": "only a .py script can be forked"}
    sock.close()
    assert _alive(client.pid)
    _serves(path, tmp_path)


@contextlib.contextmanager
def _descriptor_room(pid: int, room: int) -> Iterator[None]:
    """Meanwhile process ``pid`` may open only ``room`` more descriptors (its RLIMIT_NOFILE, set from here)."""
    import resource

    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    free = [fd for fd in range(max(used) + room + 2) if fd not in used]
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (free[room], old[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)


def test_a_server_out_of_descriptors_refuses_what_it_cannot_do_and_serves_on(servers: Servers,
                                                                            tmp_path: Path) -> None:
    client, path = servers.start()
    sock = _authed(path)
    with _descriptor_room(client.pid, 1):  # room for the worker's output as it arrives, none for the fork's pipe
        read, write = os.pipe()
        _send_raw(sock, _fork_request(), [write])
        for fd in (read, write):
            os.close(fd)
        reply = json.loads(sock.recv(MAX_MESSAGE + 1))
        assert reply["id"] == 1 and "pid" not in reply and "cannot fork" in reply["error"]
    with _descriptor_room(client.pid, 0):  # no room to accept a connection
        late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        late.settimeout(DEADLINE)
        late.connect(str(path))  # (queued: the server cannot take it yet)
        for ident in (2, 3):  # two round trips: the server has tried to accept it in between
            _send_raw(sock, _fork_request(id=ident, argv=[PYTHON, "w.sh"]))
            assert json.loads(sock.recv(MAX_MESSAGE + 1))["id"] == ident
    assert "challenge" in json.loads(late.recv(MAX_MESSAGE + 1))  # taken once there is room again
    for s in (sock, late):
        s.close()
    _serves(path, tmp_path)


def test_descriptors_sent_with_rejected_messages_are_closed(servers: Servers, tmp_path: Path) -> None:
    client, path = servers.start()
    baseline = _fd_count(client.pid)
    for attempt in range(50):
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(2 if attempt % 5 else 3)]  # (3: over MAX_FDS)
        kind = attempt % 5
        if kind in (0, 1):
            sock, nonce = _raw(path)
            _send_raw(sock, b"garbage" if kind == 0 else {"op": "hello", "mac": _mac(nonce)}, fds)
            if kind == 1:  # a good hello that carries descriptors: authenticated, the descriptors dropped
                assert json.loads(sock.recv(MAX_MESSAGE + 1))["ok"] is True
                _send_raw(sock, {"op": "nothing", "id": 1}, [fds[0]])
        else:
            sock = _authed(path)
            message = {2: _fork_request(env={"A": 1}), 3: _fork_request(), 4: {"op": "quit-not"}}[kind]
            _send_raw(sock, message, fds)
            if kind in (2, 3):  # refused with a reply (a fork needs one descriptor): the connection stays
                assert "error" in json.loads(sock.recv(MAX_MESSAGE + 1))
        for fd in fds:
            os.close(fd)
        sock.close()
    assert _until(lambda: _fd_count(client.pid) <= baseline), (_fd_count(client.pid), baseline)
    assert _alive(client.pid)
    _serves(path, tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Lifetime

SLEEPER_WITH_CHILD = '''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
'''


def test_what_a_connection_asked_for_dies_when_it_closes(servers: Servers, tmp_path: Path) -> None:
    script = _script(tmp_path, "parent.py", SLEEPER_WITH_CHILD)
    _, path = servers.start()
    agent = _connect(path)
    other = _connect(path)  # another agent's worker lives on
    mine, theirs = (c.spawn([PYTHON, str(script)], _env(), None, None) for c in (agent, other))
    grandchildren = []
    for proc in (mine, theirs):
        assert proc.stdout is not None
        grandchildren.append(int(proc.stdout.readline()))
    agent.close()
    assert _wait_gone(mine.pid) and _wait_gone(grandchildren[0])  # (by process group, as the agent ends workers)
    assert _alive(theirs.pid) and _alive(grandchildren[1])
    other.close()
    assert _wait_gone(theirs.pid) and _wait_gone(grandchildren[1])
    for proc in (mine, theirs):
        assert proc.stdout is not None
        proc.stdout.close()


SLOW_START = '''
import os, time
_setsid = os.setsid
def setsid():  # a forked child that is slow to reach its own session (a loaded machine)
    time.sleep(1.0)
    return _setsid()
os.setsid = setsid
'''


def test_a_worker_dies_with_its_connection_even_before_it_has_its_own_session(servers: Servers,
                                                                             tmp_path: Path) -> None:
    _script(tmp_path / "mods", "slowstart.py", SLOW_START)
    script = _script(tmp_path, "sleeper.py", "import time\ntime.sleep(600)\n")
    env = _env(PYTHONPATH=str(tmp_path / "mods"))
    _, path = servers.start(env, preload=("json", "slowstart"))
    agent = _connect(path)
    proc = agent.spawn([PYTHON, str(script)], env, None, None)
    agent.close()  # at once: the child has not left the server's process group yet
    assert _wait_gone(proc.pid), "a worker outlived the connection that asked for it"
    assert proc.stdout is not None
    proc.stdout.close()


def test_quit_ends_the_server_and_its_workers_and_removes_the_socket(servers: Servers, tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    client, path = servers.start()
    proc = client.spawn([PYTHON, str(script)], _env(), None, None)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    assert path.exists()
    client.quit()
    assert _wait_gone(client.pid)
    assert not path.exists()
    assert _wait_gone(proc.pid)
    assert proc.wait(DEADLINE) == -signal.SIGKILL
    assert ForkClient.connect(path, TOKEN) is None
    proc.stdout.close()


def test_a_server_started_before_the_workers_starts_no_thread_until_the_reader_and_is_reaped(
        servers: Servers, tmp_path: Path) -> None:
    """An agent with several workers starts the server before them (``reap=False``): no thread may exist while it
    may still start a worker with ``preexec_fn``; the reader's start also reaps the server once it leaves (no
    zombie is left)."""
    threads = set(threading.enumerate())  # (other tests' threads may end meanwhile: only new ones count)
    client, _ = servers.start(reader=False, reap=False)
    assert not set(threading.enumerate()) - threads and client.server is not None
    script = _script(tmp_path, "alive.py", "print('alive')\n")
    proc = client.spawn([PYTHON, str(script)], _env(), None, None)  # (as the agent: its workers, then the reader)
    assert not set(threading.enumerate()) - threads
    client.start_reader()
    assert proc.stdout is not None and proc.stdout.read() == b"alive\n" and proc.wait(DEADLINE) == 0
    proc.stdout.close()
    client.quit()
    assert client.server.wait(DEADLINE) is not None
    assert _wait_gone(client.pid)


def test_a_server_without_any_client_leaves_after_its_linger(servers: Servers) -> None:
    client, path = servers.start(linger=1)
    assert _alive(client.pid)
    client.close()
    assert _wait_gone(client.pid)
    assert not path.exists()


def test_a_stale_socket_is_replaced_by_the_next_server(servers: Servers, tmp_path: Path) -> None:
    first, path = servers.start()
    os.kill(first.pid, signal.SIGKILL)
    assert _wait_gone(first.pid)
    assert path.exists()  # left behind
    first.close()
    assert ForkClient.connect(path, TOKEN) is None
    second, _ = servers.start(path=path)
    assert second.pid != first.pid
    _serves(path, tmp_path)


def test_two_agents_starting_a_server_at_once_get_the_same_one(servers: Servers, tmp_path: Path) -> None:
    path = socket_path(_job(), "host-a")
    got: list[ForkClient | BaseException] = []

    def start() -> None:
        try:
            got.append(start_server(path, TOKEN, [PYTHON, "train.py"], _env(), None, linger=30, preload=("json",)))
        except BaseException as exc:  # noqa: BLE001  (told by the assertion below)
            got.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE * 2)
    clients = [c for c in got if isinstance(c, ForkClient)]
    servers.started += [(c, path) for c in clients]
    assert len(clients) == 2, got
    assert clients[0].pid == clients[1].pid
    assert _until(lambda: _processes_naming(str(path)) == [clients[0].pid]), _processes_naming(str(path))
    _serves(path, tmp_path)


def test_when_the_server_dies_its_workers_die_and_the_client_says_so(servers: Servers, tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "sleeper.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    quick = _script(tmp_path, "quick.py", "raise SystemExit(5)\n")
    client, _ = servers.start(reader=False)  # as the agent: every worker started before the reader
    done = client.spawn([PYTHON, str(quick)], _env(), None, None)
    assert done.stdout is not None and done.stdout.read() == b""
    running = client.spawn([PYTHON, str(sleeper)], _env(), None, None)
    assert running.stdout is not None and running.stdout.readline() == b"up\n"
    assert _wait_gone(done.pid)
    for _ in range(2):  # (two round trips: the server has reaped the first worker and reported it meanwhile)
        with pytest.raises(ForkServerError):
            client.spawn([PYTHON, str(tmp_path / "run.sh")], _env(), None, None)
    os.kill(client.pid, signal.SIGKILL)
    assert _wait_gone(running.pid), "a worker outlived its server"
    client.start_reader()
    assert running.wait(DEADLINE) == -signal.SIGKILL
    assert done.wait(DEADLINE) == 5
    for proc in (done, running):
        assert proc.stdout is not None
        proc.stdout.close()
    client.close()


# ----------------------------------------------------------------------------------------------------------
# Where the socket lives


def test_the_socket_path_is_per_job_and_host_in_a_private_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "_private_dir", PRIVATE_DIR)  # the real one, under a temporary directory
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    path = socket_path("job-a", "host-a")
    assert path == socket_path("job-a", "host-a")
    assert len({path, socket_path("job-b", "host-a"), socket_path("job-a", "host-b")}) == 3
    private = tmp_path / f"varuna-{os.getuid()}"
    assert path.parent == private
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    private.chmod(0o755)
    with pytest.raises(ForkServerError, match="only this user"):
        socket_path("job-a", "host-a")
    private.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    private.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ForkServerError, match="only this user"):
        socket_path("job-a", "host-a")
    if os.getuid() == 0:  # a directory another user made (only root can make one here)
        private.unlink()
        private.mkdir(mode=0o700)
        os.chown(private, 12345, 12345)
        with pytest.raises(ForkServerError, match="only this user"):
            socket_path("job-a", "host-a")


# ----------------------------------------------------------------------------------------------------------
# The store host


def test_the_store_host_serves_the_store_and_leaves_with_its_control_socket(torch_server: Path) -> None:
    import torch.distributed as dist

    client = _connect(torch_server)
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        port = listening.getsockname()[1]
        store = client.store(listening, "127.0.0.1", 60)
        listening.close()
        store.set("varuna/key", "the value")
        reader = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=DEADLINE))
        assert reader.get("varuna/key") == b"the value"
        reader.set("back", "x")
        store.set("varuna/other", "second")
        assert reader.get("varuna/other") == b"second"
        assert _alive(store.pid)
        store.close()
        assert _wait_gone(store.pid)
    finally:
        listening.close()
        client.close()


def test_the_store_host_dies_with_the_connection_that_asked_for_it(torch_server: Path) -> None:
    client = _connect(torch_server)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        store = client.store(listening, "127.0.0.1", 60)
    store.set("k", "v")
    client.close()
    assert _wait_gone(store.pid)
    with pytest.raises((ForkServerError, OSError)):
        store.set("k", "again")
    store.close()


def test_forked_process_is_what_the_agent_reads() -> None:
    # (the agent treats a ForkedProcess as a Popen: pid, stdout, poll, wait with a timeout)
    proc = ForkedProcess(123, None, [PYTHON, "w.py"])
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.01)
    proc._exited(-9)
    proc._exited(0)  # (the first report stands)
    assert proc.poll() == proc.wait(0) == -9
