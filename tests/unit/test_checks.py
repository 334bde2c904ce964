"""Checks of numbers (``util/checks``) and the requests that use them: each names the field it refuses, so the CLI
can name the option instead (``--gpus``), and the library never speaks of the CLI's flags."""

from __future__ import annotations

import pickle

import pytest

from varuna_core.errors import ConfigError, FieldError
from varuna_core.util.checks import integer, real


@pytest.mark.parametrize(("call", "message"), [
    (lambda: integer("gpus", 0, low=1, high=64), "gpus must be in 1..64, got 0"),
    (lambda: integer("top", 101, low=0, high=100), "top must be in 0..100, got 101"),
    (lambda: integer("batch_size", -3, low=1), "batch_size must be ≥ 1, got -3"),
    (lambda: integer("seed", 2**64, high=2**64 - 1), "seed must be ≤ 18446744073709551615, got 18446744073709551616"),
    (lambda: integer("n", 2.0), "n must be an integer, got 2.0"),
    (lambda: real("headroom", 1.0, low=0, high=1, high_open=True), "headroom must be a number in [0, 1), got 1"),
    (lambda: real("headroom", float("nan"), low=0, high=1, high_open=True),
     "headroom must be a number in [0, 1), got nan"),
    (lambda: real("timeout", 0, low=0, low_open=True), "timeout must be greater than 0, got 0"),
])
def test_a_refusal_names_the_field_and_shows_the_value_exactly(call, message) -> None:
    with pytest.raises(FieldError) as info:
        call()
    assert info.value.message == message or info.value.message.startswith(message), info.value.message
    assert info.value.field == message.split()[0]


def test_a_field_error_is_renamed_by_its_field_not_its_text() -> None:
    error = FieldError("gpus", "must be in 1..64, got 0", hint="fewer")
    renamed = error.renamed("--gpus")
    assert isinstance(renamed, ConfigError) and renamed.exit_code == 2
    assert (renamed.message, renamed.field, renamed.hint) == ("--gpus must be in 1..64, got 0", "--gpus", "fewer")
    again = pickle.loads(pickle.dumps(error))  # crosses process boundaries like any other error
    assert (again.message, again.field, again.hint) == (error.message, error.field, error.hint)


@pytest.mark.parametrize(("fields", "message"), [
    ({"gpus": 0}, "gpus must be in 1..65536, got 0"),
    ({"gpus": 2.5}, "gpus must be an integer, got 2.5"),
    ({"batch_size": 0}, "batch_size must be ≥ 1, got 0"),
    ({"gpus_per_node": 0}, "gpus_per_node must be in 1..65536, got 0"),
    ({"gpu_memory": 0}, "gpu_memory must be ≥ 1, got 0"),
    ({"headroom": 1.0}, "headroom must be a number in [0, 1), got 1"),
    ({"top": -1}, "top must be in 0..100, got -1"),
    ({"max_concurrent_sends": 0}, "max_concurrent_sends must be in 1..1024, got 0"),
    ({"microbatch_sizes": (0,)}, "microbatch_sizes must be in 1..1048576, got 0"),
    ({"microbatch_sizes": ()}, "microbatch_sizes names no size"),
    ({"schedules": ()}, "schedules names no schedule"),
    ({"schedules": "varuna"}, "schedules must be a list or tuple, got str"),
])
def test_a_plan_request_checks_itself_and_names_its_fields(fields, message) -> None:
    from varuna_core.planning.planner import PlanRequest

    with pytest.raises(FieldError) as info:
        PlanRequest(**{"gpus": 4, "batch_size": 16, **fields})
    assert info.value.message.startswith(message), info.value.message
    assert "--" not in info.value.message


def test_a_plan_request_keeps_plain_values() -> None:
    import numpy as np

    from varuna_core.planning.planner import PlanRequest

    req = PlanRequest(gpus=np.int64(4), batch_size=16, schedules=["1f1b", "varuna", "1f1b"], microbatch_sizes=[2])
    assert type(req.gpus) is int and req.schedules == ("1f1b", "varuna") and req.microbatch_sizes == (2,)


def test_too_many_micro_batches_name_the_field() -> None:
    from tests.profiles import make_profile
    from varuna_core.planning.planner import PlanRequest, make_plan

    with pytest.raises(FieldError, match=r"^batch_size 10000000000 over at most 4 replicas") as info:
        make_plan(make_profile([0.001] * 2), PlanRequest(gpus=4, batch_size=10**10))
    assert info.value.field == "batch_size"


@pytest.mark.parametrize(("fields", "message"), [
    ({"nproc": 0}, "nproc must be in 1..64, got 0"),
    ({"repeats": 0}, "repeats must be in 1..10000, got 0"),
    ({"warmup": -1}, "warmup must be in 0..10000, got -1"),
    ({"microbatch_sizes": (1, 0)}, "microbatch_sizes must be in 1..1048576, got 0"),
    ({"microbatch_sizes": ()}, "microbatch_sizes must hold 1 to 64 sizes, got 0"),
    ({"memory_limit": 0}, "memory_limit must be ≥ 1, got 0"),
    ({"timeout": 0}, "timeout must be greater than 0, got 0"),
])
def test_profile_options_check_themselves_and_name_their_fields(fields, message) -> None:
    from varuna_core.profiling.options import ProfileOptions

    with pytest.raises(FieldError) as info:
        ProfileOptions(**fields)
    assert info.value.message == message


def test_profile_options_refuse_a_device_or_precision_by_name() -> None:
    from varuna_core.profiling.options import ProfileOptions

    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        ProfileOptions(device="tpu")
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        ProfileOptions(precision="fp8")
    assert ProfileOptions(microbatch_sizes=[4, 1, 4]).microbatch_sizes == (1, 4)
