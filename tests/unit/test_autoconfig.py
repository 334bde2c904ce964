"""``AutoConfig``: the original's class over this planner (any depth, pp=1 included, memory-aware)."""

from __future__ import annotations

import pytest

from tests.profiles import make_profile
from varuna_core.errors import ConfigError
from varuna_core.planning.autoconfig import AutoConfig
from varuna_core.planning.planner import PlanRequest, plan_for


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "profile.json").write_text(make_profile([0.01] * 5, param_bytes=10**7).model_dump_json())
    return tmp_path


def test_every_depth_is_scored_and_the_fastest_is_chosen(folder) -> None:
    config = AutoConfig(4, 4, 32, folder)
    assert sorted(config.batch_times) == [1, 2, 3, 4]  # 3 and 4 do not divide the 5 segments
    pp, mbs, seconds = config.get_min()
    assert seconds == min(config.batch_times.values()) and mbs == config.micro_batch[pp]
    plan = plan_for(config.profile, PlanRequest(gpus=4, batch_size=32, gpus_per_node=4, schedules=("varuna",)),
                    pp=pp, dp=4 // pp, microbatch_size=mbs, schedule="varuna")
    assert plan.prediction.step_time == pytest.approx(seconds)
    assert config.plans[pp].stage_to_rank_map == plan.stage_to_rank_map


def test_the_profile_file_itself_may_be_given(folder) -> None:
    from_file = AutoConfig(2, 2, 8, folder / "profile.json", verbose=False).get_min()
    assert from_file == AutoConfig(2, 2, 8, folder).get_min()


def test_memory_capacity_excludes_what_does_not_fit(folder) -> None:
    free = AutoConfig(4, 4, 32, folder)
    one_stage = free.plans[1].stages[0].memory_bytes
    tight = AutoConfig(4, 4, 32, folder, gpu_memory_capacity=int(one_stage * 0.9))
    assert 1 not in tight.batch_times and tight.batch_times  # the whole model on one device no longer fits
    with pytest.raises(ConfigError, match="no pipeline depth from 1 to 4 fits 1000 bytes per device"):
        AutoConfig(4, 4, 32, folder, gpu_memory_capacity=1000)


@pytest.mark.parametrize(("args", "match"), [
    ((0, 1, 8), "num_gpus must be in 1..65536, got 0"),
    ((2, 1.5, 8), "gpus_per_vm must be an integer, got 1.5"),
    ((2, 1, True), "batch_size must be an integer, got True"),
])
def test_bad_arguments_are_named(folder, args, match) -> None:
    with pytest.raises(ConfigError, match=match):
        AutoConfig(*args, folder)


def test_a_missing_or_broken_profile_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="profile"):
        AutoConfig(2, 2, 8, tmp_path)
    (tmp_path / "profile.json").write_text('{"schema_version": 1, "model": ')
    with pytest.raises(ConfigError, match="profile"):
        AutoConfig(2, 2, 8, tmp_path)
    with pytest.raises(ConfigError, match="gpu_memory_capacity"):
        AutoConfig(2, 2, 8, tmp_path, gpu_memory_capacity=-5)
