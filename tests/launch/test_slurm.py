"""`varuna launch` inside a real Slurm job (a one-node cluster on this machine, :mod:`devtools.testslurm`): the
example batch script runs the example GPT on the allocation's two tasks, agents started by srun; Slurm's warning
signal (to the batch shell, or to the job steps) makes it checkpoint and requeue itself; a preemption-like SIGTERM
to every process of the job makes it checkpoint and stop; each requeue resumes from the latest checkpoint of the
job's run, and every step's loss equals the uninterrupted run's."""

from __future__ import annotations

import time

import pytest

from devtools.launching import Launch, job_processes, read_events, read_steps
from devtools.testslurm import SlurmUnavailable, start_slurm
from tests.launch.conftest import ROOT, TRAIN, VARUNA, run_reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

STEPS = 120
EXAMPLE = ROOT / "examples" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm cluster on this machine: {exc}")
    yield cluster
    cluster.close()


def _wait(what, timeout: float, message):
    """``what()`` once it is true; after ``timeout`` seconds, an AssertionError with ``message()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(message() if callable(message) else message)


def test_a_slurm_job_checkpoints_on_the_schedulers_signals_and_resumes_when_requeued(slurm, plan2, tmp_path,
                                                                                    launches) -> None:
    reference = run_reference(plan2, STEPS, tmp_path, launches)
    run_dir, out = tmp_path / "slurm-run", tmp_path / "job.out"
    job = slurm.sbatch(EXAMPLE, "--output", str(out), "--ntasks=2", "--nodes=1", env={
        "VARUNA": str(VARUNA), "PLAN": str(plan2), "RUN_DIR": str(run_dir), "STEPS": str(STEPS),
        "WORK": str(tmp_path / "work")})
    output = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    steps = lambda: max(read_steps(run_dir), default=-1)  # noqa: E731

    # 1. Slurm's warning (the example's --signal=B:USR1@N, sent now): checkpoint, and the launcher requeues the job
    _wait(lambda: steps() >= 25, 180, lambda: f"no training progress: {slurm.diagnose(job)}\n{output()[-3000:]}")
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    slurm.wait_state(job, {"PENDING"}, 120)
    assert f"job {job} requeued" in output(), output()[-3000:]
    first_stop = max(read_steps(run_dir)) + 1  # steps done: the step the checkpoint resumes at

    # 2. the requeued job resumes by itself; then SIGTERM to every process of the job (a preemption, the time
    #    limit): the workers checkpoint; the scheduler requeues it (as PreemptMode=REQUEUE would)
    _wait(lambda: steps() >= first_stop + 30, 180,
          lambda: f"the requeued job made no progress: {slurm.diagnose(job)}\n{output()[-3000:]}")
    slurm.run("scancel", "--signal=TERM", "--full", job)
    slurm.wait_state(job, {"FAILED", "CANCELLED", "COMPLETED"}, 120)
    second_stop = max(read_steps(run_dir)) + 1
    slurm.run("scontrol", "requeue", job)
    slurm.wait_state(job, {"PENDING"}, 60)

    # 3. the second requeue resumes; Slurm's warning as `--signal=USR1@N` without B: sends it to the job steps
    #    (the node agents and their workers), not to the batch shell: an agent reports it, the job checkpoints
    #    and the launcher requeues it as in 1.
    _wait(lambda: steps() >= second_stop + 20, 180,
          lambda: f"the second requeue made no progress: {slurm.diagnose(job)}\n{output()[-3000:]}")
    slurm.run("scancel", "--signal=USR1", job)
    slurm.wait_state(job, {"PENDING"}, 120)
    third_stop = max(read_steps(run_dir)) + 1

    # 4. the third requeue resumes and finishes
    state = slurm.wait_state(job, {"COMPLETED", "FAILED"}, 240)
    text = output()
    assert state == "COMPLETED", f"{slurm.diagnose(job)}\n{text[-4000:]}"
    assert slurm.job(job)["Restarts"] == "3"

    starts = [e for e in read_events(run_dir) if e["event"] == "starting"]
    assert [e["resume"] for e in starts] == [None, first_stop, second_stop, third_stop], (starts, text[-3000:])
    assert [e["attempt"] for e in starts] == [1, 2, 3, 4]  # numbered on in the run directory the requeues share
    assert text.count("resuming run slurm-varunatest-" + job) == 3, text[-3000:]
    said = " ".join(text.split())  # the launcher's lines as said, not as wrapped for the job's output file
    assert "stopped on SIGTERM, after an on-demand checkpoint" in said
    assert f"stopped on SIGUSR1 from the scheduler on {slurm.node}, after an on-demand checkpoint" in said, said
    assert said.count(f"job {job} requeued") == 2, text[-3000:]
    steps_seen = read_steps(run_dir)
    assert sorted(steps_seen) == sorted(reference) and len(reference) == STEPS
    assert steps_seen == reference  # every step's loss, bit for bit
    scheduler = [e for e in read_events(run_dir) if e["event"] in ("scheduler_signal", "requeue")]
    assert any(e["event"] == "requeue" and e["done"] for e in scheduler), scheduler


def test_plan_takes_the_devices_of_the_allocation(slurm, gpt_profile, tmp_path) -> None:
    out = tmp_path / "plan.yaml"
    log = tmp_path / "plan.out"
    job = slurm.run("sbatch", "--parsable", "--ntasks=2", "--output", str(log), "--chdir", str(ROOT), "--wrap",
                    f"{VARUNA} plan {gpt_profile} --slurm --batch-size 32 -o {out}").stdout.strip()
    state = slurm.wait_state(job, {"COMPLETED", "FAILED"}, 120)
    assert state == "COMPLETED", log.read_text()
    from varuna_core.planning.artifacts import load_plan

    plan = load_plan(out)
    assert plan.gpus == 2 and plan.pp * plan.dp <= 2
    assert f"Slurm job {job}: 1 node(s), 2 tasks" in log.read_text()


@pytest.fixture
def allocation(slurm):
    """A running two-task job to launch into from outside its batch script, as from an salloc shell: its
    environment, as Slurm gives it to the job."""
    job = slurm.run("sbatch", "--parsable", "--ntasks=2", "--output=/dev/null", "--wrap", "sleep 600").stdout.strip()
    slurm.wait_state(job, {"RUNNING"}, 60)
    yield {"SLURM_CONF": slurm.env["SLURM_CONF"], "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": slurm.node,
           "SLURM_TASKS_PER_NODE": "2", "SLURM_CLUSTER_NAME": "varunatest"}
    slurm.run("scancel", job, check=False)


def test_no_process_of_the_job_outlives_a_killed_launcher_in_an_allocation(allocation, plan2, tmp_path) -> None:
    """The agents are job steps, not children of the launcher, and a killed srun would leave its step running: a
    launcher killed outright closes srun's stdin instead, which reaches the agents, which stop their workers.
    (Ctrl-C stops the agents with a command, as for local and SSH jobs.)"""
    launch = Launch([str(plan2), "--run-dir", str(tmp_path / "run"), "--", *TRAIN, "--steps", "100000"],
                    tmp_path / "run", timeout=180, env=allocation)
    try:
        launch.wait_for(lambda: len(launch.steps()) >= 3)
        assert f"Slurm job {allocation['SLURM_JOB_ID']}: 1 node(s), 2 tasks" in launch.output()
        job = launch.job()
        assert len(job_processes(job)) == 3  # one agent, two workers
        launch.kill()
        _wait(lambda: not job_processes(job), 30, f"left behind: {job_processes(job)}")
    finally:
        launch.close()


def test_a_node_left_out_is_checked_by_starting_an_agent_as_a_job_step(allocation, monkeypatch) -> None:
    """How a `--morph` job checks a node it left out (its agent did not start): a node agent without workers,
    started with srun inside the allocation, reports ready on a node of it; a node srun cannot reach is named with
    srun's reason, and nothing of the check is left running."""
    from varuna_core.launch.hosts import Host
    from varuna_core.launch.options import HostRuntime, SlurmConfig
    from varuna_core.launch.ssh import probe_agents

    monkeypatch.setenv("SLURM_CONF", allocation["SLURM_CONF"])
    good, bad = Host(allocation["SLURM_JOB_NODELIST"], 2), Host("nosuchnode", 2)
    problems = probe_agents([good, bad], HostRuntime(code_dir=str(ROOT)), SlurmConfig(allocation["SLURM_JOB_ID"]),
                            job="probe-test", timeout=60)
    assert [p.host for p in problems] == [bad], problems
    assert "its node agent did not start" in problems[0].message, problems
    assert job_processes("probe-test") == []
