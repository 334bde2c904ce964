"""benchmarks/wire_dtype.py without training anything: its arguments, how it compares two loss curves, its table,
and the overflow check's timing on one small message."""

from __future__ import annotations

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "wire_dtype.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_wire_dtype")


def test_arguments(bench) -> None:
    args = bench.parse_args(["--steps", "100", "--precisions", "bf16", "--json"])
    assert (args.steps, args.precision_list, args.chunk_size, args.json) == (100, ["bf16"], 4, True)
    assert bench.parse_args([]).precision_list == ["fp32", "bf16"]
    for bad in (["--steps", "10"], ["--precisions", "fp16"], ["--precisions", ","], ["--check-repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_curves_are_compared_step_by_step_and_smoothed(bench) -> None:
    exact = {"losses": [4.0] * 60}
    other = {"losses": [4.0] * 10 + [4.4] + [4.1] * 49}
    gap = bench.compare(exact, other)
    assert gap["max_gap"] == pytest.approx(0.4) and gap["max_gap_step"] == 10
    assert gap["max_gap_rel"] == pytest.approx(0.1)
    assert gap["mean_gap"] == pytest.approx((0.4 + 49 * 0.1) / 60)
    assert gap["max_smoothed_gap"] == pytest.approx((0.4 + 49 * 0.1) / 50)  # the window ending at the last step


def test_table_and_check_cost(bench) -> None:
    args = bench.parse_args(["--check-repeats", "3"])
    cost = bench.check_cost(args)
    assert cost["elements"] == 4 * 64 * 64 and cost["cast_and_check"] > 0
    rows = [{"precision": "fp32", "wire": "exact", "final_loss": 1.5, "val_loss": 1.6, "step_time": 0.1},
            {"precision": "fp32", "wire": "bf16", "final_loss": 1.51, "val_loss": 1.61, "step_time": 0.1,
             "max_gap": 0.02, "max_gap_step": 7, "max_gap_rel": 0.01, "mean_gap": 0.005, "max_smoothed_gap": 0.003}]
    text = bench.table({"microbatches": 8}, rows, cost)
    assert "| fp32 | bf16 | 1.5100 | 1.6100 | 0.0200 (7) | 1.00% | 0.0050 | 0.0030 | 100.0 |" in text
    assert "16 messages a step cross the cut" in text
