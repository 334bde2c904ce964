"""In-memory snapshots, the parts that need no process group: when one is due (every N steps, or as often as
costs 2% of the training time), which host keeps whose copy, what the worker is told, and a snapshot whose publish
or copy fails (said once, training goes on, the previous snapshot stays)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from varuna_core.env import WorkerEnv
from varuna_core.errors import ConfigError, HandoverError, ShelfFullError
from varuna_core.launch.shelf import Shelf
from varuna_core.util.digest import of_bytes
from varuna_core.worker.snapshots import (
    AUTO,
    FIRST_AUTO,
    MAX_EVERY,
    WARM_RETAKE,
    Snapshots,
    every_for,
    ring_source,
    step_of,
)


def test_the_automatic_interval_keeps_snapshots_within_two_percent_of_the_training_time() -> None:
    assert every_for(0.05, 0.05) == 50  # a snapshot as long as a step: one every 50 steps
    assert every_for(0.001, 1.0) == 1  # cheaper than 2% of one step: every step
    assert every_for(0.0101, 0.5) == 2  # rounded up: never over the budget
    for seconds, step in ((0.3, 0.07), (1.7, 4.5), (12.0, 0.1)):
        n = every_for(seconds, step)
        assert seconds / (n * step) <= 0.02 and (n == 1 or seconds / ((n - 1) * step) > 0.02)
    assert every_for(1e6, 1e-6) == MAX_EVERY
    assert every_for(0.05, None) == 1 and every_for(0.05, 0.0) == 1  # no step time yet: measured again next time
    assert every_for(float("nan"), 1.0) == 1


def _snapshots(every, *, publish=None, gather=None, shelf=None) -> Snapshots:
    return Snapshots(every, rank=0, host="h0", shelf=shelf, server=None, job="j", token="t", attempt=1,
                     publish=publish or (lambda reserve, copies: {}), all_gather=gather or (lambda obj: [obj]))


def test_a_fixed_interval_is_due_on_its_multiples_once() -> None:
    snaps = _snapshots(5)
    assert [i for i in range(21) if snaps.due(i)] == [5, 10, 15, 20]
    snaps.last = 10
    assert not snaps.due(10)  # taken already (a step may start twice: resumed there)
    assert not any(_snapshots(0).due(i) for i in range(50))


def test_the_automatic_interval_starts_past_the_first_steps_and_then_follows_the_measured_cost() -> None:
    snaps = _snapshots(AUTO)
    snaps.last = 0
    assert [i for i in range(10) if snaps.due(i)] == list(range(FIRST_AUTO, 10))
    snaps.last, snaps.next = FIRST_AUTO, FIRST_AUTO + 40
    assert not snaps.due(FIRST_AUTO + 39) and snaps.due(FIRST_AUTO + 40)
    resumed = _snapshots(AUTO)
    resumed.last = 700  # resumed at step 700: the first snapshot right after the first step there
    assert not resumed.due(700) and resumed.due(701)


def test_after_a_regroup_the_next_automatic_snapshot_is_taken_at_the_next_step() -> None:
    """The snapshots before a regroup name their files by the old ranks, which the launcher no longer follows: the
    survivors take a new one at once rather than 100 steps later (a fixed interval keeps its multiples)."""
    snaps = _snapshots(AUTO)
    snaps.last, snaps.next = 13, 213
    assert not snaps.due(73)
    snaps.regrouped(1)
    assert snaps.rank == 1 and snaps.due(73)
    fixed = _snapshots(5)
    fixed.regrouped(1)
    assert not fixed.due(73) and fixed.due(75)


def test_a_process_snapshots_again_soon_after_its_first_whose_cost_is_not_the_steady_one(tmp_path) -> None:
    """The first snapshot of a process costs what later ones do not (first use, first connection): 1.7 s against
    0.1 s on the example GPT. Its interval would leave a thousand steps unprotected; the second comes within
    WARM_RETAKE steps, and its cost sets the interval from then on, alike on every rank."""
    costs = iter([1.7, 0.05, 0.05])

    def publish(reserve, copies):
        return {}

    def gather(obj):
        if isinstance(obj, tuple) and len(obj) == 3:  # (problem, seconds, step time): the slowest rank's cost
            return [(None, next(costs), 0.05)]
        return [obj]

    snaps = _snapshots(AUTO, publish=publish, gather=gather, shelf=Shelf("j-1", root=tmp_path))
    first = snaps.take(FIRST_AUTO, step_time=0.05)
    assert first is not None and first.every == WARM_RETAKE < every_for(1.7, 0.05)
    assert snaps.next == FIRST_AUTO + WARM_RETAKE
    second = snaps.take(snaps.next, step_time=0.05)
    assert second is not None and second.every == every_for(0.05, 0.05) == 50
    third = snaps.take(snaps.next, step_time=0.05)
    assert third is not None and third.every == 50


def test_each_host_keeps_the_copy_of_the_host_before_it_in_rank_order() -> None:
    hosts = ["a", "b", "c"]
    assert [ring_source(hosts, h) for h in hosts] == ["c", "a", "b"]
    assert ring_source(["a"], "a") is None and ring_source(["a", "b"], "z") is None
    assert step_of("step_12/__0_0.distcp") == 12 and step_of("step_x/f") is None and step_of("other") is None
    assert step_of("step_/f") is None and step_of("step_3") is None


@pytest.mark.parametrize(("value", "interval"), [(None, 0), ("0", 0), ("auto", AUTO), (" 25 ", 25)])
def test_the_worker_reads_its_interval(value, interval) -> None:
    assert WorkerEnv(snapshot_every=value).snapshot_interval == interval


@pytest.mark.parametrize("value", ["-3", "soon", "1e3", "Auto\n"])
def test_a_bad_interval_is_refused_when_read(value) -> None:
    with pytest.raises(ConfigError, match="VARUNA_SNAPSHOT_EVERY"):
        WorkerEnv.from_environ({"VARUNA_SNAPSHOT_EVERY": value})


@pytest.mark.parametrize("value", ["h:0", "h:99999", ":80", "nohost"])
def test_a_bad_shelf_server_is_refused_when_read(value) -> None:
    with pytest.raises(ConfigError, match="VARUNA_SHELF_SERVER"):
        WorkerEnv.from_environ({"VARUNA_SHELF_SERVER": value})


def test_a_snapshot_that_does_not_fit_is_said_once_and_training_goes_on(tmp_path, caplog) -> None:
    calls = []

    def full(reserve, copies):
        calls.append(copies)
        raise ShelfFullError("rank 0's state does not fit on its host's shelf", hint="use the store")

    snaps = _snapshots(4, publish=full, shelf=Shelf("j-1", root=tmp_path))
    with caplog.at_level(logging.WARNING):
        assert snaps.take(4) is None and snaps.take(8) is None
    said = [r.getMessage() for r in caplog.records if "not taken" in r.getMessage()]
    assert len(said) == 1 and "does not fit" in said[0] and "training goes on" in said[0]
    assert calls == [True, True]


def _two_host_snapshots(tmp_path, copy=None, peer=("127.0.0.1", 9)):
    """This rank (0, on h0) and rank 1 on h1 serving its shelf at ``peer`` (None: no shelf); ``copy`` stands for the
    pull from h1 (None: the real one)."""
    shelf = Shelf("j-1", root=tmp_path)
    shelf.put("step_4/__0_0.distcp", b"old")

    def publish(reserve, copies):
        with reserve(3) as space:
            path = space.directory / "f"
            path.write_bytes(b"new")
            space.adopt("step_8/__0_0.distcp", path, digest=of_bytes(b"new"))
        return {"step_8/__0_0.distcp": 0, "step_8/__1_0.distcp": 1}

    def gather(obj):
        if isinstance(obj, tuple) and len(obj) == 2:  # (host, server) of each rank
            return [obj, ("h1", peer)]
        return [obj, obj]

    snaps = _snapshots(4, publish=publish, gather=gather, shelf=shelf)
    snaps.server, snaps.last = ("127.0.0.1", 9), 4
    if copy is not None:
        snaps._copy_previous_host = copy
    return snaps, shelf


def test_a_failed_copy_keeps_the_snapshot_without_its_peer_and_the_previous_one_until_then(tmp_path) -> None:
    """Two hosts; this rank's peer serves no shelf: the snapshot is kept (on this host only: ``peer`` False), and
    the blobs of the snapshot before it are dropped only once it is whole."""
    announced = []
    snaps, shelf = _two_host_snapshots(tmp_path, peer=None)
    report = snaps.take(8, announced.append)
    assert report is not None and not report.peer and report.held == 3 and announced == [report]
    assert shelf.names() == ["step_8/__0_0.distcp"]


def test_the_peer_copy_runs_while_the_next_step_computes_and_its_start_makes_the_snapshot_whole(tmp_path) -> None:
    """The copy of step k while step k + 1 runs: start() returns with the copy still running in another thread;
    nothing is announced and the snapshot before stays until finish() (the next step's start) has waited for it;
    then the report says what was copied, and the training paid only for what the step did not cover."""
    release, threads = threading.Event(), []

    def copy(step, owners, places, cancelled):
        threads.append(threading.current_thread())
        assert release.wait(10)
        return 1234

    announced = []
    snaps, shelf = _two_host_snapshots(tmp_path, copy)
    began = time.perf_counter()
    assert snaps.start(8, announced.append, overlap=True) and snaps.pending
    in_start = time.perf_counter() - began
    assert announced == [] and "step_4/__0_0.distcp" in shelf.names()  # not whole yet: the old one stays
    time.sleep(0.3)  # the next step computes
    release.set()
    began = time.perf_counter()
    report = snaps.finish()
    in_finish = time.perf_counter() - began
    assert threads and threads[0] is not threading.current_thread()
    assert report is not None and report.copied == 1234 and report.peer and announced == [report]
    # its cost is the time spent in the two calls, not the step's that ran between them
    assert report.seconds <= in_start + in_finish and not snaps.pending and snaps.last == 8
    assert shelf.names() == ["step_8/__0_0.distcp"]
    assert snaps.finish() is None  # nothing pending: nothing to agree on


def test_an_overlapped_copy_is_charged_for_how_much_it_slowed_the_step_it_ran_beside(tmp_path) -> None:
    """On shared cores the copy slows the step it overlaps: that loss counts in the snapshot's cost (which sets the
    automatic interval), not only the time the next step's start waited for it."""
    snaps, _ = _two_host_snapshots(tmp_path, lambda step, owners, places, cancelled: 5)
    assert snaps.start(8, step_time=0.1, overlap=True)
    report = snaps.finish(overlapped=0.4)  # the step beside the copy took 0.4 s against 0.1 s before
    assert report is not None and report.seconds >= 0.3
    began = time.perf_counter()
    assert snaps.start(12, step_time=0.1, overlap=True)
    second = snaps.finish(overlapped=0.05)  # a faster step is not a credit: only the calls' own time counts
    assert second is not None and second.seconds <= time.perf_counter() - began


