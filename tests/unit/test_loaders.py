"""Hostile plan, profile and hosts files: each ends in a ConfigError naming the file, the line or the field, in
seconds, never in a crash, a hang, or a plan that a worker would choke on later."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
import yaml

from tests.profiles import make_profile
from varuna_core.errors import ConfigError
from varuna_core.ir.units import parse_bytes
from varuna_core.launch.hosts import Host, HostsWatcher, parse_hosts, read_hosts
from varuna_core.launch.options import SSHConfig
from varuna_core.planning.artifacts import (
    MAX_MICROBATCHES,
    MAX_PLAN_BYTES,
    MAX_PROFILE_BYTES,
    Plan,
    load_plan,
    load_profile,
    save_plan,
)
from varuna_core.planning.planner import PlanRequest, make_plan, plan_for
from varuna_core.util.versioned_io import save_artifact

pytestmark = pytest.mark.timeout(20)


def _plan() -> Plan:
    """pp=2 × dp=2 over 4 segments, 16 examples in micro-batches of 2: every field has something to break."""
    return plan_for(make_profile([0.001, 0.003, 0.003, 0.002]), PlanRequest(gpus=4, batch_size=16), pp=2, dp=2,
                    microbatch_size=2, schedule="1f1b")


@pytest.fixture(scope="module")
def plan_data() -> dict:
    return _plan().model_dump(mode="json")


def _write_yaml(tmp_path: Path, data) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _refused(loader, path, *needles: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        loader(path)
    message = info.value.message
    assert "\n" not in message and len(message) < 1000, message
    for needle in needles:
        assert needle in message, message
    return info.value


# --- plans: fields ---------------------------------------------------------------------------------------

def _stage_step_time(data, value):
    data["prediction"]["step_time"] = value


PLAN_MUTATIONS = [
    ({"pp": 0}, "pp: Input should be greater than or equal to 1 (got 0)"),
    ({"dp": -1}, "dp: Input should be greater than or equal to 1"),
    ({"pp": True}, "pp: Input should be a valid integer"),
    ({"gpus": "four"}, "gpus: Input should be a valid integer"),
    ({"gpus": 10**30}, "gpus: Input should be less than or equal to"),
    ({"gpus": 3}, "pp × dp = 2 × 2 = 4 devices, more than gpus = 3"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 1}, "dp = 2 replicas for a global batch of 1"),
    ({"microbatch_size": 100}, "microbatch_size 100 is larger than a replica's batch of 8"),
    ({"num_microbatches": 50_000_000}, f"num_microbatches: Input should be less than or equal to {MAX_MICROBATCHES}"),
    ({"num_microbatches": 5}, ("num_microbatches is 5, but batch_size 16 over dp = 2 replicas in micro-batches of 2 "
                               "makes 4")),
    ({"stage_to_rank_map": "0,1;;2"}, "stage_to_rank_map: stage 1 of stage-to-rank map '0,1;;2' is empty"),
    ({"stage_to_rank_map": "0,1,2,3"}, "stage_to_rank_map has 1 stages × 4 replicas, but the plan has pp = 2, dp = 2"),
    ({"stage_to_rank_map": "0,x;1,3"}, "non-integer rank 'x'"),
    ({"stage_to_rank_map": "0,2;1,9"}, "stage_to_rank_map"),
    ({"stage_to_rank_map": "0," * 100_000}, "characters long, too long for 4 ranks"),
    ({"partition": [[0, 1], [2, 4]]}, "partition[1] is [2, 4), but stage 1 must start at segment 1"),
    ({"partition": [[0, 4], [4, 4]]}, "partition[1] is [4, 4)"),
    ({"partition": [[0, 2], [2, 3]]}, "partition ends at segment 3, but the model has 4 segments"),
    ({"partition": [[0, 4]]}, "partition has 1 ranges for pp = 2 stages"),
    ({"partition": [[0, 2, 9], [2, 4]]}, "partition.0"),
    ({"nodes": [[0, 1], [1, 2]]}, "nodes[1]: rank 1 is listed twice"),
    ({"nodes": [[0, 1], [2]]}, "rank 3 is on no node"),
    ({"nodes": [[0, 1, 2, 3, 7]]}, "nodes[0] has 5 ranks"),
    ({"nodes": [[], [0, 1, 2, 3]]}, "nodes[0] has 0 ranks"),
    ({"schedule": "zb-h2"}, "schedule: unknown schedule 'zb-h2'; choose one of varuna, 1f1b, gpipe, zb, varuna-zb"),
    ({"schedules": []}, "schedules"),
    ({"headroom": float("nan")}, "headroom: Input should be a finite number"),
    ({"headroom": 1.5}, "headroom"),
    ({"memory_limit": 0}, "memory_limit"),
    ({"num_segments": 1}, "pp = 2 stages for 1 segments"),
    ({"foo": 1}, "foo: Extra inputs are not permitted"),
    ({"memory_limit": 9_000_000}, "stages[0]: memory_bytes 9812000 is more than memory_limit 9000000"),
    ({"schedules": ["gpipe", "varuna"]}, "schedule 1f1b is not among schedules ['gpipe', 'varuna']"),
]


@pytest.mark.parametrize(("update", "needle"), PLAN_MUTATIONS, ids=[str(i) for i in range(len(PLAN_MUTATIONS))])
def test_plan_with_bad_fields(tmp_path, plan_data, update, needle) -> None:
    path = _write_yaml(tmp_path, {**copy.deepcopy(plan_data), **update})
    error = _refused(load_plan, path, str(path), "is not a valid plan", needle)
    assert error.hint


@pytest.mark.parametrize(("where", "value", "needle"), [
    (("prediction", "step_time"), float("nan"), "prediction.step_time: Input should be a finite number"),
    (("prediction", "step_time"), float("inf"), "prediction.step_time"),
    (("prediction", "pipeline_time"), -1.0, "prediction.pipeline_time: Input should be greater than or equal to 0"),
    (("stages", 0, "memory_bytes"), -5, "stages.0.memory_bytes"),
    (("stages", 1, "stage"), 0, "stages[1] is stage 0"),
    (("stages", 0, "segments"), [0, 3], "stages[0] is stage 0 over segments [0, 3], but partition[0] is [0, 2]"),
    (("alternatives",), [{"pp": 0}], "alternatives.0"),
    # fields of one stage that contradict each other or the stage's place in the pipeline
    (("stages", 0, "skip_bytes"), 30_000, "stages[0]: skip_bytes 30000 is more than activation_bytes 20000"),
    (("stages", 1, "skip_bytes"), 8, ("stages[1] is the last stage, which sends nothing to a next one, but has "
                                      "activation_bytes 0, skip_bytes 8")),
    (("stages", 1, "activation_bytes"), 20_000, "stages[1] is the last stage"),
    (("stages", 1, "send_activation"), 0.5, "send_activation 0.5 (all must be 0)"),
    (("stages", 0, "send_gradient"), 0.5, ("stages[0] is the first stage, which sends no gradient to a previous one, "
                                           "but has send_gradient 0.5")),
    (("stages", 0, "held_microbatches"), 9, "stages[0]: held_microbatches 9 is more than the num_microbatches 4"),
    (("alternatives",), [{"pp": 4, "dp": 2, "microbatch_size": 1, "num_microbatches": 2, "schedule": "gpipe",
                          "step_time": 1.0, "samples_per_second": 16.0, "bubble_fraction": 0.5,
                          "peak_memory_bytes": 1}], "alternatives[0]: pp × dp = 4 × 2 = 8 devices, more than gpus = 4"),
])
def test_plan_with_bad_nested_fields(tmp_path, plan_data, where, value, needle) -> None:
    data = copy.deepcopy(plan_data)
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    _refused(load_plan, _write_yaml(tmp_path, data), needle)


def test_stages_list_must_match_pp(tmp_path, plan_data) -> None:
    data = copy.deepcopy(plan_data)
    data["stages"] = data["stages"][:1]
    _refused(load_plan, _write_yaml(tmp_path, data), "stages lists 1 entries for pp = 2 stages")


# --- plans: documents -------------------------------------------------------------------------------------

def _bomb(levels: int = 9, width: int = 10) -> str:
    """The "billion laughs": each anchor refers ``width`` times to the one before, ``width ** levels`` nodes."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("text", "needle"), [
    ("", "it is empty"),
    ("- 1\n- 2\n", "it holds [1, 2], not a mapping of fields"),
    ("just a string\n", "it holds 'just a string'"),
    ("42\n", "it holds 42"),
    ("[" * 200_000 + "]" * 200_000, "nested more than 32 levels deep"),
    ("- " * 200_000 + "x\n", "nested more than 32 levels deep"),
    ("".join(" " * i + "a:\n" for i in range(40)), "nested more than 32 levels deep"),
    ("pp: 1\npp: 2\n", "key 'pp' appears twice in one mapping (line 2"),
    ("!!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
    ("model: !custom x\n", "could not determine a constructor"),
    ("a: [1, 2\n", "line 2"),
    ("pp: " + "9" * 5000 + "\n", "digits"),
    ("created: 2026-13-45\n", "month must be in 1..12"),
    ("a: b\n\tc: d\n", "is not a valid plan"),
    ("{pp: 1}", "model: Field required"),
    ('{"a": ' * 100_000, "nested too deeply"),
    ('{"pp": 1, "pp": 2}', "key 'pp' appears twice"),
    ("- 1\n" * 500_000, "more than 400,000 values"),
    ("schema_version: 2\n", "plan format version 2"),
    ("schema_version: true\n", "plan format version True"),
])
def test_plan_documents_that_are_not_plans(tmp_path, text, needle) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    _refused(load_plan, path, str(path), needle)  # at once: the module's timeout stops a parse that runs away


