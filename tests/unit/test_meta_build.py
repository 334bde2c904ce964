"""Models built on ``meta`` in one process: running the unsliced model on values made as ops read them
(``on_touch``), slicing a stage that allocates only its own tensors, and ``Varuna(model_on_meta, seed=,
init=, weights=)`` -- with the values a plain process gets from ``materialize`` and ``load_weights``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests import hf_models
from tests.models import SHARED, ToyLM, batch, init_toy
from varuna_core import Varuna, materialize, meta_init
from varuna_core.errors import ConfigError
from varuna_core.ir.partition import Partition
from varuna_core.model import materialize as materialize_module
from varuna_core.model.discovery import discover, make_batch_fn
from varuna_core.model.lazy_values import ValueSource, on_touch
from varuna_core.model.stage import StageSlice, find_tie_sets, weight_groups

transformers = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]')")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def toy_on_meta() -> ToyLM:
    with meta_init():
        return ToyLM()


def toy_materialised(seed: int = 3) -> ToyLM:
    return materialize(toy_on_meta(), seed=seed, init=init_toy)


def hf_on_meta(name: str) -> torch.nn.Module:
    with meta_init():
        return hf_models.build(name)


# ----------------------------------------------------------------------------------------------------------
# on_touch


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_on_touch_runs_a_meta_model_on_the_values_materialize_gives(name) -> None:
    reference = materialize(hf_on_meta(name), seed=7).eval()
    model = hf_on_meta(name).eval()
    inputs = hf_models.batch(name, 2, 0)
    with torch.no_grad():
        want = reference(**inputs).loss
        with on_touch(model, ValueSource(seed=7), keep=2) as mode:
            got = model(**inputs).loss
            assert len(mode.cache) <= 2
    assert torch.equal(got, want)
    assert all(p.is_meta for p in model.parameters())  # the model itself was never given memory
    assert mode.touched_owners >= len({id(m) for m in model.modules() if any(True for _ in m.parameters(False))})


def test_on_touch_answers_device_and_is_meta_as_the_real_tensor_would() -> None:
    model = toy_on_meta()
    with on_touch(model, ValueSource(seed=0, init=init_toy)):
        assert model.pos.device == torch.device("cpu") and not model.pos.is_meta
        made = torch.zeros(2, device=model.pos.device)
        assert made.device.type == "cpu"
        assert model.pos.shape == (6, 16) and model.pos.dtype == torch.float32
    assert model.pos.is_meta


def test_on_touch_is_a_no_op_for_a_real_model_or_without_values() -> None:
    with on_touch(ToyLM(), ValueSource(seed=0)) as mode:
        assert mode is None
    with on_touch(toy_on_meta(), None) as mode:
        assert mode is None


def test_on_touch_takes_declared_aliases_and_pretrained_weights(tmp_path) -> None:
    reference = toy_materialised(seed=1)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.5)  # not what the seed gives: the weights must win
    path = tmp_path / "toy.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items() if k != "head.weight"}, str(path))
    model = toy_on_meta()
    inputs = batch(2)
    with torch.no_grad(), on_touch(model, ValueSource(seed=1, init=init_toy, weights=path,
                                                 aliases={"head.weight": "emb.weight"})):
        got = model(**inputs)
    assert torch.equal(got, reference(**inputs))


def test_on_touch_refuses_weights_of_the_wrong_shape(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"pos": torch.zeros(5, 16)}, str(path))
    model = toy_on_meta()
    with (pytest.raises(ConfigError, match=r"'pos' has shape \[5, 16\].*has \[6, 16\]"), torch.no_grad(),
          on_touch(model, ValueSource(seed=0, init=init_toy, weights=path))):
        model(**batch(2))


# ----------------------------------------------------------------------------------------------------------
# A stage of a meta model


def _structure(model):
    batch_fn, dims = make_batch_fn(batch(2), None)
    return discover(model, batch_fn, dims, use_cache=False, values=ValueSource(seed=3, init=init_toy))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_stage_allocates_only_its_modules_with_the_reference_values(stage, monkeypatch) -> None:
    initialised: list[str] = []
    real_init_owner = materialize_module._init_owner

    def record(model, all_modules, name, *args, **kwargs):
        initialised.append(name)
        return real_init_owner(model, all_modules, name, *args, **kwargs)

    reference = dict(toy_materialised(seed=3).named_parameters(remove_duplicate=False))
    model = toy_on_meta()
    structure = _structure(model)
    partition = Partition.from_ranges([(0, 1), (1, 3), (3, 4), (4, 5)], structure.num_segments)
    ties = find_tie_sets(model, structure, partition, weight_groups(model, SHARED))
    monkeypatch.setattr(materialize_module, "_init_owner", record)
    sm = StageSlice(model, structure, partition, stage, ties, torch.device("cpu"), values=ValueSource(3, init_toy))
    held = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert held == {name for name, _ in sm.param_names} | ({"emb.weight", "head.weight"} & held)
    for name, param in sm.param_names:
        assert torch.equal(param, reference[name]), name
    owners = {name.rpartition(".")[0] for name in held}
    assert set(initialised) <= owners | {"emb"}, (initialised, owners)  # only what the stage holds
    blocks = {f"blocks.{i}" for i in range(4)}
    assert len(set(initialised) & blocks) <= 2


def test_a_stage_of_a_meta_model_without_values_is_an_error() -> None:
    model = toy_on_meta()
    structure = _structure(model)
    partition = Partition.from_ranges([(0, 3), (3, 5)], structure.num_segments)
    with pytest.raises(ConfigError, match=r"on the meta device.*no values"):
        StageSlice(model, structure, partition, 1,
                   find_tie_sets(model, structure, partition, weight_groups(model, SHARED)), torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------------
# Varuna(model on meta)


def test_varuna_on_a_meta_model_holds_the_materialised_values_and_trains_alike() -> None:
    vm = Varuna(toy_on_meta(), "0", batch(2), batch_size=8, chunk_size=4, shared_weights=SHARED, seed=3,
                init=init_toy, validate=True)
    reference = toy_materialised(seed=3)
    want = dict(reference.named_parameters())
    for name, param in vm.named_parameters():
        assert torch.equal(param, want[name]), name
    vm.set_optimizer(torch.optim.SGD(vm.parameters(), lr=0.1))
    loss, _ = vm.step(batch(8, seed=9))
    assert abs(loss - reference(**batch(8, seed=9)).item()) < 1e-6


def test_varuna_loads_weights_into_a_real_model_too(tmp_path) -> None:
    source = toy_materialised(seed=4)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"}, str(path))
    vm = Varuna(ToyLM(), "0", batch(2), batch_size=8, chunk_size=4, shared_weights=SHARED, weights=path)
    want = dict(source.named_parameters())
    for name, param in vm.named_parameters():
        assert torch.equal(param, want[name]), name


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"init": 3}, "init must be a callable"),
    ({"weights": "/nonexistent/w.safetensors"}, "does not exist"),
])
def test_bad_init_or_weights_fail_before_start_up(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        Varuna(toy_on_meta(), "0", batch(2), batch_size=8, chunk_size=4, shared_weights=SHARED, seed=1,
               **({"init": init_toy} | kwargs))


def test_meta_device_build_without_buffer_values_names_the_buffer() -> None:
    model = toy_on_meta()
    model._buffers["logit_scale"] = model.logit_scale.to("meta")  # what torch.device("meta") does to a buffer
    with pytest.raises(ConfigError, match=r"logit_scale.*meta_init"):
        Varuna(model, "0", batch(2), batch_size=8, chunk_size=4, shared_weights=SHARED, seed=1, init=init_toy)


def test_weights_missing_a_parameter_name_it(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    state = {k: v.contiguous() for k, v in toy_materialised().state_dict().items() if k not in ("head.weight", "pos")}
    save_file(state, str(path))
    with pytest.raises(ConfigError, match=r"'pos'.*not in weights"):
        Varuna(toy_on_meta(), "0", batch(2), batch_size=8, chunk_size=4, shared_weights=SHARED, seed=1,
               init=init_toy, weights=path)
