"""benchmarks/stage_overhead.py without timing anything: its arguments, the even split, and that one forward of
a later stage runs with the memo on and off and marks the incoming cut inside the forward."""

from __future__ import annotations

import argparse

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "stage_overhead.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_stage_overhead")


def test_arguments(bench) -> None:
    args = bench.parse_args(["--pp", "3", "--repeats", "5", "--json"])
    assert (args.pp, args.repeats, args.warmup, args.microbatch_size, args.json) == (3, 5, 20, 4, True)
    for bad in (["--pp", "1"], ["--repeats", "0"], ["--n-embd", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_even_ranges(bench) -> None:
    assert bench.even_ranges(5, 2) == [(0, 3), (3, 5)]
    assert bench.even_ranges(5, 5) == [(i, i + 1) for i in range(5)]
    assert bench.even_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    for bad in ((3, 4), (3, 0)):
        with pytest.raises(ValueError):
            bench.even_ranges(*bad)


def test_a_later_stage_runs_with_and_without_the_memo(bench) -> None:
    from varuna_core.model.discovery import discover, make_batch_fn
    from varuna_core.model.values import ValueSource

    spec, _ = bench.gpt_spec(argparse.Namespace(n_embd=32, n_layer=2, n_head=2))
    batch_fn, dims = make_batch_fn(spec.inputs, None)
    structure = discover(spec.make(), batch_fn, dims, use_cache=False, values=ValueSource(seed=0, init=spec.init))
    stage = bench.LaterStage(spec, structure, bench.even_ranges(structure.num_segments, 2), 1, 2)
    samples = bench.measure(stage, repeats=2, warmup=1)
    assert all(len(v) == 2 for v in samples.values())
    assert all(0 < pre < whole for pre, whole in zip(samples["pre_on"], samples["forward_on"], strict=True))
    assert stage._memos[True].hits >= 2 and len(stage._memos[False]) == 0  # the embeddings' add, memoised
    row = bench.summarize(1, samples)
    assert 0 < row["pre_share_on"] < 1 and bench.table([row]).count("\n") == 2


def test_too_many_stages_is_one_line_and_exit_2(bench, capsys) -> None:
    assert bench.main(["--pp", "9", "--repeats", "1", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot split 5 segments into 9 stages" in err
