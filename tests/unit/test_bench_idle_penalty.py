"""benchmarks/idle_penalty.py without asserting any timing: its arguments, that each workload runs after either
kind of gap, that penalties are taken against the same series' tight loop, the tables, and the concurrent run."""

from __future__ import annotations

import argparse
import time

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "idle_penalty.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_idle_penalty")


def test_arguments(bench) -> None:
    args = bench.parse_args(["--gaps", "5,0.5", "--workloads", "linear", "--waits", "event", "--concurrent", "0"])
    assert args.gaps == [0.0, 0.5, 5.0]  # sorted, with the tight loop added
    assert (args.workloads, args.waits, args.concurrent) == (["linear"], ["event"], 0)
    for bad in (["--gaps", "x"], ["--gaps", "-1"], ["--gaps", "5000"], ["--gaps", ","], ["--workloads", "conv"],
                ["--waits", "spin"], ["--repeats", "0"], ["--concurrent", "1"], ["--warmup", "-1"],
                ["--microbatch-size", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize("wait", ["sleep", "event"])
def test_idle_waits_at_least_the_gap(bench, wait) -> None:
    start = time.perf_counter()
    bench.idle(wait, 0.01)
    assert time.perf_counter() - start >= 0.009
    bench.idle(wait, 0.0)


def test_penalties_are_against_the_tight_loop(bench) -> None:
    args = bench.parse_args(["--gaps", "0,1", "--workloads", "linear", "--repeats", "2", "--warmup", "1",
                             "--concurrent", "0"])
    rows = bench.measure("linear", args)
    assert [(r["wait"], r["gap_ms"]) for r in rows] == [("sleep", 0.0), ("sleep", 1.0), ("event", 0.0), ("event", 1.0)]
    for first in (rows[0], rows[2]):
        assert first["penalty_ms"] == 0 and first["penalty"] == 0
    assert rows[1]["penalty_ms"] == pytest.approx(rows[1]["median_ms"] - rows[0]["median_ms"])
    text = bench.tables(rows, [{"workload": "linear", "processes": 2, "alone_ms": 1.0, "concurrent_ms": [1.0, 1.5],
                                "slowdown": 0.5}])
    assert text.count("| linear |") == 5 and "+50.0%" in text


def test_the_gpt_workload_runs(bench) -> None:
    bench.make_workload("gpt", 1)()
    with pytest.raises(ValueError):
        bench.make_workload("conv", 1)


def test_concurrent_processes(bench) -> None:
    args = argparse.Namespace(concurrent=2, microbatch_size=1, repeats=2, warmup=0)
    row = bench.measure_concurrent("linear", args)
    assert row["processes"] == 2 and len(row["concurrent_ms"]) == 2 and row["alone_ms"] > 0
