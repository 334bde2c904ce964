"""The node agent's protocol under hostile or broken input: what counts as an event, output without newlines,
a spec or command that is garbage, SIGTERM at any moment, and where the job's store listens."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from varuna_core.launch.agent import _store_socket
from varuna_core.launch.protocol import (
    MAX_EVENT,
    MAX_LINE,
    AgentSpec,
    ErrorEvent,
    LegacyArgs,
    SignalCommand,
    StopCommand,
    parse_command,
    parse_event,
    parse_spec,
)
from varuna_core.launch.protocol import grace_seconds as _grace
from varuna_core.launch.ssh import _lines

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("line", [
    b"42", b"[]", b'"ready"', b"null", b"{}", b'{"event": 1}', b'{"event": "shutdown"}',
    b'{"event": "exit", "rank": 0}', b'{"event": "exit", "rank": "0", "code": 1}',
    b'{"event": "exit", "rank": true, "code": 1}', b'{"event": "exit", "rank": -1, "code": 1}',
    b'{"event": "exit", "rank": 0, "code": 1.5}', b'{"event": "store", "port": 70000}',
    b'{"event": "store", "port": 0}', b'{"event": "log", "rank": 0, "line": ["x"]}',
    b'{"event": "ready", "pid": 1, "interface": 3, "address": null}',
    b'{"event": "ready", "pid": 1, "interface": null, "address": null, "shelf_port": 0}',
    b'{"event": "ready", "pid": 1, "interface": null, "address": null, "shelf_port": "41000"}',
    b"[" * 100_000, b"\xff\xfe",
    b"Welcome to Ubuntu 22.04 LTS", b'{"event": "error", "message": {"nested": 1}}',
    b'{"event": "gone", "code": 0}',  # the launcher's own event: an agent cannot claim its host is gone
    b'{"event": "preempt", "source": "aws", "seconds": -1}', b'{"event": "preempt", "source": "aws"}',
    b'{"event": "preempt", "source": "aws", "seconds": 1e300}',
    b'{"event": "preempt", "source": "aws", "seconds": "5"}',
    b'{"event": "preempt", "source": "' + b"x" * 100 + b'", "seconds": 5}',
    b'{"event": "signalled", "signal": "SIGKILL"}', b'{"event": "signalled"}',
    b'{"event": "log", "rank": 0, "line": "' + b"x" * (MAX_LINE + 1) + b'"}',
])
def test_only_well_formed_events_count(line) -> None:
    """A remote shell's banner printing `42` crashed the launcher (before: any JSON line was an event)."""
    assert parse_event(line) is None


@pytest.mark.parametrize("event", [
    {"event": "ready", "pid": 12, "interface": "lo", "address": "127.0.0.1", "shelf_port": 41000},
    {"event": "ready", "pid": 12, "interface": None, "address": None, "shelf_port": None},
    {"event": "store", "port": 29500}, {"event": "started", "rank": 3, "pid": 99, "forked": False},
    {"event": "started", "rank": 3, "pid": 99, "forked": True},
    {"event": "forkserver", "pid": 77, "seconds": 2.5, "message": None},
    {"event": "forkserver", "pid": None, "seconds": 0.0, "message": "no fork server: it did not start"},
    {"event": "log", "rank": 0, "line": "[/] step 1"}, {"event": "exit", "rank": 1, "code": -9},
    {"event": "error", "message": "boom"}, {"event": "stopped"},
    {"event": "preempt", "source": "gcp", "seconds": 0.0, "detail": "preempted"},
    {"event": "signalled", "signal": "SIGUSR1"}, {"event": "signalled", "signal": "SIGTERM"},
])
def test_real_events_are_accepted(event) -> None:
    assert parse_event(json.dumps(event).encode()).model_dump() == event


def _parse(line: bytes) -> dict | None:
    event = parse_event(line)
    return None if event is None else event.model_dump()


