"""The original's ``Profiler`` over this profiler, in one process (the distributed form is in tests/dist)."""

from __future__ import annotations

import pytest
import torch

from tests.models import SHARED, ListCutLM, ToyLM, batch
from varuna import AutoConfig, Profiler
from varuna_core.errors import ConfigError
from varuna_core.planning.artifacts import load_profile


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def get_batch(size, device=None):  # the original's signature, with a non-tensor flag
    return {**batch(size)}


def test_profile_all_writes_the_profile_that_autoconfig_reads(tmp_path) -> None:
    model = ListCutLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profiler = Profiler(model, get_batch, device="cpu", out_folder=tmp_path / "profiles", shared_weights=SHARED,
                        repeats=1, warmup=0)
    profiler.set_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    result = profiler.profile_all([1, 2])
    written = load_profile(tmp_path / "profiles" / "profile.json")
    assert written == result and written.num_segments == 5 and written.microbatch_sizes == [1, 2]
    assert written.cut_names == ["cuts.0", "cuts.1", "cuts.2", "cuts.3"]
    seg = written.segments[2]  # one block: SGD with momentum keeps one buffer per parameter
    assert seg.optimizer_bytes == seg.param_bytes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is not modified
    pp, mbs, seconds = AutoConfig(2, 2, 8, tmp_path / "profiles", verbose=False).get_min()
    assert pp in (1, 2) and mbs in (1, 2) and seconds > 0


def test_the_older_form_and_bf16(tmp_path) -> None:
    profiler = Profiler(ToyLM(), "cpu", precision="bf16", shared_weights=SHARED, repeats=1, warmup=0)
    profiler.initialize(get_batch)
    result = profiler.profile_all(get_batch, [1], out_folder=tmp_path / "out")
    assert result.environment.precision == "bf16" and (tmp_path / "out" / "profile.json").is_file()


@pytest.mark.parametrize(("call", "match"), [
    (lambda p: p.profile_all([0]), "positive integers"),
    (lambda p: p.profile_all("12"), "positive integers"),
    (lambda p: p.profile_all(get_batch, [1], [2]), "takes the micro-batch sizes"),
    (lambda p: p.set_optimizer("adam"), "torch.optim.Optimizer"),
])
def test_bad_calls_are_named(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call(Profiler(ToyLM(), get_batch, device="cpu"))


def test_bad_construction_is_named() -> None:
    with pytest.raises(ConfigError, match="no batch function"):
        Profiler(ToyLM(), "cpu").profile_all([1])
    with pytest.raises(ConfigError, match="pstages_to_profile is not supported"):
        Profiler(ToyLM(), get_batch, pstages_to_profile=[0, 1])
    with pytest.raises(ConfigError, match="contradicts"):
        Profiler(ToyLM(), get_batch, fp16=True, precision="bf16")


@pytest.mark.parametrize("device", ["tpu", "cuda:99", 99])
def test_a_device_this_machine_lacks_is_named(device) -> None:
    with pytest.raises(ConfigError, match=r"device=.* (is not a device|picks)") as info:
        Profiler(ToyLM(), get_batch, device=device)
    assert "this machine has cpu" in str(info.value)
