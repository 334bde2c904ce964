"""The launcher's parts on their own: hosts files, placement, the heartbeat channel's authentication, straggler
detection, re-planning for another device count, and the SSH command line."""

from __future__ import annotations

import json
import time

import pytest

from tests.profiles import make_profile
from varuna_core.errors import ConfigError
from varuna_core.launch.attempt import JobFiles, crash_cause, error_line, local_checkpoints_in, place, worker_argv
from varuna_core.launch.heartbeat import Listener, send_notice
from varuna_core.launch.hosts import Host, HostsWatcher, parse_hosts
from varuna_core.launch.manager import replan
from varuna_core.launch.options import HostRuntime, SSHConfig
from varuna_core.launch.protocol import decode, encode
from varuna_core.launch.stragglers import StragglerDetector
from varuna_core.planning.planner import PlanRequest, make_plan, plan_for
from varuna_core.worker.beacon import Beacon


def test_hosts_file_lines() -> None:
    hosts = parse_hosts("# cluster\n\n10.0.0.1\nalice@node2:2222 slots=4  # big one\n[fe80::1]:22\n", 2)
    assert hosts == [Host("10.0.0.1", 2), Host("node2", 4, user="alice", port=2222), Host("fe80::1", 2, port=22)]
    assert hosts[1].name == "alice@node2:2222"


@pytest.mark.parametrize(("text", "fragment"), [
    ("10.0.0.1\n10.0.0.2:ssh\n", "line 2: '10.0.0.2:ssh' is not a host name or address"),
    ("10.0.0.1\nnot a host\n", "line 2: unknown field 'a'"),
    ("10.0.0.1 slots=0\n", "line 1: unknown field 'slots=0'"),
    ("10.0.0.1 gpus=2\n", "unknown field 'gpus=2'"),
    ("a\nb\na\n", "line 3: a is already listed on line 1"),
])
def test_hosts_file_errors_name_the_line(text, fragment) -> None:
    with pytest.raises(ConfigError, match="hosts file") as info:
        parse_hosts(text, 1)
    assert fragment in info.value.message