def test_the_launchers_spec_and_commands_survive_the_wire() -> None:
    spec = AgentSpec.model_validate(_spec(["python", "train.py"], workers=2))
    assert parse_spec(spec.model_dump_json()) == spec
    legacy = spec.model_copy(update={"legacy_args": LegacyArgs(stage_to_rank_map="0;1;", chunk_size=2, batch_size=8)})
    assert parse_spec(legacy.model_dump_json()) == legacy
    assert parse_command(SignalCommand(signal="SIGUSR1").model_dump_json()) == SignalCommand(signal="SIGUSR1")
    assert parse_command(StopCommand(grace=3).model_dump_json()).grace_or(5) == 3
    assert parse_command('{"cmd": "stop", "grace": "soon"}').grace_or(5) == 5  # a stop still stops
    assert parse_command('{"cmd": "stop", "grace": 1e9}').grace_or(5) == 3600


@pytest.mark.parametrize("change, needle", [
    ({"world": "2"}, "world"), ({"store": 1}, "store"), ({"argv": []}, "argv"), ({"master_port": 70000}, "port"),
    ({"grace": float("nan")}, "grace"), ({"evil": 1}, "evil"), ({"job": ""}, "job"),
    ({"workers": [{"rank": 5, "local_rank": 0}]}, "below world"),
    ({"workers": [{"rank": 0, "local_rank": 0}, {"rank": 0, "local_rank": 1}]}, "same rank"),
    ({"master_port": None}, "master_port"), ({"spot": {"source": "ibm"}}, "spot.source"),
    ({"spot": {"source": "aws", "interval": 0}}, "interval"), ({"scheduler_signals": 1}, "scheduler_signals"),
    ({"legacy_args": {"stage_to_rank_map": "0;", "chunk_size": 0, "batch_size": 1}}, "chunk_size"),
])
def test_a_wrong_spec_is_refused_in_one_line(change, needle) -> None:
    with pytest.raises(ValueError) as info:
        parse_spec(json.dumps({**_spec(["true"], workers=2), **change}))
    message = str(info.value)
    assert needle in message and "\n" not in message and len(message) < 500


@pytest.mark.parametrize("line", ['{"cmd": "signal"}', '{"cmd": "signal", "signal": 9}', '{"cmd": "reboot"}', "{}"])
def test_a_wrong_command_is_refused(line) -> None:
    with pytest.raises(ValueError):
        parse_command(line)


def test_an_error_event_is_cut_to_fit() -> None:
    event = ErrorEvent.of("x" * (3 * MAX_LINE))
    assert parse_event(event.model_dump_json()) == event and len(event.message) == MAX_LINE


def test_lines_are_bounded() -> None:
    stream = io.BytesIO(b"a\n" + b"x" * (3 * MAX_EVENT) + b"\nb\n" + b"y" * 10)
    lines = list(_lines(stream))
    assert lines[0] == b"a\n" and len(lines[1]) == MAX_EVENT and lines[2:] == [b"b\n", b"y" * 10]


def test_grace_periods_from_the_launcher_are_sane() -> None:
    assert _grace("3", 5) == 3 and _grace(None, 5) == 5 and _grace("nan", 5) == 5 and _grace(1e9, 5) == 3600
    assert _grace(-4, 5) == 0 and _grace(float("inf"), 5) == 5 and _grace([1], 5) == 5


