"""A sweep of bad input through the command line, as a user would type it.

Every case must end in exactly one ``error:`` line on stderr (and at most one ``hint:`` line), exit code 2 for
bad input (1 for failures), no traceback and no hang. Most cases run ``varuna_cli.app.main`` in this process
(fast); a representative subset runs the real command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import varuna_cli.app as cli
from tests.profiles import make_profile
from varuna_core.planning.artifacts import save_plan
from varuna_core.planning.planner import PlanRequest, plan_for
from varuna_core.util.versioned_io import save_artifact

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)
    monkeypatch.delenv("VARUNA_JOB_TOKEN", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A valid profile and plan (pp=2 × dp=2), a script to launch, and hostile files to pass instead."""
    d = tmp_path_factory.mktemp("inputs")
    profile = make_profile([0.001, 0.003, 0.003, 0.002])
    save_artifact(profile, d / "profile.json")
    plan = plan_for(profile, PlanRequest(gpus=4, batch_size=16), pp=2, dp=2, microbatch_size=2, schedule="1f1b")
    save_plan(plan, d / "plan.yaml")
    (d / "train.py").write_text("print('never run')\n")
    os.mkfifo(d / "fifo")
    (d / "dir").mkdir()
    (d / "binary").write_bytes(b"\xff\xfe\x00garbage\n")
    with open(d / "huge", "wb") as f:
        f.truncate(2**30)
    data = plan.model_dump(mode="json")
    for name, update in {"pp0": {"pp": 0}, "dp-1": {"dp": -1}, "badmap": {"stage_to_rank_map": "0,1;;2"},
                         "gapped": {"partition": [[0, 1], [2, 4]]}, "uncovered": {"partition": [[0, 1], [1, 3]]},
                         "manymb": {"num_microbatches": 50_000_000}, "nanstep": {"prediction": {
                             **data["prediction"], "step_time": float("nan")}}}.items():
        (d / f"{name}.yaml").write_text(yaml.safe_dump({**data, **update}, sort_keys=False))
    last_skips = [data["stages"][0], {**data["stages"][1], "skip_bytes": 4096}]  # the last stage sends nothing
    big_skips = [{**data["stages"][0], "skip_bytes": data["stages"][0]["activation_bytes"] + 1}, data["stages"][1]]
    for name, stages in {"lastskip": last_skips, "bigskip": big_skips}.items():
        (d / f"{name}.yaml").write_text(yaml.safe_dump({**data, "stages": stages}, sort_keys=False))
    bad = json.loads(profile.model_dump_json())
    bad["segments"][1]["measures"][0]["skip_bytes"] = bad["segments"][1]["measures"][0]["output_bytes"] + 1
    (d / "bigskip.json").write_text(json.dumps(bad))
    bad = json.loads(profile.model_dump_json())
    bad["segments"][-1]["measures"][0]["skip_bytes"] = 8
    (d / "lastskip.json").write_text(json.dumps(bad))
    (d / "bomb.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)))
    (d / "deep.yaml").write_text("[" * 100_000 + "]" * 100_000)
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "empty.yaml").write_text("")
    (d / "markup.json").write_text(profile.model_copy(update={"model": "[/][bold]x"}).model_dump_json())
    return {p.name: p for p in d.iterdir()} | {"dir_path": d}


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def assert_one_error(code: int, err: str, expected: int = 2, needle: str | None = None) -> None:
    lines = err.splitlines()
    assert code == expected, err
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("error: "), err
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), err
    if needle is not None:
        assert needle in lines[0], err


# --- varuna plan ------------------------------------------------------------------------------------------

