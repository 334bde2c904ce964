"""Python state kept on modules during forward ([Note: module state]): discovery finds the attributes a forward
writes and where they are read; slicing refuses one written on one stage and read on another by name; the dry
runs leave the model as they found it; a recomputed forward does not count twice."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from tests import models
from tests.stage_chain import pipelined, reference
from varuna_core.errors import CutPointError
from varuna_core.ir.partition import Partition
from varuna_core.model import module_state
from varuna_core.model.discovery import Structure, discover, make_batch_fn
from varuna_core.model.module_state import AttributeSnapshot, AttributeUse, check_state_crossings


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def _structure(model: nn.Module) -> Structure:
    fn, dims = make_batch_fn(models.batch(3), None)
    return discover(model, fn, dims, use_cache=False)


def _seeded(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


class _Cache(nn.Module):
    """Reads and extends its own cache, as Hugging Face's rotary modules do (``self._seq_len_cached``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(models.HIDDEN, models.HIDDEN)
        self._seq_len_cached = 0
        self._table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self._seq_len_cached:
            self._seq_len_cached = x.shape[0]
            self._table = torch.ones(x.shape[0], 1, 1)
        return self.proj(x) * self._table[: x.shape[0]]


class CachingLM(models.ToyLM):
    """Block 1 is a module with its own cache, read only by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1] = _Cache()


class _Meter(nn.Module):
    """Parameter-free: notes the sequence length of the inputs (it runs for real on every stage)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.length = idx.shape[1]
        return idx


class MeterLM(models.ToyLM):
    """A parameter-free module writes in segment 0; the head's segment reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.meter = _Meter()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(self.meter(idx), targets) * (self.meter.length / models.SEQ)


class RootState(models.ToyLM):
    """The model itself keeps a value after block 0 that it reads after block 2."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0]((self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                self.gain = 1.0 + float(x.detach().abs().mean())
            if i == 2:
                x = x * self.gain
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        return nn.functional.cross_entropy(self.head(self.ln_f(x)).reshape(-1, models.VOCAB), targets.t().reshape(-1))


def test_writes_reads_and_where_a_read_comes_from_are_found() -> None:
    model = models.StateAcrossCut()
    assert _structure(model).module_state == (AttributeUse("blocks.0", "scale", (1,), (3,), ((1, 3),)),)
    # the model itself writes self.gain after block 0 and reads it after block 2
    assert _structure(RootState()).module_state == (AttributeUse("", "gain", (1,), (3,), ((1, 3),)),)
    with pytest.raises(CutPointError, match=r"^the model \(RootState\) keeps attribute 'gain'"):
        pipelined(_seeded(RootState), [(0, 3), (3, 5)], models.batch(3))
    # a counter reads the previous forward's value and writes in its own segment
    counting = _structure(models.CountingLM()).module_state
    assert [(u.module, u.attr, u.flows) for u in counting] == [
        (f"blocks.{i}", "calls", ((i + 1, i + 1),)) for i in range(4)]


def test_a_model_that_writes_nothing_records_nothing_and_keeps_its_classes() -> None:
    model = models.ToyLM()
    assert _structure(model).module_state == ()
    assert all(type(b) is models.Block for b in model.blocks) and type(model) is models.ToyLM


def test_the_dry_runs_leave_the_attributes_as_they_were() -> None:
    counting, state = models.CountingLM(), models.StateAcrossCut()
    _structure(counting)
    _structure(state)
    assert [b.calls for b in counting.blocks] == [0, 0, 0, 0]
    assert state.blocks[0].scale == 0.0
    assert type(state.blocks[0]).__name__ == "_ScaleWriter" and type(state.blocks[0]) is not type(state.blocks[2])


def test_a_module_whose_class_cannot_be_swapped_is_judged_by_its_values(monkeypatch, caplog) -> None:
    make = module_state._spy_class

    def refuse(cls, *args):
        if cls is models._ScaleWriter:
            raise TypeError("__class__ assignment only supported for mutable types")
        return make(cls, *args)

    monkeypatch.setattr(module_state, "_spy_class", refuse)
    model = models.StateAcrossCut()
    assert _structure(model).module_state == (AttributeUse("blocks.0", "scale", (1,), (1,), ((1, 1),)),)
    assert "'blocks.0' (_ScaleWriter) changes attribute 'scale'" in caplog.text
    assert model.blocks[0].scale == 0.0 and type(model.blocks[0]) is models._ScaleWriter


