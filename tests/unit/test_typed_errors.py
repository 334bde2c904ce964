"""Errors are told apart by their type or by a structural fact, never by their text: a backend's or torch's
message is not an interface, and a word in it ("timeout", "meta") can appear for another reason."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed
import torch.nn as nn
import torch.nn.functional as F

from tests import models
from tests.stage_chain import pipelined
from varuna_core.errors import CommTimeoutError, ConfigError, CutPointError, InternalError
from varuna_core.pipeline import p2p


class _Work:
    """A work handle whose wait fails after ``after`` seconds (at most the timeout it is given) with ``error``."""

    def __init__(self, error: BaseException, after: float | None) -> None:
        self.error, self.after = error, after

    def wait(self, timeout) -> None:
        time.sleep(timeout.total_seconds() if self.after is None else self.after)
        raise self.error


@pytest.mark.parametrize(("error", "after", "expected"), [
    (RuntimeError("Connection closed by peer"), None, "no progress within 0.3s"),  # waited out: a timeout
    (torch.distributed.DistBackendError("NCCL error"), None, "no progress within 0.3s"),
    (RuntimeError("Timed out waiting for the store"), 0.0, "the connection failed (Timed out waiting for the store)"),
    (torch.distributed.DistBackendError("watchdog timeout"), 0.0, "the connection failed (watchdog timeout)"),
])
def test_a_failed_wait_is_a_timeout_by_the_clock_not_by_its_text(error, after, expected) -> None:
    with pytest.raises(CommTimeoutError) as info:
        p2p.wait_all([_Work(error, after)], timeout=0.3, describe=lambda: "rank 0 in 0F0", peer=1)
    assert info.value.message.startswith("rank 0 in 0F0: " + expected), info.value.message


# --- a stage's forward failing on a value of another stage (on meta) ----------------------------------------


class _Late(models.ToyLM):
    """Code of the last segment that discovery never saw run (its probes hold 1 and 2 examples): ``late`` reads
    a root parameter, so it stays with stage 0 and is on meta on the last stage; ``failing`` raises a plain
    error whose text happens to say "meta", before or after the last stage's incoming cut."""

    def __init__(self, late: str = "", failing: str = "") -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(models.HIDDEN))
        self.late, self.failing = late, failing

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        unseen = idx.shape[0] > 2
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        if unseen and self.failing == "before" and x.is_meta:  # on the later stages, before their cut
            raise ValueError("the metadata of this batch is wrong")
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        if unseen and self.failing == "after":
            raise ValueError("the metadata of this batch is wrong")
        if unseen and self.late:
            x = x + self.extra
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, models.VOCAB), targets.reshape(-1))


def _make(**options):
    def make():
        torch.manual_seed(0)
        return _Late(**options)
    return make


def test_an_op_on_another_stages_tensor_after_the_cut_is_named() -> None:
    with pytest.raises(CutPointError, match=r"on stage 1, code after CutPoint 'cuts\.0' mixes") as info:
        pipelined(_make(late="yes"), [(0, 1), (1, 5)], models.batch(4), shared=models.SHARED)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_error_that_only_says_meta_is_left_as_it_is(where) -> None:
    """Before, any error whose text held "meta" ("metadata") became a CutPointError blaming a skipped value."""
    with pytest.raises(ValueError, match="metadata"):
        pipelined(_make(failing=where), [(0, 1), (1, 5)], models.batch(4), shared=models.SHARED)


# --- an invariant of ours is not the user's bad input ----------------------------------------------------------


def _bare_executor():
    from varuna_core.pipeline.executor import PipelineExecutor

    executor = object.__new__(PipelineExecutor)  # only what the checks read
    executor.rank, executor.stage_index, executor.replica, executor.num_stages = 1, 1, 0, 2
    executor.schedule_name = "1f1b"
    executor._schedules = {}
    return executor


def test_a_backward_without_a_forward_is_our_defect_not_bad_input() -> None:
    from varuna_core.ir.schedule import Action, Op
    from varuna_core.pipeline.executor import _MicroState

    with pytest.raises(InternalError) as info:
        _bare_executor()._backward(None, _MicroState(), None, Action(1, Op.B, 3))
    assert info.value.exit_code == 1 and not isinstance(info.value, ConfigError)
    assert "1B3" in info.value.message and "defect of varuna" in info.value.message
    assert "report" in info.value.hint


def test_a_generated_schedule_that_does_not_validate_is_our_defect(monkeypatch) -> None:
    from varuna_core.ir.schedule import Schedule, generate
    from varuna_core.pipeline import executor as module

    def broken(name, stages, microbatches):  # the last backward of stage 0 is missing
        good = generate(name, stages, microbatches)
        return Schedule(name, stages, microbatches, (good.actions[0][:-1], *good.actions[1:]))

    monkeypatch.setattr(module, "generate", broken)
    with pytest.raises(InternalError, match="the generated 1f1b schedule of 2 stages and 4 micro-batches"):
        _bare_executor().schedule_for(4)


def test_an_internal_error_survives_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(InternalError("x went wrong")))
    assert error.message.count("internal error") == 1 and error.message.endswith("x went wrong") and error.hint