PLAN_CASES = [
    (["--gpus", "0"], "--gpus must be in 1..65536, got 0"),
    (["--gpus", "abc"], "Invalid value for '--gpus'"),
    (["--gpus", "10000000"], "--gpus must be in"),
    (["--batch-size", "-3"], "--batch-size must be ≥ 1, got -3"),
    (["--batch-size", "1000000000000"], "micro-batches per replica; a plan holds at most 100,000"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be in"),
    (["--headroom", "nan"], "--headroom must be a number in [0, 1), got nan"),
    (["--headroom", "1"], "--headroom must be a number in [0, 1), got 1"),
    (["--headroom", "-0.5"], "--headroom must be a number in [0, 1), got -0.5"),
    (["--top", "-1"], "--top must be in 0..100, got -1"),
    (["--gpu-memory", "abc"], "cannot read 'abc' as a size"),
    (["--gpu-memory", "-5GiB"], "cannot read '-5GiB' as a size"),
    (["--gpu-memory", "nan"], "cannot read 'nan' as a size"),
    (["--gpu-memory", "1e400"], "is not between 0 and"),
    (["--gpu-memory", "0"], "--gpu-memory must be ≥ 1, got 0"),
    (["--host-memory", "lots"], "cannot read 'lots' as a size"),
    (["--host-memory", "-1GiB"], "cannot read '-1GiB' as a size"),
    (["--host-memory", "0"], "--host-memory must be ≥ 1, got 0"),
    (["--schedule", "bogus"], "unknown schedule 'bogus'"),
    (["--schedule", ","], "--schedule names no schedule"),
    (["--no-such-option"], "No such option"),
    (["--slurm"], "--gpus and --slurm both give the device count"),
    (["--pp", "0"], "--pp must be in 1..65536, got 0"),
    (["--pp", "3"], "--pp 3 does not divide the 4 devices"),
    (["--pp", "8"], "--pp 8 stages need 8 devices; 4 are available"),
    (["--gpus", "8", "--pp", "8"], "--pp 8 stages need at least 8 segments; the profiled model has 4"),
    (["--dp", "-1"], "--dp must be in 1..65536, got -1"),
    (["--dp", "3", "--pp", "2"], "--dp pp=2 × dp=3 needs 6 devices; 4 are available"),
    (["--dp", "5"], "--dp 5 replicas need 5 devices; 4 are available"),
    (["--gpus", "32", "--dp", "17"], "--dp 17 replicas need at least one example each; the global batch is 16"),
    (["--microbatch-size", "0"], "--microbatch-size must be in"),
    (["--microbatch-size", "17"], "--microbatch-size 17 is larger than the global batch of 16"),
    (["--microbatch-size", "8", "--dp", "4"], "no configuration"),
    (["--link-rate", "fast"], "--link-rate: cannot read 'fast' as a rate"),
    (["--link-rate", "0mbit"], "--link-rate: rate 0mbit is not above 0"),
    (["--link-rate", "50Mb/s"], "--link-rate: '50Mb/s' is ambiguous: bits or bytes?"),
    (["--link-rate", "nanmbit"], "--link-rate: cannot read"),
    (["--link-rate", "1e6gbit"], "--link-rate must be"),
    (["--link-latency", "-1ms"], "--link-latency: cannot read '-1ms' as a duration"),
    (["--link-latency", "1e400s"], "--link-latency: duration 1e400s is not finite"),
    (["--link-latency", "20s"], "--link-latency must be"),
]


@pytest.mark.parametrize(("extra", "needle"), PLAN_CASES, ids=[" ".join(c[0]) for c in PLAN_CASES])
def test_plan_options(capsys, files, extra, needle) -> None:
    out_path = files["dir_path"] / "out.yaml"
    code, _, err = run_main(capsys, "plan", files["profile.json"], "--gpus", "4", "--batch-size", "16",
                              "-o", out_path, *extra)  # the last value of an option given twice wins
    assert_one_error(code, err, needle=needle)
    assert not out_path.exists()


def test_plan_says_when_snapshots_would_not_fit_a_node(capsys, files) -> None:
    """The snapshots' footprint is printed; a node too small for it gets one warning line, and the plan is still
    written (snapshots are skipped at run time, not required)."""
    out_path = files["dir_path"] / "snap.yaml"
    base = ["plan", files["profile.json"], "--gpus", "4", "--batch-size", "16", "-o", out_path]
    code, out, err = run_main(capsys, *base)
    assert code == 0 and "in-memory snapshots" in out and "warning" not in err
    code, out, err = run_main(capsys, *base, "--host-memory", "1KiB")
    assert code == 0 and out_path.exists()
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "in-memory snapshots need" in warnings[0] and "Traceback" not in err
    code, _, err = run_main(capsys, *base, "--host-memory", "1TiB")
    assert code == 0 and "warning" not in err


@pytest.mark.parametrize(("profile", "needle"), [
    ("missing.json", "does not exist"), ("dir", "is a directory"), ("fifo", "is a FIFO"), ("binary", "UTF-8"),
    ("huge", "more than the"), ("plan.yaml", "not JSON"), ("list.yaml", "not JSON"),
    ("bigskip.json", "segments[1].measures[0] (micro-batch 1): skip_bytes 10001 is more than output_bytes 10000"),
    ("lastskip.json", "segments[3].measures[0] (micro-batch 1): output_bytes 0 and skip_bytes 8 on the last segment"),
])
def test_plan_bad_profile_files(capsys, files, profile, needle) -> None:
    path = files.get(profile, files["dir_path"] / profile)
    code, _, err = run_main(capsys, "plan", path, "--gpus", "4", "--batch-size", "16", "-o",
                            files["dir_path"] / "out.yaml")
    assert_one_error(code, err, needle=needle)


def test_plan_output_into_a_missing_directory_or_onto_a_directory(capsys, files) -> None:
    base = ["plan", files["profile.json"], "--gpus", "4", "--batch-size", "16", "-o"]
    code, _, err = run_main(capsys, *base, files["dir_path"] / "missing" / "p.yaml")
    assert_one_error(code, err, needle="does not exist")
    code, _, err = run_main(capsys, *base, files["dir"])
    assert_one_error(code, err, needle="is a directory")


ESCAPES = "\x1b[2J\x1b]0;owned\x07\u202e"  # clear the screen, retitle the window, bell, right-to-left override


def test_plan_prints_text_from_the_profile_with_control_characters_escaped(capsys, files, tmp_path) -> None:
    """A terminal escape in a profile's model name reached the terminal through `varuna plan`'s table."""
    profile = make_profile([0.001, 0.003])
    profile = profile.model_copy(update={"model": f"gpt{ESCAPES}"})
    save_artifact(profile, tmp_path / "profile.json")
    code, out, err = run_main(capsys, "plan", tmp_path / "profile.json", "--gpus", "2", "--batch-size", "8",
                              "-o", tmp_path / "evil\x1b[31m.yaml")
    assert code == 0, err
    assert "gpt\\x1b[2J\\x1b]0;owned\\x07\\u202e: 2 devices" in out
    assert not any(c in out + err for c in "\x1b\x07\u202e"), (out, err)


def test_profile_summary_escapes_names_from_user_code(capsys, tmp_path) -> None:
    from varuna_cli.commands.profile import _summary
    from varuna_core.planning.artifacts import StopReason

    profile = make_profile([0.001, 0.003])
    segments = [profile.segments[0].model_copy(update={"output_cut": f"c0{ESCAPES}", "skips": [f"mask{ESCAPES}"]}),
                profile.segments[1].model_copy(update={"input_cut": f"c0{ESCAPES}"})]
    profile = profile.model_copy(update={"model": f"gpt{ESCAPES}", "cut_names": [f"c0{ESCAPES}"],
                                         "segments": segments, "stopped": StopReason(
                                             microbatch_size=16, segment=0, reason=f"out of memory{ESCAPES}")})
    _summary(profile, tmp_path / f"p{ESCAPES}.json")
    captured = capsys.readouterr()
    assert "gpt\\x1b[2J" in captured.out and "out of memory\\x1b[2J" in captured.out
    assert not any(c in captured.out + captured.err for c in "\x1b\x07\u202e"), captured


def test_plan_prints_a_model_name_with_markup(capsys, files, tmp_path) -> None:
    code, out, err = run_main(capsys, "plan", files["markup.json"], "--gpus", "2", "--batch-size", "8",
                              "-o", tmp_path / "p.yaml")
    assert code == 0, err
    assert "[/][bold]x: 2 devices" in out


# --- varuna plan show -------------------------------------------------------------------------------------

BAD_PLANS = [
    ("pp0.yaml", "pp: Input should be greater than or equal to 1"),
    ("dp-1.yaml", "dp: Input should be greater than or equal to 1"),
    ("badmap.yaml", "stage_to_rank_map: stage 1"),
    ("gapped.yaml", "partition[1] is [2, 4)"),
    ("uncovered.yaml", "partition ends at segment 3"),
    ("manymb.yaml", "num_microbatches: Input should be less than or equal to 100000"),
    ("nanstep.yaml", "prediction.step_time: Input should be a finite number"),
    ("lastskip.yaml", ("stages[1] is the last stage, which sends nothing to a next one, but has activation_bytes 0, "
                       "skip_bytes 4096")),
    ("bigskip.yaml", "stages[0]: skip_bytes 20001 is more than activation_bytes 20000"),
    ("bomb.yaml", "anchors and aliases"),
    ("deep.yaml", "nested more than 32 levels deep"),
    ("list.yaml", "it holds [1, 2]"),
    ("empty.yaml", "it is empty"),
    ("binary", "is not UTF-8 text"),
    ("dir", "is a directory"),
    ("fifo", "is a FIFO"),
    ("huge", "more than the"),
    ("missing.yaml", "does not exist"),
]


@pytest.mark.parametrize(("plan", "needle"), BAD_PLANS)
def test_plan_show_bad_plans(capsys, files, plan, needle) -> None:
    code, out, err = run_main(capsys, "plan", "show", files.get(plan, files["dir_path"] / plan))
    assert_one_error(code, err, needle=needle)
    assert out == ""


@pytest.mark.parametrize(("extra", "needle"), [
    (["--max-steps", "-1"], "--max-steps must be ≥ 0"),
    (["--measured", "x.json"], "--measured needs --png"),
    (["--png", "missing/t.png"], "does not exist"),
    (["--png", "PNG", "--measured", "FIFO"], "is a FIFO"),
])
def test_plan_show_options(capsys, files, extra, needle) -> None:
    d = files["dir_path"]
    extra = [{"missing/t.png": str(d / "missing" / "t.png"), "PNG": str(d / "t.png"),
              "FIFO": str(files["fifo"])}.get(w, w) for w in extra]
    code, _, err = run_main(capsys, "plan", "show", files["plan.yaml"], *extra)
    assert_one_error(code, err, needle=needle)


# --- varuna launch ----------------------------------------------------------------------------------------

def _launch(capsys, files, tmp_path, *extra: str, plan: str = "plan.yaml") -> tuple[int, str]:
    run = tmp_path / "run"
    code, _, err = run_main(capsys, "launch", files.get(plan, tmp_path / plan), "--run-dir", run, "--code-dir",
                            files["dir_path"], *extra, "--", "train.py")
    assert not run.exists(), "something was started"
    return code, err


@pytest.mark.parametrize(("plan", "needle"), [case for case in BAD_PLANS if case[0] in (
    "pp0.yaml", "dp-1.yaml", "badmap.yaml", "gapped.yaml", "manymb.yaml", "bomb.yaml", "fifo", "binary",
    "lastskip.yaml", "bigskip.yaml")])
def test_launch_bad_plans(capsys, files, tmp_path, plan, needle) -> None:
    code, err = _launch(capsys, files, tmp_path, plan=plan)
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("--heartbeat-timeout", "nan", "--heartbeat-timeout must be a number in [1, 86400], got nan"),
    ("--heartbeat-timeout", "inf", "--heartbeat-timeout"),
    ("--morph-timeout", "nan", "--morph-timeout"),
    ("--morph-timeout", "0", "--morph-timeout"),
    ("--preempt-margin", "nan", "--preempt-margin"),
    ("--preempt-margin", "-1", "--preempt-margin"),
    ("--grace", "nan", "--grace"),
    ("--grace", "1e300", "--grace"),
    ("--straggler-threshold", "0", "--straggler-threshold must be a number in (0, 100]"),
    ("--straggler-threshold", "-inf", "--straggler-threshold"),
    ("--straggler-threshold", "nan", "--straggler-threshold"),
    ("--ckpt-every", "-1", "--ckpt-every must be in 0..1000000000"),
    ("--ckpt-keep", "0", "--ckpt-keep"),
    ("--max-restarts", "-1", "--max-restarts"),
    ("--max-restarts", "10000000", "--max-restarts"),
    ("--gpus-per-node", "0", "--gpus-per-node"),
    ("--gpus-per-node", "100000", "--gpus-per-node must be in 1..4096"),
    ("--steps", "0", "--steps"),
    ("--ssh-port", "70000", "--ssh-port must be in 1..65535"),
    ("--ssh-user", "-oProxyCommand=x", "--ssh-user '-oProxyCommand=x' is not a user name"),
    ("--heartbeat-timeout", "soon", "Invalid value for '--heartbeat-timeout'"),
    ("--preemption-source", "ibm", "--preemption-source 'ibm' is not one of azure, aws, gcp"),
    ("--preemption-endpoint", "http://127.0.0.1:9", "--preemption-endpoint needs --preemption-source"),
    ("--preemption-interval", "0", "--preemption-interval needs --preemption-source"),
    ("--preemption-interval", "nan", "--preemption-interval"),
    ("--recheck-max", "0", "--recheck-max must be a number in [1, 3600], got 0"),
    ("--recheck-max", "nan", "--recheck-max"),
    ("--recheck-max", "inf", "--recheck-max"),
    ("--shelf-budget", "-1", "--shelf-budget must be in 0.."),
    ("--shelf-budget", "1e9", "Invalid value for '--shelf-budget'"),
    ("--shelf-dir", "shm", "--shelf-dir 'shm' is not an absolute path"),
    ("--shelf-dir", "", "--shelf-dir '' is not an absolute path"),
    ("--shelf-dir", "/dev/shm\0x", "--shelf-dir"),
    ("--snapshot-every", "-1", "--snapshot-every '-1' is neither a number of steps nor 'auto'"),
    ("--snapshot-every", "often", "--snapshot-every 'often' is neither a number of steps nor 'auto'"),
    ("--snapshot-every", "99999999999", "--snapshot-every must be in 0..1000000000"),
    ("--snapshot-every", "5", "--snapshot-every needs --morph with the handover"),
])
def test_launch_bad_numbers(capsys, files, tmp_path, option, value, needle) -> None:
    code, err = _launch(capsys, files, tmp_path, option, value)
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize(("extra", "needle"), [
    ((), "--ckpt-local needs --morph with the handover"),
    (("--morph", "--no-handover"), "--ckpt-local needs --morph with the handover"),
    (("--morph", "--ckpt-tempdir", "/tmp"), "--ckpt-local and --ckpt-tempdir do not go together"),
])
def test_launch_ckpt_local_needs_the_shelves(capsys, files, tmp_path, extra, needle) -> None:
    code, err = _launch(capsys, files, tmp_path, "--ckpt-local", *extra)
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize(("text", "needle"), [
    (b"-oProxyCommand=touch /tmp/x\n", "starts with '-', which ssh would read as an option"),
    (b"alice@-p slots=2\n", "starts with '-'"),
    (b"node1:70000\n", "port 70000 is not in 1-65535"),
    (b"node1 slots=100000\n", "only slots=N with 1 <= N <= 4096"),
    (b"node1 slots=\xc2\xb2\n", "unknown field 'slots=\xb2'"),
    (b"[/]\n", "is not a host name or address"),
    (b"node1\nnode\xff2\n", "is not UTF-8 text (byte 0xff on line 2)"),
    (b"#\n" * 1_000_000, "more than the"),
    (b"# nobody\n", "lists no host"),
])
def test_launch_bad_hosts_files(capsys, files, tmp_path, text, needle) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_bytes(text)
    code, err = _launch(capsys, files, tmp_path, "--hosts", str(hosts))
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize("name", ["fifo", "dir", "binary", "huge"])
def test_launch_hosts_that_are_not_files(capsys, files, tmp_path, name) -> None:
    code, err = _launch(capsys, files, tmp_path, "--hosts", str(files[name]))
    assert_one_error(code, err, needle=str(files[name]))


