"""The gradient sync overlapped with the last backward (:mod:`varuna_core.pipeline.overlap`) gives the gradients of
the sync after the pipeline (``VARUNA_OVERLAP_SYNC=0``) bit for bit: every step's gradients, the losses, the final
parameters and buffers, under every schedule at pp=2 x dp=2 (a tied weight across the stages) and pp=1 x dp=3 (where
gloo's ring sums three replicas, so the bucket boundaries decide the order of summation: [Note: bucket
boundaries]); with a sharded optimizer; over an fp16 overflow; and with parameters that get no gradient in a
step, or from the last micro-batch, or ever (a bucket holding them still completes). Small buckets, so that a
stage has many and posts most of them during its last backward."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.models import SEQ, batch
from varuna_core.ir.schedule import SCHEDULE_NAMES

pytestmark = pytest.mark.dist

BATCH, CHUNK, STEPS = 12, 2, 2
BUCKET_MB = 1024 / 2**20  # 256 floats: UnusedLM's stages hold 2-4 thousand parameters

TOPOLOGIES = {"2x2": ("0,2;1,3", 4, 2), "1x3": ("0,1,2", 3, 3)}  # name -> (map, world, dp)


def _runs(name: str) -> list[dict]:
    base = {"model": "UnusedLM", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": STEPS,
            "bucket_mb": BUCKET_MB, "grads": True}
    runs = [{**base, "schedule": s} for s in SCHEDULE_NAMES]
    if name == "2x2":
        runs.append({**base, "schedule": "zb", "shard": True})
        runs.append({**base, "schedule": "varuna", "precision": "fp16", "init_loss_scale": 2**10,
                     "inject_inf": {"rank": 1, "step": 1}})
    return [r for run in runs for r in ({**run, "overlap": True}, {**run, "overlap": False})]


def _ok(results) -> list[list[dict]]:
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    return [res.result["runs"] for res in results]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], label: str) -> None:
    assert a.keys() == b.keys(), label
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), (label, key)


def _gains_skipped(dp: int) -> tuple[bool, bool]:
    """Whether, in the test's steps, some replica's last micro-batch leaves the gains without a gradient while an
    earlier one of it gives them one, and whether some replica gives them none in a step (UnusedLM uses them in
    micro-batches whose first token is a multiple of 4)."""
    last_only = whole = False
    for step in range(STEPS):
        idx = batch(BATCH, seed=100 + step)["idx"]
        assert idx.shape[1] == SEQ
        share = BATCH // dp
        for r in range(dp):
            used = [int(idx[start, 0]) % 4 == 0 for start in range(r * share, (r + 1) * share, CHUNK)]
            last_only |= any(used[:-1]) and not used[-1]
            whole |= not any(used)
    return last_only, whole


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_the_overlapped_sync_gives_the_same_gradients_bit_for_bit(name, tmp_path) -> None:
    stage_map, world, dp = TOPOLOGIES[name]
    last_only, whole = _gains_skipped(dp)
    assert last_only, "the test must leave a used parameter without a gradient from a last micro-batch"
    assert whole, "the test must leave a used parameter without a gradient in a whole step"
    runs = _runs(name)
    per_rank = _ok(run_ranks({"map": stage_map, "timeout": 30, "runs": runs}, world, tmp_path, timeout=120))
    for rank, got in enumerate(per_rank):
        for i in range(0, len(runs), 2):
            on, off = got[i], got[i + 1]
            run = runs[i]
            label = f"{name} rank {rank} {run['schedule']}{' shard' if run.get('shard') else ''} " \
                    f"{run.get('precision', 'fp32')}"
            assert torch.equal(on["losses"], off["losses"]), label
            assert torch.equal(on["overflows"], off["overflows"]) and torch.equal(on["norms"], off["norms"]), label
            for step, (a, b) in enumerate(zip(on["grads"], off["grads"], strict=True)):
                _same(a, b, f"{label} step {step} gradients")
            _same(on["params"], off["params"], f"{label} parameters")
            _same(on["buffers"], off["buffers"], f"{label} buffers")
            assert off["posted_early"] == [0] * STEPS, label
            # collectives went out during the last backward: buckets (a sharded optimizer's reduce-scatter runs
            # after the pipeline, but its stages' tied weight's sum still overlaps)
            if not run.get("shard") or name == "2x2":
                assert min(on["posted_early"]) > 0, (label, on["posted_early"])
            if "inject_inf" in run:
                assert on["overflows"].tolist() == [False, True], label
        grads = got[0]["grads"]
        spare = [n for n in grads[0] if n.endswith(".spare")]
        assert spare and all(not g[n].any() for g in grads for n in spare), "spare parameters got a gradient"
