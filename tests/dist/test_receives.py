"""Bounded receive buffers in a real run: with 16 micro-batches per step, each rank's peak of posted and
unconsumed receives per direction (``runtime.max_posted``) equals the IR's count
(``varuna_core.ir.inflight.posted_receives``, what the planner's memory model charges), and its sent values not
yet waited for (``runtime.max_unwaited``) never exceed the receiving neighbour's window
(``varuna_core.ir.inflight.unwaited_sends``), for every schedule at pp=2 and pp=3; and the run still equals one
process bit for bit (losses and parameters, as in ``test_parity``)."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.test_parity import assert_equal_run, reference, shape_of

pytestmark = pytest.mark.dist

SCHEDULES = ("varuna", "1f1b", "gpipe")
BATCH, CHUNK, STEPS = 16, 1, 2  # 16 micro-batches of one example


@pytest.mark.parametrize("stage_map,world", [("0;1", 2), ("0;1;2", 3)])
def test_posted_receives_peak_at_the_ir_count(stage_map: str, world: int, tmp_path) -> None:
    runs = [{"schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": STEPS} for s in SCHEDULES]
    results = run_ranks({"map": stage_map, "timeout": 60, "runs": runs}, world, tmp_path, timeout=240.0,
                        worker="tests.dist.receives_worker")
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    ref_losses, ref_params, _ = reference("sgd", *shape_of(stage_map), batch_size=BATCH, steps=STEPS, chunk=CHUNK)
    for i, run in enumerate(runs):
        for rank, res in enumerate(results):
            got = res.result["runs"][i]
            label = f"pp={world} {run['schedule']} rank {rank} (stage {got['stage']})"
            want = got["want"].tolist()
            assert got["peaks"].tolist() == [want] * STEPS, f"{label}: peaks {got['peaks'].tolist()} vs IR {want}"
            caps = got["want_sends"].tolist()
            for peak in got["unwaited"].tolist() + [got["eval_unwaited"].tolist()]:
                assert all(0 <= p <= c for p, c in zip(peak, caps)), f"{label}: unwaited sends {peak} over {caps}"
            assert [c > 0 for c in caps] == [got["stage"] < world - 1, got["stage"] > 0], f"{label}: caps {caps}"
            assert max(got["unwaited"].tolist()[-1]) >= 1, f"{label}: no send was counted"
            if world == 3 and run["schedule"] != "gpipe":
                assert max(want) < BATCH, f"{label}: the window {want} is not below M"
                assert max(caps) < BATCH, f"{label}: the send cap {caps} is not below M"
            # an evaluation posts activation receives in the training window and no gradient receives
            assert got["eval_peak"].tolist() == [want[0], 0], f"{label}: evaluation peak {got['eval_peak']}"
            assert_equal_run(got, ref_losses, ref_params, label)
