"""The GPU suite (``make test-gpu``; ``make test`` does not collect this folder). Without CUDA every test FAILS with
one line: a GPU suite that skipped everything would pass having proved nothing. Each test runs on one thread, with
its own structure cache under tmp and a free port for anything that would open a process group.

``VARUNA_GPU_TESTS_ON_CPU=1`` (a developer aid, see ``common.py``) runs the suite on the CPU instead."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.gpu.common import NO_CUDA, ON_CPU
from varuna_core.env import CACHE_DIR, TORCHRUN
from varuna_core.util.procs import free_port


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item) -> None:
    if not ON_CPU and not torch.cuda.is_available():
        pytest.fail(NO_CUDA, pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference's thread count: a CPU kernel may split a reduction by it
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A single process (no torchrun variables inherited), a free port, a structure cache of the test's own; CUDA
    memory released after the test."""
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv(CACHE_DIR, str(tmp_path / "cache"))
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
