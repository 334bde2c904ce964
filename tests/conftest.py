"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest


def _no_skips(report) -> None:
    """With ``VARUNA_NO_SKIPS=1`` (CI: ``.ci/run``) a skip fails: a test skipped because a tool (Slurm, sshd,
    transformers, a tmpfs) could not be had would otherwise let the run pass having proved nothing."""
    if report.skipped and os.environ.get("VARUNA_NO_SKIPS") == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and VARUNA_NO_SKIPS=1 forbids skips: {reason}"


# The files that take longest (seconds measured on 2 cores: `make test PYTEST_ARGS=--durations=0`), longest first.
# `make test` hands whole files to its workers in collection order (`--dist loadfile --no-loadscope-reorder`);
# starting with these, the workers end together instead of one of them finishing a two-minute file alone.
LONGEST_FIRST = (
    "tests/launch/test_launch_ssh.py",  # 171
    "tests/launch/test_chaos_ssh.py",  # 163
    "tests/launch/test_handover_ssh.py",  # 125
    "tests/launch/test_slurm.py",  # 105
    "tests/launch/test_hf_examples.py",  # 78
    "tests/launch/test_launch_local.py",  # 76
    "tests/dist/test_parity.py",  # 70
    "tests/dist/test_hf_parity.py",  # 67
    "tests/launch/test_original_launcher.py",  # 58
    "tests/launch/test_regroup_ssh.py",  # 58
    "tests/launch/test_launch_faults.py",  # 50
    "tests/dist/test_features.py",  # 50
    "tests/dist/test_zero_bubble.py",  # 34
    "tests/dist/test_overlap.py",  # ~40 (measured 63 on a loaded machine)
    "tests/dist/test_meta_parity.py",  # 47
    "tests/launch/test_snapshot_ssh.py",  # 44
    "tests/launch/test_plan_regret.py",  # 44
    "tests/launch/test_ckpt_local_ssh.py",  # 38
)


def pytest_collection_modifyitems(items) -> None:
    """Put the files of :data:`LONGEST_FIRST` first, in its order; the rest keep theirs (a stable sort: the tests of
    a file stay in file order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _no_skips((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    _no_skips((yield).get_result())  # a module skipped whole (importorskip at its top)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes) -> Path``: a directory on a tmpfs of that size (a real full disk: writes fail with
    ENOSPC). Needs root to mount; skipped otherwise. Unmounted after the test."""
    mounts: list[Path] = []

    def make(size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(autouse=True, scope="session")
def _outside_any_scheduler():
    """The suite may itself run inside a Slurm job: `varuna launch` would then take the allocation's nodes. Its
    launches stay local unless a test builds its own cluster (tests/launch/test_slurm.py)."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SLURM_")}
    yield
    os.environ.update(saved)
