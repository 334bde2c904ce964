"""Supervision with stand-in callables: it decides when to load, save and stop without a model or a facade."""

from __future__ import annotations

import os
import signal

import pytest

from varuna_core.errors import EXIT_CHECKPOINTED, CheckpointError, ConfigError
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
            raise CheckpointError(f"step_{step}: sha256 mismatch")
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
    with pytest.raises(ResumeRefused, match="sha256 mismatch") as refused:
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
