"""The handover's own checks, in one process over plain callables (dicts stand for the hosts' shelves): what a
take refuses by name (no holder known, a blob the holder does not send, one of another size than the manifest's,
bytes that do not match the manifest), with the live state untouched; the multi-process runs over real shelf
servers are in ``tests/dist/test_handover.py``."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from tests.unit.test_ckpt_state import _state, _Tied
from varuna_core.checkpoint.handover import blob_name, publish, take
from varuna_core.errors import CheckpointError, HandoverError, ShelfFullError

STEP = 3


@pytest.fixture
def shelf(tmp_path) -> dict[str, tuple[bytes, dict]]:
    """A published checkpoint of a trained-looking model: blob name -> (bytes, meta)."""
    torch.manual_seed(0)
    model = _Tied()
    state = _state(model)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.full_like(p, 0.5)}
    blobs: dict[str, tuple[bytes, dict]] = {}
    owners = publish(state, lambda name, data, meta, sha256: blobs.__setitem__(name, (bytes(data), meta)),
                     staging=tmp_path / "publish")
    assert owners == dict.fromkeys(blobs, 0)
    assert not any((tmp_path / "publish").iterdir())  # the local copy is gone once on the shelf
    for data, meta in blobs.values():
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rank": 0}
    return blobs


def _fetch(blobs, log=None, size_of=None):
    def fetch(holder, names, into, max_bytes):
        for name in names:
            if name not in blobs:
                continue  # a holder that does not have it sends nothing
            data = blobs[name][0]
            view = into(name, len(data) if size_of is None else size_of(name, data))
            view[: len(data)] = data
            if log is not None:
                log.append((holder, name))
    return fetch


def _fresh(tmp_path):
    model = _Tied()
    state = _state(model, iteration=0, seed=1, run_id="run-b", loss_scaler={"scale": 1.0, "growth_tracker": 0})
    return model, state, {n: p.detach().clone() for n, p in model.named_parameters()}


def _untouched(model, state, before) -> None:
    assert not state.restored and state.iteration == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_take_restores_what_publish_put(shelf, tmp_path) -> None:
    log: list = []
    _, state, _ = _fresh(tmp_path)
    assert take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(shelf, log), staging=tmp_path / "s") \
        == STEP
    assert (state.restored, state.iteration, state.run_id) == (True, 3, "run-a")
    assert sorted(name for _, name in log) == sorted(shelf)
    assert not any((tmp_path / "s").iterdir())


def test_a_blob_no_host_holds_is_refused_by_name(shelf, tmp_path) -> None:
    model, state, before = _fresh(tmp_path)
    data = blob_name(STEP, "__0_0.distcp")

    def locate(name):
        return {n: "hostA" for n in shelf if n != data}[name]

    with pytest.raises(HandoverError, match=re.escape(f"no host is known to hold blob {data}")):
        take(state, step=STEP, locate=locate, fetch=_fetch(shelf), staging=tmp_path / "s")
    _untouched(model, state, before)


def test_a_blob_the_holder_does_not_send_is_refused_by_name(shelf, tmp_path) -> None:
    model, state, before = _fresh(tmp_path)
    data = blob_name(STEP, "__0_0.distcp")
    partial = {n: v for n, v in shelf.items() if n != data}
    with pytest.raises(HandoverError, match=re.escape(f"holder hostA did not send blob {data}")):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(partial), staging=tmp_path / "s")
    _untouched(model, state, before)
    assert not any((tmp_path / "s").iterdir())


def test_a_blob_of_another_size_than_the_manifest_is_refused_by_name(shelf, tmp_path) -> None:
    model, state, before = _fresh(tmp_path)
    data = blob_name(STEP, "__0_0.distcp")
    grown = {**shelf, data: (shelf[data][0] + b"\0" * 8, shelf[data][1])}
    with pytest.raises(HandoverError, match=rf"blob {re.escape(data)} on hostA holds \d+ bytes; the manifest says"):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(grown), staging=tmp_path / "s")
    _untouched(model, state, before)


def test_bytes_that_do_not_match_the_manifest_are_refused(shelf, tmp_path) -> None:
    """A holder whose own hash check passed (its entry was rewritten with the bytes) still cannot hand over other
    bytes: the load checks every file this rank took against the manifest."""
    model, state, before = _fresh(tmp_path)
    data = blob_name(STEP, "__0_0.distcp")
    raw = bytearray(shelf[data][0])
    raw[len(raw) // 2] ^= 0xFF
    damaged = {**shelf, data: (bytes(raw), shelf[data][1])}
    with pytest.raises(CheckpointError, match=re.escape("__0_0.distcp: sha256 mismatch")):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(damaged), staging=tmp_path / "s")
    _untouched(model, state, before)
    assert not any((tmp_path / "s").iterdir())


def test_a_reader_of_some_files_checks_each_whole_and_reads_no_other(tmp_path) -> None:
    """With ``present``, a rank checks every file it took (under a world of several ranks too, where a shared
    directory's files are split among the ranks for checking), and refuses to read from a file it did not take."""
    from varuna_core.checkpoint.storage import RawReader, RawWriter, dcp_load, dcp_save

    writer = RawWriter(tmp_path, sync_files=False)
    dcp_save({"model/w": torch.arange(64.0)}, writer)
    expected = {f.path: (f.bytes, f.sha256) for f in writer.files}
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    reader = RawReader(tmp_path, expected, rank=1, world=2, present=["__0_0.distcp"])
    with pytest.raises(CheckpointError, match=re.escape("__0_0.distcp: sha256 mismatch")):
        dcp_load({"model/w": torch.zeros(64)}, reader, no_dist=True)
    data.unlink()
    reader = RawReader(tmp_path, expected, rank=1, world=2, present=[])
    with pytest.raises(CheckpointError, match=re.escape("in __0_0.distcp, which was not taken")):
        dcp_load({"model/w": torch.zeros(64)}, reader, no_dist=True)


def test_a_full_shelf_fails_the_publish_as_such_and_leaves_no_local_copy(tmp_path) -> None:
    taken: list[str] = []

    def put(name, data, meta, sha256=None):
        if name.endswith(".distcp"):
            raise ShelfFullError(f"blob {name} does not fit", hint="use the store")
        taken.append(name)

    with pytest.raises(ShelfFullError, match=re.escape(f"could not put {blob_name(STEP, '__0_0.distcp')}")):
        publish(_state(_Tied()), put, staging=tmp_path / "publish")
    assert not any((tmp_path / "publish").iterdir())


def test_a_file_checked_on_arrival_is_not_hashed_again_and_must_be_the_manifests(shelf, tmp_path,
                                                                                   monkeypatch) -> None:
    """A fetch over the wire checks each blob's sha256 as it arrives and says so ({name: sha256}): the load then
    does not hash that file again, once its hash is the manifest's; a blob whose checked hash is another is refused
    by name, with the live state untouched."""
    import varuna_core.checkpoint.storage as storage

    hashed: list[str] = []
    real = storage.RawReader._read_file

    def spy(self, name, chunks, planner, check):
        if check:
            hashed.append(name)
        return real(self, name, chunks, planner, check)

    monkeypatch.setattr(storage.RawReader, "_read_file", spy)
    data_files = sorted(n for n in shelf if n.endswith(".distcp"))

    def checked(holder, names, into, max_bytes):
        _fetch(shelf)(holder, names, into, max_bytes)
        return {n: hashlib.sha256(shelf[n][0]).hexdigest() for n in names}

    _, state, _ = _fresh(tmp_path)
    assert take(state, step=STEP, locate=lambda name: "hostA", fetch=checked, staging=tmp_path / "a") == STEP
    assert hashed == [] and state.restored
    _, state, _ = _fresh(tmp_path)
    assert take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(shelf), staging=tmp_path / "b") == STEP
    assert sorted(hashed) == sorted(n.split("/", 1)[1] for n in data_files)  # unchecked ones are hashed

    def lying(holder, names, into, max_bytes):
        _fetch(shelf)(holder, names, into, max_bytes)
        return dict.fromkeys(names, "0" * 64)

    model, state, before = _fresh(tmp_path)
    with pytest.raises(HandoverError, match="is not the manifest's"):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=lying, staging=tmp_path / "c")
    _untouched(model, state, before)
