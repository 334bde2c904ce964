"""The example GPT (examples/gpt) runs unpartitioned: finite loss, cutpoints, tied weights, learning, data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from varuna_core import CutPoint

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def _load(name: str):
    """Import examples/gpt/<name>.py under a unique module name (no sys.path changes)."""
    mod_name = f"_example_gpt_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, GPT_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt():
    return _load("model")


@pytest.fixture(scope="module")
def data():
    return _load("data")


def _tiny(gpt, vocab_size=16, n_layer=3):
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)
    return gpt.GPT(cfg)


def _fixed_batch(vocab_size=16, b=4, t=16):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(vocab_size, (b, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def test_loss_is_finite_and_near_uniform_at_init(gpt):
    model = _tiny(gpt)
    idx, targets = _fixed_batch()
    loss = model(idx, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(16.0)).item()) < 0.5  # small init: close to ln(V)


def test_one_cutpoint_per_layer(gpt):
    for n_layer in (1, 3, 4):
        model = _tiny(gpt, n_layer=n_layer)
        cuts = [m for m in model.modules() if isinstance(m, CutPoint)]
        assert len(cuts) == n_layer  # n_layer + 1 segments


def test_each_cutpoint_is_called_once_per_forward(gpt):
    model = _tiny(gpt, n_layer=3)
    calls = []
    cuts = [m for m in model.modules() if isinstance(m, CutPoint)]
    handles = [c.register_forward_hook(lambda mod, inp, out, i=i: calls.append(i)) for i, c in enumerate(cuts)]
    model(*_fixed_batch())
    for h in handles:
        h.remove()
    assert calls == [0, 1, 2]


def test_lm_head_is_tied_to_token_embedding(gpt):
    model = _tiny(gpt)
    assert model.lm_head.weight is model.wte.weight
    names = dict(model.named_parameters(remove_duplicate=False))
    for a, b in gpt.SHARED_WEIGHTS:
        assert names[a] is names[b]


def test_one_adamw_step_lowers_the_loss(gpt):
    model = _tiny(gpt)
    idx, targets = _fixed_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = model(idx, targets)
    before.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        after = model(idx, targets)
    assert after.item() < before.item()


def test_logits_and_generate(gpt):
    model = _tiny(gpt)
    idx, targets = _fixed_batch()
    logits = model.logits(idx)
    assert logits.shape == (4, 16, 16)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))
    torch.testing.assert_close(loss, model(idx, targets))
    out = gpt.generate(model, idx[:1, :3], max_new_tokens=20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 23) and int(out.max()) < 16
    assert model.training  # generate restores the mode


def test_get_batch_is_deterministic_and_shifted(data):
    b1 = data.get_batch("train", 8, 32, torch.Generator().manual_seed(7))
    b2 = data.get_batch("train", 8, 32, torch.Generator().manual_seed(7))
    b3 = data.get_batch("train", 8, 32, torch.Generator().manual_seed(8))
    assert set(b1) == {"idx", "targets"}
    assert b1["idx"].shape == (8, 32) and b1["idx"].dtype == torch.long
    assert torch.equal(b1["idx"], b2["idx"]) and torch.equal(b1["targets"], b2["targets"])
    assert not torch.equal(b1["idx"], b3["idx"])
    assert torch.equal(b1["idx"][:, 1:], b1["targets"][:, :-1])
    val = data.get_batch("val", 2, 32, torch.Generator().manual_seed(7))
    assert val["idx"].shape == (2, 32)


def test_vocab_round_trip(data):
    ds = data.default_dataset()
    text = "In the beginning God created the heaven and the earth."
    assert data.decode(data.encode(text)) == text
    assert ds.chars == sorted(ds.chars) and ds.vocab_size == len(ds.chars)
    with pytest.raises(ValueError):
        data.get_batch("test", 2, 8, torch.Generator())