@pytest.mark.parametrize(("text", "needle"), [
    (b"RANK=3\n", "line 1: RANK is set by the launcher for every worker"),
    (b"A=1\nexport MASTER_ADDR=10.0.0.1\n", "line 2: MASTER_ADDR is set by the launcher"),
    (b"VARUNA_JOB_TOKEN=stolen\n", "VARUNA_JOB_TOKEN is set by the launcher"),
    (b"VARUNA_CKPT_EVERY=5\n", "VARUNA_CKPT_EVERY is set by the launcher"),
    (b"WORLD_SIZE=1\n", "WORLD_SIZE"),
    (b"A=1\x00\n", "line 1 holds a NUL byte"),
    (b"A=1\nB=\xff\n", "line 2 is not UTF-8 text"),
    (b"not an assignment\n", "not KEY=VALUE"),
    (b"1A=x\n", "not KEY=VALUE"),
    (b"A='unclosed\n", "No closing quotation"),
    (b"A=" + b"x" * 200_000 + b"\n", "a process cannot be started with an environment string over"),
    (b"A=1\n" * 100_000, "more than the"),
])
def test_launch_bad_env_files(capsys, files, tmp_path, text, needle) -> None:
    env = tmp_path / "env"
    env.write_bytes(text)
    code, err = _launch(capsys, files, tmp_path, "--env-file", str(env))
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize("name", ["fifo", "dir", "huge"])
def test_launch_env_files_that_are_not_files(capsys, files, tmp_path, name) -> None:
    code, err = _launch(capsys, files, tmp_path, "--env-file", str(files[name]))
    assert_one_error(code, err, needle=str(files[name]))


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("--code-dir", "MISSING", "--code-dir MISSING does not exist"),
    ("--code-dir", "train.py", "--code-dir train.py is not a directory"),
    ("--ssh-identity", "MISSING", "--ssh-identity MISSING does not exist"),
    ("--ssh-identity", "dir", "--ssh-identity dir is not a file"),
])
def test_launch_missing_paths(capsys, files, tmp_path, option, value, needle) -> None:
    """A place an option names that is missing is named as missing, with a hint (not blamed on SCRIPT, not an
    SSH failure); checked before anything starts."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=4\n")
    path = str(tmp_path / "missing" / "x") if value == "MISSING" else str(files[value])
    run = tmp_path / "run"
    code, _, err = run_main(capsys, "launch", files["plan.yaml"], "--run-dir", run, "--hosts", hosts,
                            *([] if option == "--code-dir" else ["--code-dir", files["dir_path"]]),
                            option, path, "--", "train.py")
    assert_one_error(code, err, needle=needle.replace(value, path))
    assert "hint: " in err or value != "MISSING"
    assert not run.exists()


def test_launch_run_dir_that_is_a_file(capsys, files, tmp_path) -> None:
    code, _, err = run_main(capsys, "launch", files["plan.yaml"], "--run-dir", files["train.py"], "--", "train.py")
    assert_one_error(code, err, needle="--run-dir")


def test_reporter_prints_markup_and_escapes_as_text(capsys) -> None:
    from types import SimpleNamespace

    from varuna_cli.commands.launch import _panel, _Reporter

    reporter = _Reporter()
    reporter.event("host [/] said [bold]hi[/bold] \x1b[2J")
    status = SimpleNamespace(total_steps=10, loss=None, samples_per_second=None, stragglers=["[/]", "a[b]"],
                             attempt=1, state="running", pp=2, dp=2, hosts=1, step=3, eta=None, restarts=0, morphs=0)
    reporter.status(status)
    reporter.close()
    err = capsys.readouterr().err
    assert "host [/] said [bold]hi[/bold] \\x1b[2J" in err and "\x1b[2J" not in err
    assert "stragglers: [/]; a[b]" in err
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(_panel(status))
    assert "[/]; a[b]" in console.export_text()


# --- varuna notify-preempt --------------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "needle"), [
    (None, "does not exist"),
    ("DIR", "is a directory"),
    ("FIFO", "is a FIFO"),
    (b"x" * (2**20), "more than the"),
    (b"not json", "is not JSON"),
    (b"\xff\xfe", "is not JSON"),
    (b"[" * 60_000, "nested too deeply"),
    (b"[1, 2]", "holds a list, not an object"),
    (b'{"job": "j", "token": "t", "port": "x"}', "port must be an integer in 1..65535, got 'x'"),
    (b'{"job": "j", "token": "t", "port": 70000}', "port must be an integer in 1..65535, got 70000"),
    (b'{"job": "j", "token": "t", "port": true}', "port must be an integer in 1..65535, got True"),
    (b'{"job": "j", "token": 5, "port": 1234}', "token must be a string, got 5"),
    (b'{"job": ["j"], "token": "t", "port": 1234}', "job must be a string"),
    (b'{"token": "t", "port": 1234}', "job must be a string, got None"),
])
def test_notify_preempt_bad_manager_files(capsys, tmp_path, content, needle) -> None:
    path = tmp_path / "manager.json"
    if content == "DIR":
        path.mkdir()
    elif content == "FIFO":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    code, _, err = run_main(capsys, "notify-preempt", "node1", "--run-dir", tmp_path)
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize(("extra", "needle"), [
    (["--in", "nan"], "--in must be a number of seconds"),
    (["--in", "inf"], "--in must be a number of seconds"),
    (["--in", "-1"], "--in must be a number of seconds"),
    (["--address", "no such host"], "--address 'no such host' is not an address"),
])
def test_notify_preempt_bad_options(capsys, tmp_path, extra, needle) -> None:
    (tmp_path / "manager.json").write_text(json.dumps({"job": "j", "token": "t", "port": 9}))
    code, _, err = run_main(capsys, "notify-preempt", "node1", "--run-dir", tmp_path, *extra)
    assert_one_error(code, err, needle=needle)


@pytest.mark.parametrize("subprocess_run", [False, True])
def test_notify_preempt_missing_run_dir(capsys, files, tmp_path, subprocess_run) -> None:
    """As every missing path argument: one line that says it does not exist, a hint, exit 2."""
    missing = tmp_path / "no-such-run"
    if subprocess_run:
        done = _run("notify-preempt", "node1", "--run-dir", missing)
        code, err = done.returncode, done.stderr
    else:
        code, _, err = run_main(capsys, "notify-preempt", "node1", "--run-dir", missing)
    assert_one_error(code, err, needle=f"--run-dir {missing} does not exist")
    assert err.splitlines()[1].startswith("hint: give --run-dir of a running `varuna launch`")
    code, _, err = run_main(capsys, "notify-preempt", "node1", "--run-dir", files["train.py"])
    assert_one_error(code, err, needle=f"--run-dir {files['train.py']} is not a directory")


def test_notify_preempt_bad_host_names(capsys, tmp_path) -> None:
    (tmp_path / "manager.json").write_text(json.dumps({"job": "j", "token": "t", "port": 9}))
    for host in ("", "h" * 300, "a\nb"):
        code, _, err = run_main(capsys, "notify-preempt", host, "--run-dir", tmp_path)
        assert_one_error(code, err, needle="is not a host name")


def test_notify_preempt_host_with_markup(capsys, tmp_path) -> None:
    from varuna_core.launch.heartbeat import Listener

    listener = Listener("job1", "token1", bind="127.0.0.1")
    try:
        (tmp_path / "manager.json").write_text(json.dumps({"job": "job1", "token": "token1", "port": listener.port}))
        code, out, err = run_main(capsys, "notify-preempt", "[/]node", "--in", "5", "--run-dir", tmp_path)
    finally:
        listener.close()
    assert code == 0, err
    assert out.strip() == "notified: [/]node goes away in 5s"


# --- varuna profile ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "needle"), [
    (["--nproc", "0"], "--nproc must be in 1..64, got 0"),
    (["--nproc", "100000"], "--nproc must be in 1..64"),
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--microbatch-sizes", "0"], "--microbatch-sizes must be in"),
    (["--microbatch-sizes", ","], "--microbatch-sizes must be 1 to 64 positive integers"),
    (["--microbatch-sizes", "1,x"], "--microbatch-sizes must be"),
    (["--microbatch-sizes", "-1"], "--microbatch-sizes must be"),
    (["--microbatch-sizes", "99999999999"], "--microbatch-sizes must be"),
    (["--max-microbatch", "0"], "--max-microbatch must be in"),
    (["--max-microbatch", "1000000000"], "--max-microbatch must be in"),
    (["--max-microbatch", "4", "--microbatch-sizes", "1"], "not both"),
    (["--memory-limit", "nan"], "cannot read 'nan' as a size"),
    (["--memory-limit", "0"], "--memory-limit must be ≥ 1, got 0"),
    (["-o", "MISSING"], "does not exist"),
    (["-o", "DIR"], "is a directory"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_profile_options_fail_before_the_model_is_built(capsys, monkeypatch, files, tmp_path, extra, needle) -> None:
    marker = tmp_path / "built"
    monkeypatch.setenv("SLEEP_BUILD_MARKER", str(marker))
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    extra = [{"MISSING": str(tmp_path / "missing" / "p.json"), "DIR": str(files["dir"])}.get(w, w) for w in extra]
    if "-o" not in extra:
        extra += ["-o", str(tmp_path / "p.json")]
    code, _, err = run_main(capsys, "profile", "tests.specs.sleep:marked", *extra)
    assert_one_error(code, err, needle=needle)
    assert not marker.exists(), "the model was built before the options were checked"


@pytest.mark.parametrize(("attr", "code", "needle"), [
    ("build_value_error", 1, "the model spec's build() raised ValueError at tests/specs/failing.py:"),
    ("build_type_error", 1, "the model spec's build() raised TypeError at tests/specs/failing.py:"),
    ("forward_type_error", 1, "raised TypeError at tests/specs/failing.py:"),
    ("factory_type_error", 1, "tests.specs.failing:factory_type_error() raised TypeError at tests/specs/failing.py:"),
    ("factory_with_an_argument", 2, "cannot be called so: missing a required argument: 'size'"),
    ("batch_without_n", 2, "the model spec's batch(1) cannot be called so"),
    ("wrong_input_names", 2, "does not take the inputs ['targets', 'tokens']"),
])
def test_profile_a_spec_whose_code_fails(capsys, monkeypatch, tmp_path, attr, code, needle) -> None:
    """The user's code raising is exit 1, saying where in their files; a spec called against its signature
    (never a TypeError raised inside it) is bad input, exit 2."""
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    args = ["profile", f"tests.specs.failing:{attr}", "-o", tmp_path / "p.json", "--microbatch-sizes", "1",
            "--repeats", "1", "--warmup", "0"]
    got, _, err = run_main(capsys, *args)
    assert_one_error(got, err, expected=code, needle=needle)
    assert "unexpected" not in err and not (tmp_path / "p.json").exists()
    if code == 1:
        assert err.splitlines()[1] == ("hint: the error is in that code, not in varuna; set VARUNA_DEBUG=1 for "
                                       "the whole traceback")
        monkeypatch.setenv("VARUNA_DEBUG", "1")
        from varuna_core.errors import UserCodeError

        with pytest.raises(UserCodeError) as info:
            cli.main([str(a) for a in args])
        assert info.value.__cause__ is not None  # the user's own traceback, with VARUNA_DEBUG=1


@pytest.mark.parametrize(("name", "needle"), [
    ("missing.py", "does not exist"),
    ("spec.txt", "spec.txt is not a Python file"),  # once an AttributeError from importlib
])
def test_profile_a_spec_file_that_cannot_be_imported(capsys, tmp_path, name, needle) -> None:
    (tmp_path / "spec.txt").write_text("spec = None\n")
    code, _, err = run_main(capsys, "profile", f"{tmp_path / name}:spec", "-o", tmp_path / "p.json")
    assert_one_error(code, err, needle=needle)


# --- varuna env -------------------------------------------------------------------------------------------

def test_env_redacts_secrets(capsys, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_JOB_TOKEN", "s3cr3t-token")
    monkeypatch.setenv("VARUNA_API_KEY", "s3cr3t-key")
    monkeypatch.setenv("VARUNA_PASSWORD", "s3cr3t-pw")
    monkeypatch.setenv("VARUNA_SEED", "1234")
    code, out, _ = run_main(capsys, "env", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["env.VARUNA_JOB_TOKEN"] == info["env.VARUNA_API_KEY"] == info["env.VARUNA_PASSWORD"] == "<redacted>"
    assert info["env.VARUNA_SEED"] == "1234"
    code, out, _ = run_main(capsys, "env")
    assert code == 0 and "s3cr3t" not in out and "<redacted>" in out


# --- main(): the last line of defence ---------------------------------------------------------------------

class CheckpointException(BaseException):
    """Like torch.distributed.checkpoint's, which derives from BaseException."""


