"""Reading a Slurm allocation from its environment and ``scontrol``, under well-formed and hostile input (a fake
``scontrol`` plays the cluster); the srun command line of a node agent; the job's run id; its requeue."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from varuna_core.checkpoint.layout import check_run_id
from varuna_core.errors import ConfigError
from varuna_core.launch.hosts import Host
from varuna_core.launch.options import SlurmConfig
from varuna_core.launch.slurm import allocation, expand_counts, in_allocation, nodelist_size, requeue

pytestmark = pytest.mark.timeout(60)


def fake_scontrol(tmp_path: Path, body: str) -> str:
    """An executable standing in for scontrol: ``body`` is the shell code it runs (arguments in "$@")."""
    path = tmp_path / "scontrol"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def env(**extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_TASKS_PER_NODE": "2(x2),1",
            "SLURM_CLUSTER_NAME": "lab", **extra}


HOSTNAMES = 'printf "gpu01\\ngpu02\\ngpu03\\n"'


@pytest.mark.parametrize(("text", "counts"), [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), (" 4(x2) ", [4, 4]),
                                              ("1,2,3", [1, 2, 3])])
def test_counts_per_node_are_expanded(text, counts) -> None:
    assert expand_counts(text) == counts


@pytest.mark.parametrize("text", ["", "2(x", "-1", "a", "1,,2", "2(x3", "2(x99999999)", "2 (x3)", "1" * 20,
                                  ",".join(["1(x60000)"] * 3)])
def test_counts_that_are_not_slurms_are_refused(text) -> None:
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        expand_counts(text)


def test_the_allocations_nodes_and_tasks(tmp_path) -> None:
    job = allocation(env(SLURM_RESTART_COUNT="2"), scontrol=fake_scontrol(tmp_path, HOSTNAMES))
    assert job.hosts() == [Host("gpu01", 2), Host("gpu02", 2), Host("gpu03", 1)]
    assert (job.total, job.devices, job.restarts) == (5, "tasks", 2)
    assert (tmp_path / "calls").read_text() == "-- show hostnames gpu[01-03]\n"  # no option after --
    assert job.describe() == "Slurm job 4242: 3 node(s), 5 tasks (gpu01×2, gpu02×2, gpu03×1)"
    assert job.config() == SlurmConfig(job_id="4242", cluster="lab", restarts=2)


@pytest.mark.parametrize(("extra", "slots"), [
    ({"SLURM_GPUS_PER_NODE": "4"}, 4), ({"SLURM_GPUS_PER_NODE": "a100:8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "gpu:a100:2"}, 2), ({"SLURM_GPUS_ON_NODE": "3"}, 3),
    ({"SLURM_GPUS_PER_NODE": "volta:3,kepler:1"}, 4), ({"SLURM_GPUS_PER_NODE": "3g.40gb:2, a100:1"}, 3),
    ({"SLURM_GPUS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}, 2),  # what the job asked for per node wins
    ({"SLURM_GPUS_ON_NODE": "0"}, None),  # no GPUs: the tasks count
])
def test_gpus_per_node_win_over_tasks(tmp_path, extra, slots) -> None:
    job = allocation(env(**extra), scontrol=fake_scontrol(tmp_path, HOSTNAMES))
    assert job.slots == ((slots,) * 3 if slots else (2, 2, 1))


def test_the_launchers_gpus_per_node_win_over_slurms(tmp_path) -> None:
    job = allocation(env(SLURM_GPUS_PER_NODE="8"), gpus_per_node=2, scontrol=fake_scontrol(tmp_path, HOSTNAMES))
    assert job.slots == (2, 2, 2) and job.devices == "GPUs"


@pytest.mark.parametrize(("environ", "body", "needle"), [
    ({"SLURM_JOB_ID": ""}, HOSTNAMES, "not inside a Slurm job"),
    ({"SLURM_JOB_ID": "12; rm -rf /"}, HOSTNAMES, "is not a Slurm job id"),
    ({"SLURM_JOB_NODELIST": ""}, HOSTNAMES, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "x" * (2**20 + 1)}, HOSTNAMES, "not a node list"),
    ({"SLURM_TASKS_PER_NODE": "2(x2)"}, HOSTNAMES, "counts 2 node(s) but the job has 3"),
    ({"SLURM_TASKS_PER_NODE": ""}, HOSTNAMES, "neither its GPUs nor its tasks"),
    ({"SLURM_TASKS_PER_NODE": "0(x3)"}, HOSTNAMES, "would run 0 workers"),
    ({"SLURM_TASKS_PER_NODE": "9999(x3)"}, HOSTNAMES, "would run 9999 workers"),
    ({"SLURM_GPUS_PER_NODE": "a100:lots"}, HOSTNAMES, "is not a GPU count"),
    ({}, "echo 'scontrol: error: Invalid hostlist' >&2; exit 1", "failed: scontrol: error: Invalid hostlist"),
    ({}, "true", "names no node"),
    ({}, 'printf -- "-oProxyCommand=evil\\n"', "which is not a host name"),
    ({}, 'printf "gpu01\\n\\033[31mred\\n"', "which is not a host name"),
    ({}, 'printf "gpu01\\ngpu01\\n"', "names a node twice"),
    ({}, 'printf "\\377\\376\\n"', "which is not a host name"),
    ({"SLURM_GPUS_PER_NODE": "volta:3,,kepler:1"}, HOSTNAMES, "SLURM_GPUS_PER_NODE 'volta:3,,kepler:1' is not"),
    ({"SLURM_GPUS_PER_NODE": "volta:3(x2)"}, HOSTNAMES, "SLURM_GPUS_PER_NODE 'volta:3(x2)' is not a GPU count"),
    ({"SLURM_GPUS_PER_NODE": "volta:9000,kepler:9000"}, HOSTNAMES, "would run 18000 workers (SLURM_GPUS_PER_NODE)"),
    ({"SLURM_GPUS_ON_NODE": "a100:2"}, HOSTNAMES, "SLURM_GPUS_ON_NODE 'a100:2' is not a GPU count"),
    ({"SLURM_RESTART_COUNT": "two"}, HOSTNAMES, "SLURM_RESTART_COUNT 'two' is not a count"),
    ({"SLURM_CLUSTER_NAME": "lab\x1b[2J"}, HOSTNAMES, "SLURM_CLUSTER_NAME 'lab\\x1b[2J' is not a cluster name"),
    ({"SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "x[1-2"}, "echo 'Invalid hostlist: x[1-2' >&2",
     "SLURM_NODELIST 'x[1-2' names no node (scontrol: Invalid hostlist: x[1-2)"),
])
def test_a_broken_allocation_is_one_clear_error(tmp_path, environ, body, needle) -> None:
    with pytest.raises(ConfigError) as info:
        allocation(env(**environ), scontrol=fake_scontrol(tmp_path, body))
    assert needle in info.value.message and "\n" not in info.value.message and len(info.value.message) < 400


def test_without_scontrol_the_error_says_so(tmp_path) -> None:
    with pytest.raises(ConfigError, match="is not installed here"):
        allocation(env(), scontrol=str(tmp_path / "missing"))


def test_in_allocation() -> None:
    assert in_allocation({"SLURM_JOB_ID": "7"}) and not in_allocation({}) and not in_allocation({"SLURM_JOB_ID": " "})


@pytest.mark.parametrize("cluster", [None, "lab", "a b/c$d", "x" * 200])
@pytest.mark.parametrize("job", ["123456789_42", "1" * 20 + "_" + "2" * 20])
def test_the_run_is_named_after_the_job(tmp_path, cluster, job) -> None:
    """The whole job id is in the name (it was cut at 64 characters: two array tasks could share a run)."""
    environ = env(SLURM_JOB_ID=job) | ({"SLURM_CLUSTER_NAME": cluster} if cluster else {})
    if cluster is None:
        environ.pop("SLURM_CLUSTER_NAME")
    run = allocation(environ, scontrol=fake_scontrol(tmp_path, HOSTNAMES)).run_id()
    assert check_run_id(run) == run and run.startswith("slurm-") and run.endswith("-" + job)


def test_an_agent_is_one_srun_task_on_its_node() -> None:
    argv = SlurmConfig(job_id="77").argv(Host("gpu02", 4), "cd /x && exec python -m varuna_core.launch.agent")
    assert argv[0] == "srun" and "--nodelist=gpu02" in argv and "--jobid=77" in argv
    assert {"--nodes=1", "--ntasks=1", "--overlap", "--unbuffered"} <= set(argv)
    assert argv[-3:] == ["/bin/sh", "-c", "cd /x && exec python -m varuna_core.launch.agent"]


@pytest.mark.parametrize(("shown", "done", "why"), [
    ("echo 'JobId=5 Requeue=1 Restarts=0'", True, ""),
    ("echo 'JobId=5 Requeue=0 Restarts=0'", False, "not requeueable"),
    ("echo 'slurm_load_jobs error: Invalid job id' >&2; exit 1", False, "Invalid job id"),
])
def test_requeue_only_a_requeueable_job(tmp_path, shown, done, why) -> None:
    body = f'case "$1 $2" in "-o show") {shown};; requeue*) exit 0;; esac'
    requeued, reason = requeue("5", scontrol=fake_scontrol(tmp_path, body))
    assert requeued == done and why in reason and (reason == "") == done
    calls = (tmp_path / "calls").read_text().splitlines()
    assert ("requeue 5" in calls) == done


@pytest.mark.parametrize(("after", "done", "why"), [
    ("echo 'JobId=5 JobState=RUNNING Requeue=1 Restarts=1'", True, ""),
    ("echo 'JobId=5 JobState=PENDING Requeue=1 Restarts=0'", True, ""),
    ("echo 'JobId=5 JobState=REQUEUED Requeue=1 Restarts=0'", True, ""),
    ("echo 'JobId=5 JobState=RUNNING Requeue=1 Restarts=0'", False, "stopped by SIGTERM; the job is still RUNNING"),
    ("echo 'JobId=5 Requeue=1'", False, "stopped by SIGTERM; the job is still in an unknown state"),
    ("echo 'down' >&2; exit 1", False, "stopped by SIGTERM and the job's state could not be read again: down"),
])
def test_a_requeue_that_kills_its_own_scontrol_is_judged_by_the_jobs_state(tmp_path, after, done, why) -> None:
    """A requeue stops every process of the job, the launcher's scontrol too, sometimes before it exits 0 (seen
    under Slurm: the job was requeued and the launcher said "`scontrol requeue` failed: ")."""
    body = (f'if [ -e {tmp_path}/asked ]; then {after}; exit; fi\n'
            f'case "$1 $2" in "-o show") echo "JobId=5 JobState=RUNNING Requeue=1 Restarts=0";; '
            f'requeue*) touch {tmp_path}/asked; kill -TERM $$;; esac')
    requeued, reason = requeue("5", scontrol=fake_scontrol(tmp_path, body))
    assert (requeued, reason == "") == (done, done) and why in reason


def test_a_failed_requeue_without_a_message_says_its_exit_code(tmp_path) -> None:
    body = 'case "$1 $2" in "-o show") echo "JobId=5 Requeue=1 Restarts=0";; requeue*) exit 3;; esac'
    assert requeue("5", scontrol=fake_scontrol(tmp_path, body)) == (False, "`scontrol requeue` failed: exit code 3")


@pytest.mark.parametrize("nodelist", ["-V", "--help", "-M other", "-"])
def test_a_node_list_that_looks_like_an_option_never_reaches_scontrol(tmp_path, nodelist) -> None:
    """`scontrol show hostnames -V` printed scontrol's version, read as the host names `slurm` and `23.02.7`."""
    scontrol = fake_scontrol(tmp_path, 'case "$*" in *-V*) echo "slurm 23.02.7";; *) echo gpu01;; esac')
    with pytest.raises(ConfigError) as info:
        allocation(env(SLURM_JOB_NODELIST=nodelist), scontrol=scontrol)
    assert info.value.message.startswith(f"SLURM_JOB_NODELIST {nodelist!r} starts with '-'")
    assert not (tmp_path / "calls").exists()