def test_without_overlap_and_in_take_the_copy_is_made_before_the_call_returns(tmp_path) -> None:
    threads = []

    def copy(step, owners, places, cancelled):
        threads.append(threading.current_thread())
        return 7

    snaps, _ = _two_host_snapshots(tmp_path, copy)
    report = snaps.take(8)
    assert report is not None and report.copied == 7 and threads == [threading.current_thread()]


def test_a_copy_that_fails_in_its_thread_leaves_a_snapshot_without_its_peer_said_once(tmp_path, caplog) -> None:
    def copy(step, owners, places, cancelled):
        raise RuntimeError("the wire broke")

    snaps, _ = _two_host_snapshots(tmp_path, copy)
    with caplog.at_level(logging.WARNING):
        assert snaps.start(8, overlap=True)
        report = snaps.finish()
    assert report is not None and not report.peer
    assert any("no copy on another host" in r.getMessage() and "the wire broke" in r.getMessage()
               for r in caplog.records)


def test_a_regroup_forgets_the_pending_snapshot_and_keeps_the_whole_one_before(tmp_path) -> None:
    """Its ranks are not the job's any more: it is never announced, and the snapshot before it stays."""
    release = threading.Event()

    def copy(step, owners, places, cancelled):
        release.wait(10)
        return 1

    announced = []
    snaps, shelf = _two_host_snapshots(tmp_path, copy)
    assert snaps.start(8, announced.append, overlap=True)
    copy_ = snaps._pending
    snaps.regrouped(0)  # (not waiting for the copy, which may wait on the lost host)
    assert copy_ is not None and copy_.cancelled.is_set() and copy_.thread.is_alive()
    release.set()
    assert not snaps.pending and snaps.finish() is None and announced == [] and snaps.last == 4
    assert "step_4/__0_0.distcp" in shelf.names()


