"""Checkpoints reshard: save at one pipeline depth and width, resume at another, and the run continues as if
uninterrupted."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_parity import TIES, assert_equal_buffers, assert_equal_run, rel_diff, shape_of
from tests.dist.worker import make_optimizer
from tests.models import ToyLM, UNetLM, batch
from tests.reference import Layout, train_reference

pytestmark = pytest.mark.dist

BATCH, CHUNK = 8, 2


def uninterrupted(layouts: list[Layout], model_cls=ToyLM, optimizer: str = "adamw"):
    """The run as one plain process that adds as the pipeline did at each step (``layouts``: one per step, the
    layout of the run that made that step), so a resumed run equals it bit for bit (``tests/reference.py``)."""
    torch.manual_seed(0)
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_reference(model_cls(), lambda ps: make_optimizer(optimizer, ps), len(layouts),
                                     lambda step: batch(BATCH, seed=100 + step), layouts, ties=TIES, buffers=buffers)
    return losses, {**params, **buffers}


def steps_as(map_a: str, steps_a: int, map_b: str, steps_b: int) -> list[Layout]:
    """The layouts of ``steps_a`` steps under ``map_a``, then ``steps_b`` under ``map_b``."""
    return ([Layout(BATCH, CHUNK, *reversed(shape_of(map_a)))] * steps_a
            + [Layout(BATCH, CHUNK, *reversed(shape_of(map_b)))] * steps_b)


def assert_resumed(results, losses: torch.Tensor, params: dict, *, first: int, tol: float = 0.0) -> None:
    """Every rank of a resumed run succeeded; its losses equal the uninterrupted run's from step ``first`` on,
    and its final parameters equal that run's (bit for bit unless ``tol`` says how close, and the caller why)."""
    for res in results:
        assert res.returncode == 0, res.error
        got = res.result["runs"][0]
        if tol == 0.0:
            assert_equal_run(got, losses[first:], params, f"stage {got['stage']} replica {got['replica']}")
            continue
        assert rel_diff(got["losses"], losses[first:]) <= tol, (got["losses"], losses[first:])
        for name, value in got["params"].items():
            assert rel_diff(value, params[name]) <= tol, name
        assert_equal_buffers(got, params, f"stage {got['stage']} replica {got['replica']}", tol)


@pytest.mark.parametrize(("resume_map", "world", "background"), [("0;1;2;3", 4, False), ("0,1", 2, True)])
def test_resume_under_another_layout_equals_uninterrupted(resume_map, world, background, tmp_path) -> None:
    store = tmp_path / "ckpt"
    save = {"dir": str(store), "at": 4, "background": background}
    if background:
        save["tempdir"] = str(tmp_path / "local")
    first = {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": 4, "save": save}
    for res in run_ranks({"map": "0,2;1,3", "timeout": 60, "runs": [first]}, 4, tmp_path / "a"):
        assert res.returncode == 0, res.error
    assert (store / "step_4" / "COMPLETE").is_file()
    _merged_model_matches(store, tmp_path)
    second = {"schedule": "varuna", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": 8,
              "load": str(store)}
    results = run_ranks({"map": resume_map, "timeout": 60, "runs": [second]}, world, tmp_path / "b")
    assert_resumed(results, *uninterrupted(steps_as("0,2;1,3", 4, resume_map, 4)), first=4)


def test_a_weight_held_by_two_stages_resumes_under_one(tmp_path) -> None:
    """UNetLM at 3 stages holds its root-level ``pos`` on the first and the last (read again where the carried
    embedding is used): saved once, resumed by 2 replicas of one stage, equal to an uninterrupted run (to the
    parity tests' 1e-5: the two copies of ``pos`` add their gradients in an order one process cannot mirror,
    see ``test_values_skipping_over_cuts_are_carried``)."""
    store = tmp_path / "ckpt"
    first = {"model": "UNetLM", "schedule": "1f1b", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": 3, "partition": [(0, 1), (1, 5), (5, 6)], "save": {"dir": str(store), "at": 3}}
    for res in run_ranks({"map": "0;1;2", "timeout": 60, "runs": [first]}, 3, tmp_path / "a"):
        assert res.returncode == 0, res.error
    second = {"model": "UNetLM", "schedule": "1f1b", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
              "steps": 5, "load": str(store)}
    results = run_ranks({"map": "0,1", "timeout": 60, "runs": [second]}, 2, tmp_path / "b")
    assert_resumed(results, *uninterrupted(steps_as("0;1;2", 3, "0,1", 2), UNetLM, "sgd"), first=3, tol=1e-5)


def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    store = tmp_path / "ckpt"
    run = {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": 4,
           "save": {"dir": str(store), "at": 2, "every": [2, 4]}, "die_in_save": {"rank": 1, "at": 4}}
    results = run_ranks({"map": "0;1", "timeout": 20, "runs": [run]}, 2, tmp_path / "a")
    assert results[1].returncode == -9 and results[0].returncode == 1
    assert results[0].error.startswith("CheckpointError: writing checkpoint"), results[0].error
    assert (store / "step_2" / "COMPLETE").is_file()
    assert not (store / "step_4").exists()  # the surviving rank 0 removed what the failed save wrote
    # a directory a killed save left behind (here: made by hand) is reported and refused as incomplete
    import shutil

    from varuna_core.checkpoint.tools import verify

    shutil.copytree(store / "step_2", store / "step_4")
    (store / "step_4" / "COMPLETE").unlink()
    report = verify(store / "step_4")
    assert not report.ok and "COMPLETE" in report.first_problem
    # resuming picks the last complete checkpoint and continues like an uninterrupted run
    resume = {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, "steps": 4,
              "load": str(store)}
    losses, _ = uninterrupted(steps_as("0;1", 2, "0;1", 2))
    for res in run_ranks({"map": "0;1", "timeout": 20, "runs": [resume]}, 2, tmp_path / "b"):
        assert res.returncode == 0, res.error
        assert torch.equal(res.result["runs"][0]["losses"], losses[2:])
    # the incomplete one is refused, and so is a corrupt one, by name
    for res in run_ranks({"map": "0;1", "timeout": 20, "runs": [dict(resume, load_step=4)]}, 2, tmp_path / "i"):
        assert res.returncode == 1 and "step_4 is incomplete" in res.error, res.error
    data = sorted((store / "step_2").glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    for res in run_ranks({"map": "0;1", "timeout": 20, "runs": [resume]}, 2, tmp_path / "c"):
        assert res.returncode == 1 and res.error.startswith("CheckpointError"), res.error
        assert "digest mismatch" in res.error and data.name in res.error


def _merged_model_matches(store, tmp_path) -> None:
    """`ckpt merge` gives one state dict that a fresh unpartitioned model loads strictly, with the same loss."""
    from safetensors.torch import load_file

    from varuna_core.checkpoint.tools import merge, verify

    assert verify(store / "step_4").ok
    merge(store / "step_4", tmp_path / "model.safetensors")
    model = ToyLM()
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    _, params = uninterrupted(steps_as("0,2;1,3", 4, "0,2;1,3", 0))
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p.detach(), params[name]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, params[name]), name
    with torch.no_grad():
        reference = ToyLM()
        reference.load_state_dict({k: v for k, v in params.items()}, strict=False)
        data = batch(BATCH, seed=999)
        assert model(**data).item() == reference(**data).item()
