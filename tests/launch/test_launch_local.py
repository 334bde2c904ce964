"""`varuna launch` on local processes: a run to completion, the worker contract, bad input, crashes and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from devtools.launching import listening_addresses, worker_pid
from tests.launch.conftest import ROOT, TRAIN, VARUNA, interrupt_and_expect_nothing_left, job_processes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(VARUNA), "launch", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_local_run_completes_with_per_rank_logs_and_metrics(plan4, tmp_path, launches) -> None:
    launch = launches([str(plan4), "--", *TRAIN, "--steps", "40"], tmp_path / "run", timeout=180)
    launch.wait_for(lambda: len(launch.steps()) >= 2)
    # a local job is off the network: its store (in the agent) and gloo (in the workers) listen on the loopback
    assert listening_addresses([pid for pid, _ in job_processes(launch.job())]) == {"127.0.0.1"}
    assert launch.wait() == 0, launch.output()[-3000:]
    for rank in range(4):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert "===== attempt 1: rank" in log
    assert "final loss" in (tmp_path / "run" / "logs" / "rank0.log").read_text()
    steps = launch.steps()
    assert sorted(steps) == list(range(40)) and steps[39] < steps[0]
    kinds = [e["event"] for e in launch.events()]
    assert kinds[:2] == ["starting", "started"] and "first_step" in kinds and kinds[-1] == "stopped"
    # four workers on one host: one interpreter imported torch (the fork server) and forked them all
    assert [e["pid"] > 0 for e in launch.events() if e["event"] == "fork_server"] == [True]
    assert next(e for e in launch.events() if e["event"] == "first_step")["forked"] == 4
    assert next(e for e in launch.events() if e["event"] == "ending")["kind"] == "done"
    assert job_processes(launch.job()) == []


@pytest.mark.parametrize("fork", ["--fork-server", "--no-fork-server"])
def test_worker_contract_legacy_args_and_env_file(plan4, tmp_path, fork) -> None:
    """What a worker is given, the same whether the host's fork server forked it or it started as a new
    interpreter."""
    env_file = tmp_path / "job.env"
    env_file.write_text("# comment\nexport FROM_ENV_FILE=yes\nSPACED='a b'\n")
    done = run(str(plan4), "--run-dir", str(tmp_path / "run"), "--env-file", str(env_file), "--legacy-args", fork,
               "--", "tests/launch/echo_worker.py", "--mine", "x y")
    assert done.returncode == 0, done.stderr
    seen = {}
    for rank in range(4):
        line = next(x for x in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text().splitlines()
                    if x.startswith("ECHO "))
        seen[rank] = json.loads(line[5:])
    for rank, info in seen.items():
        env = info["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "4" and env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert info["plan_exists"] and env["VARUNA_CKPT_DIR"].endswith("checkpoints")
        assert env["VARUNA_RESUME_STEP"] is None and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["FROM_ENV_FILE"] == "yes" and env["SPACED"] == "a b"
        assert env["PYTHONFAULTHANDLER"] == os.environ.get("PYTHONFAULTHANDLER", "1")  # stacks on a fatal signal
        assert info["argv"] == ["--mine", "x y", f"--rank={rank}", f"--local_rank={rank}",
                                "--stage_to_rank_map=0,2;1,3;", "--chunk_size=4", "--batch-size=16"]


@pytest.mark.parametrize(("args", "message"), [
    ([], "no SCRIPT"),
    (["--", "no_such_script.py"], "no_such_script.py does not exist"),
    (["--gpus-per-node", "2", "--", *TRAIN], "needs 4 devices (pp × dp); --gpus-per-node gives 2"),
])
def test_bad_input_exits_2(plan4, tmp_path, args, message) -> None:
    done = run(str(plan4), "--run-dir", str(tmp_path / "run"), *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_hosts_file_garbage_and_capacity_exit_2_before_any_ssh(plan4, tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.1.2.3 slots=2\nthis is: not a host\n")
    done = run(str(plan4), "--hosts", str(hosts), "--", *TRAIN)
    assert done.returncode == 2 and "line 2" in done.stderr and "'this is: not a host'" in done.stderr
    hosts.write_text("10.1.2.3 slots=2  # only two devices\n")
    done = run(str(plan4), "--hosts", str(hosts), "--", *TRAIN)
    assert done.returncode == 2, done.stderr
    assert "needs 4 devices (pp × dp); the hosts provide 2 (10.1.2.3: 2)" in done.stderr
    hosts.write_text("localhost slots=2\n10.1.2.3 slots=2\n")  # the master would be unreachable for the other
    done = run(str(plan4), "--hosts", str(hosts), "--", *TRAIN)
    assert done.returncode == 2 and "the first host, localhost, is the master and resolves to loopback" in done.stderr


def test_a_crash_without_morph_stops_the_job_naming_the_rank(plan2, tmp_path, launches) -> None:
    launch = launches([str(plan2), "--", *TRAIN, "--steps", "100000"], tmp_path / "run", timeout=180)
    launch.wait_for(lambda: len(launch.steps()) >= 5)
    pid = worker_pid(launch.job(), 1)
    os.kill(pid, signal.SIGKILL)
    assert launch.wait() == 1
    out = launch.output()
    assert "rank 1 on 127.0.0.1 exited with signal SIGKILL" in out and "logs/rank1.log" in out
    assert "--morph restarts" in out and "Traceback" not in out
    assert job_processes(launch.job()) == []



def test_a_worker_that_dies_of_an_exception_is_named_with_it(plan2, tmp_path, launches) -> None:
    """A worker whose script raises (here an import that fails, as a torch that is installed but cannot import
    would: the pre-flight check only finds it) ends the job with one line that quotes the exception."""
    script = tmp_path / "broken.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    import no_such_module_here\n"
                      "import time\ntime.sleep(60)\n")
    launch = launches([str(plan2), "--", str(script)], tmp_path / "run", timeout=120)
    assert launch.wait() == 1
    out = " ".join(launch.output().split())
    assert ("rank 1 on 127.0.0.1 exited with code 1: ModuleNotFoundError: No module named 'no_such_module_here' "
            "(log: ") in out, out[-2000:]
    assert "Traceback" not in launch.output()
    assert job_processes(launch.job()) == []

def test_ctrl_c_stops_every_worker_and_exits_130(plan2, tmp_path, launches) -> None:
    launch = launches([str(plan2), "--", *TRAIN, "--steps", "100000"], tmp_path / "run", timeout=180)
    launch.wait_for(lambda: len(launch.steps()) >= 3)
    # the agent, the fork server (two workers on the host), the store it hosts and the 2 workers it forked
    interrupt_and_expect_nothing_left(launch, processes=5)


def test_a_slow_rank_is_reported_as_a_straggler(plan4, tmp_path, launches) -> None:
    """Rank 1 computes 10x (or more) as long as its replica (tests/launch/slow_worker.py); the others, 4 workers
    sharing 2 cores (or 1), may differ from theirs by 2x on a loaded machine (seen: 2.3x), so a straggler here is
    one 4x its peer."""
    env_file = tmp_path / "job.env"
    env_file.write_text("SLOW_RANK=1\n")
    launch = launches([str(plan4), "--env-file", str(env_file), "--straggler-threshold", "3", "--",
                       "tests/launch/slow_worker.py", *TRAIN[1:], "--steps", "15"], tmp_path / "run", timeout=180)
    assert launch.wait() == 0, launch.output()[-3000:]
    slow = (tmp_path / "run" / "slow_machines").read_text().splitlines()
    assert len(slow) == 1 and slow[0].startswith("127.0.0.1 rank=1 stage=1 "), slow
    assert "straggler: rank 1 on 127.0.0.1" in launch.output()


def test_the_example_runs_unchanged_under_torchrun(tmp_path) -> None:
    """The same script that `varuna launch` runs (and morphs) also runs under torchrun, with a map instead of a
    plan."""
    torchrun = Path(VARUNA).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", *TRAIN, "--steps", "12",
                           "--stage-to-rank-map", "0,2;1,3"], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1", VARUNA_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 stage(s) x 2 replica(s)" in done.stdout and "final loss" in done.stdout
