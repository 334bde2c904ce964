"""The checkpoint floor on its own: save and load a plain ``CheckpointState`` (no ``Varuna``), and the one
function that picks the latest checkpoint (runs, refused steps, the quick check)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from varuna_core.checkpoint.layout import COMPLETE_FILE, latest, quick_check, scan, step_dir
from varuna_core.checkpoint.saveload import load, save
from varuna_core.checkpoint.state import CheckpointState
from varuna_core.errors import CheckpointError


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # one weight, two names
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", torch.zeros(()))


def _state(model: nn.Module, **kw) -> CheckpointState:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    values = dict(rank=0, world_size=1, replica=0, device=torch.device("cpu"), timeout=30.0, module=model,
                  params=list(model.named_parameters()), weight_groups=[("embed.weight", ("embed.weight",
                                                                                          "head.weight"))],
                  optimizer=optimizer, structure_hash="h", num_segments=1, pp=1, dp=1, stage_to_rank_map="0",
                  partition=[(0, 1)], precision="fp16", batch_size=8, plan=None, iteration=3, seed=7,
                  run_id="run-a", loss_scaler={"scale": 1024.0, "growth_tracker": 2})
    values.update(kw)
    return CheckpointState(**values)


def test_a_state_saves_and_loads_without_the_facade(tmp_path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    state = _state(model)
    assert state.samples_seen == 24
    assert state.canonical_names() == {"embed.weight": "embed.weight", "head.weight": "embed.weight"}
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.full_like(p, 0.5)}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    save(state, tmp_path)
    assert [(e.step, e.complete, e.run) for e in scan(tmp_path)] == [(3, True, "run-a")]

    fresh = _Tied()
    other = _state(fresh, iteration=0, seed=1, run_id="run-b", loss_scaler={"scale": 1.0, "growth_tracker": 0})
    assert load(other, tmp_path, run="run-a") == 3
    assert other.restored
    assert (other.iteration, other.seed, other.run_id) == (3, 7, "run-a")
    assert other.loss_scaler == {"scale": 1024.0, "growth_tracker": 2}
    for name, p in fresh.named_parameters():
        assert torch.equal(p, saved[name]), name
    assert all(torch.equal(other.optimizer.state[p]["momentum_buffer"], torch.full_like(p, 0.5))
               for p in fresh.parameters())


def test_a_refused_load_restores_nothing(tmp_path) -> None:
    state = _state(_Tied())
    save(state, tmp_path)
    (step_dir(tmp_path, 3) / COMPLETE_FILE).unlink()
    other = _state(_Tied(), iteration=0, run_id="run-b")
    with pytest.raises(CheckpointError, match="incomplete"):
        load(other, tmp_path, iteration=3)
    assert not other.restored and (other.iteration, other.run_id) == (0, "run-b")


def _store(tmp_path, layout: list[tuple[int, str | None, bool]]):
    for step, run, complete in layout:
        d = step_dir(tmp_path, step)
        d.mkdir()
        if run is not None:
            (d / "RUN").write_text(f"{run}\n")
        if complete:
            (d / COMPLETE_FILE).write_text(f"{step}\n")
    return tmp_path


def test_latest_filters_runs_completeness_and_refused_steps(tmp_path) -> None:
    store = _store(tmp_path, [(1, "a", True), (2, "b", True), (3, "a", True), (4, "a", False), (5, None, True)])
    assert latest(store).step == 5
    assert latest(store, of_runs={"a"}).step == 3
    assert latest(store, of_runs={"a"}, complete=False).step == 4
    assert latest(store, of_runs={"a", None}).step == 5
    assert latest(store, of_runs={"a"}, refused={3: "bad"}).step == 1
    assert latest(scan(store), of_runs={"b"}).step == 2  # what scan found, as well as a path
    assert latest(store, of_runs={"c"}) is None
    assert latest(tmp_path / "missing") is None


def test_the_quick_check_matches_a_listed_name_whole(tmp_path) -> None:
    """`$` also matched before a final newline: a manifest listing `__0_0.distcp\n` (present under that name,
    of its size) passed the check."""
    from varuna_core.checkpoint.manifest import FileEntry, Manifest

    store = _store(tmp_path, [(1, "a", True)])
    name = "__0_0.distcp\n"
    (store / "step_1" / name).write_bytes(b"x")
    manifest = Manifest(step=1, run_id="a", created="2025-01-01", model="M", structure_hash="h", num_segments=1,
                        pp=1, dp=1, stage_to_rank_map="0;", partition=[(0, 1)], precision="fp32", iteration=1,
                        samples_seen=1, seed=0, parameters=[],
                        files=[FileEntry(path=name, bytes=1, digest="blake3:" + "0" * 64)])
    (store / "step_1" / "manifest.json").write_text(manifest.model_dump_json())
    problem = quick_check(scan(store)[0])
    assert problem is not None and "not a checkpoint file name" in problem


def test_latest_with_the_quick_check_sets_aside_what_fails_once(tmp_path) -> None:
    store = _store(tmp_path, [(1, "a", True), (2, "a", True)])  # complete, but no manifest: not loadable
    refused: dict[int, str] = {}
    assert latest(store, of_runs={"a"}, refused=refused, check=True) is None
    assert list(refused) == [2, 1]  # newest first, each with its reason
    assert all("manifest" in why for why in refused.values())
    assert latest(store, of_runs={"a"}, check=True) is None  # without a refused map: skipped, not recorded


def test_a_target_is_left_uncleared_only_when_one_stored_chunk_covers_it() -> None:
    """A load fills a new tensor from the checkpoint's chunks: one chunk covering it writes every byte (no zero fill
    first); several chunks, or one that covers a part, leave it cleared first."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from varuna_core.checkpoint.saveload import _whole_chunk

    def meta(*chunks):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                                     [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])

    assert _whole_chunk(meta(((0, 0), (4, 3))))
    assert not _whole_chunk(meta(((0, 0), (2, 3)), ((2, 0), (2, 3))))
    assert not _whole_chunk(meta(((0, 0), (2, 3))))
    assert not _whole_chunk(meta()) and not _whole_chunk(None)