@pytest.mark.parametrize(("nodelist", "size"), [
    ("gpu01", 1), ("gpu[01-04,07],login1", 6), ("rack[1-2]n[1-8]", 16), ("a,b,c", 3), ("x[3-1]", None),
    ("x[1-2", None), ("x[a-b]", None), ("x[[1]]", None)])
def test_the_size_of_a_node_list_is_counted_without_expanding_it(nodelist, size) -> None:
    assert nodelist_size(nodelist) == size


@pytest.mark.parametrize(("nodelist", "needle"), [
    ("node[0-99999999]", "names 100,000,000 nodes, more than the 65,536 a job can have"),
    ("n[0-9999]r[0-9999]", "names 100,000,000 nodes"),
    ("n[0-" + "9" * 60 + "]", "names about 10^60 nodes"),
])
def test_an_absurd_range_is_refused_as_too_large(tmp_path, nodelist, needle) -> None:
    with pytest.raises(ConfigError) as info:
        allocation(env(SLURM_JOB_NODELIST=nodelist), scontrol=fake_scontrol(tmp_path, "true"))
    assert needle in info.value.message and "SLURM_JOB_NODELIST" in info.value.message
    assert len(info.value.message) < 300 and not (tmp_path / "calls").exists()


def test_every_slurm_variable_in_an_error_is_escaped_and_shortened(tmp_path) -> None:
    value = "\x1b]0;owned\x07" + "x" * 5000
    for name in ("SLURM_JOB_ID", "SLURM_CLUSTER_NAME", "SLURM_RESTART_COUNT", "SLURM_GPUS_PER_NODE",
                 "SLURM_GPUS_ON_NODE", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST"):
        with pytest.raises(ConfigError) as info:
            allocation(env(**{name: value}), scontrol=fake_scontrol(tmp_path, 'echo "Invalid hostlist" >&2' if
                                                                     name == "SLURM_JOB_NODELIST" else HOSTNAMES))
        message = info.value.message
        assert name in message and "\x1b" not in message and "\\x1b" in message and len(message) < 400, message
