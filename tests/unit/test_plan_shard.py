"""The planner and a sharded optimizer: its memory model (``1/dp`` of the optimizer state, plus the collectives'
scratch), its choice (sharded where the whole state does not fit or where it is faster; whole on a tie), and the
CLI that asks for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.profiles import make_profile
from varuna_core.errors import FieldError
from varuna_core.planning.artifacts import load_plan
from varuna_core.planning.planner import SHARD_BUCKET, PlanRequest, make_plan, plan_for
from varuna_core.util.versioned_io import save_artifact

ROOT = Path(__file__).resolve().parents[2]
MB = 10**8  # bytes of parameters per segment: the optimizer state of a segment is twice that


def _profile():
    # compute dominates (1 s per example and segment) and the links are fast: depth only adds bubbles
    return make_profile([1.0] * 4, param_bytes=MB, bandwidth=1e12, latency=1e-6)


def test_a_sharded_stage_holds_its_share_of_the_optimizer_state_plus_the_scratch() -> None:
    profile, req = _profile(), PlanRequest(gpus=2, batch_size=8, schedules=("1f1b",), headroom=0.0)
    whole = plan_for(profile, req, pp=1, dp=2, microbatch_size=4, schedule="1f1b")
    sharded = plan_for(profile, req, pp=1, dp=2, microbatch_size=4, schedule="1f1b", shard_optimizer=True)
    assert not whole.shard_optimizer and sharded.shard_optimizer
    saved = 4 * 2 * MB / 2  # half of the four segments' optimizer state
    scratch = SHARD_BUCKET * (1 + 1 / 2)
    assert whole.stages[0].memory_bytes - sharded.stages[0].memory_bytes == pytest.approx(saved - scratch, abs=2)
    one = plan_for(profile, PlanRequest(gpus=1, batch_size=8), pp=1, dp=1, microbatch_size=4, schedule="1f1b",
                   shard_optimizer=True)
    assert not one.shard_optimizer  # one replica: nothing to shard


def test_sharding_is_chosen_where_the_whole_state_does_not_fit() -> None:
    profile = _profile()
    whole = plan_for(profile, PlanRequest(gpus=2, batch_size=8, headroom=0.0), pp=1, dp=2, microbatch_size=4,
                     schedule="1f1b")
    limit = whole.stages[0].memory_bytes - 1  # pp=1 × dp=2 with the whole state misses by a byte
    req = PlanRequest(gpus=2, batch_size=8, gpu_memory=limit, headroom=0.0, schedules=("1f1b",),
                      microbatch_sizes=(4,))
    chosen = make_plan(profile, req)
    assert (chosen.pp, chosen.dp, chosen.shard_optimizer) == (1, 2, True), chosen
    assert max(s.memory_bytes for s in chosen.stages) <= limit
    never = make_plan(profile, PlanRequest(gpus=2, batch_size=8, gpu_memory=limit, headroom=0.0,
                                           schedules=("1f1b",), microbatch_sizes=(4,), shard_optimizer=False))
    assert (never.pp, never.dp, never.shard_optimizer) == (2, 1, False)  # deeper, with its bubble
    assert never.prediction.step_time > chosen.prediction.step_time


def test_on_a_tie_the_state_stays_whole_and_the_sharded_twin_says_why_it_lost() -> None:
    profile = _profile()
    plan = make_plan(profile, PlanRequest(gpus=2, batch_size=8, schedules=("1f1b",)))
    assert (plan.pp, plan.dp, plan.shard_optimizer) == (1, 2, False)
    twin = next(a for a in plan.alternatives if (a.pp, a.dp, a.microbatch_size) == (1, 2, plan.microbatch_size))
    assert twin.shard_optimizer and "sharded" in twin.reason
    forced = make_plan(profile, PlanRequest(gpus=2, batch_size=8, schedules=("1f1b",), shard_optimizer=True))
    assert forced.shard_optimizer and not any(not a.shard_optimizer and a.dp > 1 for a in forced.alternatives)


def test_a_bad_request_names_the_field() -> None:
    with pytest.raises(FieldError, match="shard_optimizer"):
        PlanRequest(gpus=2, batch_size=8, shard_optimizer="auto")  # type: ignore[arg-type]


def test_the_cli_asks_for_it_and_shows_it(tmp_path) -> None:
    profile = tmp_path / "profile.json"
    save_artifact(_profile(), profile)
    varuna = Path(sys.executable).with_name("varuna")
    out = tmp_path / "plan.yaml"
    done = subprocess.run([str(varuna), "plan", str(profile), "--gpus", "2", "--batch-size", "8", "--schedule",
                           "1f1b", "--shard-optimizer", "-o", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_plan(out).shard_optimizer
    assert "1×2 z" in done.stdout and "optimizer state sharded over the 2 replicas" in done.stdout, done.stdout
    shown = subprocess.run([str(varuna), "plan", "show", str(out)], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
    assert shown.returncode == 0 and "optimizer state sharded over the 2 replicas" in shown.stdout, shown.stdout


def test_a_morph_keeps_the_runs_choice_where_it_fits(tmp_path) -> None:
    """Re-planned for a morph, a job whose optimizer state was whole stays whole (its lost replicas regroup, its
    replicas keep copies of each other's handover files), even where the search alone would shard it; it is
    sharded only where the whole state does not fit."""
    from varuna_core.launch.manager import replan

    profile = _profile()
    for seg in profile.segments:
        seg.optimizer_time = 0.5  # a slow optimizer step: sharding halves it, which a free search takes
    path = tmp_path / "profile.json"
    save_artifact(profile, path)
    free = make_plan(profile, PlanRequest(gpus=2, batch_size=8, schedules=("1f1b",)))
    assert free.shard_optimizer
    whole = make_plan(profile, PlanRequest(gpus=1, batch_size=8, schedules=("1f1b",), microbatch_sizes=(4,)))
    whole.profile_path = str(path)
    grown, _ = replan(whole, 2, 2)
    assert (grown.dp, grown.shard_optimizer) == (2, False)
    # one segment (no deeper pipeline to fall back on) and a limit the whole state misses by a byte at dp=2
    single = make_profile([1.0], param_bytes=MB, bandwidth=1e12, latency=1e-6)
    save_artifact(single, path)
    limit = plan_for(single, PlanRequest(gpus=2, batch_size=8, headroom=0.0), pp=1, dp=2, microbatch_size=4,
                     schedule="1f1b").stages[0].memory_bytes - 1
    tight = whole.model_copy(update={"memory_limit": limit, "headroom": 0.0, "num_segments": 1,
                                     "partition": [(0, 1)], "profile_hash": single.structure_hash})
    grown, _ = replan(tight, 2, 2)
    assert (grown.pp, grown.dp, grown.shard_optimizer) == (1, 2, True)
    assert max(st.memory_bytes for st in grown.stages) <= limit
