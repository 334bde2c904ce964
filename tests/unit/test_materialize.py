"""``materialize`` and ``meta_init``: values that depend on the seed and the tensor's owner only -- not on which
modules a rank materialises, in which order, in which process -- and clear errors instead of garbage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models import ToyLM, batch
from varuna_core import ConfigError, materialize, meta_init

ROOT = Path(__file__).resolve().parents[2]
SEED = 1234


def toy_init(module: nn.Module) -> None:
    """ToyLM's root-level ``pos`` has no ``reset_parameters``; everything else uses its own."""
    if isinstance(module, ToyLM):
        nn.init.normal_(module.pos, std=0.1)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def build_toy() -> ToyLM:
    with meta_init():
        return ToyLM(n_layer=4)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer slot by name (tied slots under each name)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    model = materialize(build_toy(), seed=SEED, init=toy_init)
    assert model.head.weight is model.emb.weight
    return {k: v.detach().clone() for k, v in tensors(model).items()}


# ----------------------------------------------------------------------------------------------------------
# meta_init


def test_meta_init_puts_parameters_on_meta_and_keeps_buffers_real():
    original = nn.Module.register_parameter
    model = build_toy()
    assert nn.Module.register_parameter is original
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.emb.weight  # ties survive
    assert torch.equal(model.logit_scale, torch.linspace(0.5, 1.5, model.logit_scale.numel()))


def test_meta_init_restores_the_patch_on_error_and_when_nested():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), meta_init():
        with meta_init():
            assert nn.Linear(2, 2).weight.is_meta
        assert nn.Linear(2, 2).weight.is_meta  # the outer context still holds
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


# ----------------------------------------------------------------------------------------------------------
# (a) layout independence


def test_materialize_allocates_initialises_and_ties(reference):
    model = materialize(build_toy(), seed=SEED, init=toy_init)
    assert not any(t.is_meta for t in tensors(model).values())
    assert model.head.weight is model.emb.weight
    for name, value in tensors(model).items():
        assert torch.equal(value, reference[name]), name
        assert not torch.isnan(value).any(), name
    other = materialize(build_toy(), seed=SEED + 1, init=toy_init)
    assert not torch.equal(other.blocks[0].fc1.weight, model.blocks[0].fc1.weight)
    assert model(**batch(2)).isfinite()


def test_materialize_leaves_the_callers_random_stream_alone():
    model = build_toy()  # building draws (ToyLM's pos): only materialize is under test
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    materialize(model, seed=SEED, init=toy_init)
    assert torch.equal(torch.rand(3), expected)


def test_same_values_in_another_process_with_another_hash_seed(reference, tmp_path):
    out = tmp_path / "state.pt"
    script = textwrap.dedent(f"""
        import torch
        from tests.unit.test_materialize import build_toy, tensors, toy_init
        from varuna_core import materialize
        torch.manual_seed(99)  # the caller's stream must not matter either
        model = materialize(build_toy(), seed={SEED}, init=toy_init)
        torch.save({{k: v.detach() for k, v in tensors(model).items()}}, {str(out)!r})
    """)
    env = {**os.environ, "PYTHONHASHSEED": "4321", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env=env, timeout=120)
    theirs = torch.load(out)
    assert theirs.keys() == reference.keys()
    for name, value in theirs.items():
        assert torch.equal(value, reference[name]), name


def split(names: list[str], k: int, interleave: bool) -> list[list[str]]:
    if interleave:
        return [names[i::k] for i in range(k)]
    size = -(-len(names) // k)
    return [names[i * size:(i + 1) * size] for i in range(k)]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("interleave", [False, True])
def test_stages_materialised_separately_match_the_reference(reference, k, interleave):
    """Each group of modules (a stage) in a fresh copy: only its tensors are allocated, each equal to the
    single-process reference; together the groups cover every tensor."""
    names = [n for n, _ in build_toy().named_modules()]
    covered: set[str] = set()
    for group in split(names, k, interleave):
        model = materialize(build_toy(), seed=SEED, init=toy_init, modules=set(group))
        for name, value in tensors(model).items():
            owner = name.rpartition(".")[0]
            tied_here = name in ("emb.weight", "head.weight") and {"emb", "head"} & set(group)
            if owner in group or tied_here:
                assert not value.is_meta, name
                assert torch.equal(value, reference[name]), name
                covered.add(name)
            elif name in dict(model.named_buffers()):  # real since meta_init: left as built
                assert torch.equal(value, reference[name]), name
            else:
                assert value.is_meta, name
        if "head" in group:  # a stage with the head but maybe not the embedding holds the tied weight once
            assert model.head.weight is model.emb.weight
    assert covered == set(reference)


def test_groups_in_any_order_on_one_model_match_the_reference(reference):
    names = [n for n, _ in build_toy().named_modules()]
    model = build_toy()
    for group in reversed(split(names, 4, interleave=True)):
        materialize(model, seed=SEED, init=toy_init, modules=lambda n, g=set(group): n in g)
    for name, value in tensors(model).items():
        assert torch.equal(value, reference[name]), name
    assert model.head.weight is model.emb.weight


# ----------------------------------------------------------------------------------------------------------
# (b) Hugging Face GPT-2 and Llama


def hf_build(name: str, meta: str | None) -> nn.Module:
    tf = pytest.importorskip("transformers")
    if name == "gpt2":
        cls, cfg = tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                                     bos_token_id=0, eos_token_id=0)
    else:
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=100, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    if meta == "meta_init":
        with meta_init():
            return cls(cfg)
    if meta == "device":
        with torch.device("meta"):
            return cls(cfg)
    return cls(cfg)


