"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest


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
