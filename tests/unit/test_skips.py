"""Skip routing (see [Note: skip routing]): discovery finds the tensors read after a cut that the cut does not
carry, and stages carry them. Checked in one process with every stage of a pipeline (tests.stage_chain):
loss and every gradient equal the unsliced model's, for hand-placed CutPoints (a U-Net-like model) and
automatic ones (T5 and BART built from configs), in every partition tried."""

from __future__ import annotations

import json

import pytest
import torch

from tests import models
from tests.stage_chain import pipelined, reference
from varuna_core.errors import CutPointError
from varuna_core.model import discovery
from varuna_core.model.discovery import Structure, discover, make_batch_fn

UNET_PARTITIONS = [
    [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)],  # every cut a stage boundary
    [(0, 2), (2, 6)],
    [(0, 3), (3, 5), (5, 6)],
    [(0, 1), (1, 5), (5, 6)],  # a stage that only passes skips on
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def _structure(model, inputs=None, **kw) -> Structure:
    fn, dims = make_batch_fn(inputs if inputs is not None else models.batch(3), None)
    return discover(model, fn, dims, **kw)


def _seeded(cls, seed: int = 0):
    def make():
        torch.manual_seed(seed)
        return cls()
    return make


def _assert_same(ref, got) -> None:
    (ref_loss, ref_grads), (loss, grads) = ref, got[:2]
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0)
    assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
    for name, grad in ref_grads.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert ((grads[name] - grad).abs().max() / scale).item() <= 1e-5, name


def test_discovery_finds_what_skips_each_cut() -> None:
    s = _structure(models.UNetLM(), use_cache=False)
    found = {(k.source, k.name, k.produced, k.reads) for k in s.skips}
    # h0 (the embedding's output) is read in segment 1 and by the head; h1 and h2 leave cuts 1 and 2
    assert found == {("module", "emb", 0, (1, 5)), ("cut", "cuts.1", 2, (5,)), ("cut", "cuts.2", 3, (4,))}
    assert [len(s.skips_across(b)) for b in range(5)] == [1, 1, 2, 3, 2]
    crossing = s.crossing(3)
    assert len(crossing.leaves) == 4 and crossing.describe(2).count("[2, 6, 16] float32") == 4
    assert s.param_uses["pos"] == (0, 5)  # read again where the carried embedding is used: held there too


def test_a_model_without_skips_sends_exactly_its_cut_values() -> None:
    s = _structure(models.ToyLM(), use_cache=False)
    assert s.skips == ()
    assert all(s.crossing(b) is s.cuts[b] for b in range(len(s.cuts)))


@pytest.mark.parametrize("placeholders", ["meta", "real"])
@pytest.mark.parametrize("ranges", UNET_PARTITIONS, ids=lambda r: "-".join(f"{a}{b}" for a, b in r))
def test_unet_stages_equal_the_unsliced_model(ranges, placeholders) -> None:
    make, inputs = _seeded(models.UNetLM), models.batch(3)
    _assert_same(reference(make, inputs), pipelined(make, ranges, inputs, placeholders, shared=models.SHARED))


@pytest.mark.parametrize("ranges", [[(0, 1), (1, 5)], [(0, 2), (2, 4), (4, 5)]])
def test_a_skip_straight_into_the_head_is_carried(ranges) -> None:
    make, inputs = _seeded(models.SkipAcrossCut), models.batch(2)
    _assert_same(reference(make, inputs), pipelined(make, ranges, inputs, shared=models.SHARED))


def test_a_stage_that_only_passes_a_skip_on_keeps_its_placeholder() -> None:
    _, _, stages = pipelined(_seeded(models.UNetLM), UNET_PARTITIONS[3], models.batch(2), shared=models.SHARED)
    middle = stages[1]
    assert middle._in_skips and middle._out_skips
    # it reads h0 (segment 1) and h1/h2 are produced on it; it puts back only what it reads
    assert [middle.structure.skips[i].name for i in middle._in_skips] == ["emb"]


def test_a_value_left_inside_a_module_is_named() -> None:
    with pytest.raises(CutPointError, match=r"blocks\.0\.ln.*inside 'blocks\.0'.*CutPoint 'cuts\.1'") as info:
        _structure(models.SkipInsideBlock(), use_cache=False)
    assert "return the value" in info.value.hint


class _InPlace(models.ToyLM):
    def forward(self, idx, targets):
        h = self.emb(idx)
        h.mul_(2.0)  # changes the embedding's output after it was computed
        x = self.cuts[0](h.transpose(0, 1))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x).transpose(0, 1) + h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, models.VOCAB), targets.reshape(-1))


def test_a_skipped_value_changed_in_place_is_refused() -> None:
    with pytest.raises(CutPointError, match=r"output 0 of module 'emb'.*changed in place") as info:
        _structure(_InPlace(), use_cache=False)
    assert "out-of-place" in info.value.hint


