"""Supervision with stand-in callables: it decides when to load, save and stop without a model or a facade."""

from __future__ import annotations

import os
import signal

import pytest

from varuna_core.errors import EXIT_CHECKPOINTED, CheckpointError, ConfigError
from varuna_core.util.digest import of_bytes
from varuna_core.worker.supervision import ResumeRefused, Supervision


class Trainer:
    """What the facade gives supervision: an iteration counter and the two checkpoint calls."""

    def __init__(self) -> None:
        self.iteration = 0
        self.saved: list[tuple[int, dict]] = []
        self.loaded: list[int] = []
        self.refuse = False

    def save(self, directory: str, **options) -> None:
        self.saved.append((self.iteration, options))

    def load(self, directory: str, step: int) -> int:
        if self.refuse:
            raise CheckpointError(f"step_{step}: digest mismatch")
        self.loaded.append(step)
        self.iteration = step
        return step

    def supervision(self) -> Supervision:
        return Supervision(0, samples=8, save=self.save, load=self.load,
                           progress=lambda: (self.iteration, None, None))

    def train(self, sup: Supervision, steps: int, *, flag_at: int | None = None) -> None:
        for _ in range(steps):
            sup.before_step()
            self.iteration += 1
            sup.after_step(1.0, requested_anywhere=flag_at is not None and self.iteration >= flag_at)


@pytest.fixture
def launched(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("VARUNA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VARUNA_CKPT_DIR", str(tmp_path))
    yield monkeypatch
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_resumes_once_then_saves_every_n_steps(launched) -> None:
    launched.setenv("VARUNA_RESUME_STEP", "4")
    launched.setenv("VARUNA_CKPT_EVERY", "2")
    launched.setenv("VARUNA_CKPT_KEEP", "3")
    t = Trainer()
    sup = t.supervision()
    sup.resume()
    sup.resume()
    t.train(sup, 5)
    assert t.loaded == [4]  # once, and the resumed step is not saved again
    assert [step for step, _ in t.saved] == [6, 8]
    assert t.saved[0][1] == {"tempdir": None, "background": False, "keep": 3}


def test_an_agreed_request_checkpoints_at_the_next_step_and_exits_75(launched) -> None:
    t = Trainer()
    sup = t.supervision()
    t.train(sup, 3, flag_at=3)
    with pytest.raises(SystemExit) as stop:
        sup.before_step()
    assert stop.value.code == EXIT_CHECKPOINTED
    assert [step for step, _ in t.saved] == [3]


def test_sigusr1_raises_this_ranks_flag(launched) -> None:
    sup = Trainer().supervision()
    assert sup.flag() == 0.0
    os.kill(os.getpid(), signal.SIGUSR1)
    assert sup.flag() == 1.0


def test_a_refused_resume_tells_the_launcher_to_fall_back(launched) -> None:
    launched.setenv("VARUNA_RESUME_STEP", "4")
    t = Trainer()
    t.refuse = True
    with pytest.raises(ResumeRefused, match="digest mismatch") as refused:
        t.supervision().resume()
    assert refused.value.exit_code == 76


@pytest.mark.parametrize(("name", "value"), [
    ("VARUNA_CKPT_EVERY", "5"), ("VARUNA_RESUME_STEP", "3"),
    ("VARUNA_ON_SIGTERM", "checkpoint"),  # a SIGTERM would checkpoint into no store
])
def test_checkpoint_requests_need_a_store(monkeypatch, name, value) -> None:
    for old in list(os.environ):
        if old.startswith("VARUNA_"):
            monkeypatch.delenv(old)
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="VARUNA_CKPT_DIR"):
        Trainer().supervision()


