"""The schedules that split the backward (``zb``, ``varuna-zb``) train as one plain process.

``B`` computes the input's gradient and the unsplit modules' whole backward; ``W`` the split modules' weight
gradients (:mod:`varuna_core.model.split`), later, where the stage would wait. Every test here holds the split
schedules to what the other schedules are held to (``tests/dist/test_parity.py``, ``test_features.py``): every
loss, parameter and buffer against ``tests/reference.py``, for pp ∈ {2, 3 uneven, 4} × dp ∈ {1, 2}, with a tied
weight, clipping, dropout, fp16 overflow, bf16, written buffers, values skipping over cuts, and a meta-built model.
Runs share a launch where they can (starting processes is most of the time).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import test_meta_parity as meta
from tests.dist.harness import run_ranks
from tests.dist.test_features import CLIP, MIXED_STEPS, clipped_reference, gpt_reference
from tests.dist.test_parity import TOL, assert_equal_buffers, assert_equal_run, reference, rel_diff, shape_of
from tests.models import BatchNormLM, UNetLM

pytestmark = pytest.mark.dist

SPLIT = ("zb", "varuna-zb")
BATCH, CHUNK, STEPS = 8, 3, 3

TOPOLOGIES = {  # name -> (stage_to_rank_map, world, partition of ToyLM's 5 segments); the other tests here add
    # ToyLM's runs at 2x1 ("0;1"), 2x2 ("0,2;1,3") and 3x1 uneven ("0;1;2") to their own launches
    "3x2-uneven": ("0,3;1,4;2,5", 6, [(0, 2), (2, 3), (3, 5)]),
    "4x1": ("0;1;2;3", 4, None),
}
UNEVEN3 = [(0, 1), (1, 4), (4, 5)]


def _ok(results) -> list[list[dict]]:
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    return [res.result["runs"] for res in results]


def toy_runs(partition: list[tuple[int, int]] | None) -> list[dict]:
    """ToyLM (tied embedding across the first and last stage, a root-level parameter, a buffer, LayerNorm) with
    AdamW, and with SGD + momentum and clipping by the global norm, under both split schedules."""
    runs = [{"schedule": s, "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": STEPS,
             "partition": partition} for s in SPLIT]
    return runs + [{"schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": STEPS,
                    "partition": partition, "clip": CLIP} for s in SPLIT]


def check_toy(per_rank: list[list[dict]], runs: list[dict], stage_map: str, first: int = 0) -> None:
    """:func:`toy_runs`' results (at ``first`` in each rank's runs) against one process: bit for bit, and as
    test_features holds clipping (the float64 squared norm is summed over the ranks in the collective's order)."""
    pp, dp = shape_of(stage_map)
    for i, run in enumerate(runs):
        label = f"{stage_map} {run['schedule']} {run['optimizer']}"
        if "clip" not in run:
            losses, state, _ = reference(run["optimizer"], pp, dp)
            for rank, got in enumerate(r[first + i] for r in per_rank):
                assert_equal_run(got, losses, state, f"{label} rank {rank}")
            continue
        losses, norms, state = clipped_reference(run["optimizer"], stage_map)
        assert float(norms.min()) > CLIP, "the test must exercise clipping"
        for rank, got in enumerate(r[first + i] for r in per_rank):
            assert rel_diff(got["norms"], norms) <= 1e-12, (label, rank, got["norms"], norms)
            assert rel_diff(got["losses"], losses) <= 1e-6, (label, rank)
            for pname, value in got["params"].items():
                assert rel_diff(value, state[pname]) <= 1e-6, (label, rank, pname)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_split_schedules_equal_one_process(name: str, tmp_path) -> None:
    stage_map, world, partition = TOPOLOGIES[name]
    runs = toy_runs(partition)
    check_toy(_ok(run_ranks({"map": stage_map, "timeout": 60, "runs": runs}, world, tmp_path)), runs, stage_map)


def test_dropout_masks_and_written_buffers_are_those_of_the_other_schedules(tmp_path) -> None:
    """With dropout, both split schedules equal 1F1B bit for bit at pp=2 (the masks are a function of (seed,
    step, micro-batch, segment), not of the schedule); BatchNorm statistics change once per micro-batch, in
    order, as in one process (varuna-zb's recompute must neither update them again nor see the first update)."""
    runs = [{"schedule": s, "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": STEPS, "dropout": 0.1}
            for s in ("1f1b", *SPLIT)]
    runs += [{"model": "BatchNormLM", "schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": 2}
             for s in SPLIT]
    toys = toy_runs(None)
    per_rank = _ok(run_ranks({"map": "0,2;1,3", "timeout": 60, "runs": runs + toys}, 4, tmp_path))
    check_toy(per_rank, toys, "0,2;1,3", first=len(runs))
    for rank_runs in per_rank:
        first = rank_runs[0]
        for other in rank_runs[1:3]:
            assert torch.equal(first["losses"], other["losses"])
            for pname, value in first["params"].items():
                assert torch.equal(value, other["params"][pname]), f"{pname} differs between schedules"
    losses, state, _ = reference("sgd", 2, 2, steps=2, model_cls=BatchNormLM)
    for rank, rank_runs in enumerate(per_rank):
        for got in rank_runs[3:5]:
            assert_equal_run(got, losses, state, f"BatchNormLM rank {rank}")


def test_values_skipping_over_cuts_an_overflow_and_a_meta_built_model(tmp_path) -> None:
    """The U-Net model (its up path adds the down path's features across the cuts), fp16 with an inf injected in
    one stage (every rank skips that step and halves the scale), and Hugging Face Llama (nn.Linear everywhere, cut
    automatically) built on ``meta`` with its stages materialised per rank; and ToyLM: 3 uneven stages."""
    runs = [{"model": "UNetLM", "schedule": s, "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 1), (1, 5), (5, 6)]} for s in SPLIT]
    runs += [{"schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": 3, "precision": "fp16",
              "init_loss_scale": 2**10, "inject_inf": {"rank": 1, "step": 1}, "partition": UNEVEN3}
             for s in SPLIT]
    runs += [{"model": "hf-llama", "schedule": s, "optimizer": "sgd", "batch": meta.BATCH, "chunk": meta.CHUNK,
              "steps": meta.STEPS, "meta": True, "varuna_seed": meta.SEED} for s in SPLIT]
    toys = toy_runs(UNEVEN3)
    per_rank = _ok(run_ranks({"map": "0;1;2", "timeout": 60, "runs": runs + toys}, 3, tmp_path))
    check_toy(per_rank, toys, "0;1;2", first=len(runs))
    unet_losses, unet_state, _ = reference("adamw", 3, 1, model_cls=UNetLM)
    llama_losses, llama_state = meta.reference("hf-llama")
    for rank, rank_runs in enumerate(per_rank):
        for got in rank_runs[0:2]:
            # as in test_parity: the stage reading the carried value holds `pos` as a tied copy, summed after the
            # pipeline where one process sums before reducing: the last bit may differ
            assert rel_diff(got["losses"], unet_losses) <= TOL, (rank, got["losses"])
            for pname, value in got["params"].items():
                assert rel_diff(value, unet_state[pname]) <= TOL, (rank, pname)
        for got in rank_runs[2:4]:
            assert got["overflows"].tolist() == [False, True, False], rank
            scales = got["scales"].tolist()  # before each step, then after the last
            assert scales[0] == scales[1] == 2.0**10 and scales[2] == scales[3] == 2.0**9
        for got in rank_runs[4:6]:  # as in test_meta_parity (its reference adds in another order)
            assert rel_diff(got["losses"], llama_losses) <= meta.TOL, (rank, got["losses"], llama_losses)
            for pname, value in got["params"].items():
                assert meta.param_diff(value, llama_state[pname]) <= meta.TOL, (rank, pname)
            assert got["held_bytes"] == got["stage_bytes"]


def test_bf16_equals_one_process_in_bf16(tmp_path) -> None:
    """The example GPT (nn.Linear everywhere, a tied head) under bf16 autocast: the split's W computes in the
    autocast dtype what the unsplit backward would, so every loss and parameter equals one plain bf16 process. And
    ToyLM in fp32 at 2x1."""
    runs = [{"model": "GPT", "n_layer": 2, "schedule": s, "optimizer": "adamw", "batch": 8, "chunk": 3,
             "steps": MIXED_STEPS, "precision": "bf16"} for s in SPLIT]
    toys = toy_runs(None)
    per_rank = _ok(run_ranks({"map": "0;1", "timeout": 120, "runs": runs + toys}, 2, tmp_path, timeout=300))
    check_toy(per_rank, toys, "0;1", first=len(runs))
    want_losses, want_params = gpt_reference("bf16", 2, 1, 2)
    for i, run in enumerate(runs):
        for rank, got in enumerate(r[i] for r in per_rank):
            label = f"bf16 {run['schedule']} rank {rank}"
            assert torch.equal(got["losses"], want_losses), (label, got["losses"], want_losses)
            for pname, value in got["params"].items():
                assert torch.equal(value, want_params[pname]), (label, pname, rel_diff(value, want_params[pname]))
            assert_equal_buffers(got, want_params, label)
