"""cutpoints="auto": where the cuts go, what the model keeps, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests import models
from varuna_core import CutPoint, ModelSpec, Varuna
from varuna_core.errors import ConfigError, CutPointError
from varuna_core.ir.partition import Partition
from varuna_core.model.autocut import (
    AUTO_ATTRIBUTE,
    apply_auto_cutpoints,
    block_stacks,
    longest_module_list,
    repeated_module,
)
from varuna_core.model.discovery import discover, dry_forward, make_batch_fn
from varuna_core.model.stage import find_tie_sets, weight_groups


class Plain(nn.Module):
    """Blocks in a ModuleList, a shorter ModuleList of heads, and a tied head; no CutPoint."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx, targets):
        x = self.emb(idx)
        scale = torch.ones_like(x)  # loop-invariant, computed before the loop
        for block in self.blocks:
            x = torch.tanh(block(x)) * scale
        for head in self.heads:
            x = head(x)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def inputs(n: int = 2) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"idx": torch.randint(0, 11, (n, 5), generator=g), "targets": torch.randint(0, 11, (n, 5), generator=g)}


def test_every_block_stack_gets_a_cut_before_every_block_but_the_first() -> None:
    model = Plain()
    keys = set(model.state_dict())
    assert longest_module_list(model)[0] == "blocks"
    assert [name for name, _ in block_stacks(model)] == ["blocks", "heads"]
    cut = ["blocks.1", "blocks.2", "blocks.3", "heads.1"]
    assert apply_auto_cutpoints(model) == cut
    assert apply_auto_cutpoints(model) == cut  # idempotent
    assert len(getattr(model, AUTO_ATTRIBUTE)) == 4 and set(model.state_dict()) == keys
    before = Plain()
    before.load_state_dict(model.state_dict())
    assert torch.equal(model(**inputs()), before(**inputs()))  # inactive cuts change nothing


def test_auto_cuts_in_one_process_find_the_tie_and_equal_the_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = Plain()
    reference = Plain()
    reference.load_state_dict(model.state_dict())
    vm = Varuna(model, "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")
    assert vm.structure.num_segments == 5 and vm.structure.cut_names[0] == f"{AUTO_ATTRIBUTE}.0"
    loss, _ = vm.step(inputs(4))
    assert loss == pytest.approx(reference(**inputs(4)).item(), rel=1e-6)


@pytest.mark.parametrize(("model", "message"), [
    (models.ToyLM(), "already has CutPoints"),
    (nn.Sequential(nn.Linear(2, 2)), "no block stack .* of at least 2 blocks"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), "no block stack"),
])
def test_models_auto_cannot_cut_are_refused(model, message) -> None:
    with pytest.raises(CutPointError, match=message):
        apply_auto_cutpoints(model)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="cutpoints must be 'auto' or None"):
        Varuna(Plain(), "0", inputs(), batch_size=2, chunk_size=1, cutpoints="yes")
    with pytest.raises(ConfigError, match=r"ModelSpec\.cutpoints"):
        ModelSpec(build=Plain, batch=inputs, cutpoints="all")
    spec = ModelSpec(build=Plain, batch=inputs, cutpoints="auto")
    assert any(isinstance(m, CutPoint) for m in spec.make().modules())


class Stacks(nn.Module):
    """Two stacks run one after the other (an encoder's nn.Sequential of repeated blocks, then a decoder's
    ModuleList), a small list of heads run side by side (no cut), and an MLP Sequential inside each block (not a
    stack: its children differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.encoder = nn.Sequential(*(Block() for _ in range(3)))
        self.decoder = nn.ModuleList(Block() for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 11)

    def forward(self, idx, targets):
        x = self.encoder(self.emb(idx))
        for block in self.decoder:
            x = block(x)
        x = sum(head(x) for head in self.heads)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return x + self.mlp(x)


def test_several_stacks_and_sequentials_are_cut_and_side_by_side_heads_are_not(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, reference = Stacks(), Stacks()
    reference.load_state_dict(model.state_dict())
    assert [name for name, _ in block_stacks(model)] == ["encoder", "decoder", "heads"]
    assert apply_auto_cutpoints(model) == ["encoder.1", "encoder.2", "decoder.1", "heads.1", "heads.2"]
    vm = Varuna(model, "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")
    assert vm.structure.num_segments == 4  # the heads' cut is never called: heads run side by side
    loss, _ = vm.step(inputs(4))
    assert loss == pytest.approx(reference(**inputs(4)).item(), rel=1e-6)


class _Attention(nn.Module):
    """A block that attends with the mask it is given (``[s, s]``), as layers of one attention type do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask):
        return x + torch.tanh(self.lin(mask @ x))