def test_skips_survive_the_structure_cache_and_old_entries_are_ignored(tmp_path) -> None:
    model = models.UNetLM()
    first = _structure(model)
    discovery._MEMO.clear()
    again = _structure(model)
    assert again is not first and again.skips == first.skips and again == first
    path = discovery.cache_dir() / f"{first.key}.json"
    data = json.loads(path.read_text())
    data["format"] = 1  # an entry written before skips existed
    path.write_text(json.dumps(data))
    discovery._MEMO.clear()
    assert discovery._cache_get(first.key) is None


@pytest.mark.parametrize("text", ['{"format": F, "key": "k", "skips": [["module"]]}', '{"format": F}', "[", "null",
                                  '{"format": F, "skips": ' + "[" * 5000 + "]" * 5000 + "}", "\x00" * 64])
def test_a_damaged_cache_entry_is_a_miss(text) -> None:
    model = models.UNetLM()
    key = discovery.structure_key(model, models.batch(1), models.batch(2), {"idx": 0, "targets": 0})
    discovery.cache_dir().mkdir(parents=True, exist_ok=True)
    (discovery.cache_dir() / f"{key}.json").write_text(text.replace("F", str(discovery.FORMAT_VERSION)))
    discovery._MEMO.clear()
    assert discovery._cache_get(key) is None
    assert _structure(model).skips  # discovered again


@pytest.mark.parametrize("carried", [{"_varuna_auto_cuts.0": ["0"]}, {"_varuna_auto_cuts.0": [-1]},
                                     {"_varuna_auto_cuts.0": [2**40]}, {"_varuna_auto_cuts.0": "0"},
                                     {"_varuna_auto_cuts.0": [True]}, {"_varuna_auto_cuts.0": None}, [], "x"])
def test_a_cache_entry_with_damaged_auto_cut_places_is_a_miss(carried) -> None:
    model = models.UNetLM()
    discovery._MEMO.clear()
    first = _structure(model)
    path = discovery.cache_dir() / f"{first.key}.json"
    data = json.loads(path.read_text())
    data["auto_carried"] = carried
    path.write_text(json.dumps(data))
    discovery._MEMO.clear()
    assert discovery._cache_get(first.key) is None




class _RootPositions(models.SequentialLM):
    """Auto cuts and a root-level parameter added before the first block: a later stage runs that code on
    NaN placeholders while the parameter lives elsewhere (on meta); the mix computes on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(models.SEQ, models.HIDDEN) * 0.1)

    def forward(self, idx, targets):
        x = self.blocks((self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1))
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, models.VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("ranges", [[(0, 1), (1, 4)], [(0, 2), (2, 3), (3, 4)]])
def test_auto_cuts_with_a_root_level_parameter_of_another_stage(ranges) -> None:
    from varuna_core.model.autocut import apply_auto_cutpoints

    def make():
        torch.manual_seed(0)
        model = _RootPositions()
        apply_auto_cutpoints(model)
        return model

    inputs = models.batch(3)
    _assert_same(reference(make, inputs), pipelined(make, ranges, inputs, "real", shared=models.SHARED))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_models_cut_automatically_equal_the_unsliced_model(name) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra")
    from tests import hf_models

    def make():
        torch.manual_seed(0)
        return hf_models.build(name, auto=True)

    inputs = hf_models.batch(name, 3)
    ref = reference(make, inputs)
    probe = make()
    fn, dims = make_batch_fn(inputs, None)
    structure = discover(probe, fn, dims, use_cache=False)
    n = structure.num_segments
    assert n == 5  # 3 encoder and 3 decoder blocks: a cut in front of blocks 1 and 2 of each stack
    assert any(s.name.endswith("encoder.layers.2") or s.name == "encoder.dropout" for s in structure.skips)
    for ranges in ([(0, 2), (2, 5)], [(0, 1), (1, 3), (3, 5)], [(i, i + 1) for i in range(n)]):
        _assert_same(ref, pipelined(make, ranges, inputs, "real"))


class _ThroughPython(models.ToyLM):
    """The embedding's mean leaves torch as a Python number and comes back as a new tensor read by the head:
    no tensor op leads from the embedding to its use, so nothing is carried."""

    def forward(self, idx, targets):
        h = self.emb(idx)
        scale = torch.tensor(1.0 + h.detach().abs().mean().item())
        x = self.cuts[0](h.transpose(0, 1))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x)).transpose(0, 1) * scale
        return torch.nn.functional.cross_entropy(logits.reshape(-1, models.VOCAB), targets.reshape(-1))


def test_a_value_that_leaves_torch_is_named_at_run_time() -> None:
    with pytest.raises(CutPointError, match=r"on stage 1, code before CutPoint 'cuts\.0' mixes") as info:
        pipelined(_seeded(_ThroughPython), [(0, 1), (1, 5)], models.batch(2), shared=models.SHARED)
    assert "Python number" in info.value.hint
