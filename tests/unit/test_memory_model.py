"""The planner's memory model against what the runtime allocates (``benchmarks/memory_model.py`` measures it):
the profile's saved activations leave the weights out, and a stage is charged for the sent values the runtime
keeps unwaited: the receiving neighbour's window, not the step's micro-batches ([Note: unwaited sends] in
``varuna_core.ir.inflight``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.profiles import make_profile
from varuna_core import CutPoint, ModelSpec
from varuna_core.ir.inflight import pending_weights, pending_weights_named, receive_windows
from varuna_core.ir.schedule import SCHEDULE_NAMES, generate
from varuna_core.planning.memory import stage_bytes
from varuna_core.planning.planner import PlanRequest, plan_for
from varuna_core.planning.simulate import inflight_counts
from varuna_core.profiling.run import profile

HIDDEN, LENGTH = 256, 2


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


class _Linears(nn.Module):
    """Two big Linears on small 3-D activations, a cut between them: autograd saves each one's transposed weight
    (a view of the parameter, not a ``Parameter``) and its input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.cut = CutPoint()
        self.second = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.second(self.cut(self.first(x))) - y) ** 2).mean()


def _batch(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, LENGTH, HIDDEN, generator=g), "y": torch.randn(n, LENGTH, HIDDEN, generator=g)}


def test_saved_activations_leave_the_weights_out() -> None:
    """Counted as activations, views of the weights would be charged once per graph a schedule keeps."""
    result = profile(ModelSpec(build=_Linears, batch=_batch, name="linears"), microbatch_sizes=[1, 2], repeats=1,
                     warmup=0)
    activation = LENGTH * HIDDEN * 4  # one example's [LENGTH, HIDDEN] in fp32
    for m in result.segments[0].measures:  # saves its input x
        assert m.saved_bytes == m.microbatch_size * activation
    for m in result.segments[1].measures:  # saves its input (the cut) and the difference squared
        assert m.saved_bytes == 2 * m.microbatch_size * activation


def _middle_stage_memory(schedule: str, batch: int) -> int:
    """Predicted bytes (no headroom) of the middle stage of 3, micro-batches of 2 examples."""
    prof = make_profile([0.001] * 6, param_bytes=10**6, saved_per_example=10**5, out_per_example=10**4)
    plan = plan_for(prof, PlanRequest(gpus=3, batch_size=batch, headroom=0.0), pp=3, dp=1, microbatch_size=2,
                    schedule=schedule)
    assert plan.partition == [(0, 2), (2, 4), (4, 6)]
    return plan.stages[1].memory_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "varuna"])
def test_more_microbatches_cost_no_memory_where_the_schedule_holds_no_more(schedule: str) -> None:
    """The runtime waits for its oldest send before exceeding the receiver's window, so sent values no longer
    pile up until the step ends: 32 or 64 micro-batches need the same memory."""
    assert _middle_stage_memory(schedule, 64) == _middle_stage_memory(schedule, 32)


def test_gpipe_memory_grows_with_the_microbatches_it_holds() -> None:
    grown = _middle_stage_memory("gpipe", 64) - _middle_stage_memory("gpipe", 32)
    # 16 more micro-batches held: each its graph (2 segments x 2 examples), input and outputs (gradient receive + sent)
    assert grown == 16 * (2 * 2 * 10**5 + 2 * 10**4 + 2 * 2 * 10**4)


def test_gpipe_counts_each_microbatchs_input_once() -> None:
    """A received activation is first a posted buffer, then the stashed input, then its gradient is sent back:
    one buffer per micro-batch, not a window of posted buffers on top of every stashed one."""
    m = 16
    (held, graphs), = inflight_counts("gpipe", 3, m)[1:2]
    act, grad = receive_windows([h for h, _ in inflight_counts("gpipe", 3, m)])[1]
    assert (held, act, grad) == (m, m, m)
    inputs = stage_bytes(static=0.0, saved=0.0, input_bytes=1.0, output_bytes=0.0, held=held, graphs=graphs,
                         act_recvs=act, grad_recvs=grad, headroom=0.0, microbatches=m)
    assert inputs == m


def test_a_recompute_keeps_its_own_outputs() -> None:
    """The output of a recompute is a new tensor kept until its backward; a forward's output is the one it sent,
    so a stage without recompute never holds more outputs than the step's values it sent."""
    terms = {"static": 0.0, "saved": 0.0, "input_bytes": 0.0, "output_bytes": 1.0, "held": 3, "graphs": 2,
             "act_recvs": 3, "grad_recvs": 3, "headroom": 0.0, "microbatches": 4}
    assert stage_bytes(**terms, recompute=True) == 3 + 3 + 2  # posted receives, unwaited sends, the recomputes'
    assert stage_bytes(**terms, recompute=False) == 3 + 4  # posted receives, the 4 values sent


# --- a split backward (zb, varuna-zb): what W needs waits from B to W ----------------------------------------


def test_the_micro_batches_waiting_for_their_W_are_charged_what_W_keeps() -> None:
    terms = {"static": 0.0, "saved": 0.0, "input_bytes": 0.0, "output_bytes": 0.0, "held": 3, "graphs": 2,
             "act_recvs": 3, "grad_recvs": 3, "headroom": 0.5, "microbatches": 4}
    assert stage_bytes(**terms) == 0.0
    assert stage_bytes(**terms, pending=3, weight_bytes=10.0) == 3 * 10.0 * 1.5
    assert stage_bytes(**terms, pending=0, weight_bytes=10.0) == 0.0  # no split, nothing waits


@pytest.mark.parametrize("split", ["zb", "varuna-zb"])
def test_a_split_schedule_is_charged_the_pending_weights(split) -> None:
    """The middle stage of 3 has up to 2 micro-batches waiting for their W, each keeping its 2 segments'
    weight_bytes: that is what the same plan costs more than with nothing kept for W. zb holds 1F1B's graphs and
    inputs, so that is also all it needs more than 1f1b."""
    def middle(schedule: str, weight_per_example: int):
        prof = make_profile([0.001] * 6, param_bytes=10**6, saved_per_example=10**5, out_per_example=10**4,
                            split=0.5, weight_per_example=weight_per_example)
        plan = plan_for(prof, PlanRequest(gpus=3, batch_size=32, headroom=0.0), pp=3, dp=1, microbatch_size=2,
                        schedule=schedule)
        assert plan.partition == [(0, 2), (2, 4), (4, 6)]
        return plan.stages[1]

    stage = middle(split, 3 * 10**4)
    assert (stage.pending_weights, stage.weight_bytes) == (2, 2 * 2 * 3 * 10**4)
    assert stage.memory_bytes - middle(split, 0).memory_bytes == 2 * stage.weight_bytes
    if split == "zb":
        plain = middle("1f1b", 3 * 10**4)
        assert stage.memory_bytes - plain.memory_bytes == 2 * stage.weight_bytes
        assert plain.pending_weights == plain.weight_bytes == 0


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_pending_weights_by_name_are_those_of_the_generated_schedule(name) -> None:
    """The planner's closed form (it asks for every configuration) against the count over the schedule itself."""
    for stages in range(1, 9):
        for mbs in range(1, 24):
            assert pending_weights_named(name, stages, mbs) == pending_weights(generate(name, stages, mbs)), \
                (stages, mbs)