def hf_loss(model: nn.Module) -> torch.Tensor:
    model.eval()  # no dropout: the loss depends on the weights alone
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_built_under_meta_init(name):
    a = materialize(hf_build(name, "meta_init"), seed=SEED)
    b = materialize(hf_build(name, "meta_init"), seed=SEED)
    assert torch.equal(hf_loss(a), hf_loss(b))
    assert torch.isfinite(hf_loss(a))
    for key, value in tensors(a).items():
        assert torch.equal(value, tensors(b)[key]), key
    normal = dict(hf_build(name, None).named_buffers())
    assert dict(a.named_buffers()).keys() == normal.keys()
    for key, value in a.named_buffers():  # Llama's rotary tables (GPT-2 here has no buffers)
        assert torch.equal(value, normal[key]), key


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_built_on_meta_device_comes_out_right_or_says_so(name):
    """Found with transformers 5.x: ``_init_weights`` restores rotary ``inv_freq``/``original_inv_freq``
    itself, and GPT-2 keeps no causal-mask buffer, so both come out right; an older or custom model that does
    not restore a buffer gets the error tested in ``test_unrestored_meta_buffer_is_an_error``."""
    model = hf_build(name, "device")
    try:
        materialize(model, seed=SEED)
    except ConfigError as e:
        assert "meta_init" in str(e)
        return
    reference = materialize(hf_build(name, "meta_init"), seed=SEED)
    for key, value in tensors(model).items():
        assert torch.equal(value, tensors(reference)[key]), key


def test_hf_parent_initialiser_wins_and_stages_match():
    """GPT-2 scales ``c_proj`` in its attention's ``_init_weights`` (a parent's initialiser): that must win,
    also when the block is materialised on its own."""
    reference = tensors(materialize(hf_build("gpt2", "meta_init"), seed=SEED))
    std = reference["transformer.h.0.attn.c_proj.weight"].std().item()
    assert 0.006 < std < 0.014  # 0.02 / sqrt(2 * n_layer) = 0.01, not the plain 0.02
    names = [n for n, _ in hf_build("gpt2", "meta_init").named_modules()]
    for group in split(names, 2, interleave=True):
        model = materialize(hf_build("gpt2", "meta_init"), seed=SEED, modules=set(group))
        for key, value in tensors(model).items():
            if not value.is_meta:
                assert torch.equal(value, reference[key]), key


# ----------------------------------------------------------------------------------------------------------
# (c) errors, (d) nothing on meta


def test_no_initialiser_is_an_error_naming_the_tensor():
    model = build_toy()
    with pytest.raises(ConfigError, match=r"'pos'.*init=") as info:
        materialize(model, seed=SEED)
    assert "ToyLM" in str(info.value)
    assert model.pos.is_meta  # left as it came


def test_partial_initialiser_is_an_error():
    with pytest.raises(ConfigError, match=r"fc1\.bias"):
        materialize(build_toy(), seed=SEED,
                    init=lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else toy_init(m))


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


def test_unrestored_meta_buffer_is_an_error_pointing_to_meta_init():
    with torch.device("meta"):
        model = WithMask()
    with pytest.raises(ConfigError, match=r"buffer 'mask'.*meta_init\(\)"):
        materialize(model, seed=SEED)
    with meta_init():
        model = WithMask()
    materialize(model, seed=SEED)
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))


@pytest.mark.parametrize("seed", [2**64, -1, 2.5, True, "1", None])
def test_bad_seed(seed):
    with pytest.raises(ConfigError, match="seed"):
        materialize(build_toy(), seed=seed, init=toy_init)


def test_largest_seed_is_fine():
    materialize(build_toy(), seed=2**64 - 1, init=toy_init)


@pytest.mark.parametrize("modules", [{"blocks.9"}, {"emb", "blokcs.0"}, "emb", 3])
def test_bad_module_selection(modules):
    with pytest.raises(ConfigError, match="modules"):
        materialize(build_toy(), seed=SEED, init=toy_init, modules=modules)


def test_bad_init_and_device():
    with pytest.raises(ConfigError, match="init"):
        materialize(build_toy(), seed=SEED, init="normal")
    with pytest.raises(ConfigError, match="meta"):
        materialize(build_toy(), seed=SEED, device="meta")


def test_model_without_meta_tensors_is_left_unchanged():
    """No re-initialisation of real tensors: they may be trained or loaded values."""
    torch.manual_seed(0)
    model = ToyLM(n_layer=2)
    before = {k: (v, v.detach().clone()) for k, v in tensors(model).items()}
    assert materialize(model, seed=SEED) is model  # no initialiser needed: nothing to initialise
    for key, value in tensors(model).items():
        assert value is before[key][0] and torch.equal(value, before[key][1]), key


@pytest.mark.parametrize("device", ["tpu", "garbage", 1.5, *(["cuda", "cuda:0", 0] if not torch.cuda.is_available()
                                                           else ["cuda:7000", 7000])])
def test_a_device_this_machine_lacks_is_named_before_anything_is_allocated(device):
    model = build_toy()
    with pytest.raises(ConfigError, match=r"device=.* is not a device.*this machine has cpu") as e:
        materialize(model, seed=SEED, device=device)
    assert "Expected one of" not in str(e.value)
    assert all(t.is_meta for t in model.parameters())
