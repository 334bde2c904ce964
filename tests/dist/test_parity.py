"""The backbone: a pipelined run equals the same model trained in one process without the library.

For each topology the workers train ``ToyLM`` (tied embedding, root-level parameter, buffer, LayerNorm,
``[s, b, h]`` cuts) for 3 steps with every schedule and with SGD+momentum and AdamW; the loss of every step
and every final parameter and buffer must equal a plain single-process run **bit for bit**: the reference
(``tests/reference.py``) adds micro-batches, tied copies and replicas in the order the pipeline does, so nothing
is left to a tolerance (one exception, explained where it is made). The global batch of 8 in micro-batches of 3 makes the last micro-batch smaller (3, 3, 2;
or 3, 1 per replica).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.worker import make_optimizer
from tests.models import (
    BatchNormLM,
    CountingLM,
    ResNetLM,
    SequentialLM,
    SkipAcrossCut,
    StateAcrossCut,
    ToyLM,
    UNetLM,
    batch,
)
from tests.reference import Layout, train_reference

pytestmark = pytest.mark.dist

SCHEDULES = ("varuna", "1f1b", "gpipe")
OPTIMIZERS = ("sgd", "adamw")
BATCH, CHUNK, STEPS = 8, 3, 3
TOL = 1e-5  # only where the pipeline adds in an order the reference cannot mirror; each use says why

TOPOLOGIES = {
    "1x1": ("0", 1, None),
    "2x1": ("0;1", 2, None),
    "1x2": ("0,1", 2, None),
    "2x2": ("0,2;1,3", 4, None),
    "4x1": ("0;1;2;3", 4, None),  # 5 segments over 4 stages
    "3x1-uneven": ("0;1;2", 3, [(0, 1), (1, 4), (4, 5)]),  # 1 + 3 + 1 segments
}


TIES = (("emb.weight", "head.weight"),)  # the tied embedding of every model here


@functools.cache
def reference(optimizer: str, pp: int = 1, dp: int = 1, batch_size: int = BATCH, steps: int = STEPS,
              model_cls=ToyLM, chunk: int = CHUNK) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, str]]:
    """Losses, final state (every parameter slot name, tied ones included, and every buffer) and each parameter
    slot's first name, from a plain one-process run that sums as a ``pp`` × ``dp`` pipeline does
    (``tests/reference.py``)."""
    torch.manual_seed(0)
    model = model_cls()
    first_name = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), n)
    owner = {n: first_name[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_reference(model, lambda ps: make_optimizer(optimizer, ps), steps,
                                     lambda step: batch(batch_size, seed=100 + step),
                                     Layout(batch_size, chunk, dp, pp), ties=TIES, buffers=buffers)
    return losses, {**params, **buffers}, owner


def shape_of(stage_map: str) -> tuple[int, int]:
    """``(pp, dp)`` of a stage_to_rank_map such as ``"0,2;1,3"``."""
    stages = stage_map.split(";")
    return len(stages), len(stages[0].split(","))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def assert_equal_run(got: dict, losses: torch.Tensor, state: dict[str, torch.Tensor], label: str) -> None:
    """Every loss, parameter and buffer a rank reports equals the reference's (``state``: parameters and buffers
    by name), bit for bit."""
    assert torch.equal(got["losses"], losses), f"{label}: losses {got['losses']} vs {losses}"
    for pname, value in got["params"].items():
        assert torch.equal(value, state[pname]), \
            f"{label}: parameter {pname} differs by {rel_diff(value, state[pname]):.2e} (relative)"
    assert_equal_buffers(got, state, label)


def assert_equal_buffers(got: dict, state: dict[str, torch.Tensor], label: str, tol: float | None = None) -> None:
    """Every buffer a rank holds equals the reference's (``tol``: relative difference, where the test says why)."""
    for bname, value in got.get("buffers", {}).items():
        want = state[bname]
        same = torch.equal(value, want) if tol is None or not value.is_floating_point() else \
            rel_diff(value, want) <= tol
        assert same, f"{label}: buffer {bname} is {value} where one process has {want}"


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_pipeline_equals_single_process(name: str, tmp_path) -> None:
    stage_map, world, partition = TOPOLOGIES[name]
    runs = [
        {"schedule": s, "optimizer": o, "batch": BATCH, "chunk": CHUNK, "steps": STEPS, "partition": partition}
        for s in SCHEDULES for o in OPTIMIZERS
    ]
    results = run_ranks({"map": stage_map, "timeout": 60, "runs": runs}, world, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    for i, run in enumerate(runs):
        ref_losses, ref_params, owner = reference(run["optimizer"], *shape_of(stage_map))
        seen: set[str] = set()
        for rank, res in enumerate(results):
            got = res.result["runs"][i]
            assert_equal_run(got, ref_losses, ref_params, f"{name} {run['schedule']} {run['optimizer']} rank {rank}")
            seen.update(got["params"])
        assert {owner[n] for n in seen} == set(owner.values()), f"{name}: some parameters are held by no rank"


def test_cutpoints_in_a_plain_list_pipeline_as_registered_ones(tmp_path) -> None:
    """The original's README pattern (CutPoints in a plain list, not registered) trains like ToyLM, uneven."""
    runs = [{"model": "ListCutLM", "schedule": "varuna", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 1), (1, 4), (4, 5)]}]
    results = run_ranks({"map": "0;1;2", "timeout": 60, "runs": runs}, 3, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    ref_losses, ref_params, _ = reference("sgd", pp=3)
    for rank, res in enumerate(results):
        assert_equal_run(res.result["runs"][0], ref_losses, ref_params, f"rank {rank}")


def test_blocks_in_a_sequential_cut_automatically_pipeline_as_registered_cuts(tmp_path) -> None:
    """nn.Sequential blocks and cutpoints="auto": three uneven stages over its 4 segments equal one process."""
    runs = [{"model": "SequentialLM", "schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 1), (1, 3), (3, 4)]} for s in ("varuna", "1f1b")]
    results = run_ranks({"map": "0;1;2", "timeout": 60, "runs": runs}, 3, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    ref_losses, ref_params, _ = reference("sgd", pp=3, model_cls=SequentialLM)
    for rank, res in enumerate(results):
        for got in res.result["runs"]:
            assert_equal_run(got, ref_losses, ref_params, f"rank {rank}")


def test_state_kept_on_modules_trains_as_one_process(tmp_path) -> None:
    """Blocks counting their forwards in ``self.calls`` (their output scales with the count) under the varuna
    schedule, whose first stage recomputes, with start-up validation: neither the dry runs, the validation nor
    a recompute counts. And a value one block keeps for another on the same stage. Both equal one process."""
    runs = [{"model": "CountingLM", "schedule": "varuna", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 3), (3, 5)], "validate": True},
            {"model": "StateAcrossCut", "schedule": "varuna", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 1), (1, 5)]}]
    results = run_ranks({"map": "0;1", "timeout": 60, "runs": runs}, 2, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    for index, cls in enumerate((CountingLM, StateAcrossCut)):
        ref_losses, ref_params, _ = reference("sgd", pp=2, model_cls=cls)
        for rank, res in enumerate(results):
            assert_equal_run(res.result["runs"][index], ref_losses, ref_params, f"{cls.__name__} rank {rank}")


def test_rank_holds_only_its_stage(tmp_path) -> None:
    """Each of 4 stages holds its own parameters (plus the tied embedding where used), not the model."""
    runs = [{"schedule": "1f1b", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": 1}]
    results = run_ranks({"map": "0;1;2;3", "timeout": 60, "runs": runs}, 4, tmp_path)
    assert all(r.returncode == 0 for r in results), [r.error for r in results]
    per_rank = [r.result["runs"][0] for r in results]
    full = per_rank[0]["full_bytes"]
    for got in per_rank:
        assert got["held_bytes"] == got["stage_bytes"], got
        assert got["held_bytes"] < 0.6 * full, (got["held_bytes"], full)
    tied = ToyLM().emb.weight
    tied_bytes = tied.numel() * tied.element_size()
    # every parameter is held exactly once, except the tied embedding held by the first and last stages
    assert sum(g["held_bytes"] for g in per_rank) == full + tied_bytes


@pytest.mark.parametrize(("stage_map", "world", "partition"), [
    ("0;1;2", 3, [(0, 1), (1, 5), (5, 6)]),  # the middle stage only passes the down path's features on
    ("0,2;1,3", 4, [(0, 3), (3, 6)]),
])
def test_values_skipping_over_cuts_are_carried(stage_map, world, partition, tmp_path) -> None:
    """A U-Net-like model (its up path adds the down path's features across the cuts) and a model whose
    embedding skips into the head: pipelined, every loss and parameter equal one process."""
    runs = [{"model": "UNetLM", "schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": partition},
            {"model": "SkipAcrossCut", "schedule": "varuna", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "partition": [(0, 1), (1, 5)] if world == 4 else [(0, 1), (1, 2), (2, 5)]}]
    results = run_ranks({"map": stage_map, "timeout": 60, "runs": runs}, world, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    for index, (cls, optimizer) in enumerate(((UNetLM, "adamw"), (SkipAcrossCut, "sgd"))):
        ref_losses, ref_params, owner = reference(optimizer, *shape_of(stage_map), model_cls=cls)
        seen: set[str] = set()
        for rank, res in enumerate(results):
            got = res.result["runs"][index]
            label = f"{cls.__name__} rank {rank}"
            # Not bit for bit: both models read the root-level `pos` in code that the stage reading the carried
            # value runs again (`emb + pos`, see [Note: skip routing]), so the stage holds `pos` as a tied copy.
            # Each copy's gradient is reduced over the batch on its own stage and the two are added after the
            # step; one process adds the two upstream gradients first and reduces once. Same terms, another
            # order: the last bit differs, then the optimizer carries it on.
            assert rel_diff(got["losses"], ref_losses) <= TOL, f"{label}: {got['losses']}"
            for pname, value in got["params"].items():
                assert rel_diff(value, ref_params[pname]) <= TOL, f"{label}: {pname} differs"
            seen.update(got["params"])
        assert {owner[n] for n in seen} == set(owner.values()), f"{cls.__name__}: some parameters are held by no rank"


BUFFER_LAYOUTS = {"pp2 dp1": ("0;1", 2), "pp3 dp1": ("0;1;2", 3), "pp2 dp2": ("0,2;1,3", 4),
                  "pp3 dp2": ("0,3;1,4;2,5", 6)}
BUFFER_MODELS = (ResNetLM, BatchNormLM)


@pytest.mark.parametrize("name", list(BUFFER_LAYOUTS))
def test_buffers_written_by_the_forward_change_as_in_one_process(name: str, tmp_path) -> None:
    """BatchNorm statistics (a ResNet-like model cut automatically) and a call counter read by the forward (a
    CutPoint model) change once per micro-batch, in order, under every schedule: with ``varuna`` a recomputing
    stage runs each forward twice, and the second run must neither update the buffers again nor see the first
    run's updates. With replicas, replica 0's buffers win after each step (as DDP's ``broadcast_buffers``).
    Every loss, parameter and buffer equals ``tests/reference.py`` bit for bit."""
    stage_map, world = BUFFER_LAYOUTS[name]
    runs = [{"model": cls.__name__, "schedule": s, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": 2}
            for cls in BUFFER_MODELS for s in SCHEDULES]
    results = run_ranks({"map": stage_map, "timeout": 60, "runs": runs}, world, tmp_path)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    for i, run in enumerate(runs):
        cls = getattr(__import__("tests.models", fromlist=[run["model"]]), run["model"])
        ref_losses, ref_state, _ = reference("sgd", *shape_of(stage_map), steps=2, model_cls=cls)
        written = {n for n in ref_state if n.endswith(("running_mean", "num_batches_tracked", "calls"))}
        seen: set[str] = set()
        for rank, res in enumerate(results):
            got = res.result["runs"][i]
            assert_equal_run(got, ref_losses, ref_state, f"{name} {run['model']} {run['schedule']} rank {rank}")
            seen.update(got["buffers"])
        assert written <= seen, f"{name}: buffers held by no rank: {sorted(written - seen)}"
