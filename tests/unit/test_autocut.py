"""cutpoints="auto": where the cuts go, what the model keeps, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests import models
from varuna_core import CutPoint, ModelSpec, Varuna
from varuna_core.errors import ConfigError, CutPointError
from varuna_core.model.autocut import AUTO_ATTRIBUTE, apply_auto_cutpoints, block_stacks, longest_module_list


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
