"""`varuna launch` when checkpoints or the scheduler misbehave: a reused store, SIGTERM, a disk on which every save
fails. (A corrupt newest checkpoint: the chaos test in test_launch_ssh.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.launch.conftest import ROOT, TRAIN, VARUNA, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


def _fake_checkpoint(store, step: int, run: str | None, complete: bool = True) -> None:
    path = store / f"step_{step}"
    path.mkdir(parents=True)
    if run is not None:
        (path / "RUN").write_text(run + "\n")
    if complete:
        (path / "COMPLETE").write_text(f"{step}\n")


def test_a_new_job_refuses_a_store_that_holds_checkpoints(plan4, tmp_path) -> None:
    """Before: the new job's retention deleted its own checkpoints in favour of the old run's higher steps, and a
    restart resumed the old run."""
    store = tmp_path / "store"
    _fake_checkpoint(store, 1000, "oldrun")
    args = [str(VARUNA), "launch", str(plan4), "--run-dir", str(tmp_path / "run"), "--ckpt-dir", str(store)]
    done = subprocess.run([*args, "--", *TRAIN], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"checkpoint store {store} already holds checkpoints (run oldrun (step 1000))" in done.stderr
    assert "hint: --resume continues" in done.stderr and "Traceback" not in done.stderr
    _fake_checkpoint(store, 5, "otherrun")
    done = subprocess.run([*args, "--resume", "--", *TRAIN], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "holds checkpoints of 2 runs" in done.stderr and "--run-id" in done.stderr
    assert sorted(p.name for p in store.iterdir()) == ["step_1000", "step_5"]  # nothing touched



def test_sigterm_checkpoints_and_resume_continues(plan2, tmp_path, launches) -> None:
    """SIGTERM (a scheduler's warning) makes the workers write an on-demand checkpoint and the launcher exit 143
    (before: 143 at once, nothing saved, no word); `--resume` then continues from that checkpoint. A rank that
    dies as it leaves, after its checkpoint (here SIGABRT on exit 75), is named but does not turn the stop into
    a crash (before: a crash, which counts against --max-restarts)."""
    store = tmp_path / "run" / "checkpoints"
    env_file = tmp_path / "env"
    env_file.write_text("CRASH_RANK=1\n")
    launch = launches([str(plan2), "--morph", "--ckpt-every", "5", "--env-file", str(env_file), "--",
                       "tests/launch/teardown_crash_worker.py", *TRAIN[1:], "--steps", "100000"],
                      tmp_path / "run", timeout=300)
    launch.wait_for(lambda: (store / "step_10" / "COMPLETE").exists())
    job = launch.job()
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert launch.wait() == 143, launch.output()[-3000:]
    term = next(e for e in launch.events() if e["event"] == "terminated")
    assert term["checkpoint"] is not None and term["checkpoint"] > 10
    assert (store / f"step_{term['checkpoint']}" / "COMPLETE").exists()
    assert "stopped on SIGTERM" in launch.output() and "Traceback" not in launch.output()
    assert [e["kind"] for e in launch.events() if e["event"] == "ending"] == ["terminated"]
    late = [e for e in launch.events() if e["event"] == "late_exit"]
    assert [(e["rank"], e["step"]) for e in late] == [(1, term["checkpoint"])], late
    assert "exited with signal SIGABRT after checkpointing" in " ".join(launch.output().split())
    assert "Fatal Python error: Aborted" in (tmp_path / "run" / "logs" / "rank1.log").read_text()  # its stacks
    deadline = time.monotonic() + 5
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == []
    again = launches([str(plan2), "--resume", "--ckpt-dir", str(store), "--", *TRAIN, "--steps",
                      str(term["checkpoint"] + 2)], tmp_path / "again", timeout=300)
    assert again.wait() == 0, again.output()[-3000:]
    assert [e["resume"] for e in again.events() if e["event"] == "starting"] == [term["checkpoint"]]


def test_a_spot_notice_checkpoints_a_job_that_cannot_move(plan2, tmp_path, launches) -> None:
    """Each node agent asks the cloud's metadata service (here GCP's, served on 127.0.0.1) whether its VM goes
    away; when it says TRUE, the job (local, no --morph: nowhere to move) checkpoints and stops with 143, as on
    SIGTERM; every agent asked with the documented header."""
    from devtools.metadata import MetadataServer

    store = tmp_path / "run" / "checkpoints"
    preempted = ("GET", "/computeMetadata/v1/instance/preempted")
    with MetadataServer() as cloud:
        cloud.required[preempted] = {"Metadata-Flavor": "Google"}
        cloud.routes[preempted] = (200, b"FALSE")
        launch = launches([str(plan2), "--preemption-source", "gcp", "--preemption-endpoint", cloud.base,
                           "--preemption-interval", "0.2", "--", *TRAIN, "--steps", "100000"], tmp_path / "run",
                          timeout=300)
        launch.wait_for(lambda: len(launch.steps()) >= 10)
        cloud.routes[preempted] = (200, b"TRUE")
        assert launch.wait() == 143, launch.output()[-3000:]
        asked = [a for a in cloud.asked if (a[0], a[1]) == preempted]
    assert asked and all(headers.get("Metadata-Flavor") == "Google" for _, _, headers in asked)
    events = launch.events()
    notice = next(e for e in events if e["event"] == "spot_notice")
    assert (notice["host"], notice["source"], notice["seconds"]) == ("127.0.0.1", "gcp", 0.0)
    term = next(e for e in events if e["event"] == "terminated")
    assert "the preemption notice for 127.0.0.1" in term["reason"] and term["checkpoint"] >= 10
    assert (store / f"step_{term['checkpoint']}" / "COMPLETE").exists()
    assert "gcp says 127.0.0.1 goes away in 0s" in launch.output()


def test_a_job_whose_every_save_fails_gives_up(plan2, tmp_path, small_disk, launches) -> None:
    """Progress is counted in checkpoints saved, not steps trained (a job that can never save would otherwise
    lose its work again and again)."""
    disk = small_disk(32 * 1024)
    launch = launches([str(plan2), "--morph", "--ckpt-dir", str(disk), "--ckpt-every", "3", "--max-restarts", "1",
                       "--", *TRAIN, "--steps", "100000"], tmp_path / "run", timeout=300)
    assert launch.wait() == 1, launch.output()[-3000:]
    out = launch.output()
    assert "giving up after 1 restarts without a new checkpoint" in out and "Traceback" not in out
    assert len([e for e in launch.events() if e["event"] == "starting"]) == 2
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "No space left on device" in log
    assert list(disk.iterdir()) == []  # every failed save removed what it wrote
