"""A worker's exit: no thread of a process group may outlive ``atexit`` into the interpreter's teardown (where it
can kill a finished worker with SIGABRT), even when the script keeps its ``Varuna`` and its optimizer in module
globals. Real processes: the forked workers of the harness leave with ``os._exit`` and never reach the
teardown."""

from __future__ import annotations

import json
import sys

import pytest

from tests.dist.harness import ROOT
from varuna_core.util.procs import run_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def test_no_process_group_thread_outlives_atexit(tmp_path) -> None:
    outcome = run_workers([sys.executable, "-m", "tests.dist.exit_worker", str(tmp_path)], 2, log_dir=tmp_path,
                          timeout=90, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "VARUNA_CKPT_DIR": str(tmp_path / "ck")})
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(2))
    assert outcome.returncodes == [0, 0], logs
    for rank in range(2):
        start = json.loads((tmp_path / f"start{rank}.json").read_text())
        left = json.loads((tmp_path / f"exit{rank}.json").read_text())
        assert len(start) > 1, start  # the default group's threads, which must be gone at the end
        assert len(left) == 1, (start, left)  # the main thread alone