class Patterned(nn.Module):
    """Blocks of two attention types in a pattern (as Gemma's and ModernBERT's): each block takes the mask of its
    type, both computed once before the loop."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout.split(",")
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(_Attention() for _ in self.layout)
        self.out = nn.Linear(8, 11)

    def forward(self, idx, targets):
        x = self.emb(idx)
        s = idx.shape[1]
        masks = {"full": torch.ones(s, s) / s, "sliding": torch.ones(s, s).tril().triu(-1) / 2}
        for kind, block in zip(self.layout, self.blocks, strict=True):
            x = block(x, masks[kind])
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("layout", ["full,sliding,sliding,full", "sliding,full,full,sliding",
                                    "sliding,full,sliding,full", "sliding,sliding,sliding,full,sliding,sliding,full"])
def test_a_layer_type_pattern_carries_only_the_hidden_state(tmp_path, monkeypatch, layout) -> None:
    """Each mask reaches several blocks, so no cut carries one (a mask used by one block only would be carried
    by its cut: correct, if not the cheapest); the decision does not depend on the probe's size, so discovery
    agrees with itself at 1 and 2 examples, and a structure from the cache makes the cuts carry the same."""
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, reference = Patterned(layout), Patterned(layout)
    reference.load_state_dict(model.state_dict())
    vm = Varuna(model, "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")
    blocks = len(layout.split(","))
    assert vm.structure.num_segments == blocks
    for spec in vm.structure.cuts:
        assert [leaf.shape for leaf in spec.leaves] == [(1, 5, 8)]  # the hidden state alone
    assert set(vm.structure.auto_carried.values()) == {(0,)}
    loss, _ = vm.step(inputs(4))
    assert loss == pytest.approx(reference(**inputs(4)).item(), rel=1e-6)
    torch.manual_seed(0)
    again = Varuna(Patterned(layout), "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")  # cached
    assert again.structure is vm.structure and again.step(inputs(4))[0] == loss


def test_a_mask_used_by_one_block_only_crosses_its_cut() -> None:
    """The one sliding block's mask is first seen at that block and never again: its cut carries it."""
    from varuna_core.model.autocut import survey_auto_cuts

    model = Patterned("full,full,sliding,full")
    apply_auto_cutpoints(model)
    carried = survey_auto_cuts(model, lambda: model(**inputs()))
    assert carried == {f"{AUTO_ATTRIBUTE}.0": (0,), f"{AUTO_ATTRIBUTE}.1": (0, 1), f"{AUTO_ATTRIBUTE}.2": (0,)}


