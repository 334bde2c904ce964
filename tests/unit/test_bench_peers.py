"""Pure helpers of benchmarks/pipeline_vs_peers.py: the slow network's flags, tc commands and namespace names."""

from __future__ import annotations

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "pipeline_vs_peers.py"


@pytest.fixture(scope="module")
def bench():
    """Import the script under a unique module name (it imports only the standard library at top level)."""
    return load_script(SCRIPT, "_bench_pipeline_vs_peers")


@pytest.mark.parametrize(("text", "bps"), [
    ("200mbit", 200_000_000), ("1.5gbit", 1_500_000_000), ("64kbit", 64_000), ("800bit", 800), (" 10MBit ", 10**7),
])
def test_parse_rate(bench, text, bps):
    assert bench.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["200", "200mb", "200mbps", "0mbit", "-1mbit", "mbit", ""])
def test_parse_rate_rejects(bench, text):
    with pytest.raises(ValueError, match="--rate"):
        bench.parse_rate(text)


@pytest.mark.parametrize(("text", "seconds"), [("1ms", 1e-3), ("0ms", 0.0), ("250us", 250e-6), ("2s", 2.0),
                                               ("0.5ms", 5e-4)])
def test_parse_delay(bench, text, seconds):
    assert bench.parse_delay(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "ms", "-1ms", "1min", ""])
def test_parse_delay_rejects(bench, text):
    with pytest.raises(ValueError, match="--delay"):
        bench.parse_delay(text)


def test_bad_rate_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--network", "slow", "--rate", "fast"])
    assert e.value.code == 2
    assert "--rate 'fast'" in capsys.readouterr().err


