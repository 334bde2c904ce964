"""``python -m varuna.run_varuna``: the original launcher's command line becomes a plan and a ``varuna launch``
(captured here, not run), and layouts given by hand are plans of their own kind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.profiles import make_profile
from varuna_cli import legacy
from varuna_core.errors import ConfigError
from varuna_core.launch.manager import replan
from varuna_core.pipeline.config import resolve_config
from varuna_core.planning.artifacts import Plan, load_plan, save_plan
from varuna_core.planning.planner import layout_plan


@pytest.fixture
def launched(monkeypatch):
    """The keyword arguments ``run()`` gives ``varuna launch``, and the plan it wrote."""
    calls = []

    def fake_launch(plan, script, **kwargs):
        calls.append({"plan": load_plan(plan), "script": script, **kwargs})

    monkeypatch.setattr("varuna_cli.commands.launch.launch", fake_launch)
    return calls


@pytest.fixture
def machines(tmp_path):
    def write(*lines: str):
        path = tmp_path / "machines"
        path.write_text("".join(line + "\n" for line in lines))
        return str(path)
    return write


def run(tmp_path, *args: str) -> None:
    legacy.run([*args, "--run-dir", str(tmp_path / "run"), "train.py", "--lr", "1e-3", "--batch-size", "99"])


def test_a_layout_given_by_hand_on_ssh_machines(tmp_path, machines, launched) -> None:
    """dp = devices // nstages; the global batch rounded down to a multiple of dp, as the original launcher
    did; the script's own arguments (even `--batch-size`) are passed untouched."""
    run(tmp_path, "--machine_list", machines("10.0.0.1", "10.0.0.2"), "--batch_size", "15", "--nstages", "3",
        "--chunk_size", "2")
    (call,) = launched
    plan = call["plan"]
    assert plan.by_hand and (plan.pp, plan.dp, plan.batch_size, plan.microbatch_size) == (3, 2, 14, 2)
    assert plan.num_microbatches == 4 and plan.stage_to_rank_map.rstrip(";") == "0,3;1,4;2,5"
    assert any("rounded down to 14" in a for a in plan.assumptions)
    assert call["script"] == ["train.py", "--lr", "1e-3", "--batch-size", "99"]
    assert call["hosts"] is not None and call["gpus_per_node"] == 4  # the original's default
    assert call["morph"] and call["legacy_args"] and not call["resume"]
    assert (tmp_path / "run" / "plan.yaml").is_file()


def test_one_loopback_machine_runs_local_processes_and_both_batch_spellings_work(tmp_path, machines,
                                                                                   launched) -> None:
    run(tmp_path, "--machine_list", machines("127.0.0.1 slots=3"), "--batch-size", "12", "--nstages", "1",
        "--chunk_size", "4", "--no_morphing", "--resume")
    (call,) = launched
    assert call["hosts"] is None and call["gpus_per_node"] == 3
    assert (call["plan"].pp, call["plan"].dp, call["plan"].batch_size) == (1, 3, 12)
    assert not call["morph"] and call["resume"]


def test_with_a_profile_the_planner_chooses_and_the_batch_fits_the_replicas(tmp_path, machines, launched) -> None:
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "profile.json").write_text(make_profile([0.01] * 5, param_bytes=10**3).model_dump_json())
    run(tmp_path, "--machine_list", machines("127.0.0.1"), "--gpus_per_node", "3", "--batch_size", "16",
        "--profile_folder", str(tmp_path / "prof"))
    plan = launched[-1]["plan"]
    assert not plan.by_hand and plan.profile_path == str(tmp_path / "prof" / "profile.json")
    assert plan.batch_size % plan.dp == 0 and plan.batch_size > 16 - plan.dp
    run(tmp_path, "--machine_list", machines("127.0.0.1"), "--gpus_per_node", "3", "--batch_size", "16",
        "--profile", str(tmp_path / "prof" / "profile.json"), "--nstages", "3")
    plan = launched[-1]["plan"]
    assert (plan.pp, plan.dp, plan.batch_size) == (3, 1, 16) and plan.partition is not None


