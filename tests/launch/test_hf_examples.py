"""The Hugging Face examples (automatic cut points, models never edited) train pipelined as in one process:
GPT-2 (2 stages) and T5 (2 stages x 2 replicas) under `varuna launch` with a plan, BERT (2 stages) under
torchrun; the printed losses (4 decimals) agree. (Deeper pipelines and more replicas of every model, exactly:
tests/dist/test_hf_parity.py.)

(To within a unit of the last printed decimal: the examples use Adam, which turns the rounding noise of
gradients that are zero in exact arithmetic, GPT-2's key bias, into full steps; the exact parity with SGD is
tests/dist/test_hf_parity.py's.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launch.conftest import ROOT, VARUNA, make_plan

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]')")

ARGS = ["--batch-size", "16", "--steps", "8", "--log-every", "1"]


def losses(output: str) -> list[float]:
    return [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]


def close(got: list[float], want: list[float]) -> bool:
    assert len(got) == len(want) == 8, (got, want)
    return max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1.5e-4


def alone(example: str, tmp_path) -> list[float]:
    done = subprocess.run([sys.executable, f"examples/{example}/train.py", *ARGS], cwd=ROOT, capture_output=True,
                          text=True, timeout=200, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                           VARUNA_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr[-2000:]
    return losses(done.stdout)


def test_hf_gpt2_under_varuna_launch_equals_one_process(tmp_path, launches) -> None:
    profile = tmp_path / "profile.json"
    done = subprocess.run([str(VARUNA), "profile", "examples/hf_gpt2/spec.py:spec", "--repeats", "1", "--warmup",
                           "0", "--microbatch-sizes", "4", "-o", str(profile)], cwd=ROOT, capture_output=True,
                          text=True, timeout=200, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    plan = make_plan(profile, tmp_path / "plan.yaml", pp=2, dp=1, mbs=4)
    launch = launches([str(plan), "--", "examples/hf_gpt2/train.py", *ARGS], tmp_path / "run", timeout=240)
    assert launch.wait() == 0, launch.output()[-3000:]
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "2 stage(s) x 1 replica(s)" in log and "transformer.wte.weight = lm_head.weight" in log
    assert close(losses(log), alone("hf_gpt2", tmp_path))


def test_hf_bert_under_torchrun_equals_one_process(tmp_path) -> None:
    torchrun = VARUNA.parent / "torchrun"
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "examples/hf_bert/train.py",
                           "--stage-to-rank-map", "0;1", "--schedule", "1f1b", *ARGS], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", VARUNA_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 stage(s) x 1 replica(s)" in done.stdout
    assert close(losses(done.stdout), alone("hf_bert", tmp_path))


def test_hf_t5_profile_plan_launch_equals_one_process(tmp_path, launches) -> None:
    """The encoder–decoder example end to end: the profile reports what skips over each cut, the plan what
    each stage boundary carries, and 2 stages x 2 replicas train as one process."""
    profile = tmp_path / "profile.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    done = subprocess.run([str(VARUNA), "profile", "examples/hf_t5/spec.py:spec", "--repeats", "1", "--warmup",
                           "0", "--microbatch-sizes", "4", "-o", str(profile)], cwd=ROOT, capture_output=True,
                          text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "also carries" in done.stdout and "of 'encoder.dropout'" in done.stdout, done.stdout[-2000:]
    plan = make_plan(profile, tmp_path / "plan.yaml", pp=2, dp=2, mbs=4, batch_size=16)
    shown = subprocess.run([str(VARUNA), "plan", "show", str(plan)], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env=env)
    assert shown.returncode == 0 and "values skipping the cut" in shown.stdout, shown.stdout + shown.stderr
    launch = launches([str(plan), "--", "examples/hf_t5/train.py", *ARGS], tmp_path / "run", timeout=240)
    assert launch.wait() == 0, launch.output()[-3000:]
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "2 stage(s) x 2 replica(s)" in log and "shared.weight" in log
    assert close(losses(log), alone("hf_t5", tmp_path))