def test_alias_bomb_is_refused_at_once(tmp_path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(_bomb())
    _refused(load_plan, path, "anchors and aliases", "line 1")  # expanded, it would never finish


def test_alias_inside_a_valid_plan_is_refused(tmp_path) -> None:
    text = yaml.safe_dump(_plan().model_dump(mode="json"), sort_keys=False)
    text = text.replace("schedules:\n- varuna", "schedules: &s\n- varuna")
    text = text.replace("assumptions:", "extra: *s\nassumptions:")
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    _refused(load_plan, path, "anchors and aliases")


def test_plan_files_that_are_not_files(tmp_path) -> None:
    _refused(load_plan, tmp_path / "missing.yaml", "does not exist")
    _refused(load_plan, tmp_path, "is a directory")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    _refused(load_plan, fifo, "is a FIFO")
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    _refused(load_plan, loop, str(loop))


def test_plan_file_size_and_encoding(tmp_path) -> None:
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(MAX_PLAN_BYTES + 1)
    _refused(load_plan, huge, f"{MAX_PLAN_BYTES + 1:,} bytes")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model: x\npp: \xff\xfe\n")
    _refused(load_plan, binary, "is not UTF-8 text (byte 0xff on line 2)")
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"model: a\x00b\n")
    _refused(load_plan, nul, "is not a valid plan")


