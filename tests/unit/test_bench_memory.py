"""Pure helpers of benchmarks/memory.py: flags, /proc and cgroup parsing, the search for the largest model, the
verdict on a run. No worker runs here (those take minutes and gigabytes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import BENCHMARKS, load_script
from varuna_core.util.procs import JobOutcome

SCRIPT = BENCHMARKS / "memory.py"


@pytest.fixture(scope="module")
def bench():
    """Import the script under a unique module name (torch is imported only by its workers and helpers)."""
    return load_script(SCRIPT, "_bench_memory")


# ---------------------------------------------------------------------------------------------------------- flags


def test_defaults_and_quick_presets(bench):
    args = bench.parse_args([])
    assert (args.n_layer, args.n_embd, args.n_head, args.search_n_embd) == (24, 1024, 16, 512)
    assert (args.cap_mb, args.max_probes, args.seq) == (1000.0, 5, args.block_size)
    assert args.contender_list == [c for c in bench.CONTENDERS if c not in bench.SHARDED]
    assert (args.dp, args.pp) == (1, 4)
    assert "ours-weights" not in args.search_list and "ours-meta" in args.search_list  # same training memory
    quick = bench.parse_args(["--quick"])
    assert (quick.n_layer, quick.n_embd, quick.search_n_embd, quick.cap_mb, quick.max_probes) == (16, 512, 256,
                                                                                                 500.0, 2)
    assert quick.search_list == ["ours-meta", "deepspeed", "torch-meta"]
    explicit = bench.parse_args(["--quick", "--n-layer", "8", "--cap-mb", "700", "--seq", "512"])
    assert (explicit.n_layer, explicit.cap_mb, explicit.seq) == (8, 700.0, 512)


def test_contender_lists(bench):
    args = bench.parse_args(["--contenders", "torch-meta, ours-meta,torch-meta"])
    assert args.contender_list == ["torch-meta", "ours-meta"]
    assert args.search_list == ["torch-meta", "ours-meta"]
    only_weights = bench.parse_args(["--contenders", "ours-weights"])
    assert only_weights.search_list == ["ours-weights"]  # never an empty search
    chosen = bench.parse_args(["--search-contenders", "ours-weights,deepspeed"])
    assert chosen.search_list == ["ours-weights", "deepspeed"]


@pytest.mark.parametrize("argv", [
    ["--n-layer", "6"], ["--n-layer", "0"], ["--n-embd", "100"], ["--search-n-embd", "100"],
    ["--microbatches", "3"], ["--steps", "0"], ["--cap-mb", "0"], ["--contenders", "ours-gpu"],
    ["--search-contenders", "nope"], ["--max-layers", "2"], ["--seq", "0"],
    ["--dp", "0"], ["--contenders", "ours-sharded"], ["--search-contenders", "deepspeed-zero1"],
    ["--dp", "2", "--contenders", "torch-meta"], ["--dp", "2", "--n-layer", "5"], ["--dp", "2", "--max-layers", "1"],
])
def test_bad_flags_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_ours_partition_matches_the_peers_split(bench):
    # stage 0 = embeddings + 6 blocks, then 6 blocks per stage; the last segment holds ln_f and the head
    assert bench.ours_partition(24, 4) == [(0, 7), (7, 13), (13, 19), (19, 25)]
    assert bench.ours_partition(4, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert bench.ours_partition(24, 2) == [(0, 13), (13, 25)]
    # DeepSpeed's layers are [embeddings, 24 blocks, head]: its cuts fall on the same blocks
    assert bench.deepspeed_parts(24, 4) == [0, 7, 13, 19, 26]
    assert bench.deepspeed_parts(24, 2) == [0, 13, 26]


def test_data_parallel_layout(bench):
    """--dp D > 1: pp=2 x dp=D, stage s on ranks s, s+2, ... (the clustered map), the sharded contenders by
    default; --dp 1 keeps pp=4 on one rank per stage."""
    args = bench.parse_args(["--dp", "2"])
    assert (args.pp, args.dp) == (2, 2)
    assert args.contender_list == ["ours-meta", "ours-sharded", "deepspeed", "deepspeed-zero1"]
    assert args.search_list == args.contender_list
    spec = bench.base_spec(args)
    assert (spec["pp"], spec["dp"]) == (2, 2)
    assert bench.rank_map(2, 2) == "0,2;1,3;"
    assert bench.rank_map(2, 4) == "0,2,4,6;1,3,5,7;"
    assert bench.rank_map(4, 1) == "0;1;2;3;"
    for pp, dp in ((2, 2), (2, 4), (4, 1)):
        stages = [ranks.split(",") for ranks in bench.rank_map(pp, dp).rstrip(";").split(";")]
        for rank in range(pp * dp):
            stage, replica = bench.coords(rank, pp)
            assert stages[stage][replica] == str(rank)
    job = bench.Job(spec=dict(spec, n_layer=24, microbatches=4, microbatch_size=2), rank=3, ds=None, cfg=None)
    assert (job.stage, job.replica, job.k, job.replica_batch, job.batch_size) == (1, 1, 12, 8, 16)
    chosen = bench.parse_args(["--dp", "2", "--only", "search",
                               "--search-contenders", "ours-meta,ours-sharded,deepspeed-zero1"])
    assert chosen.search_list == ["ours-meta", "ours-sharded", "deepspeed-zero1"]
    assert bench.parse_args(["--dp", "4", "--n-layer", "6", "--microbatches", "2"]).pp == 2  # 3 blocks per stage


def test_state_bytes_counts_tensors_of_the_state(bench):
    import torch

    w = torch.nn.Parameter(torch.zeros(3, 4))
    opt = torch.optim.AdamW([w])
    assert bench.state_bytes(opt) == 0  # AdamW creates its state at the first step
    w.grad = torch.ones(3, 4)
    opt.step()
    assert bench.state_bytes(opt) == 2 * 12 * 4  # exp_avg and exp_avg_sq; the 0-d step is not counted


def _row(key, state, peak, error=None):
    return {"key": key, "contender": key, "error": error, "optimizer_state_mb": state, "train_peak_mb": peak}


def test_sharding_targets(bench):
    side = {"contenders": [_row("ours-meta", [400, 400, 300, 300], [2000, 2000, 1900, 1900]),
                           _row("ours-sharded", [200, 201, 150, 149], [1700, 1710, 1600, 1600]),
                           _row("deepspeed-zero1", [200, 200, 150, 150], [1800, 1800, 1750, 1750])]}
    found = {"contenders": [{"key": "ours-meta", "largest": 20, "error": None},
                            {"key": "ours-sharded", "largest": 28, "error": None},
                            {"key": "deepspeed-zero1", "largest": 24, "error": None}]}
    t = bench.sharding_targets(side, found, 2)
    assert t["sharded_state_is_1_over_dp"] and t["sharded_state_off_mb"] == pytest.approx(1)
    assert t["sharded_peak_below_zero1"] and t["train_peak_mb"] == {"ours-sharded": 1710, "deepspeed-zero1": 1800}
    assert t["sharded_fits_more_than_unsharded"] and t["sharded_fits_at_least_zero1"]
    side["contenders"][1] = _row("ours-sharded", [400, 400, 150, 150], [1900, 1900, 1600, 1600])  # not sharded
    found["contenders"][1]["largest"] = 20
    t = bench.sharding_targets(side, found, 2)
    assert not t["sharded_state_is_1_over_dp"] and not t["sharded_fits_more_than_unsharded"]
    assert t["sharded_fits_at_least_zero1"] is False and any("MISS" in line for line in bench.sharding_target_lines(t))
    side["contenders"][2] = _row("deepspeed-zero1", None, None, error="boom")  # a failed run is no comparison
    assert "sharded_peak_below_zero1" not in bench.sharding_targets(side, None, 2)
    assert bench.targets(side, None, 2, 2).get("startup_above_baseline_x") is None  # the 0.35x target is pp=4's


# ---------------------------------------------------------------------------------------------------------- /proc

STATUS = """Name:\tpython
Umask:\t0022
VmPeak:\t 2461024 kB
VmHWM:\t  1580748 kB
VmRSS:\t  1398004 kB
RssAnon:\t 1290000 kB
RssFile:\t  107000 kB
RssShmem:\t    1004 kB
Threads:\t7
"""


def test_parse_status(bench):
    fields = bench.parse_status(STATUS)
    assert fields["VmHWM"] == 1580748 and fields["RssAnon"] == 1290000 and fields["RssShmem"] == 1004
    assert "Threads" not in fields and "Name" not in fields  # only the kB lines
    assert bench.status_mb("VmRSS", fields) == pytest.approx(1398004 / 1024)
    assert bench.status_mb(("RssAnon", "RssShmem"), fields) == pytest.approx(1291004 / 1024)
    assert bench.status_mb("VmSwap", fields) is None


def test_this_process_has_a_peak(bench):
    assert bench.peak_mb() > 1
    assert bench.read_status().get("VmRSS", 0) > 0


# ---------------------------------------------------------------------------------------------------------- search


def _fake(limit: int):
    """A model of n layers fits when n <= limit; records the calls."""
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= limit

    return fits, calls


@pytest.mark.parametrize("limit", [4, 7, 8, 13, 40, 77, 100, 255])
@pytest.mark.parametrize("start", [4, 8, 24, 64, 250])
def test_search_finds_the_largest_multiple(bench, limit, start):
    fits, calls = _fake(limit)
    out = bench.search_largest(fits, start=start, step=4, low=4, high=256, max_probes=50)
    assert out["largest"] == limit // 4 * 4
    assert out["resolved"]
    assert out["smallest_over"] in (None, out["largest"] + 4)
    assert [n for n, _ in out["probes"]] == calls
    assert all(n % 4 == 0 and 4 <= n <= 256 for n in calls)
    assert len(set(calls)) == len(calls)  # never the same run twice


def test_a_good_estimate_takes_few_runs(bench):
    fits, calls = _fake(50)
    out = bench.search_largest(fits, start=48, step=4, low=4, high=256, max_probes=50)
    assert out["largest"] == 48 and calls == [48, 52]
    fits, calls = _fake(50)
    out = bench.search_largest(fits, start=52, step=4, low=4, high=256, max_probes=50)
    assert out["largest"] == 48 and calls == [52, 48]


def test_far_estimates_gallop_with_doubling_steps(bench):
    fits, calls = _fake(200)
    bench.search_largest(fits, start=8, step=4, low=4, high=256, max_probes=50)
    assert calls[:6] == [8, 12, 20, 36, 68, 132]  # +4, +8, +16, +32, +64 from the last fit
    assert len(calls) <= 12


def test_search_edges(bench):
    fits, _ = _fake(2)
    none = bench.search_largest(fits, start=16, step=4, low=4, high=256, max_probes=50)
    assert none["largest"] is None and none["smallest_over"] == 4 and none["resolved"]
    fits, _ = _fake(10_000)
    top = bench.search_largest(fits, start=16, step=4, low=4, high=256, max_probes=50)
    assert top["largest"] == 256 and top["smallest_over"] is None and top["resolved"]


def test_search_stops_at_max_probes(bench):
    fits, calls = _fake(200)
    out = bench.search_largest(fits, start=8, step=4, low=4, high=256, max_probes=3)
    assert len(calls) == 3 and out["largest"] == 20 and not out["resolved"]


def test_search_lets_probe_errors_through(bench):
    def fits(n: int) -> bool:
        raise bench.ProbeError("rank 2: ConfigError: boom")

    with pytest.raises(bench.ProbeError, match="boom"):
        bench.search_largest(fits, start=8, step=4, low=4, high=64, max_probes=5)


def test_estimate_layers(bench):
    # 24 layers peaked 1323 MB above a 223 MB baseline; 100 MB fixed -> 50 MB per layer
    assert bench.estimate_layers(1423, 223, 24, 1423, 4, fixed_mb=100) == 24
    assert bench.estimate_layers(1423, 223, 24, 2423, 4, fixed_mb=100) == 44
    assert bench.estimate_layers(1423, 223, 24, 1423, 4, scale=0.25, fixed_mb=100) == 96  # a 4x narrower block
    assert bench.estimate_layers(1423, 223, 24, 300, 4, fixed_mb=100) == 4  # never below one block per stage


# ---------------------------------------------------------------------------------------------------------- caps


def test_cgroup_helpers(bench):
    mounts = ("cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
              "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n")
    assert bench.cgroup2_root(mounts) == Path("/sys/fs/cgroup/unified")
    assert bench.cgroup2_root("proc /proc proc rw 0 0\n") is None
    assert bench.parse_events("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n") == {
        "low": 0, "high": 0, "max": 12, "oom": 1, "oom_kill": 1}
    assert bench.cgroup_owner("varuna-bench-123") == 123
    assert bench.cgroup_owner("varuna-bench-x") is None and bench.cgroup_owner("system.slice") is None


def test_cgroup_without_memory_controller_is_unavailable(bench, tmp_path):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("hugetlb\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {root} cgroup2 rw 0 0\n")
    with pytest.raises(bench.CapUnavailable, match="no memory controller"):
        bench.CgroupCap.detect(1000, mounts=str(mounts))
    mounts.write_text("proc /proc proc rw 0 0\n")
    with pytest.raises(bench.CapUnavailable, match="no cgroup v2"):
        bench.CgroupCap.detect(1000, mounts=str(mounts))


def test_cgroup_prepare_writes_the_cap(bench, tmp_path):
    cap = bench.CgroupCap(1500, tmp_path)
    cap.parent.mkdir()
    dirs = cap.prepare("run", 2)
    assert [d.name for d in dirs] == ["run-rank0", "run-rank1"]
    assert (dirs[0] / "memory.max").read_text() == str(1500 * 2**20)
    assert not (dirs[0] / "memory.swap.max").exists()  # only where the kernel has it


def test_the_worker_joins_its_cgroup_before_exec(bench, tmp_path):
    """The shell prefix writes its own pid into cgroup.procs, then execs the command (same pid)."""
    argv = [*bench.CgroupCap.argv_prefix(tmp_path), sys.executable, "-c", "import os; print(os.getpid())"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    assert (tmp_path / "cgroup.procs").read_text().strip() == out.stdout.strip()


# ---------------------------------------------------------------------------------------------------------- verdicts


def _results(tmp_path, peaks):
    outs = []
    for rank, peak in enumerate(peaks):
        out = tmp_path / f"r{rank}.json"
        out.write_text(f'{{"rank": {rank}, "startup_peak_mb": {peak / 2}, "train_peak_mb": {peak}}}')
        outs.append(out)
    return outs


def test_judge_measured_cap(bench, tmp_path):
    ok = JobOutcome(returncodes=[0, 0])
    outs = _results(tmp_path, [900, 1100])
    fits = bench._judge(ok, outs, [], bench.MeasuredCap(1200, "test"))
    assert not fits.over_cap and not fits.error and fits.peak_mb == 1100
    over = bench._judge(ok, outs, [], bench.MeasuredCap(1000, "test"))
    assert over.over_cap and "1100" in over.detail and over.phase == "training"
    assert bench._judge(ok, outs, [], bench.MeasuredCap(500, "test")).phase == "start-up"  # 550 at start-up
    no_cap = bench._judge(ok, outs, [], None)
    assert not no_cap.over_cap


def test_judge_over_cap_and_errors(bench, tmp_path):
    outs = [tmp_path / "r0.json", tmp_path / "r1.json"]
    failed = JobOutcome(returncodes=[bench.OVER_CAP_EXIT, -9], failed=(0, bench.OVER_CAP_EXIT))
    Path(f"{outs[0]}.overcap").write_text('{"rss_mb": 1234.5, "cap_mb": 1000, "phase": "training"}')
    run = bench._judge(failed, outs, [], bench.MeasuredCap(1000, "test"))
    assert run.over_cap and not run.error and run.phase == "training"
    Path(f"{outs[0]}.overcap").unlink()
    outs[0].write_text('{"rank": 0, "startup_pe')  # killed while writing: no result, not a crash of the launcher
    assert bench._judge(JobOutcome(returncodes=[-9, -9], failed=(1, -9)), outs, [], None).error
    killed = JobOutcome(returncodes=[-9, -9], failed=(1, -9))
    oom = bench._judge(killed, outs, [{"oom_kill": 0}, {"oom_kill": 1}], None)
    assert oom.over_cap and "[1]" in oom.detail
    outs[1].write_text('{"error": "TypeError: unexpected keyword argument"}')
    error = bench._judge(JobOutcome(returncodes=[-9, 1], failed=(1, 1)), outs, [], None)
    assert error.error == "TypeError: unexpected keyword argument" and not error.over_cap
    outs[1].unlink()
    timeout = bench._judge(JobOutcome(returncodes=[-9, -9], timed_out=True, timeout=5), outs, [], None)
    assert timeout.error and "timed out" in timeout.error


def test_probe_text(bench):
    base = {"n_layer": 44, "error": None, "peak_mb": 940.2, "fits": True, "phase": None}
    assert bench._probe_text(base) == "44: fits 940"
    assert bench._probe_text(dict(base, fits=False, phase="start-up")) == "44: over in start-up"
    assert bench._probe_text(dict(base, fits=False)) == "44: over"
    assert bench._probe_text(dict(base, fits=False, error="boom")) == "44: error"


def test_md_table(bench):
    assert bench.md_table(["a", "b"], [["x", "1"]]) == ["| a | b |", "| --- | ---: |", "| x | 1 |"]
