"""The launcher-worker contract (varuna_core.env): written by one side, read back identically by the other."""

from __future__ import annotations

import pytest

from varuna_core import env
from varuna_core.env import LAUNCHER_SET, WorkerEnv
from varuna_core.errors import ConfigError


def test_what_the_launcher_writes_the_worker_reads_back() -> None:
    told = WorkerEnv(plan="/p/plan.yaml", ckpt_dir="/ckpt", run_dir="/run", resume_step=0, ckpt_every=5, ckpt_keep=2,
                     ckpt_tempdir="/tmp/x", total_steps=400, job_id="j1", job_token="t" * 64, attempt=3,
                     run_id="run-1", manager="10.0.0.1:4000", host="h1")
    environ = told.to_environ()
    assert environ["VARUNA_RESUME_STEP"] == "0" and environ["VARUNA_ATTEMPT"] == "3"
    assert WorkerEnv.from_environ(environ) == told
    assert set(environ) <= set(LAUNCHER_SET)


def test_an_empty_environment_is_an_unsupervised_script() -> None:
    assert WorkerEnv.from_environ({}) == WorkerEnv()
    assert WorkerEnv().to_environ() == {}
    assert WorkerEnv.from_environ({"VARUNA_CKPT_DIR": "  ", "VARUNA_CKPT_EVERY": ""}) == WorkerEnv()


@pytest.mark.parametrize("name, value", [("VARUNA_CKPT_EVERY", "2.5"), ("VARUNA_CKPT_KEEP", "0"),
                                         ("VARUNA_RESUME_STEP", "-1"), ("VARUNA_ATTEMPT", "nan"),
                                         ("VARUNA_TOTAL_STEPS", "1e400")])
def test_a_malformed_number_names_the_variable(name, value) -> None:
    with pytest.raises(ConfigError, match=name):
        WorkerEnv.from_environ({name: value})


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" YES ", True), ("on", True), ("0", False),
                                       ("", False), ("false", False), ("no", False), ("2", False)])
def test_switches_are_parsed_one_way(monkeypatch, value, on) -> None:
    monkeypatch.setenv(env.DEBUG, value)
    assert env.debug() is on


def test_the_env_file_may_not_set_what_the_launcher_sets() -> None:
    for name in ("RANK", "MASTER_PORT", "VARUNA_JOB_TOKEN", "VARUNA_ATTEMPT", "VARUNA_PLAN", "VARUNA_HOST"):
        assert name in LAUNCHER_SET
    assert LAUNCHER_SET["VARUNA_CKPT_DIR"] == "--ckpt-dir"


@pytest.mark.parametrize("value", ["nohost", "h:", "h:x", "h:0", "h:70000", ":4000"])
def test_a_malformed_manager_address_names_the_variable_when_read(value) -> None:
    """Heartbeats used to parse VARUNA_MANAGER themselves, and a bad one only disabled them with a warning."""
    with pytest.raises(ConfigError, match="VARUNA_MANAGER"):
        WorkerEnv.from_environ({"VARUNA_MANAGER": value})


def test_a_manager_address_is_read_once_in_one_way() -> None:
    assert WorkerEnv.from_environ({"VARUNA_MANAGER": "10.0.0.1:4000"}).manager_address == ("10.0.0.1", 4000)
    assert WorkerEnv.from_environ({"VARUNA_MANAGER": "[::1]:4000"}).manager_address == ("::1", 4000)
    assert WorkerEnv().manager_address is None


def test_a_run_id_is_read_as_it_is_set() -> None:
    """A run id with a line break is a mistake the worker reports (see agree_seed_and_run), not another name."""
    assert WorkerEnv.from_environ({"VARUNA_RUN_ID": "run-1\n"}).run_id == "run-1\n"


def test_a_beacon_is_made_from_what_the_launcher_told() -> None:
    from varuna_core.worker.beacon import Beacon

    assert Beacon.launched(WorkerEnv(), 0) is None
    assert Beacon.launched(WorkerEnv(manager="127.0.0.1:9", job_id="j"), 0) is None  # no token: not launched
    beacon = Beacon.launched(WorkerEnv(manager="127.0.0.1:9", job_id="j", job_token="t", attempt=3, host="h"), 2)
    assert (beacon.address, beacon.job, beacon.attempt, beacon.host, beacon.rank) == (("127.0.0.1", 9), "j", 3, "h", 2)