def test_truncated_plans(tmp_path) -> None:
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"plan{suffix}"
        save_plan(_plan(), path)
        text = path.read_text()
        for cut in (len(text) // 3, len(text) // 2, len(text) - 5):
            path.write_text(text[:cut])
            _refused(load_plan, path, str(path))


def test_plans_round_trip_in_yaml_and_json(tmp_path) -> None:
    plan = _plan()
    for name in ("p.yaml", "p.yml", "p.json"):
        save_plan(plan, tmp_path / name)
        assert load_plan(tmp_path / name) == plan
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_save_plan_into_a_missing_directory_or_onto_a_directory(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot write plan"):
        save_plan(_plan(), tmp_path / "missing" / "plan.yaml")
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ConfigError, match="cannot write plan"):
        save_plan(_plan(), tmp_path / "d.yaml")


@pytest.mark.parametrize("seed", range(12))
def test_every_plan_the_planner_makes_validates(seed) -> None:
    """The checks must never refuse the planner's own output (nodes, maps, micro-batch counts, predictions)."""
    rng = random.Random(seed)
    profile = make_profile([rng.choice([0.0005, 0.001, 0.004]) for _ in range(rng.randint(1, 9))],
                           with_comm=rng.random() < 0.7)
    gpus = rng.randint(1, 24)
    request = PlanRequest(gpus=gpus, batch_size=rng.randint(1, 300), gpus_per_node=rng.choice([None, 1, 2, 4, 64]),
                          schedules=tuple(rng.sample(["varuna", "1f1b", "gpipe"], rng.randint(1, 3))))
    plan = make_plan(profile, request)
    assert Plan.model_validate(plan.model_dump(mode="json")) == plan


def test_a_morph_without_a_profile_makes_a_valid_plan() -> None:
    from varuna_core.launch.manager import replan

    plan = make_plan(make_profile([0.001] * 6), PlanRequest(gpus=8, batch_size=64, gpus_per_node=4))
    for devices, per_node in ((3, 1), (5, 2), (8, 4), (16, 8)):
        if devices < plan.pp:
            continue
        new, _ = replan(plan.model_copy(update={"profile_path": None}), devices, per_node)
        Plan.model_validate(new.model_dump(mode="json"))


# --- profiles ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def profile_data() -> dict:
    return json.loads(make_profile([0.001, 0.003, 0.003]).model_dump_json())


def _segment(data: dict, k: int, **fields) -> dict:
    data = copy.deepcopy(data)
    data["segments"][k].update(fields)
    return data


def _measure(data: dict, k: int, j: int, **fields) -> dict:
    data = copy.deepcopy(data)
    data["segments"][k]["measures"][j].update(fields)
    return data


def _zero_times(data: dict) -> dict:
    data = copy.deepcopy(data)
    for seg in data["segments"]:
        for m in seg["measures"]:
            for key in ("forward", "recompute", "backward"):
                m[key] = {"median": 0.0, "p10": 0.0, "p90": 0.0, "repeats": 1}
    return data


def _comm(data: dict, k: int, **fields) -> dict:
    data = copy.deepcopy(data)
    data["comm"][k].update(fields)
    return data


PROFILE_MUTATIONS = [
    (lambda d: {**d, "num_segments": 5}, "num_segments is 5 but segments lists 3"),
    (lambda d: {**d, "num_segments": 0}, "num_segments: Input should be greater than or equal to 1"),
    (lambda d: {**d, "num_segments": 10**9}, "num_segments: Input should be less than or equal to"),
    (lambda d: {**d, "cut_names": ["c0"]}, "3 segments are separated by 2 cuts, but cut_names lists 1"),
    (lambda d: {**d, "microbatch_sizes": [1, 2]}, "segments[0] is measured at micro-batch sizes [1, 2, 4, 8]"),
    (lambda d: {**d, "microbatch_sizes": []}, "microbatch_sizes: List should have at least 1 item"),
    (lambda d: {**d, "microbatch_sizes": [8, 4, 2, 1]}, "is not strictly increasing"),
    (lambda d: {**d, "stopped": {"microbatch_size": 2, "segment": 0, "reason": "oom"}}, "stopped.microbatch_size 2"),
    (lambda d: {**d, "stopped": {"microbatch_size": 16, "segment": 7, "reason": "oom"}}, "stopped.segment is 7"),
    (lambda d: _segment(d, 0, param_bytes=-1), "segments.0.param_bytes: Input should be greater than or equal to 0"),
    (lambda d: _segment(d, 1, index=2), "segments[1] has index 2"),
    (lambda d: _segment(d, 1, input_cut="elsewhere"), "segments[1] runs from cut 'elsewhere'"),
    (lambda d: _segment(d, 0, optimizer_time="nan"), "segments.0.optimizer_time"),
    (lambda d: _segment(d, 0, measures=[]), "segments.0.measures"),
    (_zero_times, "every measured time is 0"),
    (lambda d: _comm(d, 0, times=[1e-4]), "comm.0: 6 sizes but 1 times"),
    (lambda d: _comm(d, 1, group_size=1), "comm.1.group_size: Input should be greater than or equal to 2"),
    (lambda d: _comm(d, 1, fit={"latency": 0.0, "bandwidth": 0.0, "rel_error": 0.0}), "comm.1.fit.bandwidth"),
    (lambda d: {**d, "schema_version": 3}, "profile format version 3"),
    # fields that contradict each other
    (lambda d: _measure(d, 0, 1, skip_bytes=10**6), ("segments[0].measures[1] (micro-batch 2): skip_bytes 1000000 is "
                                                     "more than output_bytes 20000")),
    (lambda d: _measure(d, 2, 0, skip_bytes=8), ("segments[2].measures[0] (micro-batch 1): output_bytes 0 and "
                                                 "skip_bytes 8 on the last segment, which ends at the loss")),
    (lambda d: _measure(d, 2, 3, output_bytes=64), "output_bytes 64 and skip_bytes 0 on the last segment"),
    (lambda d: _segment(d, 2, skips=["h: from segment 1"]), "segments[2] is the last segment but lists 1 skips"),
    (lambda d: _measure(d, 1, 0, forward={"median": 2.0, "p10": 1.0, "p90": 1.5, "repeats": 3}),
     "segments[1].measures[0] (micro-batch 1): forward has p10 1, median 2 and p90 1.5, not in increasing order"),
    (lambda d: _comm(d, 0, group_size=3), "comm[0] is a p2p curve with group_size 3"),
    (lambda d: {**d, "ties": [{"name": "wte", "segments": [2, 0], "grad_bytes": 8}]},
     "ties[0] ('wte'): segments [2, 0] are not distinct and in order"),
    (lambda d: {**d, "ties": [{"name": "wte", "segments": [0, 0], "grad_bytes": 8}]}, "are not distinct and in order"),
    (lambda d: {**d, "ties": [{"name": "wte", "segments": [0, 3], "grad_bytes": 8}]},
     "ties[0] ('wte'): segment 3 of a profile of 3 segments"),
    (lambda d: {**d, "ties": [{"name": "wte", "segments": [1], "grad_bytes": 8}]}, "ties.0.segments: List should have"),
    (lambda d: {**d, "ties": [{"name": "", "segments": [0, 1], "grad_bytes": 8}]}, "ties.0.name: String should have"),
    (lambda d: {**d, "ties": [{"name": "w", "segments": [0, 1], "grad_bytes": -1}]}, "ties.0.grad_bytes: Input should"),
    (lambda d: {**d, "idle_penalty": _idle(gaps_s=[0.002, 0.001])}, "gaps_s [0.002, 0.001] is not strictly increasing"),
    (lambda d: {**d, "idle_penalty": _idle(gaps_s=[0.001, 0.001])}, "is not strictly increasing"),
    (lambda d: {**d, "idle_penalty": _idle(fractions=[0.1])}, "2 gaps_s but 1 fractions"),
    (lambda d: {**d, "idle_penalty": _idle(gaps_s=[0.0, 0.001])}, "idle_penalty.gaps_s.0: Input should be greater"),
    (lambda d: {**d, "idle_penalty": _idle(fractions=[-0.1, 0.1])}, "idle_penalty.fractions.0: Input should be"),
    (lambda d: {**d, "idle_penalty": _idle(fractions=[0.1, 1e6])}, "idle_penalty.fractions.1: Input should be less"),
    (lambda d: {**d, "idle_penalty": _idle(action_s=0.0)}, "idle_penalty.action_s: Input should be greater than 0"),
    (lambda d: {**d, "idle_penalty": _idle(gaps_s=[1e-3] * 20, fractions=[0.1] * 20)}, "at most 16 items"),
    (lambda d: {**d, "idle_penalty": _idle(gaps_s=["0.001", 0.002])}, "idle_penalty.gaps_s.0: Input should be a valid"),
    (lambda d: {**d, "idle_penalty": [0.1]}, "idle_penalty: Input should be a valid dictionary"),
]


def _idle(**fields) -> dict:
    """A valid ``idle_penalty`` with ``fields`` replaced."""
    return {"gaps_s": [0.001, 0.005], "fractions": [0.1, 0.2], "action_s": 0.003, **fields}


@pytest.mark.parametrize(("mutate", "needle"), PROFILE_MUTATIONS, ids=[str(i) for i in range(len(PROFILE_MUTATIONS))])
def test_profile_with_bad_fields(tmp_path, profile_data, mutate, needle) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(mutate(profile_data)))
    _refused(load_profile, path, str(path), needle)


