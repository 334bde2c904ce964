"""Structure discovery: cut order, batch dims, parameter uses, bad models, and the structure cache."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tests import models
from tests.models import SHARED, ToyLM, batch
from varuna_core.errors import ConfigError, CutPointError
from varuna_core.model.cutpoint import CutPoint, find_cutpoints
from varuna_core.model.discovery import discover, make_batch_fn, structure_key


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def _discover(model, inputs=None, **kw):
    fn, dims = make_batch_fn(inputs if inputs is not None else batch(3), None)
    return discover(model, fn, dims, **kw)


def test_cuts_segments_and_batch_dims() -> None:
    s = _discover(ToyLM(n_layer=4), use_cache=False)
    assert s.cut_names == ("cuts.0", "cuts.1", "cuts.2", "cuts.3")
    assert s.num_segments == 5
    for spec in s.cuts:  # [s, b, h]: the batch is dim 1
        (leaf,) = spec.leaves
        assert leaf.shape == (models.SEQ, 1, models.HIDDEN) and leaf.batch_dims == (1,)
        assert leaf.shape_for(5) == (models.SEQ, 5, models.HIDDEN)
    assert s.inputs == {"idx": 0, "targets": 0}


def test_parameter_and_buffer_uses() -> None:
    s = _discover(ToyLM(n_layer=4), use_cache=False)
    assert s.param_uses["emb.weight"] == (0, 4)  # the tied embedding: segment 0 and the head in segment 4
    assert s.param_uses["head.weight"] == (0, 4)
    assert s.param_uses["pos"] == (0,)  # root-level parameter used through `x + self.pos`
    assert s.param_uses["blocks.2.fc1.weight"] == (3,)
    assert s.buffer_uses["logit_scale"] == (4,)
    assert s.module_calls["blocks.1"][0].segment_start == 2


def test_dry_run_leaves_model_and_rng_alone() -> None:
    model = ToyLM(dropout=0.5)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _discover(model, use_cache=False)
    assert torch.equal(torch.rand(3), expected)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_callable_dummy_inputs_find_non_leading_batch_dim() -> None:
    def batch_fn(n):  # inputs given sequence-first
        b = batch(n)
        return {k: v.t().contiguous() for k, v in b.items()}

    class SeqFirst(ToyLM):
        def forward(self, idx, targets):
            return super().forward(idx.t(), targets.t())

    fn, dims = make_batch_fn(batch_fn, None)
    assert dims == {"idx": 1, "targets": 1}
    s = discover(SeqFirst(), fn, dims, use_cache=False)
    assert s.num_segments == 5


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (models.CutTwice, "called twice in one forward"),
        (models.ReducedCut, "none has a batch dim"),
        (models.NoCuts, "has no CutPoint"),
    ],
)
def test_bad_models(cls, message) -> None:
    with pytest.raises(CutPointError, match=message) as info:
        _discover(cls(), use_cache=False)
    assert info.value.hint


def test_forward_must_return_a_scalar_loss() -> None:
    class Logits(ToyLM):
        def forward(self, idx, targets):
            return self.head(self.emb(idx))

    with pytest.raises(ConfigError, match="must return the loss"):
        _discover(Logits(), use_cache=False)


def test_dummy_inputs_disagreeing_on_batch() -> None:
    with pytest.raises(ConfigError, match="disagree on the number of examples"):
        make_batch_fn({"idx": torch.zeros(3, 6, dtype=torch.long), "targets": torch.zeros(2, 6, dtype=torch.long)},
                      None)


def test_cache_hits_for_the_same_model_and_misses_for_a_changed_one() -> None:
    first = _discover(ToyLM(n_layer=4))
    again = _discover(ToyLM(n_layer=4))
    assert again is first  # served from the cache
    deeper = _discover(ToyLM(n_layer=5))
    assert deeper.key != first.key and deeper.num_segments == 6
    model = ToyLM(n_layer=4)
    model.blocks[0].drop.p = 0.3  # a scalar attribute changed: re-discovered
    assert _discover(model).key != first.key
    shorter = {"idx": batch(3)["idx"][:, :5], "targets": batch(3)["targets"][:, :5]}
    assert _discover(ToyLM(n_layer=4), batch(3) | shorter).key != first.key


def test_cache_key_follows_the_source_code(tmp_path) -> None:
    source = textwrap.dedent(
        """
        import torch, torch.nn as nn, torch.nn.functional as F
        from varuna_core import CutPoint
        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.a = nn.Linear(4, 4); self.cut = CutPoint(); self.b = nn.Linear(4, 1)
            def forward(self, x):
                return self.b(self.cut(self.a(x))).mean()
        """
    )
    keys = []
    for variant in (source, source.replace(".mean()", ".sum()")):
        path = tmp_path / f"m{len(keys)}" / "mod.py"
        path.parent.mkdir()
        path.write_text(variant)
        spec = importlib.util.spec_from_file_location(f"_disc_mod{len(keys)}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        model = module.M()
        x = {"x": torch.ones(2, 4)}
        keys.append(structure_key(model, {"x": torch.ones(1, 4)}, {"x": torch.ones(2, 4)}, {"x": 0}))
        assert _discover(model, x).key == keys[-1]
    assert keys[0] != keys[1]


def test_shared_weights_names_are_checked() -> None:
    from varuna_core.ir.partition import balance
    from varuna_core.model.stage import find_tie_sets, weight_groups

    model = ToyLM()
    s = _discover(model, use_cache=False)
    part = balance([1.0] * s.num_segments, 2)
    ties = find_tie_sets(model, s, part, weight_groups(model, SHARED))
    assert len(ties) == 1 and set(ties[0].names) == {"emb.weight", "head.weight"} and ties[0].stages == (0, 1)
    auto = find_tie_sets(model, s, part, weight_groups(model, None))  # one object used by two stages: found
    assert [t.stages for t in auto] == [(0, 1)]
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        weight_groups(model, [("emb.weight", "lm_head.weight")])


def test_a_cut_carrying_an_object_is_named() -> None:
    class Note:
        pass

    class ObjectCut(ToyLM):
        def forward(self, idx, targets):
            x = self.emb(idx).transpose(0, 1)
            x, _ = self.cuts[0]((x, Note()))
            return self.head(self.ln_f(x)).sum()

    with pytest.raises(CutPointError, match=r"CutPoint 'cuts\.0' carries a Note, which cannot cross a cut") as info:
        _discover(ObjectCut(n_layer=1), use_cache=False)
    assert info.value.hint


def test_dry_run_keeps_no_activation_alive() -> None:
    """The recorder keeps shapes, not values: the first dry run's module outputs are freed before the second."""
    import weakref

    alive: list[weakref.ref] = []
    kept_at_second_run: list[int] = []

    class Watched(ToyLM):
        def __init__(self) -> None:
            super().__init__(n_layer=4)
            for block in self.blocks:
                block.register_forward_hook(lambda m, a, out: alive.append(weakref.ref(out)))

        def forward(self, idx, targets):
            if alive:  # the run at 2 examples
                kept_at_second_run.append(sum(ref() is not None for ref in alive))
            return super().forward(idx, targets)

    s = _discover(Watched(), use_cache=False)
    assert kept_at_second_run == [0] and len(alive) == 8  # 4 blocks at 1 and at 2 examples
    assert s.module_calls["blocks.1"][0].output.tensor_leaves[0][1].batch_dims == (1,)


