"""A lost replica stops nobody: pp=2 x dp=2, a worker dies in the middle of the run; the complete replica that is
left goes on in its own processes as ranks 0 and 1 of a pp=2 x dp=1 group (the worker whose replica lost a stage
leaves), redoes the step and takes over the lost replica's examples: every loss and the final parameters equal one
plain process that ran the same layouts (worker.regroup). The launcher's decision is put in the job's store by
rank 0 before the loss (the launcher's side is not part of this test)."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.test_checkpoint import BATCH, CHUNK, steps_as, uninterrupted
from tests.dist.test_parity import assert_equal_run
from varuna_core.worker.regroup import EXIT_LEFT

pytestmark = pytest.mark.dist

STEP, STEPS = 3, 6
ENV = {"VARUNA_JOB_ID": "regroup-test", "VARUNA_JOB_TOKEN": "regroup-token", "VARUNA_ATTEMPT": "1",
       "VARUNA_REGROUP": "1"}


@pytest.mark.parametrize(("lose", "ranks", "leaves", "kept"), [
    (1, [None, None, 0, 1], 0, {2: 0, 3: 1}),  # replica 0 loses stage 1: replica 1's workers become ranks 0, 1
    (3, [0, 1, None, None], 2, {0: 0, 1: 1}),  # replica 1 loses stage 1: its stage-0 worker leaves
])
def test_the_survivors_of_a_lost_replica_go_on_in_their_processes_exactly(tmp_path, lose, ranks, leaves, kept) -> None:
    run = {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": STEPS,
           "regroup": {"step": STEP, "lose": lose, "ranks": ranks, "map": "0;1"}}
    results = run_ranks({"map": "0,2;1,3", "timeout": 30, "runs": [run]}, 4, tmp_path, env=ENV, timeout=120)
    assert results[lose].returncode == -9, results[lose].error
    assert results[leaves].returncode == EXIT_LEFT, results[leaves].error
    losses, params = uninterrupted(steps_as("0,2;1,3", STEP, "0;1", STEPS - STEP))
    for old, new in kept.items():
        res = results[old]
        assert res.returncode == 0, res.error
        got = res.result["runs"][0]
        assert (got["stage"], got["replica"]) == (new, 0)
        assert_equal_run(got, losses, params, f"old rank {old}")
    log = (tmp_path / f"rank{min(kept)}.log").read_text()
    assert f"a peer was lost in step {STEP}" in log, log[-3000:]
    assert f"rank {min(kept)} is rank 0 of 2 (stage 0, replica 0 of 1) from step {STEP} on" in log, log[-3000:]
