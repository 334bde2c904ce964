"""``varuna profile``: accuracy against set times, exact sizes, spec loading, bad inputs, no stale results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.specs import sleep
from varuna_core.errors import ConfigError
from varuna_core.model.spec import ModelSpec, load_spec
from varuna_core.planning.artifacts import Profile
from varuna_core.profiling.run import profile
from varuna_core.util.artifacts import schema_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def _close(measured: float, expected: float) -> bool:
    """A sleep is never shorter than asked (so a swapped forward/backward or a wrong unit fails the lower bound),
    but a loaded machine wakes the process late: the upper bound leaves room for that."""
    return 0.95 * expected <= measured <= 1.5 * expected + 0.002


@pytest.mark.parametrize("nproc", [1, 2])
def test_sleep_model_times_and_sizes(nproc) -> None:
    result = profile("tests.specs.sleep:spec", microbatch_sizes=[1, 4], nproc=nproc, repeats=3, warmup=1)
    assert result.num_segments == 3 and result.microbatch_sizes == [1, 4]
    h = sleep.HIDDEN
    for seg, (fwd, bwd) in zip(result.segments, sleep.TIMES):
        assert seg.param_bytes == (h * h + h) * 4 and seg.grad_bytes == seg.param_bytes
        assert seg.optimizer_bytes == 2 * seg.param_bytes + 2 * 4  # AdamW: exp_avg, exp_avg_sq, 2 scalar steps
        for m in seg.measures:
            assert _close(m.forward.median, fwd), (seg.index, m.forward)
            assert _close(m.recompute.median, fwd), (seg.index, m.recompute)
            assert _close(m.backward.median, bwd), (seg.index, m.backward)
            assert m.output_bytes == (0 if seg.index == 2 else m.microbatch_size * h * 4)
    if nproc == 2:
        ops = sorted((c.op, c.group_size) for c in result.comm)
        assert ops == [("allreduce", 2), ("p2p", 2)]
        for curve in result.comm:
            assert len(curve.sizes) >= 6 and curve.fit.bandwidth > 0 and curve.link == "intra"


def test_memory_limit_ends_the_sweep_for_all_segments() -> None:
    result = profile(sleep.spec, microbatch_sizes=[1, 2, 4096], repeats=1, warmup=0, memory_limit=200_000)
    assert result.microbatch_sizes == [1, 2]
    assert result.stopped and result.stopped.microbatch_size == 4096 and "limit" in result.stopped.reason
    assert all(len(seg.measures) == 2 for seg in result.segments)


def test_changed_model_is_measured_again(monkeypatch) -> None:
    first = profile("tests.specs.sleep:spec", microbatch_sizes=[1], repeats=1, warmup=0)
    monkeypatch.setattr(sleep, "HIDDEN", 16)
    second = profile("tests.specs.sleep:spec", microbatch_sizes=[1], repeats=1, warmup=0)
    assert second.structure_hash != first.structure_hash
    assert second.segments[0].param_bytes == (16 * 16 + 16) * 4 != first.segments[0].param_bytes


def test_schema_file_is_in_sync() -> None:
    on_disk = (ROOT / "schemas" / "profile.schema.json").read_text()
    assert on_disk == schema_text(Profile), "regenerate schemas/: python -m varuna_core.schemas"


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("nope.module:spec", "cannot import nope.module:spec"),
        ("tests.specs.sleep:missing", "has no attribute 'missing'"),
        ("tests.specs.sleep:not_a_spec", "is a int, not a ModelSpec"),
        ("tests/specs/absent.py:spec", "does not exist"),
        ("no-colon", "is not of the form"),
    ],
)
def test_bad_spec_references(reference, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_spec(reference)


def test_spec_by_function_and_by_file() -> None:
    assert load_spec("tests.specs.sleep:make_spec") is sleep.spec
    loaded = load_spec(str(ROOT / "tests" / "specs" / "sleep.py") + ":spec")
    assert isinstance(loaded, ModelSpec)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    varuna = Path(sys.executable).with_name("varuna")
    return subprocess.run([str(varuna), *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("nope.module:spec", "cannot import"),
        ("tests.specs.sleep:missing", "has no attribute"),
        ("tests.specs.sleep:not_a_spec", "not a ModelSpec"),
        ("tests.specs.sleep:no_cuts", "has no CutPoint"),
        ("tests.specs.sleep:wrong_batch", "input 'y' with 2 examples"),
    ],
)
def test_cli_bad_inputs_exit_2(reference, message, tmp_path) -> None:
    out = _cli("profile", reference, "-o", str(tmp_path / "p.json"), env={"VARUNA_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    if "CutPoint" in message:
        assert "hint:" in out.stderr


def test_cli_unwritable_output_fails_before_measuring(tmp_path) -> None:
    marker = tmp_path / "built"
    out = _cli("profile", "tests.specs.sleep:marked", "-o", str(tmp_path / "missing-dir" / "p.json"),
               env={"SLEEP_BUILD_MARKER": str(marker)})
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert not marker.exists(), "the model was built before the output path was checked"


def test_cli_writes_profile_and_json(tmp_path) -> None:
    path = tmp_path / "p.json"
    out = _cli("profile", "tests.specs.sleep:spec", "-o", str(path), "--microbatch-sizes", "1,2", "--repeats", "1",
               "--warmup", "0", "--json", env={"VARUNA_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    printed = Profile.model_validate(json.loads(out.stdout))
    assert Profile.model_validate_json(path.read_text()) == printed
    assert printed.microbatch_sizes == [1, 2]


def test_values_skipping_a_cut_are_measured_and_planned(tmp_path) -> None:
    """U-Net-like model: each cut's output bytes include what skips over it (h0 over all, h1 over 2-4, h2 over
    3: [n, 6, 16] float32 each), reported per cut, and a plan's stage boundary carries them."""
    from varuna_core.planning.planner import PlanRequest, plan_for

    result = profile(sleep.unet, microbatch_sizes=[2, 4], repeats=1, warmup=0)
    per_tensor = {n: n * 6 * 16 * 4 for n in (2, 4)}
    skipped = [1, 1, 2, 3, 2]  # tensors skipping cut 0..4
    for seg in result.segments[:-1]:
        assert len(seg.skips) == skipped[seg.index], seg.skips
        for m in seg.measures:
            assert m.skip_bytes == skipped[seg.index] * per_tensor[m.microbatch_size]
            assert m.output_bytes == m.skip_bytes + per_tensor[m.microbatch_size]
    assert "output 0 of 'emb' ([1, 6, 16] float32 per example)" in result.segments[0].skips
    assert not result.segments[-1].skips and result.segments[-1].measures[0].skip_bytes == 0
    plan = plan_for(result, PlanRequest(gpus=2, batch_size=8), pp=2, dp=1, microbatch_size=4, schedule="1f1b")
    boundary = plan.stages[0]
    cut = boundary.segments[1] - 1
    assert boundary.skip_bytes == skipped[cut] * per_tensor[4]
    assert boundary.activation_bytes == boundary.skip_bytes + per_tensor[4]
    assert plan.stages[1].skip_bytes == plan.stages[1].activation_bytes == 0


def test_more_cuda_processes_than_gpus_is_refused_before_the_model_is_built(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="2 processes are asked for and this machine has 1 GPU"):
        profile("tests.specs.sleep:marked", nproc=2, device="cuda")