def test_a_local_store_listens_on_the_loopback_only() -> None:
    sock = _store_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def _agent(spec: dict | str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "varuna_core.launch.agent"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    proc.stdin.write(((spec if isinstance(spec, str) else json.dumps(spec)) + "\n").encode())
    proc.stdin.flush()
    return proc


def _spec(argv: list[str], workers: int = 1) -> dict:
    return {"job": "testjob0", "node": 0, "host": "h", "store": False, "master_addr": "127.0.0.1",
            "master_port": 1, "world": workers, "workers": [{"rank": r, "local_rank": r} for r in range(workers)],
            "argv": argv, "cwd": None, "env": {}, "plan": None, "grace": 2}


def _events(proc: subprocess.Popen, timeout: float = 30) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    return [e for line in out.splitlines() if (e := _parse(line)) is not None]


def test_output_without_newlines_reaches_the_launcher_in_bounded_pieces() -> None:
    spec = _spec([sys.executable, "-c", f"import sys; sys.stdout.write('x' * {3 * MAX_LINE + 5})"])
    proc = _agent(spec)
    events = []
    while not events or events[-1]["event"] != "exit":  # stdin stays open until the worker is done
        line = proc.stdout.readline()
        assert line, "the agent ended early"
        if (event := _parse(line)) is not None:
            events.append(event)
    events += _events(proc)
    lines = [e["line"] for e in events if e["event"] == "log"]
    assert [len(x) for x in lines] == [MAX_LINE, MAX_LINE, MAX_LINE, 5]
    assert {"event": "exit", "rank": 0, "code": 0} in events


@pytest.mark.parametrize("first", ["not json", "[1, 2]", '{"workers": 3}', "[" * 50_000])
def test_a_garbage_spec_is_an_error_event_not_a_traceback(first) -> None:
    proc = _agent(first)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and b"Traceback" not in err
    assert [parse_event(line).event for line in out.splitlines()] == ["error"]


def test_garbage_commands_are_reported_and_ignored() -> None:
    proc = _agent(_spec([sys.executable, "-c", "import time; time.sleep(30)"]))
    for line in ("42", "[]", "{", "[" * 50_000, '{"cmd": "signal", "signal": "SIGSTOP"}',
                 '{"cmd": "stop", "grace": "soon"}'):
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()
    events = _events(proc)
    errors = [e["message"] for e in events if e["event"] == "error"]
    assert len(errors) == 5 and "unknown signal 'SIGSTOP'" in errors[-1]
    assert events[-1]["event"] == "stopped"  # the stop with a nonsense grace still stopped it


_TERM_IN_EMIT = """
import signal, sys, threading
from varuna_core.launch import agent
from varuna_core.launch.protocol import AgentSpec
a = agent.Agent(AgentSpec(job="testjob0", node=0, host="h", store=False, master_addr="127.0.0.1", master_port=1,
                          world=1, workers=[], argv=["true"]))
signal.signal(signal.SIGTERM, agent.sigterm_handler(a, 1.0))
with agent._out_lock:  # as if the signal arrived while the main thread was writing an event
    signal.raise_signal(signal.SIGTERM)
    print("handler returned", file=sys.stderr, flush=True)
threading.Event().wait(30)
"""


def test_sigterm_while_writing_an_event_does_not_deadlock() -> None:
    """Before: the handler stopped inline and waited for the lock its own thread held, forever."""
    done = subprocess.run([sys.executable, "-c", _TERM_IN_EMIT], capture_output=True, timeout=60)
    assert done.returncode == 0 and b"handler returned" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == b'{"event":"stopped"}'


def test_sigterm_at_any_moment_stops_the_agent() -> None:
    """SIGTERM's handler stopped the agent inline, and emit() may hold the output lock when it runs: the agent
    could hang forever. Now it stops from another thread. Sent at many moments of start-up and streaming."""
    chatty = [sys.executable, "-c", "import time\nfor i in range(100000): print(i, flush=True)\ntime.sleep(30)"]
    for delay in (0.0, 0.01, 0.1, 0.3):
        proc = _agent(_spec(chatty, workers=2))
        assert parse_event(proc.stdout.readline()).event == "ready"  # its handler is installed by now
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the agent hung after SIGTERM at {delay}s")
        assert proc.returncode == 0
        assert out.strip().splitlines()[-1] == b'{"event":"stopped"}'


# each line in one write: print() writes the text and the newline apart, so a second signal arriving between them
# (the agent sends two SIGTERMs back to back) made the lines "termterm" and ""
_SLEEPER = [sys.executable, "-c", ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGUSR1, lambda *a: os.write(1, b'usr1\\n'))\n"
             "signal.signal(signal.SIGTERM, lambda *a: os.write(1, b'term\\n'))\n"
             "os.write(1, b'up\\n')\ntime.sleep(60)")]


