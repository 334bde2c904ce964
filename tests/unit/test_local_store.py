"""Checkpoints on each host's own disk (``--ckpt-local``): a host's store served read only over the shelves' wire
(launch.local_store), a rank's part written from its host's shelf with the right marker and retention, and the
sources a resume takes each file from (worker.local_store)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from varuna_core.checkpoint.layout import COMPLETE_FILE, MANIFEST_FILE, RUN_FILE, latest
from varuna_core.checkpoint.manifest import CHECKPOINT_INDEX, FileEntry, Manifest, TensorEntry
from varuna_core.checkpoint.part import read_part, write_part
from varuna_core.errors import HandoverError
from varuna_core.launch.local_store import StoreFiles, split_store_name, store_name
from varuna_core.launch.shelf import Shelf, ShelfServer, fetch, shelf_key
from varuna_core.util.digest import of_bytes
from varuna_core.worker.local_store import HERE, LocalStore, held_files
from varuna_core.worker.snapshots import SnapshotReport

TOKEN, JOB, RUN = "local-store-token", "job-local", "run-local"
DATA = {"__0_0.distcp": b"rank zero's tensors" * 100, "__1_0.distcp": b"rank one's" * 77, CHECKPOINT_INDEX: b"{}"}


def _manifest(step: int) -> bytes:
    files = [FileEntry(path=n, bytes=len(d), digest=of_bytes(d)) for n, d in sorted(DATA.items())]
    return Manifest(step=step, run_id=RUN, created="2026-01-01T00:00:00+00:00", model="Net", structure_hash="x",
                    num_segments=2, pp=2, dp=1, stage_to_rank_map="0;1", partition=[(0, 1), (1, 2)],
                    precision="fp32", iteration=step, samples_seen=step, seed=0,
                    parameters=[TensorEntry(key="model/w", shape=[2], dtype="torch.float32")],
                    files=files).model_dump_json().encode()


def _part(store: Path, step: int, files: list[str], host: str = "h0") -> Path:
    """``store/step_<step>`` as a host holding ``files`` of the checkpoint keeps it."""
    directory = store / f"step_{step}"
    directory.mkdir(parents=True)
    (directory / RUN_FILE).write_text(f"{RUN}\n")
    (directory / MANIFEST_FILE).write_bytes(_manifest(step))
    (directory / CHECKPOINT_INDEX).write_bytes(DATA[CHECKPOINT_INDEX])
    for name in files:
        (directory / name).write_bytes(DATA[name])
    write_part(directory, step=step, run_id=RUN, host=host, files=files)
    return directory


@pytest.fixture
def served(tmp_path):
    """A host's store holding rank 1's file of step 4, served with its (empty) shelf."""
    store = tmp_path / "other"
    _part(store, 4, ["__1_0.distcp"], host="h1")
    server = ShelfServer(Shelf(shelf_key(JOB, 1), root=tmp_path / "shm-other"), TOKEN, files=StoreFiles(store).open)
    yield store, server
    server.close()


def _get(server: ShelfServer, *names: str) -> dict:
    return fetch("127.0.0.1", server.port, job=shelf_key(JOB, 1), token=TOKEN, names=list(names),
                 max_bytes=1 << 30, timeout=5)


def test_a_store_is_served_under_its_wire_names_with_the_manifests_hashes(served) -> None:
    store, server = served
    got = _get(server, store_name(4, "__1_0.distcp"), store_name(4, MANIFEST_FILE), store_name(4, CHECKPOINT_INDEX))
    assert bytes(got["ckpt/step_4/__1_0.distcp"][1]) == DATA["__1_0.distcp"]
    assert got["ckpt/step_4/__1_0.distcp"][0].digest == of_bytes(DATA["__1_0.distcp"])
    assert bytes(got["ckpt/step_4/manifest.json"][1]) == (store / "step_4" / MANIFEST_FILE).read_bytes()
    assert split_store_name("ckpt/step_4/__1_0.distcp") == (4, "__1_0.distcp")


@pytest.mark.parametrize("name", ["ckpt/step_4/../step_4/RUN", "ckpt/step_4/COMPLETE", "ckpt/step_4/PART",
                                  "ckpt/step_4/__0_0.distcp", "ckpt/step_5/RUN", "ckpt/step_4/x.distcp",
                                  "ckpt/step_4/__1_0.distcp/", "ckpt//etc/passwd", "ckpt/step_-1/RUN"])
def test_names_that_are_not_files_of_the_store_are_refused(served, name) -> None:
    _, server = served
    with pytest.raises(HandoverError, match=r"refused the request: .unavailable"):
        _get(server, name)


def test_links_and_changed_files_are_refused(served, tmp_path) -> None:
    store, server = served
    directory = store / "step_4"
    (tmp_path / "secret").write_bytes(b"x" * len(DATA["__0_0.distcp"]))
    os.symlink(tmp_path / "secret", directory / "__0_0.distcp")  # listed in the manifest, but a link
    with pytest.raises(HandoverError, match=r"refused the request: .unavailable.*link"):
        _get(server, store_name(4, "__0_0.distcp"))
    os.symlink(directory, store / "step_9")
    with pytest.raises(HandoverError, match="not a directory"):
        _get(server, store_name(9, RUN_FILE))
    (directory / "__1_0.distcp").write_bytes(DATA["__1_0.distcp"] + b"!")  # another size than the manifest's
    with pytest.raises(HandoverError, match=r"not the .* of its manifest"):
        _get(server, store_name(4, "__1_0.distcp"))
    (directory / "__1_0.distcp").write_bytes(b"?" + DATA["__1_0.distcp"][1:])  # the same size, other bytes
    with pytest.raises(HandoverError, match="does not match its digest"):
        _get(server, store_name(4, "__1_0.distcp"))


def test_a_server_without_a_store_serves_no_store_names(tmp_path) -> None:
    _part(tmp_path / "store", 4, ["__1_0.distcp"])
    with ShelfServer(Shelf(shelf_key(JOB, 1), root=tmp_path / "shm"), TOKEN) as server, \
            pytest.raises(HandoverError, match="unavailable: no blob"):
        _get(server, store_name(4, RUN_FILE))


def test_held_files_follow_the_marker(tmp_path) -> None:
    part = _part(tmp_path / "a", 4, ["__1_0.distcp"])
    assert held_files(part) == {"__1_0.distcp"}
    whole = _part(tmp_path / "b", 4, ["__0_0.distcp", "__1_0.distcp"])
    (whole / "PART").unlink()
    assert held_files(whole) == set()  # neither marker: a write that was killed
    (whole / COMPLETE_FILE).write_text("4\n")
    assert held_files(whole) == {"__0_0.distcp", "__1_0.distcp"}
    (part / "PART").write_text("{not json")
    assert held_files(part) == set()
    assert latest(tmp_path / "a") is None  # a part is never taken for a whole checkpoint


# ----------------------------------------------------------------------------------------------------------
# The worker's side


class _Snapshots:
    """Stands for the snapshots (one rank): a take puts the step's blobs on the shelf as a publish and the peer
    copy would."""

    def __init__(self, shelf: Shelf, blobs: list[str]) -> None:
        self.shelf, self.blobs, self.taken = shelf, blobs, []

    def take(self, iteration, announce=None, step_time=None):
        self.taken.append(iteration)
        manifest = _manifest(iteration)
        for name in [*self.blobs, RUN_FILE, MANIFEST_FILE, COMPLETE_FILE]:
            data = {RUN_FILE: f"{RUN}\n".encode(), MANIFEST_FILE: manifest, COMPLETE_FILE: b"x"}.get(name) \
                or DATA[name]
            self.shelf.put(f"step_{iteration}/{name}", data)
        return SnapshotReport(iteration, 0.1, 0, 1, True, 1)

    @staticmethod
    def all_gather(obj):
        return [obj]


def _local(tmp_path: Path, blobs: list[str], keep: int | None = None, **kw) -> LocalStore:
    shelf = Shelf(JOB, root=tmp_path / "shm")
    snaps = _Snapshots(shelf, blobs)
    return LocalStore(tmp_path / "store", rank=0, host="h0", keep=keep, snapshots=snaps,  # type: ignore[arg-type]
                      shelf=shelf, server=None, job=JOB, token=TOKEN, attempt=1, all_gather=snaps.all_gather, **kw)


def test_a_host_holding_every_file_writes_a_complete_checkpoint(tmp_path) -> None:
    local = _local(tmp_path, ["__0_0.distcp", "__1_0.distcp", CHECKPOINT_INDEX])
    assert local.write(3)
    directory = tmp_path / "store" / "step_3"
    assert (directory / COMPLETE_FILE).is_file() and not (directory / "PART").exists()
    for name, data in DATA.items():
        assert (directory / name).read_bytes() == data
    assert latest(tmp_path / "store").step == 3
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_a_host_holding_part_writes_a_part_and_keeps_the_newest(tmp_path) -> None:
    local = _local(tmp_path, ["__1_0.distcp", CHECKPOINT_INDEX], keep=2)
    for step in (2, 4, 6):
        assert local.write(step)
    store = tmp_path / "store"
    assert sorted(p.name for p in store.iterdir()) == ["step_4", "step_6"]
    marker = read_part(store / "step_6")
    assert marker is not None and marker.files == ["__1_0.distcp"] and marker.run_id == RUN and marker.host == "h0"
    assert not (store / "step_6" / "__0_0.distcp").exists() and latest(store) is None


def test_another_runs_directory_is_not_replaced(tmp_path, caplog) -> None:
    other = tmp_path / "store" / "step_2"
    other.mkdir(parents=True)
    (other / RUN_FILE).write_text("someone-else\n")
    local = _local(tmp_path, ["__1_0.distcp", CHECKPOINT_INDEX])
    assert not local.write(2)
    assert (other / RUN_FILE).read_text() == "someone-else\n"
    assert "not written to the hosts' stores" in caplog.text and "refusing to replace it" in caplog.text


def test_the_sources_of_a_resume_are_this_hosts_store_then_the_others(tmp_path, served) -> None:
    _, server = served
    _part(tmp_path / "store", 4, ["__0_0.distcp"])
    local = _local(tmp_path, [])
    gathered = [("h0", None, ["__0_0.distcp"], True), ("h1", ("127.0.0.1", server.port), ["__1_0.distcp"], True)]
    local._all_gather = lambda obj: gathered
    locate, get = local.sources(4)
    assert locate("step_4/__0_0.distcp") == [HERE]
    assert locate("step_4/manifest.json") == [HERE, ("h1", "127.0.0.1", server.port)]
    assert locate("step_4/__1_0.distcp") == [("h1", "127.0.0.1", server.port)]
    with pytest.raises(KeyError):
        locate("step_4/__7_0.distcp")
    buffers: dict[str, bytearray] = {}

    def into(name: str, size: int) -> memoryview:
        buffers[name] = bytearray(size)
        return memoryview(buffers[name])

    assert get(HERE, ["step_4/__0_0.distcp", "step_4/COMPLETE"], into, 1 << 20) is None  # the load hashes them
    checked = get(("h1", "127.0.0.1", server.port), ["step_4/__1_0.distcp"], into, 1 << 20)
    assert checked == {"step_4/__1_0.distcp": of_bytes(DATA["__1_0.distcp"])}
    assert bytes(buffers["step_4/__0_0.distcp"]) == DATA["__0_0.distcp"]
    assert bytes(buffers["step_4/__1_0.distcp"]) == DATA["__1_0.distcp"]
    assert bytes(buffers["step_4/COMPLETE"]) == b"4\n"


def test_a_checkpoint_no_host_holds_is_refused(tmp_path) -> None:
    local = _local(tmp_path, [])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    local._all_gather = lambda obj: [("h0", None, [], False), ("h1", ("127.0.0.1", port), [], False)]
    with pytest.raises(HandoverError, match="no host holds checkpoint step_4"):
        local.sources(4)
