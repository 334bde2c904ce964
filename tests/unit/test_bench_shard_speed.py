"""benchmarks/shard_speed.py without running it: its arguments, the interface counters it reads, and how it sums a
pair's results (loopback: one ``lo`` for both ranks; slow: each rank's own link)."""

from __future__ import annotations

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "shard_speed.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_shard_speed")


def test_arguments(bench) -> None:
    args = bench.parse_args(["--network", "slow", "--rate", "100mbit", "--rounds", "2"])
    assert (args.network, args.rate_bps, args.rounds) == ("slow", 100_000_000, 2)
    assert args.contenders == ["allreduce", "sharded"] and args.bucket_mb == 25.0
    args = bench.parse_args(["--contenders", "allreduce,allreduce-after", "--bucket-mb", "1"])
    assert args.contenders == ["allreduce", "allreduce-after"] and args.bucket_mb == 1.0
    for bad in (["--steps", "0"], ["--rate", "fast"], ["--network", "wifi"], ["--contenders", "allreduce"],
                ["--contenders", "allreduce,allreduce"], ["--contenders", "allreduce,ddp"], ["--bucket-mb", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tx_bytes_reads_this_namespaces_counters(bench) -> None:
    assert bench.tx_bytes("lo") >= 0
    with pytest.raises(RuntimeError, match="no interface"):
        bench.tx_bytes("no-such-interface0")


def test_a_pair_is_summed_per_network(bench) -> None:
    ranks = [{"times_s": [0.1, 0.3, 0.2], "sent_bytes": 300, "optimizer_bytes": 8, "grad_bytes": 40,
              "losses": [1.0, 0.9, 0.8]},
             {"times_s": [0.2, 0.1, 0.2], "sent_bytes": 330, "optimizer_bytes": 8, "grad_bytes": 40,
              "losses": [1.0, 0.9, 0.8]}]
    loop, slow = bench.summarize(ranks, loopback=True), bench.summarize(ranks, loopback=False)
    assert loop["step_ms"] == pytest.approx(200.0)  # the median of the slower rank's steps: 0.2, 0.3, 0.2
    assert loop["bytes_per_step"] == 100 and slow["bytes_per_step"] == 210