def test_cutpoints_in_a_plain_list_are_found_and_named() -> None:
    """The original's README keeps its CutPoints in a plain list: not registered, still found (named by the
    attribute and index), in the order the forward calls them."""
    model = models.ListCutLM(n_layer=4)
    assert not any(isinstance(m, CutPoint) for m in model.modules())
    assert list(find_cutpoints(model)) == ["cuts.0", "cuts.1", "cuts.2", "cuts.3"]
    s = _discover(model, use_cache=False)
    assert s.cut_names == ("cuts.0", "cuts.1", "cuts.2", "cuts.3")
    assert s.cuts == _discover(ToyLM(n_layer=4), use_cache=False).cuts


def test_cutpoints_in_nested_modules_dicts_and_tuples_are_named_by_their_path() -> None:
    inner = torch.nn.Module()
    inner.marks = {"a": CutPoint(), "b": CutPoint()}
    outer = torch.nn.Module()
    outer.inner = inner
    outer.pair = (CutPoint(), 3)
    outer.registered = CutPoint()
    outer.again = [outer.registered]  # a registered one listed again keeps its registered name
    assert list(find_cutpoints(outer)) == ["registered", "pair.0", "inner.marks.a", "inner.marks.b"]


def test_a_value_is_assembled_from_its_tensors_by_its_spec() -> None:
    """One way back from a value's tensors to the value (the executor, the profiler and placeholders each had
    their own); constants are Const leaves, written as before in the structure cache."""
    from varuna_core.model.payload import Const, ValueSpec, spec_from_probes

    def value(n):
        return {"h": torch.zeros(n, 3), "flag": True, "rest": (None, torch.ones(2, n, dtype=torch.long), "x")}

    spec = spec_from_probes(value(1), value(2))
    assert [leaf for leaf in spec.leaves if isinstance(leaf, Const)] == [Const(True), Const(None), Const("x")]
    tensors = [torch.full((4, 3), 7.0), torch.full((2, 4), 5, dtype=torch.long)]
    got = spec.assemble(tensors)
    assert got["flag"] is True and got["rest"][0] is None and got["rest"][2] == "x"
    assert got["h"] is tensors[0] and got["rest"][1] is tensors[1]
    assert ValueSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert {"const": True} in spec.to_json()["leaves"]
    meta = spec.placeholder(4)
    assert meta["h"].is_meta and list(meta["h"].shape) == [4, 3] and meta["flag"] is True