def test_main_reports_a_base_exception_in_one_line(capsys, monkeypatch) -> None:
    def fake(*args, **kwargs):
        raise CheckpointException("rank 1 failed\nTraceback (most recent call last):\n  ...")

    monkeypatch.setattr(cli, "app", fake)
    code, _, err = run_main(capsys)
    assert_one_error(code, err, expected=1, needle="CheckpointException: rank 1 failed")
    monkeypatch.setenv("VARUNA_DEBUG", "1")
    with pytest.raises(CheckpointException):
        cli.main([])


def test_main_prints_a_multi_line_message_as_one_line(capsys, monkeypatch) -> None:
    from varuna_core.errors import ConfigError

    def fake(*args, **kwargs):
        raise ConfigError("bad host 'a\nb'\x1b[2J", hint="one\ntwo")

    monkeypatch.setattr(cli, "app", fake)
    code, _, err = run_main(capsys)
    assert_one_error(code, err)
    assert err.splitlines() == ["error: bad host 'a b'\\x1b[2J", "hint: one two"]


# --- the real command, in a subprocess --------------------------------------------------------------------

def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("VARUNA_DEBUG", "VARUNA_JOB_TOKEN")}
    return subprocess.run([sys.executable, "-m", "varuna_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**clean, **(env or {})}, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("case", ["plan show bomb", "plan show fifo", "plan bad gpus", "launch hosts", "launch env",
                                  "notify fifo", "unknown option"])
