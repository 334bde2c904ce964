"""benchmarks/gpu.py without a GPU: its pure helpers (the peak by device name, the FLOPs formula, the memory
estimate), a smoke run on the CPU at tiny sizes (``--device cpu --small``) in a subprocess, and the guards around
its phases (a failing phase is reported and the others run; a big model that does not fit is skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "gpu.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_gpu")


# ---------------------------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(("name", "precision", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 NVL", "fp16", 835.0), ("NVIDIA H200", "bf16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
])
def test_peak_by_device_name(bench, name, precision, peak):
    got, source = bench.peak_tflops(name, precision, None)
    assert got == peak and source.startswith("table")


def test_peak_unknown_device_and_override(bench):
    assert bench.peak_tflops("NVIDIA GeForce RTX 4090", "bf16", None)[0] is None
    assert bench.peak_tflops("x86_64", "fp32", None)[0] is None
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 500.0) == (500.0, "--peak-tflops")


def test_flops_per_token(bench):
    # 6 N + 12 L C T
    assert bench.flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16


def test_the_big_default_is_over_a_billion_and_fits_an_80gb_card_in_bf16(bench):
    args = bench.parse_args([])
    big = next(w for w in bench.workloads(args) if w.key == "big")
    info = big.describe()
    assert info["matmul_params"] >= 1e9
    need = bench.estimate_bytes(info["params"], big.n_layer, big.n_embd, big.seq, info["vocab_size"],
                                big.microbatch_size, "bf16")
    assert info["params"] * 16 < need < 78 * 2**30  # the static part and more, under an H100's memory
    assert bench.estimate_bytes(info["params"], big.n_layer, big.n_embd, big.seq, info["vocab_size"],
                                big.microbatch_size, "fp32") > need  # fp32 activations are larger


def test_microbatches_split_as_varuna_does(bench):
    assert bench.microbatches(32, 8) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert bench.microbatches(10, 4) == [(0, 4), (4, 4), (8, 2)]


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--big-heads", "3"], ["--peak-tflops", "0"],
                                  ["--warmup", "-1"], ["--precision", "fp8"], ["--device", "tpu"]])
def test_bad_flags_are_refused(bench, argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def test_precision_defaults_by_device(bench):
    assert bench.parse_args([]).precision == "bf16"
    assert bench.parse_args(["--device", "cpu"]).precision == "fp32"


# ---------------------------------------------------------------------------------------------------------- runs


def _positive(entry: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(entry[key], (int, float)) and entry[key] > 0, f"{key} = {entry[key]!r}"


def test_smoke_run_on_the_cpu():
    """The command line the README gives for a run without a GPU: one JSON document, every number there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--steps", "2", "--no-big",
                           "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["device"]["type"] == "cpu" and report["device"]["torch"]
    assert report["precision"] == "fp32" and report["failed"] == []
    [model] = report["models"]
    assert model["key"] == "example" and model["skipped"] is None
    _positive(model, "params", "tokens_per_step", "flops_per_step", "ratio_ours_over_plain",
              "ratio_predicted_over_measured")
    for name in ("ours", "plain"):
        run = model[name]
        _positive(run, "median_s", "tokens_per_s", "tflops", "build_s")
        assert len(run["step_s"]) == 2 and run["mfu"] is None  # no peak known for a CPU
        assert all(isinstance(x, float) and x > 0 for x in run["losses"])
    assert model["ours"]["loss_first"] == pytest.approx(model["plain"]["loss_first"], rel=1e-5)  # same model
    _positive(model["prediction"], "step_s", "profile_s", "memory_bytes")


def test_a_failed_phase_is_reported_and_the_others_run(bench, monkeypatch, capsys):
    """plain PyTorch fails in both models: one line each, ours still measured in both (the big model's path at
    tiny sizes: built on meta, allocated by Varuna), exit code 1."""
    def broken(*args, **kwargs):
        raise RuntimeError("plain is broken\nsecond line")

    monkeypatch.setattr(bench, "run_plain", broken)
    code = bench.main(["--device", "cpu", "--small", "--steps", "1", "--warmup", "0", "--no-profile", "--json"])
    out = capsys.readouterr()
    assert code == 1
    report = json.loads(out.out)
    assert [(f["model"], f["phase"]) for f in report["failed"]] == [
        ("example GPT", "plain (round 1/1)"), ("GPT (big path, --small)", "plain (round 1/1)")]
    assert all(f["error"] == "RuntimeError: plain is broken" for f in report["failed"])
    assert [m["key"] for m in report["models"]] == ["example", "big"]
    for model in report["models"]:
        assert model["plain"] is None and model["ratio_ours_over_plain"] is None
        assert model["ours"]["median_s"] > 0
    assert out.err.count("FAILED: RuntimeError: plain is broken") == 2


def test_a_big_model_that_does_not_fit_is_skipped(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "available_bytes", lambda dev: 1000)
    code = bench.main(["--device", "cpu", "--small", "--steps", "1", "--warmup", "0", "--no-profile", "--json-out",
                       str(tmp_path / "gpu.json")])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["models"][1]["skipped"].startswith("needs about") and report["failed"] == []
    assert "skipped: needs about" in out and "GiB free on cpu" in out
    assert "| example GPT | 208.51k | 512 | ours (Varuna pp=1) |" in out  # the tables, without --json
    assert "| example GPT | 208.51k | 512 | plain PyTorch |" in out
