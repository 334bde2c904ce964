"""A script's own SIGUSR1 handler, as the original's README told users to write (``model.checkpoint(...)``, then
exit), runs on every rank at the same step boundary even when only one rank got the signal, and leaves a
complete checkpoint; run when the signal arrives, it started a collective checkpoint on one rank mid-step."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_module_ranks
from varuna_core.checkpoint.layout import scan

pytestmark = pytest.mark.dist


def test_a_scripts_own_handler_runs_on_every_rank_at_one_step(tmp_path) -> None:
    outcome, logs = run_module_ranks("tests.dist.usr1_worker", 2, tmp_path, timeout=120)
    assert not outcome.killed and outcome.returncodes == [0, 0], logs
    steps = [(tmp_path / f"handled{r}").read_text() for r in range(2)]
    assert steps == ["3", "3"], steps  # signalled after step 2; the flag rode on step 3's all-reduce
    assert not any((tmp_path / f"finished{r}").exists() for r in range(2))
    assert [(d.step, d.complete) for d in scan(tmp_path / "ckpt")] == [(3, True)]