def test_structure_round_trips_through_json() -> None:
    structure = _structure(models.StateAcrossCut())
    assert Structure.from_json(json.loads(json.dumps(structure.to_json()))) == structure


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 5)], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]])
def test_a_value_kept_across_stages_is_refused_by_name(ranges) -> None:
    with pytest.raises(CutPointError) as err:
        pipelined(_seeded(models.StateAcrossCut), ranges, models.batch(3))
    message = str(err.value)
    assert "\n" not in message
    for part in ("'blocks.0'", "(_ScaleWriter)", "'scale'", "segment 1 (stage", "segment 3 (stage", "read a stale"):
        assert part in message, (part, message)
    assert "return" in err.value.hint and "one stage" in err.value.hint


def test_a_value_kept_within_one_stage_trains_as_one_process() -> None:
    ref = reference(_seeded(models.StateAcrossCut), models.batch(3))
    loss, grads, _ = pipelined(_seeded(models.StateAcrossCut), [(0, 1), (1, 5)], models.batch(3))
    assert loss == pytest.approx(ref[0], rel=1e-6, abs=0) and set(grads) == set(ref[1])


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 5)], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]])
def test_a_module_reading_its_own_cache_is_no_crossing(ranges) -> None:
    structure = _structure(CachingLM())
    assert {(u.attr, u.flows) for u in structure.module_state} == {
        ("_seq_len_cached", ((2, 2),)), ("_table", ((2, 2),))}
    pipelined(_seeded(CachingLM), ranges, models.batch(3))


def test_a_parameter_free_writer_runs_on_every_stage() -> None:
    model = MeterLM()
    structure = _structure(model)
    assert [(u.module, u.attr, u.flows) for u in structure.module_state] == [("meter", "length", ((0, 4),))]
    check_state_crossings(model, structure.module_state, Partition.from_ranges([(0, 2), (2, 5)], 5))
    # read before it is written (the previous forward's value) on another stage: refused
    late = (AttributeUse("meter", "length", (4,), (0,), ((4, 0),)),)
    with pytest.raises(CutPointError, match=r"'meter'.*'length'.*segment 4 \(stage 1\).*segment 0 \(stage 0\)"):
        check_state_crossings(model, late, Partition.from_ranges([(0, 2), (2, 5)], 5))


class _Gauge(nn.Module):
    """Parameter-free, but measures an activation: a stage whose input comes from an earlier stage cannot run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.level = float(x.detach().abs().mean()) if x.device.type != "meta" else 0.0
        return x


class GaugeLM(models.ToyLM):
    """A parameter-free module measures block 0's output (segment 1); block 2's segment reads the measure."""

    def __init__(self) -> None:
        super().__init__()
        self.gauge = _Gauge()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0]((self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                x = self.gauge(x)
            if i == 2:
                x = x * self.gauge.level
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        return nn.functional.cross_entropy(self.head(self.ln_f(x)).reshape(-1, models.VOCAB), targets.t().reshape(-1))


def test_a_parameter_free_writer_that_a_stage_cannot_run_is_refused_there() -> None:
    assert [(u.module, u.flows) for u in _structure(GaugeLM()).module_state] == [("gauge", ((1, 3),))]
    with pytest.raises(CutPointError, match=r"^on stage 1, module 'gauge' \(_Gauge\) writes attributes that this"):
        pipelined(_seeded(GaugeLM), [(0, 2), (2, 5)], models.batch(3))
    ref = reference(_seeded(GaugeLM), models.batch(3))
    assert pipelined(_seeded(GaugeLM), [(0, 1), (1, 5)], models.batch(3))[0] == pytest.approx(ref[0], rel=1e-6)


def test_a_recompute_sees_what_its_forward_saw_and_counts_once() -> None:
    block = models.CountingLM().blocks[0]
    snapshot = AttributeSnapshot([(block, "calls"), (block, "absent")])
    seen = snapshot.take()  # before F
    block.calls += 1  # F
    block.calls += 1  # a later micro-batch's F
    with snapshot.installed(seen):  # R
        assert block.calls == 0 and not hasattr(block, "absent")
        block.calls += 1
        block.absent = 1
    assert block.calls == 2 and not hasattr(block, "absent")


def test_the_profiler_times_each_segment_of_a_model_keeping_state_across_segments() -> None:
    """Profiling cuts every segment into a stage of its own: module state read in another segment is the
    plan's concern (a plan keeping writer and reader on one stage runs), not the profiler's."""
    from varuna_core.model.spec import ModelSpec
    from varuna_core.profiling.run import profile

    spec = ModelSpec(build=models.StateAcrossCut, batch=models.batch, name="state-across-cut")
    result = profile(spec, microbatch_sizes=[2], repeats=1, warmup=0)
    assert result.num_segments == 5