@pytest.mark.parametrize(("text", "needle"), [
    ("", "not JSON"),
    ("[]", "it holds []"),
    ("null", "it is empty"),
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ('{"model": "a", "model": "b"}', "key 'model' appears twice"),
    ('{"num_segments": ' + "9" * 5000 + "}", "is not a valid profile"),
])
def test_profile_documents_that_are_not_profiles(tmp_path, text, needle) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    _refused(load_profile, path, needle)


def test_profile_numbers_nan_and_infinity(tmp_path, profile_data) -> None:
    path = tmp_path / "profile.json"
    text = json.dumps(profile_data)
    path.write_text(text.replace('"median": 0.001', '"median": NaN', 1))
    _refused(load_profile, path, "Input should be a finite number")
    path.write_text(text.replace('"median": 0.001', '"median": Infinity', 1))
    _refused(load_profile, path, "Input should be a finite number")


def test_profile_files_that_are_not_files(tmp_path) -> None:
    error = _refused(load_profile, tmp_path / "missing.json", "does not exist")
    assert "varuna profile" in error.hint
    _refused(load_profile, tmp_path, "is a directory")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused(load_profile, fifo, "is a FIFO")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_PROFILE_BYTES + 1)
    _refused(load_profile, huge, "more than the")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"model": "\xc3\x28"}')
    _refused(load_profile, binary, "is not UTF-8 text")