def test_a_new_snapshot_finishes_the_pending_one_first(tmp_path) -> None:
    snaps, _ = _two_host_snapshots(tmp_path, lambda step, owners, places, cancelled: 5)
    announced = []
    assert snaps.start(8, announced.append, overlap=True)
    snaps.take(12, announced.append)
    assert [r.step for r in announced] == [8, 12]


def test_a_refused_copy_is_a_handover_error_naming_the_host(tmp_path) -> None:
    snaps = _snapshots(4, shelf=Shelf("j-1", root=tmp_path))
    snaps.server = ("127.0.0.1", 9)
    places = [("h0", ("127.0.0.1", 9)), ("h1", ("127.0.0.1", 9))]  # nothing listens there
    with pytest.raises(HandoverError, match=r"127\.0\.0\.1:9"):
        snaps._copy_previous_host(8, {"step_8/__1_0.distcp": 1}, places)


def test_after_a_failed_automatic_snapshot_every_rank_tries_again_at_the_same_step(tmp_path) -> None:
    """The next try depends only on what all ranks know alike (a rank that went by its own clock would enter the
    snapshot's collective while the others train: both would wait for ever)."""

    def full(reserve, copies):
        raise ShelfFullError("does not fit", hint="use the store")

    tries = []
    for _ in range(2):  # two ranks, whatever their clocks
        snaps = _snapshots(AUTO, publish=full, shelf=Shelf("j-1", root=tmp_path))
        snaps.last = 0
        steps = []
        for i in range(1, 2000):
            if snaps.due(i):
                steps.append(i)
                assert snaps.take(i, step_time=0.01 * i) is None
        tries.append(steps)
    assert tries[0] == tries[1] == [FIRST_AUTO, FIRST_AUTO + 50, FIRST_AUTO + 150, FIRST_AUTO + 350, FIRST_AUTO + 750,
                                    FIRST_AUTO + 1550]


