"""Models that call one module at every depth (ALBERT's one layer group; ``ReusedBlockLM``'s block, as a Universal
Transformer does) with ``cutpoints="auto"``: cut in front of every call of the module but the first, its weights
one weight tied over the stages that call it. At 1, 2 and 3 stages every loss, parameter and buffer equals one
plain process bit for bit (``tests/reference.py``, which gives each stage its own copy of the module and sums the
copies after the pipeline in the order of gloo's ring all-reduce: three copies at 3 stages); a checkpoint saved at
2 stages holds the reused weights once and resumes at 1 stage."""

from __future__ import annotations

import pytest
import torch

from tests import hf_models
from tests.dist.harness import run_ranks
from tests.dist.test_parity import TIES, rel_diff
from tests.dist.worker import make_optimizer
from tests.models import ReusedBlockLM, batch
from tests.reference import Layout, train_reference

pytestmark = pytest.mark.dist

BATCH, CHUNK, STEPS, DEPTH = 8, 3, 3, 6


def calls(partition: list[tuple[int, int]]) -> tuple[int, ...]:
    """The stage of each call of the reused module: call ``k`` starts segment ``k``."""
    return tuple(next(s for s, (a, b) in enumerate(partition) if a <= k < b) for k in range(DEPTH))


def reference(model_name: str, layouts: list[Layout]):
    """(losses, parameters, buffers, each parameter name's first name) of one plain process adding as the pipeline
    does at each step."""
    torch.manual_seed(0)
    if model_name == "ReusedBlockLM":
        model = ReusedBlockLM(n_layer=DEPTH)
        ties, reused, batch_at = TIES, ReusedBlockLM.REUSED, lambda step: batch(BATCH, seed=100 + step)
    else:
        model = hf_models.build("albert", n_layer=DEPTH)
        ties, reused = hf_models.ALBERT_TIES, hf_models.ALBERT_REUSED
        batch_at = lambda step: hf_models.batch("albert", BATCH, 100 + step)  # noqa: E731
    first: dict[int, str] = {}
    owner = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    losses, params = train_reference(model, lambda ps: make_optimizer("sgd", ps), len(layouts), batch_at, layouts,
                                     ties=ties, reused=reused)
    return losses, params, dict(model.named_buffers()), owner


def run(model: str, schedule: str, partition: list[tuple[int, int]], **extra) -> dict:
    name = "hf-albert" if model == "albert" else model
    return {"model": name, "n_layer": DEPTH, "schedule": schedule, "optimizer": "sgd", "batch": BATCH,
            "chunk": CHUNK, "steps": STEPS, "partition": partition, "validate": True, **extra}


def assert_equal(results, index: int, model: str, layouts: list[Layout], *, first: int = 0) -> None:
    """Run ``index`` of every rank equals the reference from step ``first`` on, bit for bit, and the ranks together
    hold every parameter."""
    losses, params, buffers, owner = reference(model, layouts)
    seen: set[str] = set()
    for res in results:
        got = res.result["runs"][index]
        label = f"{model} at {len(results)} ranks, stage {got['stage']}"
        assert torch.equal(got["losses"], losses[first:]), (label, got["losses"], losses[first:])
        for pname, value in got["params"].items():
            assert torch.equal(value, params[pname]), (label, pname, rel_diff(value, params[pname]))
        for bname, value in got["buffers"].items():
            assert torch.equal(value, buffers[bname]), (label, bname)
        seen.update(got["params"])
    assert {owner[n] for n in seen} == set(owner.values()), (model, "some parameters are held by no rank")


def test_a_module_called_at_every_depth_pipelines_as_one_process(tmp_path) -> None:
    store = tmp_path / "ckpt"
    two = {"ReusedBlockLM": [(0, 3), (3, 6)], "albert": [(0, 3), (3, 6)]}
    three = {"ReusedBlockLM": [(0, 1), (1, 4), (4, 6)], "albert": [(0, 2), (2, 4), (4, 6)]}
    one = [(0, 6)]

    at_two = run_ranks({"map": "0;1", "timeout": 60, "runs": [
        run("ReusedBlockLM", "varuna", two["ReusedBlockLM"], save={"dir": str(store), "at": STEPS}),
        run("albert", "1f1b", two["albert"])]}, 2, tmp_path / "two", timeout=240)
    for res in at_two:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, model in enumerate(("ReusedBlockLM", "albert")):
        assert_equal(at_two, index, model, [Layout(BATCH, CHUNK, 1, 2, calls(two[model]))] * STEPS)
    _held_once(store / f"step_{STEPS}", at_two, tmp_path)

    at_one = run_ranks({"map": "0", "timeout": 60, "runs": [
        run("ReusedBlockLM", "gpipe", one), run("albert", "varuna", one),
        run("ReusedBlockLM", "1f1b", one, steps=STEPS + 2, load=str(store))]}, 1, tmp_path / "one", timeout=240)
    for res in at_one:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, model in enumerate(("ReusedBlockLM", "albert")):
        assert_equal(at_one, index, model, [Layout(BATCH, CHUNK, 1, 1, calls(one))] * STEPS)
    resumed = [Layout(BATCH, CHUNK, 1, 2, calls(two["ReusedBlockLM"]))] * STEPS + [Layout(BATCH, CHUNK)] * 2
    assert_equal(at_one, 2, "ReusedBlockLM", resumed, first=STEPS)

    at_three = run_ranks({"map": "0;1;2", "timeout": 60, "runs": [
        run("ReusedBlockLM", "1f1b", three["ReusedBlockLM"]), run("albert", "varuna", three["albert"])]},
        3, tmp_path / "three", timeout=240)
    for res in at_three:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, model in enumerate(("ReusedBlockLM", "albert")):
        assert_equal(at_three, index, model, [Layout(BATCH, CHUNK, 1, 3, calls(three[model]))] * STEPS)


def _held_once(directory, results, tmp_path) -> None:
    """The checkpoint holds each parameter of the model once (the reused block's weights, held by both stages,
    included), with the values the stages trained; the merged state dict loads into a plain model."""
    from safetensors.torch import load_file

    from varuna_core.checkpoint.tools import inspect, merge, verify

    assert verify(directory).ok
    plain = ReusedBlockLM(n_layer=DEPTH)
    keys = [t.key for t in inspect(directory).tensors if t.kind == "model"]
    assert sorted(keys) == sorted(f"model/{n}" for n, _ in plain.named_parameters()), keys  # tied head: once
    merge(directory, tmp_path / "model.safetensors")
    plain.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    for res in results:
        for name, value in res.result["runs"][0]["params"].items():
            assert torch.equal(plain.get_parameter(name).detach(), value), name