def test_in_a_subprocess(files, tmp_path, case) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("-oProxyCommand=touch /tmp/pwned\n")
    env = tmp_path / "env"
    env.write_text("VARUNA_JOB_TOKEN=x\n")
    fifo_run = tmp_path / "fifo_run"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "manager.json")
    launch = ["launch", files["plan.yaml"], "--run-dir", tmp_path / "run", "--code-dir", files["dir_path"]]
    args, needle = {
        "plan show bomb": (["plan", "show", files["bomb.yaml"]], "anchors and aliases"),
        "plan show fifo": (["plan", "show", files["fifo"]], "is a FIFO"),
        "plan bad gpus": (["plan", files["profile.json"], "--gpus", "-1", "--batch-size", "8"], "--gpus must be"),
        "launch hosts": ([*launch, "--hosts", hosts, "--", "train.py"], "starts with '-'"),
        "launch env": ([*launch, "--env-file", env, "--", "train.py"], "VARUNA_JOB_TOKEN is set by the launcher"),
        "notify fifo": (["notify-preempt", "node1", "--run-dir", fifo_run], "is a FIFO"),
        "unknown option": (["plan", "show", files["plan.yaml"], "--bogus"], "No such option: --bogus"),
    }[case]
    done = _run(*args)
    assert_one_error(done.returncode, done.stderr, needle=needle)
    assert not (tmp_path / "run").exists()


