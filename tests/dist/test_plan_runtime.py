"""The runtime takes a plan (map, partition, schedule, micro-batch size) and records a Chrome trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import run_ranks
from tests.dist.test_parity import BATCH, STEPS, assert_equal_run, reference
from tests.profiles import make_profile
from varuna_core.planning.artifacts import save_plan
from varuna_core.planning.planner import PlanRequest, plan_for

pytestmark = pytest.mark.dist


def test_plan_drives_the_runtime_and_trace_is_recorded(tmp_path) -> None:
    profile = make_profile([0.001, 0.004, 0.004, 0.001, 0.002])  # ToyLM has 5 segments
    plan = plan_for(profile, PlanRequest(gpus=2, batch_size=BATCH), pp=2, dp=1, microbatch_size=2, schedule="1f1b")
    plan_path = tmp_path / "plan.yaml"
    save_plan(plan, plan_path)
    trace_dir = tmp_path / "trace"
    run = {"schedule": "varuna", "optimizer": "adamw", "batch": BATCH, "chunk": 3, "steps": STEPS,
           "plan": str(plan_path), "trace": str(trace_dir)}
    results = run_ranks({"map": None, "timeout": 60, "runs": [run]}, 2, tmp_path / "run")
    ref_losses, ref_params, _ = reference("adamw", pp=2, chunk=2)  # the plan's micro-batch size
    for rank, res in enumerate(results):
        assert res.returncode == 0, res.error
        got = res.result["runs"][0]
        assert got["schedule"] == "1f1b" and got["chunk"] == 2  # the plan's, not the arguments'
        assert [tuple(r) for r in got["partition"].tolist()] == [tuple(r) for r in plan.partition]
        assert_equal_run(got, ref_losses, ref_params, f"rank {rank}")
    files = sorted(trace_dir.glob("trace_rank*.json"))
    assert [f.name for f in files] == ["trace_rank0.json", "trace_rank1.json"]
    events = json.loads(files[0].read_text())["traceEvents"]
    assert sorted(e["name"] for e in events) == sorted(f"0{op}{mb}" for op in "FB" for mb in range(4))
    for e in events:  # what each action spent waiting for a message and computing, within its duration
        assert 0 <= e["args"]["waited_us"] and 0 < e["args"]["compute_us"]
        assert e["args"]["waited_us"] + e["args"]["compute_us"] <= e["dur"] * (1 + 1e-9) + 1e-3
    varuna = Path(sys.executable).with_name("varuna")
    out = subprocess.run([str(varuna), "plan", "show", str(plan_path), "--png", str(tmp_path / "t.png"),
                          "--measured", str(trace_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "simulated vs measured" in out.stdout and "step" in out.stdout and "waited" in out.stdout