class Whole(nn.Module):
    """Neither a block stack nor a module called twice: nothing to cut."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 11))

    def forward(self, idx, targets):
        return nn.functional.cross_entropy(self.mlp(self.emb(idx)).flatten(0, 1), targets.flatten())


def test_one_stage_trains_a_model_with_nothing_to_cut_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, reference = Whole(), Whole()
    reference.load_state_dict(model.state_dict())
    vm = Varuna(model, "0", inputs(), batch_size=4, chunk_size=4, cutpoints="auto")
    assert vm.structure.num_segments == 1 and not hasattr(model, AUTO_ATTRIBUTE)
    loss, _ = vm.step(inputs(4))
    want = reference(**inputs(4))
    want.backward()
    assert loss == want.item()
    for name, param in vm.named_parameters():
        assert torch.equal(param.grad, reference.get_parameter(name).grad), name


def test_more_than_one_stage_needs_a_stack_or_a_module_called_repeatedly() -> None:
    model = Whole()
    with pytest.raises(CutPointError, match="nor a module with parameters that its forward calls at least twice"):
        apply_auto_cutpoints(model, dry_forward(model, inputs), stages=2)
    assert apply_auto_cutpoints(model, dry_forward(model, inputs), stages=1) == []


def test_a_module_called_at_every_depth_gets_a_cut_before_every_call_but_the_first(tmp_path, monkeypatch) -> None:
    """ReusedBlockLM calls its one block 5 times: 4 cuts, 5 segments, the block's weights read in every segment and
    so tied over the stages (one weight, a copy per stage, gradients summed after the pipeline)."""
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    model = models.ReusedBlockLM(n_layer=5)
    keys = set(model.state_dict())
    batch_fn, dims = make_batch_fn(models.batch, None)
    run = dry_forward(model, batch_fn)
    name, module, count = repeated_module(model, run)
    assert (name, module, count) == ("block", model.block, 5)
    assert apply_auto_cutpoints(model, run, stages=2) == [f"block#{k}" for k in range(1, 5)]
    assert apply_auto_cutpoints(model) == [f"block#{k}" for k in range(1, 5)]  # idempotent, no run needed
    assert len(getattr(model, AUTO_ATTRIBUTE)) == 4 and set(model.state_dict()) == keys
    before = models.ReusedBlockLM(n_layer=5)
    before.load_state_dict(model.state_dict())
    assert torch.equal(model(**models.batch(3)), before(**models.batch(3)))  # inactive cuts change nothing
    structure = discover(model, batch_fn, dims, use_cache=False)
    assert structure.num_segments == 5
    assert structure.param_uses["block.fc1.weight"] == (0, 1, 2, 3, 4)
    ties = find_tie_sets(model, structure, Partition.from_ranges([(0, 2), (2, 5)], 5), weight_groups(model, []))
    by_name = {tie.canonical: tie for tie in ties}
    assert by_name["block.fc1.weight"].stages == (0, 1) and by_name["emb.weight"].stages == (0, 1)
    assert "wpe.weight" not in by_name  # read in the first segment only


def test_a_forward_calling_the_module_more_times_than_it_has_cuts_is_refused() -> None:
    model = models.ReusedBlockLM(n_layer=3)
    apply_auto_cutpoints(model, dry_forward(model, models.batch), stages=2)
    model.depth = 4
    with pytest.raises(CutPointError, match="calls block more than the 3 times"):
        model(**models.batch(2))


class Steps(nn.Module):
    """A Universal-Transformer-like loop: a small step module and a larger block, both called 3 times per forward
    (the block's MLP too, inside it), and a module that calls itself (never one call after another)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.step = nn.Linear(8, 8)
        self.block = Block()
        self.tree = Tree()
        self.out = nn.Linear(8, 11)

    def forward(self, idx, targets):
        x = self.tree(self.emb(idx))
        for _ in range(3):
            x = self.block(self.step(x))
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


class Tree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, depth: int = 3):
        return x if depth == 0 else self(torch.tanh(self.lin(x)), depth - 1)


def test_the_outermost_largest_of_the_most_called_modules_is_cut(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, reference = Steps(), Steps()
    reference.load_state_dict(model.state_dict())
    # tree.lin is called 3 times too, but holds fewer parameters; tree calls itself
    assert repeated_module(model, dry_forward(model, inputs))[0] == "block"
    vm = Varuna(model, "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")
    assert vm.structure.num_segments == 3
    loss, _ = vm.step(inputs(4))
    assert loss == pytest.approx(reference(**inputs(4)).item(), rel=1e-6)


def test_the_dry_run_leaves_the_model_as_it_was() -> None:
    """Watching a forward for repeated modules changes no training flag, buffer, gradient or random stream."""
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 8)
            self.layer = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(5), nn.Dropout(0.5))
            self.layer[1].eval()  # a flag of its own, kept

        def forward(self, idx, targets):
            x = self.emb(idx)
            for _ in range(2):
                x = self.layer(x)
            return x.pow(2).mean()

    model = Normed()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    flags = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    assert repeated_module(model, dry_forward(model, inputs))[0] == "layer"
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


class _GroupedReuse(nn.Module):
    """Two blocks in a list, each called at three depths in turn (ALBERT with two layer groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.groups = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, 11)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for depth in range(6):
            x = self.groups[depth // 3](x)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def test_a_stack_whose_blocks_are_called_at_several_depths_is_refused_by_name() -> None:
    """One line naming the block, at the first forward (discovery's dry run), not a cut said to be crossed twice."""
    model = _GroupedReuse()
    assert apply_auto_cutpoints(model) == ["groups.1"]
    with pytest.raises(CutPointError, match=r"block 'groups.0' of a stack of 2 is called more than once in one "
                                            r"forward \(its weights are reused across depth\)") as info:
        Varuna(model, "0", inputs(), batch_size=4, chunk_size=2, cutpoints="auto")
    assert "CutPoint() calls by hand" in info.value.hint
    plain = _GroupedReuse()
    plain(**inputs())  # without cuts the model is untouched


def test_a_stack_called_once_per_forward_runs_any_number_of_forwards() -> None:
    model = Plain()
    apply_auto_cutpoints(model)
    for _ in range(3):
        model(**inputs())
