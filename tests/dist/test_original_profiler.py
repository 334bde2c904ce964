"""The original's ``Profiler`` as a distributed job: every rank calls it, the ranks share the segments and
measure the network between them, rank 0 writes ``profile.json``."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_module_ranks
from varuna_core.planning.artifacts import load_profile

pytestmark = pytest.mark.dist


def test_every_rank_profiles_its_share_and_rank_0_writes(tmp_path) -> None:
    outcome, logs = run_module_ranks("tests.dist.profiler_worker", 3, tmp_path, timeout=180)
    assert not outcome.killed and outcome.returncodes == [0, 0, 0], logs
    assert [(tmp_path / f"returned{r}").read_text() for r in range(3)] == ["profile", "none", "none"]
    profile = load_profile(tmp_path / "profiles" / "profile.json")
    assert profile.environment.nproc == 3 and [s.index for s in profile.segments] == [0, 1, 2, 3, 4]
    assert {(c.op, c.group_size) for c in profile.comm} == {("p2p", 2), ("allreduce", 2), ("allreduce", 3)}