def test_flatten_remembers_each_structures_json_and_tells_structures_apart() -> None:
    """The executor flattens every forward's output; the JSON of a structure is remembered, so it must be the one
    ``treespec_dumps`` gives for that structure, whatever was flattened before."""
    import torch.utils._pytree as pytree

    from varuna_core.model import payload

    t = torch.zeros(2)
    values = [t, (t, t), [t, t], {"a": t, "b": t}, {"b": t, "a": t}, (t, None, 3), {"a": (t, [t])}]
    for _ in range(2):  # the second round from the memo
        for value in values:
            leaves, text = payload.flatten(value)
            want_leaves, spec = pytree.tree_flatten(value)
            assert text == pytree.treespec_dumps(spec) and leaves == want_leaves
    texts = {payload.flatten(v)[1] for v in values}
    assert len(texts) == len(values)  # the key order of a dict is part of its structure
    assert payload.flatten((t, None, 4))[1] == payload.flatten((t, None, 3))[1]  # a leaf differs, not the structure


def test_dry_run_in_training_mode_records_and_restores_the_buffers_it_writes() -> None:
    """Discovery runs in the model's mode: BatchNorm in training mode updates its statistics (running_mean without
    bumping its version counter) and a counter buffer; both are recorded as written, and every buffer, the
    training flags and the random stream are as before afterwards."""
    model = models.BatchNormLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    s = _discover(model, use_cache=False)
    assert torch.equal(torch.rand(3), expected)
    assert all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    assert "blocks.0.calls" in s.buffer_writes
    assert {"blocks.1.bn.running_mean", "blocks.1.bn.running_var", "blocks.1.bn.num_batches_tracked",
            "bn_f.running_mean"} <= set(s.buffer_writes)
    model.eval()  # the same model in eval mode writes nothing, and its structure is cached under another key
    assert _discover(model).buffer_writes == ()
    assert _discover(ToyLM(), use_cache=False).buffer_writes == ()


def test_a_replaced_buffer_is_recorded_and_put_back() -> None:
    class Replacing(ToyLM):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, idx, targets):
            self.seen = self.seen + idx.shape[0]  # a new tensor in the buffer slot
            return super().forward(idx, targets)

    model = Replacing()
    original = model.seen
    s = _discover(model, use_cache=False)
    assert s.buffer_writes == ("seen",)
    assert model.seen is original and float(original) == 0.0


def test_structures_of_the_two_modes_are_compared() -> None:
    from varuna_core.model.modes import all_in_mode, structure_difference

    model = models.ModeDependentLM()
    train = _discover(model, use_cache=False)
    with all_in_mode(model, False):
        evaluation = _discover(model, use_cache=False)
    assert all(m.training for m in model.modules())
    difference = structure_difference(train, evaluation, "training mode", "eval mode")
    assert difference is not None and "cuts.1" in difference and "eval mode" in difference
    same = _discover(ToyLM(), use_cache=False)
    with all_in_mode(model, False):
        assert structure_difference(same, _discover(ToyLM().eval(), use_cache=False), "a", "b") is None


class _NormedMLP(nn.Module):
    """BatchNorm1d over ``[N, C]``: in training mode it refuses a batch of one example."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.cut = CutPoint()
        self.b = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, x, y):
        return ((self.b(self.cut(self.a(x))).squeeze(1) - y) ** 2).mean()


def test_batch_norm_over_one_example_does_not_stop_discovery_in_training_mode() -> None:
    """The 1-example probe runs in training mode (the mode the model trains in), where BatchNorm1d refuses one
    value per channel; the probe gets through, records the structure, and leaves the statistics as they were."""
    torch.manual_seed(0)
    model = _NormedMLP()
    before = {n: b.clone() for n, b in model.named_buffers()}
    inputs = {"x": torch.randn(4, 4), "y": torch.randn(4)}
    fn, dims = make_batch_fn(inputs, None)
    s = discover(model, fn, dims, use_cache=False)
    assert s.num_segments == 2 and s.cuts[0].leaves[0].shape == (1, 8)
    assert {"a.1.running_mean", "b.1.num_batches_tracked"} <= set(s.buffer_writes)
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
    assert model.training