def test_env_in_a_subprocess_redacts_the_job_token() -> None:
    done = _run("env", env={"VARUNA_JOB_TOKEN": "s3cr3t"})
    assert done.returncode == 0, done.stderr
    assert "s3cr3t" not in done.stdout and "env.VARUNA_JOB_TOKEN:" in done.stdout


@pytest.mark.parametrize(("extra", "needle"), [
    (["--preemption-source", "aws", "--preemption-endpoint", "ftp://x"], "--preemption-endpoint: a metadata"),
    (["--preemption-source", "gcp", "--preemption-endpoint", "http://h/path"], "is http://host[:port]"),
    (["--slurm"], "not inside a Slurm job (SLURM_JOB_ID is not set)"),
    (["--preemption-source", "aws", "--preemption-endpoint", "http://127.0.0.1:0"], "port 0 is not in 1..65535"),
    (["--preemption-source", "aws", "--preemption-endpoint", "http://127.0.0.1:65536"], "not a number in 1..65535"),
    (["--preemption-source", "azure", "--preemption-endpoint", "http://root:s3cr3t@169.254.169.254"],
     "got 'http://***@169.254.169.254': it holds credentials"),
    (["--preemption-source", "gcp", "--preemption-endpoint", "http://" + "x" * 2000], "the 1,024 the node agents"),
    (["--preemption-source", "gcp", "--preemption-endpoint", "https://metadata"], "the scheme is 'https'"),
    (["--preemption-source", "gcp", "--preemption-endpoint", "http://:80"], "names no host"),
    (["--preemption-source", "gcp", "--preemption-interval", "0"],
     "--preemption-interval must be a number in [0.1, 3600]"),
    (["--preemption-source", "aws", "--preemption-interval", "nan"], "--preemption-interval must be a number in"),
])
def test_launch_clouds_and_clusters(capsys, monkeypatch, files, tmp_path, extra, needle) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code, err = _launch(capsys, files, tmp_path, *extra)
    assert_one_error(code, err, needle=needle)
    assert "s3cr3t" not in err