def test_tc_rate_only(bench):
    assert bench.tc_commands("eth0", 200_000_000, 0.0) == [
        ["qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "200000000bit", "burst", "32kbit", "latency", "50ms"],
    ]


def test_tc_rate_and_delay(bench):
    """netem is the root (the delay), tbf its only child (the rate)."""
    root, child = bench.tc_commands("eth0", 50_000_000, 1.5e-3)
    assert root == ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", "1500us"]
    assert child[:7] == ["qdisc", "add", "dev", "eth0", "parent", "1:1", "handle"]
    assert child[8:11] == ["tbf", "rate", "50000000bit"]


@pytest.mark.parametrize(("name", "owner"), [
    ("pvp123-r0", 123), ("pvp4567-r1", 4567),
    ("pvp-r0", None), ("pvpx1-r0", None), ("pvp12-0", None), ("vsh123-0-h1", None), ("pvp12-r0-extra", None),
])
def test_namespace_owner(bench, name, owner):
    assert bench.namespace_owner(name) == owner


def test_pairs_name_known_contenders(bench):
    assert all(a in bench.CONTENDERS and b in bench.CONTENDERS for a, b in bench.PAIRS)
    assert bench.PAIRS[-1] == ("ours-1f1b", bench.BASELINE)  # the headline stays last


def test_the_link_bound_limit_counts_each_contenders_bytes(bench):
    """50 Mbit/s, 8 micro-batches of 4 × 64 × 64 fp32 activations (512 KiB each way), and ours' tied embedding."""
    args = bench.parse_args(["--network", "slow", "--rate", "50mbit"])
    limit = bench.link_bound(args)
    acts = 8 * 4 * 64 * 64 * 4
    tie = limit["bytes_per_direction"]["ours"] - acts
    assert limit["bytes_per_direction"]["peers"] == acts and tie > 0 and tie % (64 * 4) == 0
    assert limit["bytes_per_direction"]["ours-bf16"] == acts // 2 + tie
    assert limit["ms"]["peers"] == pytest.approx(acts * 8 / 50e6 * 1e3)
    assert [bench._limit_kind(n) for n in ("ours-varuna-bf16", "ours-zb", "torch-1f1b", bench.DEEPSPEED)] == [
        "ours-bf16", "ours", "peers", "peers"]
    assert "ours-varuna-bf16" in bench.CONTENDERS and "ours-1f1b-bf16" in bench.CONTENDERS


def test_the_critical_path_limit_adds_what_no_overlap_can_hide(bench):
    """With compute taking no time the step still needs every activation and then the last one's gradient on the
    link; with slow compute a stage's own work binds; a bf16 wire halves each message; a W on stage 1 ends the
    stage 1 chain with itself."""
    args = bench.parse_args(["--network", "slow", "--rate", "50mbit"])
    link = bench.link_bound(args)
    message = 4 * 64 * 64 * 4 * 8 / 50e6 * 1e3
    idle = bench.critical_path_bound(args, [{}, {}], "ours")
    assert idle["binding"] == "activations on the link"
    assert idle["ms"] == pytest.approx(link["ms"]["ours"] + message)
    assert idle["message_ms"] == pytest.approx(message)
    half = bench.critical_path_bound(args, [{}, {}], "ours-bf16")
    assert half["ms"] == pytest.approx(link["ms"]["ours-bf16"] + message / 2)
    assert bench.critical_path_bound(args, [{}, {}], "peers")["tie_ms"] == pytest.approx(0.0, abs=1e-9)

    compute = [{"F": 3.0, "R": 2.5, "B": 4.0}, {"F": 4.0, "B": 4.5}]
    ours = bench.critical_path_bound(args, compute, "ours")
    tie = ours["tie_ms"]
    assert ours["terms_ms"]["activations on the link"] == pytest.approx(3 + 8 * message + 8.5 + message + 4 + tie)
    assert ours["terms_ms"]["stage 0 compute"] == pytest.approx(8 * 9.5 + tie)
    assert ours["terms_ms"]["stage 1 compute"] == pytest.approx(3 + message + 8 * 8.5 + message + 4 + tie)
    assert ours["ms"] == max(ours["terms_ms"].values()) and ours["binding"] == "activations on the link"

    slow = bench.critical_path_bound(args, [{"F": 20.0, "R": 20.0, "B": 40.0}, {"F": 1.0, "B": 1.0}], "ours")
    assert slow["binding"] == "stage 0 compute" and slow["ms"] == pytest.approx(8 * 80 + slow["tie_ms"])
    split = bench.critical_path_bound(args, [{}, {"F": 1.0, "B": 1.0, "W": 30.0}], "ours")
    assert split["terms_ms"]["stage 1 compute"] == pytest.approx(message + 8 * 32 + split["tie_ms"])


def test_two_replicas_put_each_replica_on_a_host_and_the_all_reduce_on_the_link(bench):
    """--dp 2: ours and torch number a replica's stages consecutively, DeepSpeed a stage's replicas; the link
    carries each stage's all-reduce (a ring of two sends the whole gradient), and no gradient byte can cross before
    stage 1's last backward starts."""
    assert [bench.place("ours-varuna", r, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [bench.place("torch-1f1b", r, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [bench.place(bench.DEEPSPEED, r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [bench.place("ours-1f1b", r, 1) for r in range(2)] == [(0, 0), (1, 0)]

    split = {"ours-1f1b": [100, 60, 100, 60], bench.DEEPSPEED: [100, 100, 70, 70]}
    params = bench._replica_params(split)
    assert params == {"ours": 160, "peers": 170, "ours-bf16": 160}
    args = bench.parse_args(["--network", "slow", "--rate", "50mbit", "--dp", "2"])
    assert "torch-gpipe" not in args.contender_list and "ours-varuna" in args.contender_list  # default: those that can
    link = bench.link_bound(args, params)
    assert link["bytes_per_direction"] == {"ours": 640, "peers": 680, "ours-bf16": 640}
    crossing = 640 * 8 / 50e6 * 1e3
    compute = [{"F": 2.0, "R": 2.0, "B": 3.0}, {"F": 3.0, "B": 4.0}, {"F": 2.5, "R": 2.0, "B": 3.0},
               {"F": 3.0, "B": 5.0}]
    bound = bench.critical_path_bound(args, compute, "ours", link)
    assert bound["terms_ms"]["all-reduce on the link"] == pytest.approx(2.5 + 8 * 3.0 + 7 * 5.0 + crossing)
    assert bound["terms_ms"]["stage 0 compute"] == pytest.approx(8 * 7.5)
    assert bound["terms_ms"]["stage 1 compute"] == pytest.approx(2.5 + 8 * 8.0 + 3.0)
    assert bound["ms"] == max(bound["terms_ms"].values())


@pytest.mark.parametrize("contender", ["torch-gpipe", "torch-zb"])
def test_two_replicas_refuse_the_contenders_that_cannot_run_them(bench, contender, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--dp", "2", "--contenders", f"ours-1f1b,{contender}"])
    assert stop.value.code == 2 and contender in capsys.readouterr().err
