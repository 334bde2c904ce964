"""benchmarks/split_cost.py without timing anything: its arguments, how it sums a segment's samples, its table,
and that one repeat of one segment runs (split and unsplit) and reports the bytes W keeps."""

from __future__ import annotations

import argparse

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "split_cost.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_split_cost")


def test_arguments(bench) -> None:
    args = bench.parse_args(["--repeats", "3", "--n-embd", "128", "--json"])
    assert (args.repeats, args.n_embd, args.microbatch_size, args.threads, args.json) == (3, 128, 4, 1, True)
    for bad in (["--repeats", "0"], ["--n-embd", "0"], ["--warmup", "-1"], ["--precision", "fp8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_a_segment_is_summed_from_medians(bench) -> None:
    samples = {"forward": [1e-3, 3e-3, 2e-3], "forward_split": [2e-3, 2e-3, 4e-3], "backward": [2e-3, 2e-3, 2e-3],
               "b": [1e-3, 1e-3, 2e-3], "w": [1e-3, 2e-3, 1e-3]}
    row = bench.summarize(1, 10, samples, [100, 100, 100])
    assert row["forward_ms"] == pytest.approx(2.0) and row["backward_ms"] == pytest.approx(2.0)
    assert row["b_plus_w_ms"] == pytest.approx(3.0)  # the median of the per-repeat sums 2, 3, 3
    assert row["split_ratio"] == pytest.approx(1.5) and row["b_ratio"] == pytest.approx(0.5)
    assert row["w_bytes"] == 100
    whole = bench.total([row, row])
    assert whole["segment"] == "all" and whole["params"] == 20 and whole["split_ratio"] == pytest.approx(1.5)
    table = bench.table([row, whole])
    assert table.count("\n") == 3 and "| all | 20 |" in table


def test_one_repeat_of_a_block_runs(bench) -> None:
    from varuna_core.model.discovery import discover, make_batch_fn
    from varuna_core.model.values import ValueSource

    args = argparse.Namespace(n_embd=32, n_layer=2, n_head=2)
    spec, config = bench.gpt_spec(args)
    assert (config.n_embd, config.n_layer) == (32, 2)
    batch_fn, dims = make_batch_fn(spec.inputs, None)
    structure = discover(spec.make(), batch_fn, dims, use_cache=False, values=ValueSource(seed=0, init=spec.init))
    segment = bench.Segment(spec, structure, 1, 2, "fp32")
    samples, nbytes = bench.measure(segment, repeats=1, warmup=0)
    assert all(len(v) == 1 for v in samples.values())
    # the inputs and output gradients of the block's 4 matmuls (2 x 64 rows), fp32: 32+32+32+128 columns in,
    # 96+32+128+32 out
    assert nbytes == [2 * 64 * 4 * (32 + 32 + 32 + 128 + 96 + 32 + 128 + 32)]