def test_profiles_round_trip(tmp_path) -> None:
    profile = make_profile([0.001, 0.002])
    save_artifact(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_a_profile_with_an_idle_penalty_loads_and_one_without_is_older(tmp_path, profile_data) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**profile_data, "idle_penalty": _idle()}))
    idle = load_profile(path).idle_penalty
    assert idle is not None and (idle.gaps_s, idle.fractions, idle.action_s) == ([0.001, 0.005], [0.1, 0.2], 0.003)
    path.write_text(json.dumps({k: v for k, v in profile_data.items() if k != "idle_penalty"}))
    assert load_profile(path).idle_penalty is None


# --- hosts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "needle"), [
    ("-oProxyCommand=touch /tmp/x", "starts with '-', which ssh would read as an option"),
    ("-p", "starts with '-'"),
    ("alice@-oProxyCommand=x", "starts with '-'"),
    ("-alice@host", "starts with '-'"),
    ("host:0", "port 0 is not in 1-65535"),
    ("host:70000", "port 70000 is not in 1-65535"),
    ("host:123456", "is not a host name or address"),
    ("host slots=0", "unknown field 'slots=0'"),
    ("host slots=99999", "only slots=N with 1 <= N <= 4096"),
    ("host slots=²", "unknown field 'slots=²'"),
    ("host slots=-1", "unknown field"),
    ("host slots=1e3", "unknown field"),
    ("host extra", "unknown field 'extra'"),
    ("a" * 300, "is not a host name or address"),
    ("[/]", "is not a host name or address"),
    ("ho$t", "is not a host name or address"),
    ("10.0.0.1\n10.0.0.1 slots=2", "10.0.0.1 is already listed on line 2"),
])
def test_hosts_lines_that_are_not_hosts(line, needle) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hosts(f"# hosts\n{line}\n", 1, source="hosts.txt")
    assert needle in info.value.message and "hosts.txt line " in info.value.message, info.value.message
    assert len(info.value.message) < 400