def test_dropping_the_snapshots_frees_their_room_for_a_handovers_publish(tmp_path) -> None:
    shelf = Shelf("j-1", root=tmp_path, budget=10_000)
    for name in ("step_4/__0_0.distcp", "step_4/manifest.json", "step_8/__1_0.distcp"):
        shelf.put(name, b"x" * 3000)
    with pytest.raises(ShelfFullError), shelf.reserve(5000):
        pass
    met = []
    snaps = _snapshots(4, shelf=shelf, gather=lambda obj: met.append(obj) or [obj])
    snaps.drop()
    assert shelf.names() == [] and met == [None]  # every rank waits for the others' room too
    with shelf.reserve(5000):
        pass


def test_a_snapshot_that_would_leave_the_host_short_of_memory_is_skipped_and_said(tmp_path, caplog) -> None:
    """A shelf lives in memory the training cannot get back: a snapshot that would leave less than a tenth of the
    host's memory free (its own files and the copy of the previous host's, for each rank of the host) is not
    taken."""
    reserved = []

    def publish(reserve, copies):
        with reserve(300 * 2**20):  # this rank's state: 300 MiB
            reserved.append(True)
        return {}

    def gather(obj):
        return [obj, ("h0", None)] if isinstance(obj, tuple) and len(obj) == 2 else [obj, obj]

    snaps = _snapshots(AUTO, publish=publish, gather=gather, shelf=Shelf("j-1", root=tmp_path))
    snaps.memory = lambda: (1300 * 2**20, 4096 * 2**20)  # 2 ranks here x 2 x 300 MiB: 90 MiB short of 10% free
    with caplog.at_level(logging.WARNING):
        assert snaps.take(FIRST_AUTO) is None
    assert reserved == [] and "needs about 1200 MiB of h0's memory" in caplog.text
    snaps.memory = lambda: (1700 * 2**20, 4096 * 2**20)
    assert snaps.take(FIRST_AUTO + 50) is not None and reserved == [True]