def test_watcher_reports_content_changes_once(tmp_path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a\nb\n")
    watcher = HostsWatcher(path, 2)
    assert watcher.poll() is None
    path.write_text("a\n")
    assert watcher.poll() == [Host("a", 2)]
    assert watcher.poll() is None
    path.write_text("a\n???\n")
    with pytest.raises(ConfigError, match="line 2"):
        watcher.poll()
    assert watcher.poll() is None  # the same bad content is reported once


def test_place_fills_hosts_in_order_and_names_the_shortfall() -> None:
    nodes = place(5, [Host("a", 2), Host("b", 4), Host("c", 1)])
    assert [(n.host.address, n.ranks) for n in nodes] == [("a", ((0, 0), (1, 1))), ("b", ((2, 0), (3, 1), (4, 2)))]
    with pytest.raises(ConfigError, match=r"needs 8 devices \(pp × dp\); the hosts provide 7 \(a: 2, b: 4, c: 1\)"):
        place(8, [Host("a", 2), Host("b", 4), Host("c", 1)])


def test_worker_argv_and_ssh_command_quote_everything() -> None:
    assert worker_argv(["train.py", "--x", "a b"], "/py") == ["/py", "train.py", "--x", "a b"]
    assert worker_argv(["./run.sh"], "/py") == ["./run.sh"]
    runtime = HostRuntime(python="/opt/my env/python", code_dir="/srv/code dir")
    command = runtime.command("-m", "varuna_core.launch.agent", env={"VARUNA_JOB_ID": "abc"})
    assert command == "cd '/srv/code dir' && VARUNA_JOB_ID=abc exec '/opt/my env/python' -m varuna_core.launch.agent"
    argv = SSHConfig(user="bob", port=2200, identity="/k", options=("ConnectTimeout=3",)).argv(
        Host("h", 1, port=22), command)
    assert argv[:3] == ["ssh", "-o", "ConnectTimeout=3"]  # the user's options first: ssh keeps the first value
    assert argv[argv.index("-p") + 1] == "22" and argv[argv.index("-l") + 1] == "bob"  # the host's port wins
    assert "BatchMode=yes" in argv and argv[-2:] == ["h", command]


def test_messages_need_the_job_token() -> None:
    data = encode("job1", "secret", "beat", {"rank": 3})
    assert decode(data, "job1", "secret")["rank"] == 3
    assert decode(data, "job1", "other") is None  # another token
    assert decode(data, "job2", "secret") is None  # another job
    assert decode(data.replace(b"3", b"4"), "job1", "secret") is None  # tampered
    assert decode(b"garbage", "job1", "secret") is None


def test_listener_collects_beats_steps_and_acknowledged_notices() -> None:
    listener = Listener("job", "tok", bind="127.0.0.1")
    try:
        beacon = Beacon(("127.0.0.1", listener.port), "job", "tok", rank=1, host="h", interval=0.05)
        beacon.progress(step=1, loss_step=0, loss=2.5, step_time=0.1, compute_time=0.05)
        beacon.progress(step=2, loss_step=1, loss=2.25, step_time=0.1, compute_time=0.05)
        intruder = Beacon(("127.0.0.1", listener.port), "job", "wrong", rank=0, host="evil", interval=0.05)
        intruder.progress(step=99, loss_step=98, loss=0.0)
        deadline = time.monotonic() + 30  # a positive wait: it ends when the condition holds
        while time.monotonic() < deadline and (1 not in listener.snapshot() or listener.rejected == 0):
            time.sleep(0.02)
        beats = listener.snapshot()
        assert set(beats) == {1} and beats[1].step == 2 and beats[1].get("compute_time") == 0.05
        assert listener.take_steps() == {0: (2.5, 0.1), 1: (2.25, 0.1)} and listener.rejected >= 1
        assert send_notice(("127.0.0.1", listener.port), "job", "tok", {"host": "h", "seconds": 5})
        assert listener.take_notices()[0]["host"] == "h"
        assert not send_notice(("127.0.0.1", listener.port), "job", "bad", {"host": "h"}, tries=1, timeout=0.3)
    finally:
        listener.close()


def test_stragglers_need_patience_and_compare_like_with_like() -> None:
    stage_of = {0: 0, 1: 0, 2: 1, 3: 1}
    detector = StragglerDetector(stage_of, expected=None, threshold=0.3, patience=3)
    found = []
    for step in range(1, 6):
        # stage 1 is twice as heavy (not a straggler); rank 1 is 50% slower than its replica from step 2 on
        reports = {0: ("a", step, 1.0), 1: ("b", step, 1.0 if step == 1 else 1.5), 2: ("c", step, 2.0),
                   3: ("d", step, 2.0)}
        found += detector.observe(reports)
        assert detector.observe(reports) == []  # the same step again counts once
    assert [(s.rank, s.host) for s in found] == [(1, "b")]
    planned = StragglerDetector(stage_of, expected=[1.0, 2.0], threshold=0.3, patience=1)
    assert [s.rank for s in planned.observe({0: ("a", 1, 1.0), 1: ("b", 1, 1.0), 2: ("c", 1, 2.0),
                                             3: ("d", 1, 3.2)})] == [3]
    # one replica per stage: compared with the others through the plan's predictions (stage 1 does twice the work)
    lone = StragglerDetector({0: 0, 1: 1, 2: 2}, expected=[1.0, 2.0, 1.0], threshold=0.3, patience=1)
    assert lone.observe({0: ("a", 1, 1.0), 1: ("b", 1, 2.0), 2: ("c", 1, 1.1)}) == []
    assert [s.rank for s in lone.observe({0: ("a", 2, 1.0), 1: ("b", 2, 3.0), 2: ("c", 2, 1.0)})] == [1]
    blind = StragglerDetector({0: 0, 1: 1}, expected=None, threshold=0.3, patience=1)
    assert blind.observe({0: ("a", 1, 1.0), 1: ("b", 1, 5.0)}) == []  # different stages, no plan: not judged


def test_a_straggler_is_judged_against_its_replicas_latest_reports_whenever_they_came() -> None:
    """Heartbeats arrive on their own clocks: a poll may hear a rank but not its replica. The rank is then judged
    against the replica's latest report, not through the plan against the other stages (whose error broke the
    streak of a rank 7x slower than its replica in a launch test); with no replica heard from yet, the streak
    stands."""
    stage_of = {0: 0, 1: 1, 2: 0, 3: 1}
    detector = StragglerDetector(stage_of, expected=[1.0, 4.0], threshold=3.0, patience=5)  # the plan: 4x off
    assert detector.observe({1: ("b", 1, 0.2), 0: ("a", 1, 0.05)}) == []  # rank 3 not heard from: not judged
    assert detector._streak.get(1, 0) == 0
    found = []
    for step in range(2, 8):
        reports = {0: ("a", step, 0.05), 1: ("b", step, 0.2)}  # rank 1: 7x its replica
        if step % 2 == 0:
            reports[3] = ("d", step, 0.028)
            reports[2] = ("c", step, 0.05)
        found += detector.observe(reports)
    assert [(s.rank, s.host, round(s.ratio, 1)) for s in found] == [(1, "b", 7.1)]


def test_replan_keeps_the_global_batch_and_the_microbatch() -> None:
    profile = make_profile([1e-3] * 6, sizes=(1, 2, 4, 8))
    path_less = plan_for(profile, PlanRequest(gpus=8, batch_size=64, gpus_per_node=4), pp=2, dp=4, microbatch_size=8,
                         schedule="1f1b")
    assert path_less.profile_path is None
    new, why = replan(path_less, 3, 1)
    assert (new.pp, new.dp, new.batch_size, new.microbatch_size) == (2, 1, 64, 8) and "no profile" in why
    assert new.stage_to_rank_map == "0;1" or new.stage_to_rank_map.rstrip(";") == "0;1"
    with pytest.raises(ConfigError, match="cannot hold the plan's 2 pipeline stages"):
        replan(path_less, 1, 1)


def test_replan_from_the_profile(tmp_path) -> None:
    profile = make_profile([1e-3] * 6, sizes=(1, 2, 4, 8))
    path = tmp_path / "profile.json"
    path.write_text(profile.model_dump_json())
    plan = make_plan(profile, PlanRequest(gpus=8, batch_size=64, gpus_per_node=4)).model_copy(
        update={"profile_path": str(path)})
    new, why = replan(plan, 4, 2)
    assert new.pp * new.dp <= 4 and new.batch_size == 64 and new.profile_path == str(path)
    assert new.microbatch_size == plan.microbatch_size and "kept" in why
    linked = make_plan(profile, PlanRequest(gpus=8, batch_size=64, gpus_per_node=4, link_rate=6.25e6,
                                            link_latency=2e-4)).model_copy(update={"profile_path": str(path)})
    again, _ = replan(linked, 4, 2)  # a morph plans for the same link between nodes
    assert (again.link_rate, again.link_latency) == (6.25e6, 2e-4)


def test_the_cli_reads_its_defaults_from_the_library() -> None:
    """A default is written once, in LaunchOptions; `varuna launch` shows and uses the same."""
    import typer.main

    from varuna_cli.app import app
    from varuna_cli.commands.launch import _snapshot_every
    from varuna_core.launch.options import DEFAULTS

    command = typer.main.get_command(app).commands["launch"]
    field_of = {"steps": "total_steps"}
    read_as = {"snapshot_every": _snapshot_every}  # the CLI spells the library's None "auto"
    shared = {p.name: p.default for p in command.params if field_of.get(p.name, p.name) in DEFAULTS}
    assert len(shared) >= 15
    for name, value in shared.items():
        assert read_as.get(name, lambda v: v)(value) == DEFAULTS[field_of.get(name, name)], name


def test_restarts_are_forgiven_by_any_new_checkpoint_also_a_morphs() -> None:
    """The sequence that once gave up on a healthy job: a crash, morphs that checkpointed (39, 45), then a crash
    before the next periodic checkpoint. Progress since the previous crash is what counts, not since the step the
    crashed attempt resumed from."""
    from varuna_core.launch.manager import RestartBudget

    budget = RestartBudget(1, baseline=None)
    assert budget.crash(10) == 1 and not budget.exhausted  # first crash after step_10
    assert budget.crash(20) == 1 and not budget.exhausted  # step_20 written in between
    # morphs wrote step_39 and step_45 (on demand); the next attempt resumed from 45 and died before step_50
    assert budget.crash(45) == 1 and not budget.exhausted
    assert budget.crash(45) == 2 and budget.exhausted  # nothing new since: give up


def test_a_job_that_never_saves_gives_up_and_a_refused_checkpoint_costs_no_restart() -> None:
    from varuna_core.launch.manager import RestartBudget

    budget = RestartBudget(2, baseline=None)
    assert [budget.crash(None) for _ in range(3)] == [1, 2, 3] and budget.exhausted
    budget = RestartBudget(1, baseline=30)  # resumed from step_30
    assert budget.crash(30) == 1
    assert budget.crash(25, refused=True) == 1 and not budget.exhausted  # step_30 set aside: fall back to 25
    assert budget.crash(25) == 2 and budget.exhausted


@pytest.mark.parametrize(("text", "before"), [
    (None, 0), (b"", 0), (b'{"event": "starting", "attempt": 2}\n{"event": "starting", "attempt": 3}\n', 3),
    (b'{"event": "starting", "attempt": 7}\n{"event": "starting", "att', 7),  # a launcher killed mid-line
    (b'{"event": "starting", "attempt": true}\n{"event": "starting", "attempt": "9"}\n[1, "starting"]\n', 0),
    (b'{"event": "starting", "attempt": 1e400}\n{"event": "starting", "attempt": 99999999999}\n', 0),
    (b'{"event": "stopped", "attempt": 5, "x": "starting"}\n\xff\xfe"starting"\n' + b"[" * 100_000 + b'"starting"', 0),
])
def test_a_reused_run_directory_numbers_attempts_on(tmp_path, text, before) -> None:
    """A requeued Slurm job launches again into its run directory: the attempts of the earlier launches are
    counted from its events (whatever else the file holds), so that logs, plans and events stay apart."""
    if text is not None:
        (tmp_path / "events.jsonl").write_bytes(text)
    files = JobFiles(tmp_path)
    try:
        assert files.attempts_before == before
    finally:
        files.close()


def test_workers_on_every_host_get_the_launchers_kernel_and_communication_settings() -> None:
    """A worker started over SSH gets its sshd's environment, not the launcher's: the variables that choose torch's
    kernels (and so its rounding) and its communication are forwarded, what is per host is not."""
    from varuna_core.launch.options import forwarded_environ

    environ = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO", "MKL_CBWR": "COMPATIBLE",
               "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
               "CUDA_VISIBLE_DEVICES": "0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
               "TORCH_HOME": "/home/me/.torch", "NCCL_DEBUG_FILE": "/tmp/nccl.%h", "HOME": "/home/me",
               "PATH": "/usr/bin", "VARUNA_JOB_TOKEN": "secret", "SSH_AUTH_SOCK": "/tmp/x"}
    assert forwarded_environ(environ) == {
        "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO", "MKL_CBWR": "COMPATIBLE",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@pytest.mark.parametrize(("every", "morph", "handover", "snapshot", "newest", "want"), [
    (None, True, True, (30, True), 25, True),  # auto (the default) recovers from a snapshot newer than the store
    (7, True, True, (28, True), None, True),
    (0, True, True, (30, True), None, False),  # none taken
    (None, True, False, (30, True), None, False),  # restarts through the store: no shelves, no snapshots
    (None, True, True, (30, True), 30, False),  # the store holds it as new: restart from the store as before
    (None, True, True, None, None, False),
])
def test_a_crash_goes_on_from_a_snapshot_only_when_one_is_newer_than_the_store(every, morph, handover, snapshot,
                                                                              newest, want) -> None:
    from types import SimpleNamespace

    from varuna_core.launch.attempt import Ending, Outcome
    from varuna_core.launch.manager import Manager

    manager = SimpleNamespace(opts=SimpleNamespace(snapshot_every=every, morph=morph, handover=handover),
                              latest=lambda: newest)
    attempt = SimpleNamespace(snapshot=lambda: snapshot)
    crash = Outcome(Ending.CRASH, "lost the agent on h2", suspects=["h2"])
    assert Manager._recoverable(manager, attempt, crash) is want
    assert Manager._recoverable(manager, attempt, Outcome(Ending.CRASH, "x", refused=True)) is False


def test_every_snapshot_is_recorded_once_in_order_however_the_beats_interleave() -> None:
    """A beat carries only its rank's newest snapshot: a poll may hear rank 0 at step 6 while rank 1 still says 3,
    and the next poll rank 1 at 9 already. Each snapshot is written once, with the reports heard of it."""
    from types import SimpleNamespace

    from varuna_core.launch.attempt import Attempt
    from varuna_core.launch.heartbeat import Beat

    written = []
    attempt = SimpleNamespace(world=2, number=1, snapshot_recorded=None, _snapshot_reports={},
                              files=SimpleNamespace(event=lambda name, **f: written.append((name, f))))

    def beats(*steps):
        return {r: Beat(r, f"h{r}", s, 0.0, {"snapshot": s, "snapshot_bytes": 10 * (r + 1), "snapshot_peer": True,
                                              "snapshot_seconds": 0.1 * (r + 1), "snapshot_every": 3})
                for r, s in enumerate(steps)}

    for polled in (beats(3, None), beats(3, 3), beats(3, 3), beats(6, 3), beats(9, 9), beats(9, 9)):
        Attempt._record_snapshot(attempt, {r: b for r, b in polled.items() if b.step is not None})
    assert [f["step"] for _, f in written] == [3, 6, 9]
    assert written[0][1]["host_bytes"] == {"h0": 10, "h1": 20} and written[0][1]["seconds"] == 0.2
    assert written[1][1]["ranks"] == 1 and written[1][1]["host_bytes"] == {"h0": 10}  # rank 1's 6 was not heard
    assert written[2][1]["ranks"] == 2


def test_the_checkpoints_in_the_hosts_stores_are_read_back_from_the_events(tmp_path) -> None:
    """What --resume --ckpt-local continues from: the ``checkpoint_local`` events of each run, whatever else the
    file holds (other events, broken or hostile lines)."""
    events = tmp_path / "events.jsonl"
    lines = [
        {"event": "checkpoint_local", "step": 3, "run": "a"}, {"event": "checkpoint_local", "step": 6, "run": "a"},
        {"event": "checkpoint_local", "step": 6, "run": "a"}, {"event": "checkpoint_local", "step": 4, "run": "b"},
        {"event": "starting", "attempt": 1}, {"event": "checkpoint_local", "step": True, "run": "a"},
        {"event": "checkpoint_local", "step": -1, "run": "a"}, {"event": "checkpoint_local", "step": 2**70, "run": "a"},
        {"event": "checkpoint_local", "step": 9, "run": ["a"]}, {"event": "checkpoint_local", "step": "9", "run": "a"},
        {"event": "other", "step": 12, "run": "a", "note": "checkpoint_local"},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    events.write_text(text + '{"event": "checkpoint_local", "step": 99, "run"\n' + "[1, 2]\n" + "[" * 100000 + "\n")
    assert local_checkpoints_in(events) == {"a": [3, 6], "b": [4]}
    assert local_checkpoints_in(tmp_path / "missing.jsonl") == {}


def test_a_crash_is_told_by_its_cause_even_when_a_symptom_was_heard_first() -> None:
    """A rank whose peer was killed exits with code 1 at once, and under load its exit may reach the launcher before
    the killed rank's: the crash names the killed rank (the suite once named the survivor)."""
    assert crash_cause({0: 1, 1: -9}) == 1
    assert crash_cause({1: -9, 0: 1}) == 1
    assert crash_cause({2: 1, 0: 1}) == 2  # only symptoms: the first heard
    assert crash_cause({3: 1, 1: 3, 0: -9}) == 1  # the first cause heard


@pytest.mark.parametrize(("line", "said"), [
    ("ModuleNotFoundError: No module named 'torch'", "ModuleNotFoundError: No module named 'torch'"),
    ("torch.OutOfMemoryError: CUDA out of memory.  ", "torch.OutOfMemoryError: CUDA out of memory."),
    ("KeyError", "KeyError"),
    ("SystemExit: 3", "SystemExit: 3"),
    ("ValueError: " + "x" * 1_000_000, "ValueError: " + "x" * 285 + "..."),  # a huge line: its start
    ("step 4 loss 2.0", None),  # a rank killed by a signal: no error of its own
    ("===== attempt 2: rank 0 on 127.0.0.1 =====", None),
    ("", None),
    ("\x00\xff\xfe garbage \x00", None),
    ("Error: not a Python exception line, as a tool may print", None),
    ("  File \"train.py\", line 1, in <module>", None),
    ("RuntimeError: first line\nsecond line", None),  # one line only
])
def test_a_crash_quotes_the_exception_its_rank_died_of(line: str, said: str | None) -> None:
    got = error_line(line)
    assert got == said
    assert got is None or len(got) <= 300