def test_hosts_that_parse() -> None:
    hosts = parse_hosts("a.example  # one\nbob@10.0.0.6:2222 slots=4\n[::1]:22 slots=4096\n_x-1\n", 8)
    assert hosts == [Host("a.example", 8), Host("10.0.0.6", 4, user="bob", port=2222), Host("::1", 4096, port=22),
                     Host("_x-1", 8)]


def test_hosts_files_that_are_not_hosts_files(tmp_path) -> None:
    _refused(lambda p: read_hosts(p, 1), tmp_path / "missing", "does not exist")
    _refused(lambda p: read_hosts(p, 1), tmp_path, "is a directory")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(lambda p: read_hosts(p, 1), fifo, "is a FIFO")
    many = tmp_path / "many"
    many.write_text("#\n" * 1_000_000)
    _refused(lambda p: read_hosts(p, 1), many, "more than the")
    binary = tmp_path / "binary"
    binary.write_bytes(b"node1\nn\xffode2\n")
    _refused(lambda p: read_hosts(p, 1), binary, "is not UTF-8 text (byte 0xff on line 2)")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    _refused(lambda p: read_hosts(p, 1), empty, "lists no host")


def test_hosts_watcher_reports_a_fifo_without_blocking(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("node1\n")
    watcher = HostsWatcher(path, 1)
    assert watcher.poll() is None
    path.unlink()
    assert watcher.poll() is None  # an editor replacing the file
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="is a FIFO"):
        watcher.poll()
    assert watcher.poll() is None  # the same bad content is reported once


def test_ssh_destination_follows_double_dash() -> None:
    argv = SSHConfig(user="u", port=22, identity="/k").argv(Host("-oProxyCommand=x", 1), "true")
    assert argv[-3:] == ["--", "-oProxyCommand=x", "true"]
    assert argv.index("--") > max(i for i, word in enumerate(argv[:-2]) if word.startswith("-") and word != "--")


# --- sizes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["abc", "-5GiB", "nan", "inf", "1e400", "9" * 400, "5 parsecs", "", True, 2.5, -1])
def test_sizes_that_are_not_sizes(text) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_sizes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes(0) == 0 and parse_bytes(" 2 k ") == 2048