def test_launch_options_pass_through(tmp_path, machines, launched) -> None:
    run(tmp_path, "--machine_list", machines("10.0.0.1"), "--batch_size", "8", "--nstages", "1", "--chunk_size",
        "2", "--ssh-identity", "key", "--ssh-option", "A=1", "--ssh-option", "B=2", "--ckpt-every", "5",
        "--heartbeat-timeout", "7.5", "--morph-any-microbatch", "--manager_ip", "10.0.0.9")
    call = launched[0]
    assert call["ssh_identity"] == "key" and call["ssh_option"] == ["A=1", "B=2"]
    assert call["ckpt_every"] == 5 and call["heartbeat_timeout"] == 7.5 and call["morph_any_microbatch"] is True
    assert call["run_dir"] == (tmp_path / "run").resolve()


@pytest.mark.parametrize("args, message", [
    (["--nstages", "2", "--chunk_size", "2"], "--batch_size is required"),
    (["--batch_size", "8"], "--nstages and --chunk_size not given, and no profile"),
    (["--batch_size", "8", "--chunk_size", "2"], "--nstages not given"),
    (["--batch_size", "8", "--nstages", "5", "--chunk_size", "1"], "--nstages 5 needs at least 5 devices"),
    (["--batch_size", "8", "--nstages", "1", "--chunk_size", "9"], "micro.?batch.* larger than a replica"),
    (["--batch_size", "0", "--nstages", "1", "--chunk_size", "1"], "--batch_size must be in 1.."),
    (["--gpus_per_node", "-1", "--batch_size", "8", "--nstages", "1", "--chunk_size", "1"], "--gpus_per_node must"),
    (["--batch_size", "eight"], "invalid int value"),
    (["--bogus", "1"], "unrecognized arguments"),
    (["--batch_size", "8", "--nstages", "1", "--chunk_size", "1", "--ckpt-every", "x"], "--ckpt-every must be"),
    (["--batch_size", "8", "--profile_folder", "/nonexistent/p"], "profile"),
])
def test_bad_command_lines_are_named(tmp_path, machines, launched, args, message) -> None:
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, "--machine_list", machines("127.0.0.1 slots=4"), *args)
    assert not launched


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage", b"host slots=abc\n", b"[" * 100_000])
def test_a_bad_machine_list_is_named(tmp_path, launched, content) -> None:
    (tmp_path / "machines").write_bytes(content)
    with pytest.raises(ConfigError, match="machines"):
        run(tmp_path, "--machine_list", str(tmp_path / "machines"), "--batch_size", "8", "--nstages", "1",
            "--chunk_size", "1")
    with pytest.raises(ConfigError, match="does not exist"):
        run(tmp_path, "--machine_list", str(tmp_path / "absent"), "--batch_size", "8")
    assert not launched


def test_the_module_reports_one_line_and_exit_code_2() -> None:
    done = subprocess.run([sys.executable, "-m", "varuna.run_varuna", "--machine_list", "/nonexistent",
                           "--batch_size", "8", "train.py"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[0] == "error: machine list /nonexistent does not exist"
    helped = subprocess.run([sys.executable, "-m", "varuna.run_varuna", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "--nstages" in helped.stdout and "--ssh-identity" in helped.stdout


# ----------------------------------------------------------------------------------------------------------
# Layouts given by hand as plans


def test_a_layout_plan_round_trips_and_has_nothing_measured(tmp_path) -> None:
    plan = layout_plan(pp=2, dp=2, microbatch_size=3, batch_size=14, gpus=4, gpus_per_node=2, model="m")
    save_plan(plan, tmp_path / "p.yaml")
    again = load_plan(tmp_path / "p.yaml")
    assert again == plan and again.by_hand and again.nodes == [[0, 1], [2, 3]]
    data = plan.model_dump()
    for field, value in (("num_segments", 4), ("profile_hash", "x"), ("profile_path", "/p")):
        with pytest.raises(ValueError, match=f"{field} is set"):
            Plan.model_validate({**data, field: value})
    made = make_profile([0.01] * 4, param_bytes=10**3)
    from varuna_core.planning.planner import PlanRequest, plan_for

    full = plan_for(made, PlanRequest(gpus=2, batch_size=8), pp=2, dp=1, microbatch_size=1, schedule="varuna")
    with pytest.raises(ValueError, match="prediction is null"):
        Plan.model_validate({**full.model_dump(), "prediction": None})


def test_varuna_keeps_its_own_partition_under_a_layout_plan() -> None:
    import torch.nn as nn

    plan = layout_plan(pp=2, dp=1, microbatch_size=2, batch_size=8, gpus=2, gpus_per_node=2)
    config = resolve_config(nn.Linear(1, 1), None, 8, None, fp16=False, schedule="varuna", partition=[1, 3],
                            timeout=None, bucket_mb=25, precision=None, seed=None, plan=plan, trace=None,
                            trace_step=0, cutpoints=None, loss_reduction="mean")
    assert (config.stage_to_rank_map.rstrip(";"), config.chunk_size, config.partition) == ("0;1", 2, [1, 3])


def test_a_morph_of_a_layout_plan_keeps_the_pipeline() -> None:
    plan = layout_plan(pp=2, dp=2, microbatch_size=2, batch_size=16, gpus=4, gpus_per_node=2)
    smaller, why = replan(plan, 3, 1)
    assert smaller.by_hand and (smaller.pp, smaller.dp, smaller.microbatch_size) == (2, 1, 2), why


def test_bad_layouts_are_named() -> None:
    with pytest.raises(ConfigError, match="larger than a replica"):
        layout_plan(pp=1, dp=2, microbatch_size=5, batch_size=8, gpus=2, gpus_per_node=2)
    with pytest.raises(ConfigError, match="unknown schedule"):
        layout_plan(pp=1, dp=1, microbatch_size=1, batch_size=8, gpus=1, gpus_per_node=1, schedule="x")


def test_plan_show_prints_a_layout_plan_and_refuses_to_draw_it(tmp_path, capsys) -> None:
    from varuna_cli.app import main

    save_plan(layout_plan(pp=2, dp=1, microbatch_size=2, batch_size=8, gpus=2, gpus_per_node=2), tmp_path / "p.yaml")
    with pytest.raises(SystemExit) as shown:
        main(["plan", "show", str(tmp_path / "p.yaml")])
    assert shown.value.code == 0 and "varuna: 2 stages, 4 micro-batches" in capsys.readouterr().out
    with pytest.raises(SystemExit) as drawn:
        main(["plan", "show", str(tmp_path / "p.yaml"), "--png", str(tmp_path / "t.png")])
    assert drawn.value.code == 2 and "layout given by hand" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_a_reused_run_directory_keeps_its_earlier_plans(tmp_path, machines, launched) -> None:
    args = ["--machine_list", machines("127.0.0.1 slots=2"), "--batch_size", "8", "--chunk_size", "2"]
    run(tmp_path, *args, "--nstages", "2")
    first = (tmp_path / "run" / "plan.yaml").read_text()
    run(tmp_path, *args, "--nstages", "1")
    assert (tmp_path / "run" / "plan.yaml").read_text() == first
    assert load_plan(tmp_path / "run" / "plan-2.yaml").pp == 1 and launched[-1]["plan"].pp == 1


# ----------------------------------------------------------------------------------------------------------
# --resume, --code_dir and Slurm


def _checkpoint(store, step: int, run: str = "r1", complete: bool = True) -> None:
    path = store / f"step_{step}"
    path.mkdir(parents=True)
    (path / "RUN").write_text(run + "\n")
    if complete:
        (path / "COMPLETE").write_text(f"{step}\n")


def _default_run(tmp_path, launched, *args: str, script: str = "train.py", name: str | None = None):
    """Run without --run-dir in ``tmp_path`` (the current directory); the run directory it got, renamed to
    ``name`` (a run of another time)."""
    legacy.run(["--machine_list", str(tmp_path / "machines"), "--batch_size", "8", "--nstages", "1",
                "--chunk_size", "2", *args, script])
    used = launched[-1]["run_dir"]
    assert used.parent == (tmp_path / "runs").resolve()
    if name is not None and used.name != name:
        used = used.rename(used.parent / name)
    return used


def test_resume_without_a_run_dir_continues_the_previous_run(tmp_path, monkeypatch, launched) -> None:
    """Each run gets a new runs/run_varuna-<time>: `--resume` looked for checkpoints in the new, empty one and
    trained from scratch. It continues the newest run of the same script with a complete checkpoint."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "machines").write_text("127.0.0.1 slots=2\n")
    (tmp_path / "other").mkdir()
    earlier = _default_run(tmp_path, launched, name="run_varuna-20200101-000000")
    _checkpoint(earlier / "checkpoints", 40)
    newest = _default_run(tmp_path, launched, name="run_varuna-20200102-000000")  # crashed before a checkpoint
    _checkpoint(newest / "checkpoints", 10, complete=False)
    other = _default_run(tmp_path, launched, "--code_dir", str(tmp_path / "other"), name="run_varuna-20200103-000000")
    _checkpoint(other / "checkpoints", 90)  # another code directory: another training
    _default_run(tmp_path, launched, "--resume")
    assert launched[-1]["resume"] and launched[-1]["run_dir"] == earlier.resolve()
    _default_run(tmp_path, launched, "--resume", "--code_dir", str(tmp_path / "other"))
    assert launched[-1]["run_dir"] == other.resolve()


def test_resume_with_nothing_to_continue_is_refused(tmp_path, monkeypatch, launched) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "machines").write_text("127.0.0.1 slots=2\n")
    with pytest.raises(ConfigError, match=r"--resume: no earlier run of .*train\.py \(code directory"):
        _default_run(tmp_path, launched, "--resume")
    _default_run(tmp_path, launched, name="run_varuna-20200101-000000")
    with pytest.raises(ConfigError, match=r"no run of .*train\.py under runs/ holds a complete checkpoint"):
        _default_run(tmp_path, launched, "--resume")
    assert len(launched) == 1


def test_a_missing_code_dir_is_refused_before_anything_starts(tmp_path, machines, launched) -> None:
    """It was found only when the first agent failed to `cd` into it (exit 1)."""
    with pytest.raises(ConfigError, match=r"--code_dir .*/missing is not a directory"):
        run(tmp_path, "--machine_list", machines("127.0.0.1 slots=2"), "--batch_size", "8", "--nstages", "1",
            "--chunk_size", "2", "--code_dir", str(tmp_path / "missing"))
    assert not launched


def test_a_loopback_machine_list_runs_locally_inside_a_slurm_job(tmp_path, machines, launched, monkeypatch) -> None:
    """Inside a Slurm job the launcher defaults to the job's nodes; a machine list of this machine asked for local
    processes, so it runs them here (an SSH machine list still goes over SSH)."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    args = ["--batch_size", "8", "--nstages", "1", "--chunk_size", "2"]
    run(tmp_path, "--machine_list", machines("127.0.0.1 slots=2"), *args)
    assert launched[-1]["hosts"] is None and launched[-1]["slurm"] is False
    run(tmp_path, "--machine_list", machines("10.0.0.1"), *args)
    assert launched[-1]["hosts"] is not None and launched[-1]["slurm"] is None


def test_resume_or_start_continues_the_previous_run_or_starts_one(tmp_path, monkeypatch, launched) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "machines").write_text("127.0.0.1 slots=2\n")
    first = _default_run(tmp_path, launched, "--resume-or-start")  # nothing to continue: a new run
    assert first.parent == (tmp_path / "runs").resolve() and launched[-1]["resume_or_start"]
    first = first.rename(first.parent / "run_varuna-20200101-000000")
    _checkpoint(first / "checkpoints", 40)
    _default_run(tmp_path, launched, "--resume-or-start")
    assert launched[-1]["run_dir"] == first.resolve()