def test_without_the_launcher_nothing_happens(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("VARUNA_"):
            monkeypatch.delenv(name)
    t = Trainer()
    sup = t.supervision()
    sup.resume()
    t.train(sup, 4, flag_at=None)
    assert t.saved == [] and t.loaded == [] and sup.beacon is None


def test_under_a_scheduler_the_first_sigterm_asks_for_a_checkpoint_and_the_second_ends_the_process() -> None:
    import subprocess
    import sys

    code = """
import os, signal, sys, time
from varuna_core.worker.supervision import Supervision
sup = Supervision(0, save=lambda *a, **k: None, load=lambda d, s: s, progress=lambda: (3, None, None))
os.kill(os.getpid(), signal.SIGTERM)
print("flag", sup.flag(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("still alive", flush=True)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARUNA_")}
    env.update(VARUNA_CKPT_DIR="/nonexistent", VARUNA_ON_SIGTERM="checkpoint")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout == "flag 1.0\n" and done.returncode == -signal.SIGTERM, (done.stdout, done.stderr[-2000:])


def test_a_wrong_sigterm_mode_is_refused(launched) -> None:
    launched.setenv("VARUNA_ON_SIGTERM", "ignore")
    with pytest.raises(ConfigError, match="VARUNA_ON_SIGTERM"):
        Trainer().supervision()


# ----------------------------------------------------------------------------------------------------------
# A morph by handover: SIGUSR2 publishes on the host's shelf instead of writing the store


class Publisher(Trainer):
    """A trainer whose state goes onto a shelf (``publish``) and comes back (``take``)."""

    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__()
        self.published: list[int] = []
        self.taken: list[int] = []
        self.fail = fail
        self.events: list[str] = []  # release and publish, in the order they came

    def release(self) -> None:
        self.events.append("release")

    def publish(self, reserve, copies, final=False, leaving=False, alone=False) -> dict[str, int]:
        self.events.append(("publish (final)" if final else "publish") + (", leaving" if leaving else "")
                           + (", alone" if alone else ""))
        if self.fail is not None:
            raise self.fail
        name = f"step_{self.iteration}/__0_0.distcp"
        with reserve(10) as space:
            (space.directory / "__0_0.distcp").write_bytes(b"x" * 10)
            space.adopt(name, space.directory / "__0_0.distcp", {"rank": 0},
                        digest=of_bytes(b"x" * 10))
        self.published.append(self.iteration)
        return {name: 0}

    def take(self, step, locate, fetch, staging, link, holder_of, drop, keep, claim) -> int:
        if self.fail is not None:
            raise self.fail
        self.taken.append(step)
        self.iteration = step
        return step

    def supervision(self, reside=None, state_files=None, warm_grads=None) -> Supervision:
        return Supervision(0, samples=8, save=self.save, load=self.load, progress=lambda: (self.iteration, None, None),
                           publish=self.publish, take=self.take, release=self.release, reside=reside,
                           state_files=state_files, warm_grads=warm_grads)


@pytest.fixture
def shelved(launched, tmp_path):
    launched.setenv("VARUNA_SHELF_DIR", str(tmp_path / "shm"))
    launched.setenv("VARUNA_JOB_ID", "job")
    launched.setenv("VARUNA_JOB_TOKEN", "t" * 64)
    launched.setenv("VARUNA_ATTEMPT", "2")
    yield launched
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_the_flags_say_what_was_asked_and_a_checkpoint_to_the_store_wins(shelved) -> None:
    from varuna_core.worker.supervision import HANDOVER_FLAG, STORE_FLAG

    sup = Publisher().supervision()
    assert sup.flag() == 0.0
    os.kill(os.getpid(), signal.SIGUSR2)
    assert sup.flag() == HANDOVER_FLAG
    sup.after_step(1.0, requested_anywhere=3 * HANDOVER_FLAG)  # three ranks asked for a handover
    assert sup.stop_agreed == "handover"
    sup.after_step(1.0, requested_anywhere=STORE_FLAG + 2 * HANDOVER_FLAG)
    assert sup.stop_agreed == "store"
    os.kill(os.getpid(), signal.SIGUSR1)
    assert sup.flag() == STORE_FLAG
    sup.after_step(1.0, requested_anywhere=True)  # a bool is a checkpoint request, as before
    assert sup.stop_agreed == "store"


def test_an_agreed_handover_publishes_on_the_shelf_at_the_next_step_and_exits_75(shelved, tmp_path) -> None:
    from varuna_core.launch.shelf import Shelf, shelf_key

    t = Publisher()
    sup = t.supervision()
    t.train(sup, 3)
    sup.after_step(1.0, requested_anywhere=2.0**-24)
    with pytest.raises(SystemExit) as stop:
        sup.before_step()
    assert stop.value.code == EXIT_CHECKPOINTED
    assert t.published == [3] and t.saved == []  # nothing written to the store
    assert t.events == ["release", "publish (final)"]  # the gradients freed first: the publish writes into that memory
    assert Shelf(shelf_key("job", 2), root=tmp_path / "shm").names() == ["step_3/__0_0.distcp"]


@pytest.mark.parametrize("marks, said", [((), ""), (("leaving",), ", leaving"), (("alone",), ", alone"),
                                         (("alone", "leaving"), ", leaving")])
def test_a_handovers_publish_says_whether_the_agent_marked_the_host_as_leaving_or_alone(shelved, tmp_path, marks,
                                                                                        said) -> None:
    from varuna_core.launch.shelf import Shelf, shelf_key

    t = Publisher()
    sup = t.supervision()
    t.train(sup, 2)
    shelf = Shelf(shelf_key("job", 2), root=tmp_path / "shm")
    for mark in marks:  # as the agent does before it passes the SIGUSR2 on
        getattr(shelf, f"mark_{mark}")()
    sup.after_step(1.0, requested_anywhere=2.0**-24)
    with pytest.raises(SystemExit):
        sup.before_step()
    # both marks: hosts sharing one tmpfs, one leaving and one the next configuration's: every writer hashes
    assert t.events == ["release", "publish (final)" + said]


def test_the_state_moves_onto_the_shelf_once_after_the_first_step_where_a_handover_may_come(shelved, launched,
                                                                                          tmp_path, caplog) -> None:
    """Once the optimizer has state (after the first step), the state moves into files of this attempt's shelf,
    once; a tmpfs too full for it leaves it where it was, said in a line; a job without a shelf never moves it."""
    from varuna_core.launch.shelf import Shelf, shelf_key

    keeps: list = []
    t = Publisher()
    t.train(t.supervision(reside=lambda keep: keeps.append(keep) or 10), 3)
    assert len(keeps) == 1 and keeps[0].parent == Shelf(shelf_key("job", 2), root=tmp_path / "shm").path

    def full(keep):
        raise OSError(28, "No space left on device")

    t = Publisher()
    with caplog.at_level("INFO"):
        t.train(t.supervision(reside=full), 3)
    assert "the training state stays in process memory" in caplog.text and "No space left" in caplog.text
    launched.delenv("VARUNA_SHELF_DIR")
    keeps.clear()
    t = Publisher()
    t.train(t.supervision(reside=lambda keep: keeps.append(keep) or 10), 3)
    assert keeps == []


def test_a_publish_that_does_not_fit_goes_to_the_store(shelved) -> None:
    from varuna_core.errors import ShelfFullError

    t = Publisher(fail=ShelfFullError("the shelf holds at most 10 bytes"))
    sup = t.supervision()
    t.train(sup, 2)
    sup.after_step(1.0, requested_anywhere=2.0**-24)
    with pytest.raises(SystemExit) as stop:
        sup.before_step()
    assert stop.value.code == EXIT_CHECKPOINTED and [step for step, _ in t.saved] == [2]
    assert t.events == ["release", "publish (final)"]  # the store's write needs no gradients either


def test_without_a_shelf_sigusr2_asks_for_nothing(launched) -> None:
    sup = Publisher().supervision()  # no VARUNA_SHELF_DIR: not a handover job
    assert sup.morph is None
    sup.handover_requested = True
    assert sup.flag() == 0.0


def _warm(shelved, t: Publisher, go) -> Supervision:
    shelved.setenv("VARUNA_HANDOVER", "wait")
    sup = t.supervision()
    assert sup.morph is not None
    sup.morph.wait_for_go = lambda timeout=None: go  # the store's part: see test_handover_go.py
    return sup


@pytest.mark.parametrize(("source", "step", "taken", "loaded", "iteration"), [
    ("shelf", 7, [7], [], 7), ("store", 5, [], [5], 5), ("none", None, [], [], 0),
])
def test_a_warm_worker_takes_its_state_from_where_the_go_says(shelved, source, step, taken, loaded,
                                                              iteration) -> None:
    from varuna_core.launch.protocol import Go, ShelfHolder

    holders = [ShelfHolder(host="h", address="127.0.0.1", port=1)] if source == "shelf" else []
    go = Go(attempt=2, source=source, step=step, shelf="job-a1" if source == "shelf" else None, holders=holders)
    t = Publisher()
    sup = _warm(shelved, t, go)
    sup.resume()
    sup.resume()  # once
    assert (t.taken, t.loaded, t.iteration) == (taken, loaded, iteration)


def test_a_warm_worker_writes_its_gradient_buffers_before_it_says_it_is_warm(shelved) -> None:
    """Off the critical path: before the launcher hears that the worker is warm (and so before the go and the
    take), once; a worker of the first configuration does not."""
    from varuna_core.launch.protocol import Go, ShelfHolder

    holders = [ShelfHolder(host="h", address="127.0.0.1", port=1)]
    t = Publisher()
    order: list[str] = []
    real_take = t.take
    t.take = lambda *args, **kwargs: order.append("take") or real_take(*args, **kwargs)
    shelved.setenv("VARUNA_HANDOVER", "wait")
    sup = t.supervision(warm_grads=lambda: order.append("grads") or 1 << 20)
    assert sup.morph is not None

    def go(timeout=None):
        order.append("go")
        return Go(attempt=2, source="shelf", step=7, shelf="job-a1", holders=holders)

    sup.morph.wait_for_go = go
    sup.resume()
    sup.resume()
    assert order == ["grads", "go", "take"]

    shelved.delenv("VARUNA_HANDOVER")
    first: list[str] = []
    Publisher().supervision(warm_grads=lambda: first.append("grads") or 0).resume()
    assert first == []


def test_a_failed_take_falls_back_to_the_stores_checkpoint_or_stops(shelved) -> None:
    from varuna_core.errors import HandoverError
    from varuna_core.launch.protocol import Go, ShelfHolder

    holders = [ShelfHolder(host="h", address="127.0.0.1", port=1)]
    t = Publisher(fail=HandoverError("shelf peer 127.0.0.1:1 did not answer within 60 s"))
    _warm(shelved, t, Go(attempt=2, source="shelf", step=9, shelf="s", holders=holders, fallback_step=4)).resume()
    assert t.loaded == [4] and t.iteration == 4
    t = Publisher(fail=HandoverError("shelf peer 127.0.0.1:1 did not answer within 60 s"))
    sup = _warm(shelved, t, Go(attempt=2, source="shelf", step=9, shelf="s", holders=holders))
    with pytest.raises(HandoverError, match="did not answer"):  # nothing to fall back on: the launcher restarts
        sup.resume()


@pytest.mark.parametrize("old_state_here", [False, True, "live"])
@pytest.mark.parametrize("fails", [False, True])
def test_a_warm_worker_touches_memory_for_what_its_take_will_receive(shelved, tmp_path, monkeypatch,
                                                                     old_state_here, fails) -> None:
    """[Note: receive into touched memory]: before it says it is warm, a worker on a host with no shelf of the
    attempt before writes a file per expected file of its state into the tmpfs, a worker on a host whose old
    workers' state lives in shelf files ("live") for what those files do not cover, and those files are gone once
    the take ended, taken or failed; a host whose old state is in process memory is left alone."""
    from varuna_core.errors import HandoverError
    from varuna_core.launch.protocol import Go, ShelfHolder
    from varuna_core.launch.shelf import Shelf, shelf_key
    from varuna_core.worker import morph as morph_mod

    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 1 << 40)
    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", 1 << 20)  # small chunks: the logic, not the volume
    if old_state_here:
        Shelf(shelf_key("job", 1), root=tmp_path / "shm").path.mkdir(parents=True)
    if old_state_here == "live":  # 3 MiB of old state in files: only the 2 MiB file is expected over the wire
        live = Shelf(shelf_key("job", 1), root=tmp_path / "shm").path / "123.live"
        live.mkdir()
        (live / "a.live").write_bytes(bytes(3 << 20))
    seen: list[list[str]] = []
    t = Publisher(fail=HandoverError("shelf peer 127.0.0.1:1 did not answer") if fails else None)
    real_take = t.take

    def take(*args, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / "shm").rglob("*.prefault")))
        return real_take(*args, **kwargs)

    t.take = take
    holders = [ShelfHolder(host="h", address="127.0.0.1", port=1)]
    shelved.setenv("VARUNA_HANDOVER", "wait")
    sup = t.supervision(state_files=lambda: [3 << 20, 2 << 20])
    assert sup.morph is not None
    sup.morph.wait_for_go = lambda timeout=None: Go(attempt=2, source="shelf", step=7, shelf="job-a1",
                                                    holders=holders, fallback_step=None)
    if fails:
        with pytest.raises(HandoverError):
            sup.resume()
    else:
        sup.resume()
    pid, slack = os.getpid(), morph_mod._POOL_SLACK
    expected = {False: [f"{pid}-0.prefault", f"{pid}-1.prefault"], True: [], "live": [f"{pid}-0.prefault"]}
    assert seen == [expected[old_state_here]]
    assert sup.morph.prefaulted == {False: (5 << 20) + 2 * slack, True: 0, "live": 2 << 20}[old_state_here]
    assert not list((tmp_path / "shm").rglob("*.prefault"))  # given back, whatever happened


def test_a_warm_worker_with_a_resume_step_is_a_contradiction(shelved) -> None:
    shelved.setenv("VARUNA_HANDOVER", "wait")
    shelved.setenv("VARUNA_RESUME_STEP", "3")
    with pytest.raises(ConfigError, match="VARUNA_HANDOVER=wait and VARUNA_RESUME_STEP"):
        Publisher().supervision()
