"""Bad inputs and failures in multi-process runs: a clear error on every rank, within the timeout, no hang."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _run(tmp_path, stage_map: str, world: int, timeout: float = 20, **run):
    base = {"schedule": "1f1b", "optimizer": "sgd", "batch": 4, "chunk": 2, "steps": 2}
    base.update(run)
    return run_ranks({"map": stage_map, "timeout": timeout, "runs": [base]}, world, tmp_path, timeout=120)


def test_map_inconsistent_with_world_size(tmp_path) -> None:
    results = _run(tmp_path, "0;1;2", 2)
    for res in results:
        assert res.returncode == 1
        assert res.error.startswith("TopologyError"), res.error
        assert "3" in res.error and "WORLD_SIZE=2" in res.error.replace(" ", "") or "world" in res.error.lower()


def test_shape_change_at_a_cut_is_named(tmp_path) -> None:
    # step 1 feeds sequences one token shorter than discovery saw, so the activation at the cut changes shape
    results = _run(tmp_path, "0;1", 2, bad_seq=1)
    sender, receiver = results
    assert sender.returncode == 1 and sender.error.startswith("ShapeMismatchError"), sender.error
    assert "CutPoint 'cuts." in sender.error and "expected [6, 2, 16] float32" in sender.error
    assert receiver.returncode == 1 and receiver.error.startswith("CommTimeoutError"), receiver.error
    assert "rank 0" in receiver.error


def test_a_skip_that_cannot_be_carried_is_named_on_every_rank(tmp_path) -> None:
    """A value left inside a module and read after a cut: every rank refuses it at start-up, naming both."""
    results = _run(tmp_path, "0;1", 2, model="SkipInsideBlock")
    for res in results:
        assert res.returncode == 1 and res.error.startswith("CutPointError"), res.error
        assert "'blocks.0'" in res.error and "CutPoint 'cuts." in res.error


@pytest.mark.parametrize(("stage_map", "world", "partition"), [
    ("0;1", 2, [(0, 2), (2, 5)]), ("0;1;2", 3, [(0, 2), (2, 4), (4, 5)])])
def test_a_module_attribute_read_on_another_stage_is_refused_on_every_rank(stage_map, world, partition,
                                                                            tmp_path) -> None:
    """Block 0 keeps ``self.scale = float(x.mean())`` for block 2 on the next stage: refused at start-up, in one
    line naming the module, the attribute and both segments."""
    results = _run(tmp_path, stage_map, world, model="StateAcrossCut", partition=partition)
    for res in results:
        assert res.returncode == 1 and res.error.startswith("CutPointError"), res.error
        assert "\n" not in res.error.strip(), res.error
        for part in ("'blocks.0'", "'scale'", "segment 1 (stage 0)", "segment 3 (stage 1)"):
            assert part in res.error, (part, res.error)


def test_validation_names_the_cut_where_values_differ(tmp_path) -> None:
    results = _run(tmp_path, "0;1;2;3", 4, model="HiddenState", validate=True)
    for res in results:
        assert res.returncode == 1 and res.error.startswith("CutPointError"), res.error
        assert "validation failed" in res.error and "CutPoint 'cuts.3'" in res.error


def test_validation_passes_on_a_correct_model(tmp_path) -> None:
    results = _run(tmp_path, "0;1;2", 3, validate=True)
    assert all(res.returncode == 0 for res in results), [res.error for res in results]


def test_timeout_names_rank_stage_action_and_peer(tmp_path) -> None:
    results = _run(tmp_path, "0;1", 2, timeout=4, stall_rank=1, stall_seconds=8)
    waiting = results[0]
    assert waiting.returncode == 1 and waiting.error.startswith("CommTimeoutError"), waiting.error
    for part in ("rank 0 (stage 0, replica 0)", "0B0", "gradient", "from rank 1 (stage 1)", "within 4s"):
        assert part in waiting.error, (part, waiting.error)


def test_a_start_up_error_of_one_rank_stops_every_rank_with_that_error(tmp_path) -> None:
    """Pretrained weights that lack a tensor of the last stage: only the rank loading that stage finds out, while
    the others go on to build the process groups. Every rank must stop with an error naming the failing rank and
    the missing tensor (not wait for the timeout and report a lost peer)."""
    from safetensors.torch import save_file

    from tests.models import ToyLM

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in ToyLM().state_dict().items() if k not in ("head.weight", "blocks.3.fc1.weight")}
    path = tmp_path / "weights.safetensors"
    save_file(state, str(path))
    results = _run(tmp_path / "run", "0;1", 2, timeout=60, meta=True, weights=str(path))
    failing, peer = results[1], results[0]
    assert failing.returncode == 1 and "blocks.3.fc1.weight" in failing.error, failing.error
    assert peer.returncode == 1 and peer.error.startswith("ConfigError"), peer.error
    assert "rank 1" in peer.error and "blocks.3.fc1.weight" in peer.error, peer.error


def test_a_stage_failing_in_validation_stops_every_rank_with_its_error(tmp_path) -> None:
    """A forward that needs a value of an earlier stage fails on stages 1 and 2 during the start-up validation,
    while stage 2 waits for stage 1's value and stage 0 for the validation's verdict: every rank must stop with
    stage 1's error (the first failing rank), none wait for its timeout."""
    results = _run(tmp_path, "0;1;2", 3, timeout=60, model="ReadsANumber", validate=True)
    for rank, res in enumerate(results):
        assert res.returncode == 1, (rank, res.output[-2000:])
        if rank == 1:
            assert res.error.startswith("CutPointError") and "stage 1" in res.error, res.error
        else:
            assert res.error.startswith("ConfigError: rank 1 "), (rank, res.error)
            assert "failed at start-up with CutPointError: on stage 1" in res.error, (rank, res.error)