def _until(proc: subprocess.Popen, predicate, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = _parse(proc.stdout.readline())
        if event is not None and predicate(event):
            return event
    pytest.fail("the agent did not report the expected event")


def test_under_a_scheduler_sigterm_is_reported_and_the_workers_keep_running() -> None:
    """Slurm signals every process of the job: the agent must not kill workers that are checkpointing; it tells
    the launcher and passes SIGUSR1 on; the launcher's stop then still stops them (a second SIGTERM)."""
    proc = _agent({**_spec(_SLEEPER), "scheduler_signals": True})
    _until(proc, lambda e: e.get("line") == "up")
    os.kill(proc.pid, signal.SIGTERM)
    assert _until(proc, lambda e: e["event"] == "signalled") == {"event": "signalled", "signal": "SIGTERM"}
    assert _until(proc, lambda e: e["event"] == "log")["line"] == "usr1"
    os.kill(proc.pid, signal.SIGUSR1)
    assert _until(proc, lambda e: e["event"] == "signalled")["signal"] == "SIGUSR1"
    proc.stdin.write(b'{"cmd": "stop", "grace": 5}\n')
    proc.stdin.flush()
    events = _events(proc)
    # two SIGTERMs (a real worker's second one ends it; this one ignores both), then SIGKILL after the grace
    assert [e["line"] for e in events if e["event"] == "log"][-2:] == ["term", "term"]
    assert {"event": "exit", "rank": 0, "code": -signal.SIGKILL} in events and events[-1]["event"] == "stopped"


def test_without_a_scheduler_sigusr1_is_passed_on_and_not_reported() -> None:
    proc = _agent(_spec(_SLEEPER))
    _until(proc, lambda e: e.get("line") == "up")
    os.kill(proc.pid, signal.SIGUSR1)
    assert _until(proc, lambda e: e["event"] in ("log", "signalled")) == {"event": "log", "rank": 0, "line": "usr1"}
    proc.stdin.write(b'{"cmd": "stop", "grace": 0}\n')
    proc.stdin.flush()
    events = _events(proc)
    assert events[-1]["event"] == "stopped" and not any(e["event"] == "signalled" for e in events)


def test_sigkill_ends_the_workers_at_once_and_the_agent_stays_until_stopped() -> None:
    """After a host of the job is lost, the survivors' workers may be blocked in a collective with it: the launcher
    ends them with SIGKILL (ignored by no one) while their agents keep serving the snapshot on their shelves."""
    proc = _agent(_spec(_SLEEPER, workers=2))
    _until(proc, lambda e: e.get("line") == "up")
    proc.stdin.write(b'{"cmd": "signal", "signal": "SIGKILL"}\n')
    proc.stdin.flush()
    exits = [_until(proc, lambda e: e["event"] == "exit") for _ in range(2)]
    assert sorted(e["rank"] for e in exits) == [0, 1] and {e["code"] for e in exits} == {-signal.SIGKILL}
    assert proc.poll() is None  # the agent is still there
    proc.stdin.write(b'{"cmd": "stop", "grace": 0}\n')
    proc.stdin.flush()
    assert _events(proc)[-1]["event"] == "stopped"


def test_a_handovers_ask_marks_the_shelf_of_a_host_that_leaves_before_the_workers_hear_it(tmp_path) -> None:
    """SIGUSR2 with ``leaving`` (or ``alone``): the agent marks its shelf first, so a worker that looks when the
    signal comes sees the mark; without it, no mark. A marked shelf goes with the agent's stop."""
    root, key = tmp_path / "shm", "job-1@attempt-2"
    look = (f"import os, signal, time\nfrom varuna_core.launch.shelf import Shelf\n"
            f"shelf = Shelf({key!r}, root={str(root)!r})\n"
            "signal.signal(signal.SIGUSR2, lambda *a: os.write(1, f'leaving {shelf.leaving} alone {shelf.alone}\\n'"
            ".encode()))\nos.write(1, b'up\\n')\ntime.sleep(60)")
    spec = {**_spec([sys.executable, "-c", look]), "shelf": {"root": str(root), "key": key},
            "env": {"VARUNA_JOB_TOKEN": "t" * 64}}
    proc = _agent(spec)
    try:
        _until(proc, lambda e: e.get("line") == "up")
        for leaving, alone, said in ((False, False, "leaving False alone False"),
                                     (False, True, "leaving False alone True"),
                                     (True, False, "leaving True alone False")):  # (one shelf: marks accumulate)
            ask = SignalCommand(signal="SIGUSR2", leaving=leaving, alone=alone)
            proc.stdin.write((ask.model_dump_json() + "\n").encode())
            proc.stdin.flush()
            assert _until(proc, lambda e: e["event"] == "log")["line"] == said
        proc.stdin.write(b'{"cmd": "stop", "grace": 2}\n')
        proc.stdin.flush()
        assert _events(proc)[-1]["event"] == "stopped"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not root.exists() or not any(root.iterdir())
