"""[Note: yield after a send] in ``varuna_core.pipeline.p2p``: a value's sends on the host are followed by one yield
of the CPU, so gloo's communication thread writes them before the sender goes on computing. (What it changes in
time is measured, not asserted: benchmarks/README.md.)"""

from __future__ import annotations

import pytest
import torch

from varuna_core.pipeline import p2p


@pytest.fixture
def recorded(monkeypatch) -> list[str]:
    events: list[str] = []

    def isend(tensor, dst, group=None, tag=0):
        events.append(f"send {tag}")
        return object()

    monkeypatch.setattr(p2p.dist, "isend", isend)
    monkeypatch.setattr(p2p.os, "sched_yield", lambda: events.append("yield"))
    return events


def test_one_yield_after_all_of_a_values_sends(recorded) -> None:
    works = p2p.send([torch.ones(3), torch.zeros(2, 2)], dst=1, mb=0, kind=p2p.ACTIVATION, group=None)
    assert len(works) == 2
    assert [e.split()[0] for e in recorded] == ["send", "send", "yield"]


def test_nothing_sent_nothing_yielded(recorded) -> None:
    assert p2p.send([], dst=1, mb=0, kind=p2p.GRADIENT, group=None) == []
    assert recorded == []


def test_a_failed_send_raises_without_yielding(monkeypatch, recorded) -> None:
    def broken(tensor, dst, group=None, tag=0):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(p2p.dist, "isend", broken)
    with pytest.raises(Exception, match="rank 1"):
        p2p.send([torch.ones(3)], dst=1, mb=0, kind=p2p.ACTIVATION, group=None)
    assert recorded == []