def test_launch_slurm_and_hosts_conflict(capsys, monkeypatch, files, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=4\n")
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    code, err = _launch(capsys, files, tmp_path, "--slurm", "--hosts", str(hosts))
    assert_one_error(code, err, needle="--slurm and --hosts both say where to run")


def test_plan_needs_a_device_count(capsys, files) -> None:
    code, _, err = run_main(capsys, "plan", files["profile.json"], "--batch-size", "16", "-o",
                              files["dir_path"] / "none.yaml")
    assert_one_error(code, err, needle="--gpus is required")


# --- Slurm's environment ------------------------------------------------------------------------------------

@pytest.fixture
def slurm_job(monkeypatch, tmp_path):
    """A Slurm job's environment with a fake scontrol on PATH that, like the real one, prints its version for
    -V wherever it stands (GNU getopt permutes) unless `--` came before it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -- ] && break; [ "$a" = -V ] && '
                        '{ echo "slurm 23.02.7"; exit 0; }; done\nprintf "node1\\nnode2\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    return monkeypatch


@pytest.mark.parametrize(("variables", "needle"), [
    ({"SLURM_JOB_NODELIST": "-V"}, "SLURM_JOB_NODELIST '-V' starts with '-'"),
    ({"SLURM_JOB_NODELIST": "node[0-99999999]"}, "names 100,000,000 nodes, more than the 65,536"),
    ({"SLURM_GPUS_PER_NODE": "volta:x"}, "SLURM_GPUS_PER_NODE 'volta:x' is not a GPU count"),
    ({"SLURM_GPUS_PER_NODE": "1", "SLURM_RESTART_COUNT": "\x1b[2J"}, "SLURM_RESTART_COUNT '\\x1b[2J' is not"),
])
@pytest.mark.parametrize("verb", ["plan", "launch"])
def test_a_bad_slurm_environment_is_one_error_naming_the_variable(capsys, files, tmp_path, slurm_job, variables,
                                                                  needle, verb) -> None:
    for name, value in variables.items():
        slurm_job.setenv(name, value)
    if verb == "plan":
        code, _, err = run_main(capsys, "plan", files["profile.json"], "--slurm", "--batch-size", "16", "-o",
                                tmp_path / "p.yaml")
    else:
        code, err = _launch(capsys, files, tmp_path)
    assert_one_error(code, err, needle=needle)
    assert "\x1b" not in err


def test_plan_slurm_counts_typed_gpus(capsys, files, tmp_path, slurm_job) -> None:
    """SLURM_GPUS_PER_NODE holds --gpus-per-node as written: volta:3,kepler:1 is 4 GPUs per node, not 1."""
    slurm_job.setenv("SLURM_GPUS_PER_NODE", "volta:3,kepler:1")
    code, _, err = run_main(capsys, "plan", files["profile.json"], "--slurm", "--batch-size", "16", "-o",
                            tmp_path / "p.yaml", "--json")
    assert code in (0, None), err
    assert "2 node(s), 8 GPUs (node1×4, node2×4)" in err
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["gpus"] == 8


# --- run ids, --resume, --code-dir ---------------------------------------------------------------------------

def _step(store: Path, step: int, run: str) -> None:
    (store / f"step_{step}").mkdir(parents=True)
    (store / f"step_{step}" / "RUN").write_text(run + "\n")
    (store / f"step_{step}" / "COMPLETE").write_text("")


@pytest.mark.parametrize("case", ["no store", "typo", "newline", "escape", "or-start no store"])
def test_launch_resume_and_run_id_mistakes(capsys, files, tmp_path, case) -> None:
    store = tmp_path / "store"
    for i, run in enumerate(["alpha", "beta"]):
        _step(store, 10 + i, run)
    args, needle = {
        "no store": (["--resume"], ("--resume needs the checkpoint store of the run to continue, but neither "
                                    "--ckpt-dir nor --run-dir is given")),
        "or-start no store": (["--resume-or-start", "--run-id", "x"], "--resume-or-start needs the checkpoint store"),
        "typo": (["--resume", "--run-id", "alpah", "--ckpt-dir", str(store)],
                 (f"--resume: checkpoint store {store} holds nothing of run alpah, but checkpoints of run(s) 'alpha', "
                  f"'beta'")),
        "newline": (["--resume", "--run-id", "alpha\n", "--ckpt-dir", str(store)],
                    "--run-id 'alpha\\n' is not a valid run id"),
        "escape": (["--run-id", "\x1b[2J" * 100, "--ckpt-dir", str(tmp_path / "new")], "is not a valid run id"),
    }[case]
    code, _, err = run_main(capsys, "launch", files["plan.yaml"], "--code-dir", files["dir_path"], *args, "--",
                            "train.py")
    assert_one_error(code, err, needle=needle)
    assert "\x1b" not in err and len(err) < 1000
    assert sorted(p.name for p in store.iterdir()) == ["step_10", "step_11"] and not (tmp_path / "new").exists()


def test_launch_resume_or_start_starts_a_named_run_beside_others(capsys, files, tmp_path, monkeypatch) -> None:
    """--resume-or-start --run-id NEW in a store of other runs goes on to start NEW (the manager is not run)."""
    import varuna_core.launch.manager as manager

    store = tmp_path / "store"
    _step(store, 10, "alpha")
    started = []

    def fake_manager(opts, *args):
        started.append(opts)
        raise KeyboardInterrupt  # stop here: nothing is started

    monkeypatch.setattr(manager, "Manager", fake_manager)
    run_main(capsys, "launch", files["plan.yaml"], "--code-dir", files["dir_path"], "--run-dir", tmp_path / "run",
             "--ckpt-dir", store, "--resume-or-start", "--run-id", "new", "--", "train.py")
    (opts,) = started
    assert opts.resume and opts.resume_or_start and opts.run_id == "new"


def test_launch_a_missing_code_dir_is_bad_input(capsys, files, tmp_path) -> None:
    """With an absolute SCRIPT, a missing --code-dir was found only when the agent failed to cd into it (exit 1)."""
    code, _, err = run_main(capsys, "launch", files["plan.yaml"], "--run-dir", tmp_path / "run", "--code-dir",
                            tmp_path / "missing", "--", files["train.py"])
    assert_one_error(code, err, needle=f"--code-dir {tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "run").exists()
