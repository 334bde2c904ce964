"""What ``probe_agents`` reports when a host's node agent does not start (the agent replaced by a stand-in)."""

from __future__ import annotations

import queue

import pytest

from varuna_core.launch import ssh
from varuna_core.launch.hosts import Host
from varuna_core.launch.options import HostRuntime
from varuna_core.launch.protocol import ErrorEvent, GoneEvent


class _Agent:
    """A node agent that reports one event at once and left nothing on its stderr."""

    def __init__(self, event: object, last_words: str) -> None:
        self.event, self.words = event, last_words

    def __call__(self, node: int, host: Host, spec: object, events: queue.Queue, runtime: object,
                 remote: object) -> _Agent:
        events.put((node, self.event))
        return self

    def last_words(self) -> str:
        return self.words

    def close(self) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        return True


@pytest.mark.parametrize(("event", "last_words", "detail"), [
    (ErrorEvent(message="no such interpreter"), "", "no such interpreter"),
    (ErrorEvent(message=""), "Traceback: ImportError", "Traceback: ImportError"),
    (ErrorEvent(message=""), "", "it reported an error without a message"),  # once a crash of the probe
    (GoneEvent(code=3), "", "exit code 3"),
    (GoneEvent(code=255), "", "unreachable over SSH: exit code 255"),
])
def test_an_agent_that_does_not_start_is_a_problem_of_its_host(monkeypatch, event, last_words, detail) -> None:
    monkeypatch.setattr(ssh, "AgentHandle", _Agent(event, last_words))
    host = Host("node1", 1)
    problems = ssh.probe_agents([host], HostRuntime(), None, job="j", timeout=5)
    assert problems == [ssh.HostProblem(host, f"its node agent did not start: {detail}")]
