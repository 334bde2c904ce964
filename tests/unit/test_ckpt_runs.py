"""Checkpoints in one process: runs that share a store, loads that are all or nothing, saves that fail cleanly
(a full disk, a failing copy), and the seed and arguments ``Varuna(...)`` accepts."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna
from varuna_core.checkpoint.layout import read_run, scan
from varuna_core.errors import CheckpointError, ConfigError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VARUNA_RUN_ID", raising=False)


def _model(n_layer: int = 4, hidden: int = 16, optimizer: str = "adamw", **kw) -> Varuna:
    torch.manual_seed(0)
    vm = Varuna(ToyLM(n_layer=n_layer, hidden=hidden), "0", batch(2), batch_size=8, chunk_size=4,
                shared_weights=SHARED, **kw)
    opt = (torch.optim.AdamW(vm.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(vm.parameters(), lr=0.1, momentum=0.9))
    vm.set_optimizer(opt)
    return vm


def _train(vm: Varuna, steps: int) -> None:
    for _ in range(steps):
        vm.step(batch(8, seed=vm.iteration))
        vm.optimizer.step()
        vm.optimizer.zero_grad()


def _state(vm: Varuna) -> dict:
    """Everything a load may change, copied."""
    out = {f"p/{n}": p.detach().clone() for n, p in vm.named_parameters()}
    for p in vm.parameters():
        for k, v in vm.optimizer.state.get(p, {}).items():
            out[f"o/{id(p)}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["rng"] = torch.get_rng_state()
    out["iteration"], out["seed"], out["run"] = vm.iteration, vm.seed, vm.run_id
    out["lr"] = [g["lr"] for g in vm.optimizer.param_groups]
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ----------------------------------------------------------------------------------------------------------
# Runs sharing a store


def test_a_new_run_in_a_reused_store_keeps_its_own_checkpoints(tmp_path) -> None:
    store = tmp_path / "ckpt"
    old = _model()
    old.checkpoint(store, step=1000)
    new = _model()
    assert new.run_id != old.run_id
    for _ in range(3):
        _train(new, 1)
        new.checkpoint(store, keep=1)  # before: keep=1 deleted each new checkpoint in favour of step_1000
    assert [(e.step, e.run) for e in scan(store) if e.complete] == [(3, new.run_id), (1000, old.run_id)]
    fresh = _model()  # a third run: the store now holds two, so "latest" is ambiguous and refused by name
    with pytest.raises(CheckpointError, match="holds checkpoints of 2 runs") as info:
        fresh.load_checkpoint(store)
    assert "run=" in info.value.hint
    with pytest.raises(ConfigError, match=r"run '.*\\n' is not a valid run id"):  # a name, nothing around it
        fresh.load_checkpoint(store, run=new.run_id + "\n")
    assert fresh.load_checkpoint(store, run=new.run_id) == 3 and fresh.run_id == new.run_id
    assert new.load_checkpoint(store) == 3  # its own latest, not the other run's higher step


def test_another_runs_checkpoint_is_never_overwritten(tmp_path) -> None:
    store = tmp_path / "ckpt"
    old = _model()
    old.checkpoint(store, step=5)
    before = {p.name: p.read_bytes() for p in (store / "step_5").iterdir()}
    new = _model()
    with pytest.raises(CheckpointError, match=f"holds a complete checkpoint of run {old.run_id}"):
        new.checkpoint(store, step=5)
    assert {p.name: p.read_bytes() for p in (store / "step_5").iterdir()} == before
    partial = store / "step_7"
    partial.mkdir()
    (partial / "RUN").write_text(f"{old.run_id}\n")
    with pytest.raises(CheckpointError, match="holds a partial checkpoint"):
        new.checkpoint(store, step=7)
    assert partial.is_dir()


def test_leftovers_of_this_run_are_cleaned_up(tmp_path) -> None:
    """A partial directory of this run (a killed save) goes once a later checkpoint completes; another run's
    stays; a stale staging directory of this run and rank goes at the next background save."""
    store, local = tmp_path / "ckpt", tmp_path / "local"
    vm = _model()
    for step, run in ((1, vm.run_id), (2, "someone-else")):
        (store / f"step_{step}").mkdir(parents=True)
        (store / f"step_{step}" / "RUN").write_text(run)
    stale = local / f"varuna-{vm.run_id}-r0-s1-abcdef"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"x" * 100)
    _train(vm, 3)
    vm.checkpoint(store, tempdir=local, background=True).result()
    assert [e.step for e in scan(store)] == [2, 3]
    assert read_run(store / "step_2") == "someone-else"
    assert not stale.exists() and list(local.iterdir()) == []


def test_a_load_adopts_the_run_and_later_saves_continue_it(tmp_path) -> None:
    store = tmp_path / "ckpt"
    first = _model()
    _train(first, 2)
    first.checkpoint(store)
    second = _model()
    assert second.load_checkpoint(store) == 2 and second.run_id == first.run_id
    _train(second, 1)
    second.checkpoint(store, keep=1)
    assert [(e.step, e.run) for e in scan(store)] == [(3, first.run_id)]


def test_the_run_id_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_RUN_ID", "my-run.1")
    assert _model().run_id == "my-run.1"
    monkeypatch.setenv("VARUNA_RUN_ID", "../evil")
    with pytest.raises(ConfigError, match="VARUNA_RUN_ID"):
        _model()
    monkeypatch.setenv("VARUNA_RUN_ID", "my-run.1\n")  # was stripped into my-run.1: another run's name
    with pytest.raises(ConfigError, match=r"VARUNA_RUN_ID 'my-run.1\\n' is not a valid run id"):
        _model()


@pytest.mark.parametrize("run", ["abc\n", "abc\r", "\nabc", "a b", "a/b", "..\x00", "a" * 65, "", "é",
                                 "x\x1b[2J" + "y" * 5000])
def test_a_run_id_is_a_name_and_nothing_around_it(run) -> None:
    """A run id ending in a newline passed the check (``$`` matches before a final newline)."""
    from varuna_core.checkpoint.layout import check_run_id

    with pytest.raises(ConfigError) as info:
        check_run_id(run, "--run-id")
    message = info.value.message
    assert message.startswith("--run-id ") and "\x1b" not in message and "\n" not in message
    assert len(message) < 200


def test_a_run_file_with_more_than_a_name_records_no_run(tmp_path) -> None:
    for text, run in (("abc\n", "abc"), ("abc\ndef\n", None), ("abc\x00", None), ("a" * 65, None)):
        (tmp_path / "RUN").write_text(text)
        assert read_run(tmp_path) == run, text


def _step(store, step: int, run: str | None, complete: bool = True) -> None:
    path = store / f"step_{step}"
    path.mkdir(parents=True)
    if run is not None:
        (path / "RUN").write_text(run + "\n")
    if complete:
        (path / "COMPLETE").write_text("")


def test_resuming_a_run_the_store_holds_nothing_of_is_refused(tmp_path) -> None:
    """`--resume --run-id typo` in a store of other runs started a new run from scratch after one log line."""
    from varuna_core.launch.manager import choose_run

    store = tmp_path / "store"
    for i in range(8):
        _step(store, 10 + i, f"run{i}")
    with pytest.raises(ConfigError) as info:
        choose_run(store, True, "typo")
    message, hint = info.value.message, info.value.hint
    assert message.startswith(f"--resume: checkpoint store {store} holds nothing of run typo, but checkpoints of ")
    assert "'run0', 'run1', 'run2', 'run3', 'run4' and 3 more" in message and "run7" not in message
    assert "--run-id" in hint and "--resume-or-start" in hint
    assert choose_run(store, True, "typo", or_start=True) == ("typo", {"typo"})  # on purpose
    assert choose_run(store, True, "run3") == ("run3", {"run3"})
    _step(store, 1, "typo", complete=False)  # a partial checkpoint of the run: it is the run's store too
    assert choose_run(store, True, "typo") == ("typo", {"typo"})
    assert choose_run(tmp_path / "empty", True, "typo") == ("typo", {"typo"})  # nothing there: a new start


def test_resume_without_a_run_id_continues_the_one_run_it_finds(tmp_path) -> None:
    from varuna_core.launch.manager import choose_run

    store = tmp_path / "store"
    _step(store, 5, "only", complete=False)  # crashed during its first checkpoint: continue that run
    assert choose_run(store, True, None) == ("only", {"only"})
    _step(store, 7, "second", complete=False)
    with pytest.raises(ConfigError, match="holds only partial checkpoints of 2 runs"):
        choose_run(store, True, None)
    _step(store, 9, "second")
    assert choose_run(store, True, None) == ("second", {"second"})


# ----------------------------------------------------------------------------------------------------------
# Loads: all or nothing


def _corrupt(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_refused_checkpoint_leaves_everything_untouched(tmp_path) -> None:
    store = tmp_path / "ckpt"
    source = _model()
    _train(source, 3)
    source.checkpoint(store)
    _corrupt(store / "step_3" / "__0_0.distcp")
    target = _model(seed=7)
    _train(target, 1)
    torch.manual_seed(123)
    before = _state(target)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        target.load_checkpoint(store)
    assert _same(_state(target), before)  # before: the parameters held part of the corrupt checkpoint


def test_a_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    """A superset of the names (before: loaded without a word), a subset, other shapes: refused by name, and
    nothing changes."""
    store = tmp_path / "ckpt"
    big = _model(n_layer=4)
    big.checkpoint(store / "big")
    small = _model(n_layer=2)
    small.checkpoint(store / "small")
    wide = _model(n_layer=2, hidden=32)
    wide.checkpoint(store / "wide")
    target = _model(n_layer=2)
    before = _state(target)
    with pytest.raises(CheckpointError, match=r"another model: it has 12 parameter\(s\) this model does not, "
                                              r"e\.g\. blocks\.2"):
        target.load_checkpoint(store / "big")
    with pytest.raises(CheckpointError, match=r"lacks 12 parameter\(s\) of this model"):
        big.load_checkpoint(store / "small")
    with pytest.raises(CheckpointError, match=r"model/pos is torch.float32 \[6, 32\] in the checkpoint, "
                                              r"torch.float32 \[6, 16\] in this model"):
        target.load_checkpoint(store / "wide")
    assert _same(_state(target), before)


def test_another_optimizer_needs_load_optimizer_false(tmp_path) -> None:
    store = tmp_path / "ckpt"
    adam = _model()
    _train(adam, 2)
    adam.checkpoint(store)
    sgd = _model(optimizer="sgd")
    before = _state(sgd)
    with pytest.raises(CheckpointError, match="AdamW optimizer; this run's is SGD") as info:
        sgd.load_checkpoint(store)
    assert "load_optimizer=False" in info.value.hint and _same(_state(sgd), before)
    assert sgd.load_checkpoint(store, load_optimizer=False) == 2
    for (name, p), (_, q) in zip(sgd.named_parameters(), adam.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_hostile_manifest_values_are_refused(tmp_path) -> None:
    import json

    store = tmp_path / "ckpt"
    vm = _model()
    _train(vm, 1)
    vm.checkpoint(store)
    path = store / "step_1" / "manifest.json"
    good = json.loads(path.read_text())
    cases = [
        ({"optimizer": {**good["optimizer"], "param_groups": [{**good["optimizer"]["param_groups"][0],
                                                                "lr": "fast"}]}}, "does not fit"),
        ({"optimizer": {**good["optimizer"], "param_groups": []}}, "parameter groups"),
        ({"step": 9}, "records step 9"),
        ({"iteration": -1}, "not a valid manifest"),
        ({"run_id": "../x"}, "not a valid manifest"),
        # a handover's manifest may list a file without a digest (only its writer's host links it); a store's not
        ({"files": [{**good["files"][0], "digest": None}, *good["files"][1:]]}, "without a digest"),
    ]
    target = _model()
    before = _state(target)
    for change, message in cases:
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(CheckpointError, match=message):
            target.load_checkpoint(store, check_complete=False)
        assert _same(_state(target), before)
    path.write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="not a valid manifest"):
        target.load_checkpoint(store)


# ----------------------------------------------------------------------------------------------------------
# Saves that fail


def test_a_full_disk_fails_the_save_cleanly(tmp_path, small_disk) -> None:
    disk = small_disk(64 * 1024)
    vm = _model(hidden=64)
    _train(vm, 1)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        vm.checkpoint(disk / "ckpt")
    assert isinstance(info.value, Exception) and "Traceback" not in str(info.value)
    assert scan(disk / "ckpt") == []  # nothing half-written is left
    local = tmp_path / "local"
    future = vm.checkpoint(disk / "ckpt", tempdir=local, background=True)
    with pytest.raises(CheckpointError, match="No space left on device"):
        future.result()
    assert scan(disk / "ckpt") == [] and list(local.iterdir()) == []
    _train(vm, 1)  # training goes on, and a save to a good store works
    vm.checkpoint(tmp_path / "good")
    assert [e.complete for e in scan(tmp_path / "good")] == [True]


def test_a_failing_write_inside_dcp_is_one_checkpoint_error(tmp_path, monkeypatch) -> None:
    """DCP wraps a rank's failure in CheckpointException, a BaseException that escaped `except Exception`."""
    from varuna_core.checkpoint import io as ckpt_io

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    vm = _model()
    monkeypatch.setattr(ckpt_io, "_write_all", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        vm.checkpoint(tmp_path / "ckpt")
    assert scan(tmp_path / "ckpt") == []


# ----------------------------------------------------------------------------------------------------------
# Seeds and arguments


def test_every_64_bit_seed_works_and_survives_a_checkpoint(tmp_path) -> None:
    for seed, stored in ((2**64 - 1, 2**64 - 1), (2**63, 2**63), (-1, 2**64 - 1), (0, 0)):
        vm = _model(seed=seed)
        assert vm.seed == stored
        _train(vm, 1)
        vm.checkpoint(tmp_path / str(seed))
        again = _model(seed=5)
        again.load_checkpoint(tmp_path / str(seed))
        assert again.seed == stored


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"chunk_size": 2.7}, "chunk_size must be an integer, got 2.7"),
    ({"chunk_size": "4"}, "chunk_size must be an integer"),
    ({"batch_size": True}, "batch_size must be an integer"),
    ({"batch_size": 0}, "batch_size must be ≥ 1"),
    ({"timeout": -1}, "timeout must be greater than 0"),
    ({"timeout": float("nan")}, "timeout must be a finite number"),
    ({"bucket_mb": 0}, r"bucket_mb must be a number in \(0, 1048576\], got 0"),
    ({"bucket_mb": float("inf")}, r"bucket_mb must be a number in \(0, 1048576\], got inf"),
    ({"trace_step": -2}, "trace_step must be ≥ 0"),
    ({"seed": 2**64}, "seed must be in -9223372036854775808..18446744073709551615, got 18446744073709551616"),
    ({"seed": 1.5}, "seed must be an integer"),
])
def test_nonsense_arguments_are_refused(kwargs, match) -> None:
    args = {"batch_size": 8, "chunk_size": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        Varuna(ToyLM(), "0", batch(2), shared_weights=SHARED, **args)


def test_a_bad_timeout_in_the_environment_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_TIMEOUT", "nan")
    with pytest.raises(ConfigError, match="VARUNA_TIMEOUT must be a finite number"):
        _model()


def test_a_one_stage_checkpoint_records_its_tied_weights(tmp_path) -> None:
    """At pp=1 a tied weight is one parameter object within one stage; the manifest still lists every name of it,
    so `ckpt merge` writes all of them and the unpartitioned model loads the file strictly (before: the merged
    file of a pp=1 checkpoint lacked `head.weight`, and its checkpoint names could differ from a pp=2 one's)."""
    import json

    from safetensors.torch import load_file

    from varuna_core.checkpoint.tools import merge

    vm = _model()
    _train(vm, 2)
    vm.checkpoint(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "step_2" / "manifest.json").read_text())
    assert manifest["tied"] == [["emb.weight", "head.weight"]]
    merge(tmp_path / "ckpt", tmp_path / "model.safetensors")
    plain = ToyLM()
    plain.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    for name, p in vm.named_parameters():
        assert torch.equal(dict(plain.named_parameters())[name], p), name
