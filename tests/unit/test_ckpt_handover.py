"""The handover's own checks, in one process over plain callables (dicts stand for the hosts' shelves): what a
take refuses by name (no holder known, a blob the holder does not send, one of another size than the manifest's,
bytes that do not match the manifest), with the live state untouched; the multi-process runs over real shelf
servers are in ``tests/dist/test_handover.py``."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest
import torch

from tests.unit.test_ckpt_state import _state, _Tied
from varuna_core.checkpoint.handover import blob_name, publish, take
from varuna_core.errors import CheckpointError, HandoverError, ShelfFullError, VarunaError
from varuna_core.launch.shelf import Shelf
from varuna_core.util.digest import of_bytes

STEP = 3


@pytest.fixture
def shelf(tmp_path) -> dict[str, tuple[bytes, dict]]:
    """A published checkpoint of a trained-looking model: blob name -> (bytes, meta)."""
    torch.manual_seed(0)
    model = _Tied()
    state = _state(model)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.full_like(p, 0.5)}
    real = Shelf("job", root=tmp_path / "publish")
    owners = publish(state, real.reserve)
    blobs = {name: (bytes(real.get(name)), entry.meta) for name, entry in real.manifest().items()}
    assert owners == dict.fromkeys(blobs, 0)
    assert sorted(p.suffix for p in real.path.iterdir() if p.name != ".lock") == [".blob"] * len(blobs)  # no copy
    for data, meta in blobs.values():
        assert meta == {"bytes": len(data), "digest": of_bytes(data), "rank": 0}
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


@pytest.mark.parametrize("damaged", [False, True])
def test_a_take_receives_its_data_files_into_claimed_memory_cut_to_size_and_checks_them(shelf, tmp_path, damaged,
                                                                                        monkeypatch) -> None:
    """[Note: receive into touched memory]: each data file that arrives is received into the file ``claim`` moved
    to its name (the same inode), cut to its size (the claimed file was larger); the small files are made new;
    the bytes are checked against the manifest as any others: a damaged one is refused, the state untouched. A
    claimed file is mapped with its pages populated at once; a new one is not (that would allocate it first)."""
    import itertools
    import mmap
    import threading

    from varuna_core.checkpoint import handover

    populated: dict[int, bool] = {}  # inode -> mapped with MAP_POPULATE
    real_mmap = mmap.mmap

    def mapping(fd, size, *args, flags=mmap.MAP_SHARED, **kwargs):
        if fd >= 0:  # (not an anonymous mapping)
            populated[os.fstat(fd).st_ino] = bool(flags & getattr(mmap, "MAP_POPULATE", 0))
        return real_mmap(fd, size, *args, flags=flags, **kwargs)

    monkeypatch.setattr(handover.mmap, "mmap", mapping)
    claimed: dict[Path, tuple[int, int]] = {}  # path -> (inode, size)
    seen: dict[Path, tuple[int, int]] = {}
    numbers, lock = itertools.count(), threading.Lock()  # (the take's two requests claim at once, as Morph's does)

    def claim(size, path):
        pooled = tmp_path / f"pool-{next(numbers)}"
        pooled.write_bytes(b"\xff" * (size + 5000))
        os.link(pooled, path)
        pooled.unlink()
        with lock:
            claimed[path] = (os.stat(path).st_ino, size)
        return True

    blobs = dict(shelf)
    data = blob_name(STEP, "__0_0.distcp")
    if damaged:
        raw = bytearray(blobs[data][0])
        raw[len(raw) // 3] ^= 0x01
        blobs[data] = (bytes(raw), blobs[data][1])
    inner = _fetch(blobs)

    def fetch(holder, names, into, max_bytes):
        inner(holder, names, into, max_bytes)
        with lock:  # while they are there
            seen.update({p: (os.stat(p).st_ino, os.stat(p).st_size) for p in claimed})

    model, state, before = _fresh(tmp_path)
    if damaged:
        with pytest.raises(CheckpointError, match=re.escape("__0_0.distcp: digest mismatch")):
            take(state, step=STEP, locate=lambda name: "hostA", fetch=fetch, staging=tmp_path / "s", claim=claim)
        _untouched(model, state, before)
    else:
        assert take(state, step=STEP, locate=lambda name: "hostA", fetch=fetch, staging=tmp_path / "s",
                    claim=claim) == STEP
        assert state.restored and state.iteration == STEP
    assert sorted(p.name for p in claimed) == sorted(n.rsplit("/", 1)[1] for n in shelf if n.endswith(".distcp"))
    assert seen == claimed
    assert not any((tmp_path / "s").iterdir())
    if hasattr(mmap, "MAP_POPULATE"):
        inodes = {inode for inode, _ in claimed.values()}
        assert inodes and all(populated[i] for i in inodes)
        assert any(not flag for i, flag in populated.items() if i not in inodes)  # the small files, made new


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
    with pytest.raises(CheckpointError, match=re.escape("__0_0.distcp: digest mismatch")):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(damaged), staging=tmp_path / "s")
    _untouched(model, state, before)
    assert not any((tmp_path / "s").iterdir())


def test_a_reader_of_some_files_checks_each_whole_and_reads_no_other(tmp_path) -> None:
    """With ``present``, a rank checks every file it took (under a world of several ranks too, where a shared
    directory's files are split among the ranks for checking), and refuses to read from a file it did not take."""
    from varuna_core.checkpoint.storage import RawReader, RawWriter, dcp_load, dcp_save

    writer = RawWriter(tmp_path, sync_files=False)
    dcp_save({"model/w": torch.arange(64.0)}, writer)
    expected = {f.path: (f.bytes, f.digest) for f in writer.files}
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    reader = RawReader(tmp_path, expected, rank=1, world=2, present=["__0_0.distcp"])
    with pytest.raises(CheckpointError, match=re.escape("__0_0.distcp: digest mismatch")):
        dcp_load({"model/w": torch.zeros(64)}, reader, no_dist=True)
    data.unlink()
    reader = RawReader(tmp_path, expected, rank=1, world=2, present=[])
    with pytest.raises(CheckpointError, match=re.escape("in __0_0.distcp, which was not taken")):
        dcp_load({"model/w": torch.zeros(64)}, reader, no_dist=True)


def test_a_full_shelf_fails_the_publish_as_such_and_leaves_no_local_copy(tmp_path) -> None:
    state = _state(_Tied())
    small = Shelf("job", root=tmp_path / "publish", budget=1000)  # no room for the state: refused before writing
    refused = r"rank 0's state does not fit on its host's shelf: [0-9]+ bytes do not fit on the shelf of job"
    with pytest.raises(ShelfFullError, match=refused):
        publish(state, small.reserve)
    assert [p.name for p in small.path.iterdir()] == [".lock"]

    roomy = Shelf("job2", root=tmp_path / "publish")
    real = roomy.reserve

    @contextlib.contextmanager
    def reserve(nbytes):  # room reserved, then the budget shrinks under it: the adoption that overflows fails
        with real(16) as space:
            roomy.budget = 4096
            yield space

    with pytest.raises(ShelfFullError, match=re.escape(f"could not put {blob_name(STEP, '__0_0.distcp')}")):
        publish(state, reserve)
    assert not [p for p in roomy.path.iterdir() if p.suffix in (".resv", ".staging", ".part")]  # room given back
    assert not [n for n in roomy.names() if n.endswith(".distcp")]  # the small files before it may stay


def test_a_file_checked_on_arrival_is_not_hashed_again_and_must_be_the_manifests(shelf, tmp_path,
                                                                                   monkeypatch) -> None:
    """A fetch over the wire checks each blob's digest as it arrives and says so ({name: digest}): the load then
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
        return {n: of_bytes(shelf[n][0]) for n in names}

    _, state, _ = _fresh(tmp_path)
    assert take(state, step=STEP, locate=lambda name: "hostA", fetch=checked, staging=tmp_path / "a") == STEP
    assert hashed == [] and state.restored
    _, state, _ = _fresh(tmp_path)
    assert take(state, step=STEP, locate=lambda name: "hostA", fetch=_fetch(shelf), staging=tmp_path / "b") == STEP
    assert sorted(hashed) == sorted(n.split("/", 1)[1] for n in data_files)  # unchecked ones are hashed

    def lying(holder, names, into, max_bytes):
        _fetch(shelf)(holder, names, into, max_bytes)
        return dict.fromkeys(names, "blake3:" + "0" * 64)

    model, state, before = _fresh(tmp_path)
    with pytest.raises(HandoverError, match="is not the manifest's"):
        take(state, step=STEP, locate=lambda name: "hostA", fetch=lying, staging=tmp_path / "c")
    _untouched(model, state, before)


# ------------------------------------------------------------------------------------------------------------
# A take on the holder's own host: blobs linked in place, not copied


def _published(tmp_path) -> tuple[Shelf, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Tied()
    state = _state(model)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.randn_like(p)}
    real = Shelf("job", root=tmp_path / "shm")
    publish(state, real.reserve)
    return real, {n: p.detach().clone() for n, p in model.named_parameters()}


def _from(real: Shelf, fetched: list[str]):
    def fetch(holder, names, into, max_bytes):
        fetched.extend(names)
        for name in names:
            real.get_into(name, lambda e: into(e.name, e.size))
    return fetch


def test_a_take_links_its_own_hosts_data_files_and_reads_them_in_place(tmp_path) -> None:
    real, want = _published(tmp_path)
    fetched: list[str] = []
    model, state, _ = _fresh(tmp_path)
    staging = tmp_path / "shm" / "take"
    assert take(state, step=STEP, locate=lambda name: "here", fetch=_from(real, fetched), staging=staging,
                link=lambda holder, name, path: _linked(real, name, path)) == STEP
    assert state.restored and fetched and not [n for n in fetched if n.endswith(".distcp")]  # small files only
    assert {n: p for n, p in model.named_parameters() if not torch.equal(p, want[n])} == {}
    assert not any(staging.iterdir()) and len(real.names()) > len(fetched)  # the shelf keeps its blobs


def _linked(real: Shelf, name: str, path) -> tuple[int, str]:
    entry = real.link(name, path)
    return entry.size, entry.digest


def test_a_linked_blob_must_be_the_manifests_by_size_and_by_its_writers_hash(tmp_path) -> None:
    """A blob linked in place never left this host's memory since its writer hashed it: it is not hashed again,
    but its size and its writer's digest must be the manifest's (a blob of another publish under the same name is
    refused), with the state untouched."""
    real, _ = _published(tmp_path)
    data = blob_name(STEP, "__0_0.distcp")
    model, state, before = _fresh(tmp_path)
    for lie, match in [((3, None), f"blob {data} on this host's shelf holds 3 bytes"),
                       ((None, "blake3:" + "0" * 64),
                        f"blob {data} on this host's shelf is not the manifest's __0_0.distcp")]:
        def link(holder, name, path, lie=lie):
            size, digest = _linked(real, name, path)
            return (lie[0] or size, lie[1] or digest) if name == data else (size, digest)

        with pytest.raises(HandoverError, match=re.escape(match)):
            take(state, step=STEP, locate=lambda name: "here", fetch=_from(real, []), staging=tmp_path / "a",
                 link=link)
        _untouched(model, state, before)


def test_a_file_listed_without_a_digest_is_taken_only_as_its_writers_hosts_or_checked_on_arrival(tmp_path) -> None:
    """[Note: a lone host's files are not hashed]: a handover's manifest may list a file without a digest (its
    writer's host runs the next configuration alone). A take accepts it linked from that host's shelf, read from
    it (the fetch says so: ``{name: None}``), or received checked against the digest its holder computed to send
    it; bytes that nothing checked are refused by name, with the state untouched."""
    import json

    real, want = _published(tmp_path)
    bare = "__0_0.distcp"
    name = blob_name(STEP, "manifest.json")
    manifest = json.loads(bytes(real.get(name)))
    manifest["files"] = [{**f, "digest": None} if f["path"] == bare else f for f in manifest["files"]]
    real.put(name, json.dumps(manifest).encode())

    def link(holder, blob, path):
        size, digest = _linked(real, blob, path)
        return size, None if blob == blob_name(STEP, bare) else digest

    def fetch(said):
        def fetch(holder, names, into, max_bytes):
            _from(real, [])(holder, names, into, max_bytes)
            return {n: said(n) for n in names if n == blob_name(STEP, bare)} if said is not None else None
        return fetch

    wire = fetch(lambda n: of_bytes(bytes(real.get(n))))  # as a server hashes it to send it, checked on arrival
    taken = [dict(link=link), dict(fetch=fetch(lambda n: None)), dict(fetch=wire)]
    for i, how in enumerate(taken):
        model, state, _ = _fresh(tmp_path)
        assert take(state, step=STEP, locate=lambda n: "here", **{"fetch": _from(real, []), **how},
                    staging=tmp_path / "shm" / f"ok{i}") == STEP
        assert {n: p for n, p in model.named_parameters() if not torch.equal(p, want[n])} == {}
    model, state, before = _fresh(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(f"{bare} has no digest in the manifest")):
        take(state, step=STEP, locate=lambda n: "there", fetch=fetch(None), staging=tmp_path / "shm" / "bad")
    _untouched(model, state, before)


def test_a_reader_with_limits_reads_and_hashes_only_the_data(tmp_path) -> None:
    """A file of which only the first bytes are the checkpoint's (a blob read in place, its entry after the data):
    large tensors read straight into their targets and small ones through bounce buffers, whose rounded-up reads
    see past the data; the hash is of the data alone, and a file shorter than its data is refused."""
    from varuna_core.checkpoint.storage import RawReader, RawWriter, dcp_load, dcp_save

    big, small = torch.randn(100_003), torch.randn(7)
    writer = RawWriter(tmp_path, sync_files=False)
    dcp_save({"model/big": big, "model/small": small}, writer)
    expected = {f.path: (f.bytes, f.digest) for f in writer.files}
    data = tmp_path / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(b"an entry after the data " * 300)
    target = {"model/big": torch.zeros(100_003), "model/small": torch.zeros(7)}
    dcp_load(target, RawReader(tmp_path, expected, present=[data.name], limits={data.name: size}), no_dist=True)
    assert torch.equal(target["model/big"], big) and torch.equal(target["model/small"], small)
    with pytest.raises(CheckpointError, match=r"size [0-9]+ != [0-9]+ in the manifest"):
        dcp_load(dict(target), RawReader(tmp_path, expected, present=[data.name]), no_dist=True)
    with pytest.raises(CheckpointError, match="truncated"):
        dcp_load(dict(target), RawReader(tmp_path, expected, present=[data.name],
                                         limits={data.name: data.stat().st_size + 1}), no_dist=True)


def test_a_take_in_place_reads_the_model_straight_into_the_live_tensors(tmp_path) -> None:
    """A warm worker's live state is worth nothing yet: its take reads the parameters into them (no second copy of
    the model), with the same result as a take that checks everything first."""
    real, want = _published(tmp_path)
    model, state, _ = _fresh(tmp_path)
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert take(state, step=STEP, locate=lambda name: "here", fetch=_from(real, []), staging=tmp_path / "a",
                link=lambda holder, name, path: _linked(real, name, path), in_place=True) == STEP
    assert state.restored and {n: p for n, p in model.named_parameters() if not torch.equal(p, want[n])} == {}
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
    momentum = {id(p): s["momentum_buffer"] for p, s in state.optimizer.state.items()}
    _, other, _ = _fresh(tmp_path)
    take(other, step=STEP, locate=lambda name: "here", fetch=_from(real, []), staging=tmp_path / "b")
    assert all(torch.equal(momentum[id(p)], other.optimizer.state[q]["momentum_buffer"])
               for (_, p), (_, q) in zip(state.params, other.params, strict=True))


def test_a_file_whose_holder_fails_comes_from_the_next_holder_and_none_left_is_named(tmp_path, caplog) -> None:
    """With several holders for a file (its writer's, then its replicas' copies), a holder that fails -- gone,
    sending less, damaged -- costs only a retry from the next; when every holder failed, the last failure is
    raised, naming the blob and the holder."""
    from varuna_core.checkpoint.handover import _take_files

    blobs = {blob_name(STEP, "__0_1.distcp"): (b"x" * 100, {}), blob_name(STEP, "__0_2.distcp"): (b"y" * 50, {})}
    expected = {"__0_1.distcp": (100, of_bytes(b"x" * 100)),
                "__0_2.distcp": (50, of_bytes(b"y" * 50))}
    asked: list[str] = []

    def fetch(holder, names, into, max_bytes):
        asked.append(holder)
        if holder == "gone":
            raise HandoverError(f"shelf peer {holder} refused the connection")
        _fetch(blobs)(holder, names, into, max_bytes)

    directory = tmp_path / "a"
    directory.mkdir()
    _take_files({f: ["gone", "replica"] for f in expected}, fetch, STEP, directory, expected)
    # (each file in a request of its own: a holder's data files go in two requests at once)
    assert sorted(asked) == ["gone", "gone", "replica", "replica"]
    assert (directory / "__0_1.distcp").read_bytes() == b"x" * 100
    assert "from another copy instead" in caplog.text
    directory = tmp_path / "b"
    directory.mkdir()
    with pytest.raises(HandoverError, match="holder replica did not send blob"):
        _take_files({f: ["gone", "replica"] for f in expected}, _fetch({}), STEP, directory, expected)
    assert not any(directory.iterdir())


def test_a_holders_data_files_come_in_two_requests_at_once_of_about_equal_bytes(tmp_path, monkeypatch) -> None:
    """Each holder's data files are dealt out, largest first, to two requests of about equal bytes, which run at
    once (each waits here until the other has started); the small files come in one request; a request names at
    most _BATCH files."""
    import threading

    from varuna_core.checkpoint import handover as handover_mod
    from varuna_core.checkpoint.handover import _batches, _take_files

    sizes = {f"__0_{i}.distcp": n for i, n in enumerate([900, 500, 400, 300, 100, 100, 10])}
    expected = {f: (n, of_bytes(bytes([i % 251]) * n)) for i, (f, n) in enumerate(sizes.items())}
    parts = _batches(sorted(sizes), expected)
    assert len(parts) == 2 and sorted(f for part in parts for f in part) == sorted(sizes)
    assert abs(sum(sizes[f] for f in parts[0]) - sum(sizes[f] for f in parts[1])) <= 100
    assert _batches(["RUN", "MANIFEST"], None) == [["RUN", "MANIFEST"]]  # the small files: one request
    assert _batches(["__0_0.distcp"], expected) == [["__0_0.distcp"]]
    blobs = {blob_name(STEP, f): (bytes([i % 251]) * n, {}) for i, (f, n) in enumerate(sizes.items())}
    both = threading.Barrier(2, timeout=10)
    requests: list[list[str]] = []

    def fetch(holder, names, into, max_bytes):
        requests.append(sorted(names))
        both.wait()  # a BrokenBarrierError after 10 s if the other request never starts
        _fetch(blobs)(holder, names, into, max_bytes)

    directory = tmp_path / "a"
    directory.mkdir()
    assert _take_files({f: ["h"] for f in sizes}, fetch, STEP, directory, expected) == set()
    assert len(requests) == 2 and sorted(n for r in requests for n in r) == sorted(blobs)
    for i, (f, n) in enumerate(sizes.items()):
        assert (directory / f).read_bytes() == bytes([i % 251]) * n, f
    monkeypatch.setattr(handover_mod, "_BATCH", 2)
    assert [len(b) for b in _batches(sorted(sizes), expected)] == [2, 2, 2, 1]


def test_a_shelf_that_fills_up_while_the_publish_writes_fails_it_and_leaves_nothing(small_disk, monkeypatch) -> None:
    """The room was there when reserved (another process filled the tmpfs meanwhile: here, its free space is
    misreported): the write that finds no space fails the publish with one error, the room and every file written
    are given back, and a later put still works."""
    import varuna_core.launch.shelf as shelf_mod

    root = small_disk(64 * 1024)
    usage = type(shelf_mod.shutil.disk_usage(root))
    monkeypatch.setattr(shelf_mod.shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 200)  # 160 KB of weights: more than the tmpfs holds
    state = _state(_Tied())
    state.module, state.params, state.weight_groups = model, list(model.named_parameters()), []
    state.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    real = Shelf("job", root=root)
    with pytest.raises(VarunaError, match="No space left on device"):
        publish(state, real.reserve)
    assert not [p for p in real.path.iterdir() if p.suffix in (".resv", ".staging", ".part")]
    real.put("after", b"x" * 100)
    assert bytes(real.get("after")) == b"x" * 100


# ------------------------------------------------------------------------------------------------------------
# A warm worker's take maps the files it owns as its memory ([Note: a take maps its files])


class _Wide(torch.nn.Module):
    """A parameter of 256 KiB and small ones (a file each, the parameter at offset 0, then its momentum)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 256)
        self.norm = torch.nn.LayerNorm(3)


@pytest.fixture
def shm():
    """A directory on the tmpfs of ``/dev/shm``, where the hosts' shelves live (a take maps files only there)."""
    import shutil
    import tempfile
    from pathlib import Path

    from varuna_core.util.fs import in_memory

    if not in_memory("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="varuna-test-map-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wide_state(init: int, **kw):
    torch.manual_seed(init)
    model = _Wide()
    return model, _state(model, weight_groups=[], **kw)


def _wide_published(root) -> tuple[Shelf, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, state = _wide_state(0)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.randn_like(p)}
    real = Shelf("job", root=root)
    publish(state, real.reserve)
    momenta = {n: state.optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    return real, {n: p.detach().clone() for n, p in model.named_parameters()}, momenta


def _mapped_files(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(path, inode) of the file mapping that holds ``tensor``'s first byte, or None (anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                inode = int(parts[4])
                return (parts[5].strip() if len(parts) > 5 else "", inode) if inode else None
    return None


def _inode_of(real: Shelf, name: str) -> int:
    return os.stat(real._file(name)).st_ino


def test_a_warm_take_maps_the_files_it_fetched_as_its_parameters_and_optimizer_state(shm) -> None:
    """Files that came over the wire (checked on arrival) are this rank's own: each tensor stored whole at an
    aligned offset becomes a view of its file's pages, which outlive the staging directory; the rest is read as before,
    and the state is the one published, bit for bit; training goes on in the mapped pages."""
    real, want, momenta = _wide_published(shm / "old")

    def wire(holder, names, into, max_bytes):  # what a shelf server's fetch returns: each blob's checked hash
        for name in names:
            real.get_into(name, lambda e: into(e.name, e.size))
        return {name: real.manifest()[name].digest for name in names}

    model, state = _wide_state(1, iteration=0, seed=1, run_id="run-b")
    staging = shm / "take"
    assert take(state, step=STEP, locate=lambda name: "there", fetch=wire, staging=staging, in_place=True,
                map_files=True) == STEP
    assert not any(staging.iterdir())  # the files are removed; their pages stay while mapped
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
        assert torch.equal(state.optimizer.state[p]["momentum_buffer"], momenta[name]), name
    weight = model.fc.weight
    assert _mapped_files(weight) is not None and _mapped_files(weight)[0].startswith(str(staging))
    assert _mapped_files(state.optimizer.state[weight]["momentum_buffer"]) is not None
    norm = model.norm.weight  # 12 bytes at the start of its file, its slot at byte 12: read into memory of its own
    assert _mapped_files(norm) is not None and _mapped_files(state.optimizer.state[norm]["momentum_buffer"]) is None
    reference = torch.nn.Parameter(want["fc.weight"].clone())
    plain = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    plain.state[reference] = {"momentum_buffer": momenta["fc.weight"].clone()}
    weight.grad, reference.grad = torch.ones_like(weight), torch.ones_like(weight)
    state.optimizer.step()  # in the mapped pages
    plain.step()
    assert torch.equal(weight, reference) and _mapped_files(weight) is not None


def test_a_warm_take_maps_its_hosts_blobs_only_with_drop_which_runs_before_the_first_update(shm) -> None:
    """A blob linked from this host's shelf is mapped in place only when the take can take it off the shelf: just
    before the first optimizer step changes it (until then it is on the shelf as it was, for a take tried again);
    without ``drop`` it is copied, and a take outside memory (a disk) maps nothing."""
    real, want, _ = _wide_published(shm / "old")
    weight_blob = next(n for n in real.names() if n.endswith(".distcp") and real.manifest()[n].size > 2**18)
    before = bytes(real.get(weight_blob))

    def link(holder, name, path):  # as a worker's: None where no link can be made (the blob is then fetched)
        try:
            return _linked(real, name, path)
        except OSError:
            return None

    for drop, staging in ((None, shm / "a"), (lambda names: None, Path("/var/tmp") / f"varuna-map-{os.getpid()}")):
        model, state = _wide_state(1, iteration=0, seed=1, run_id="run-b")
        try:
            take(state, step=STEP, locate=lambda name: "here", fetch=_from(real, []), staging=staging, link=link,
                 in_place=True, map_files=True, drop=drop)
        finally:
            import shutil
            shutil.rmtree(staging, ignore_errors=True)
        assert {n for n, p in model.named_parameters() if _mapped_files(p) is not None} == set()
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())

    dropped: list[list[str]] = []
    model, state = _wide_state(1, iteration=0, seed=1, run_id="run-b")
    take(state, step=STEP, locate=lambda name: "here", fetch=_from(real, []), staging=shm / "b", link=link,
         in_place=True, map_files=True, drop=dropped.append)
    weight = model.fc.weight
    assert _mapped_files(weight)[1] == _inode_of(real, weight_blob)  # the blob's own pages
    assert dropped == [] and bytes(real.get(weight_blob)) == before
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state.optimizer.step()
    assert len(dropped) == 1 and weight_blob in dropped[0] and all(n.endswith(".distcp") for n in dropped[0])
    state.optimizer.step()
    assert len(dropped) == 1  # once


def test_of_the_ranks_that_linked_one_blob_the_lowest_owns_it(shm, monkeypatch) -> None:
    """Ranks of one host that linked the same blob (replicas of a stage, a tied weight's stages) see the same
    device and inode; only the lowest maps it, the others copy theirs before anyone trains."""
    from varuna_core.checkpoint import handover

    directory = shm / "files"
    directory.mkdir()
    for name in ("a", "b", "c"):
        (directory / name).write_bytes(b"x")
    info = {n: os.stat(directory / n) for n in ("a", "b", "c")}
    other = [("z", info["a"].st_dev, info["a"].st_ino), ("y", info["c"].st_dev, info["c"].st_ino + 10**9)]
    monkeypatch.setattr(handover, "_gather", lambda state, mine: [other, mine, [("a", info["b"].st_dev,
                                                                                  info["b"].st_ino)]])
    _, state = _wide_state(0, rank=1, world_size=3)
    assert handover._owned(state, directory, ["a", "b", "c"]) == {"b", "c"}  # rank 0 linked "a" too


def test_in_memory_tells_a_tmpfs_from_a_disk_by_the_longest_mount_point(tmp_path) -> None:
    from varuna_core.util.fs import in_memory

    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:25 / /dev/shm rw,nosuid - tmpfs tmpfs rw\n"
        "31 30 8:2 / /dev/shm/disk rw - xfs /dev/sdb rw\n"
        "32 22 0:26 / /mnt/with\\040space rw - ramfs none rw\n"
        "a line that is not one\n")
    assert in_memory("/dev/shm", str(info)) and in_memory("/dev/shm/x/y", str(info))
    assert not in_memory("/dev/shm/disk/x", str(info)) and not in_memory("/dev/shmx", str(info))
    assert in_memory("/mnt/with space/f", str(info)) and not in_memory("/var/tmp", str(info))
    assert not in_memory("/dev/shm", str(tmp_path / "absent"))


def test_a_last_publish_makes_the_files_a_take_mapped_blobs_without_a_copy(shm) -> None:
    """The files a take mapped whole stay named in ``keep`` while they are the process's memory; a final publish
    (a handover's: the process trains no more) renames each into a blob, hashed, not copied, and a take of it gets
    the trained state bit for bit. A snapshot's publish (not final) copies them, and a file's name goes with the
    last view of its pages."""
    import gc

    from varuna_core.checkpoint import handover

    real, _, _ = _wide_published(shm / "old")

    def wire(holder, names, into, max_bytes):
        for name in names:
            real.get_into(name, lambda e: into(e.name, e.size))
        return {name: real.manifest()[name].digest for name in names}

    model, state = _wide_state(1, iteration=0, seed=1, run_id="run-b")
    keep = shm / "keep"
    take(state, step=STEP, locate=lambda name: "there", fetch=wire, staging=shm / "take", in_place=True,
         map_files=True, keep=keep)
    kept = {p.stat().st_ino: p for p in keep.iterdir()}
    weight = model.fc.weight
    assert _mapped_files(weight)[1] in kept  # its file, under a name of its own
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state.optimizer.step()
    state.iteration = STEP + 1
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}

    snapshot = Shelf("snap", root=shm / "snap")
    publish(state, snapshot.reserve)  # training goes on: copies
    assert set(keep.iterdir()) == set(kept.values())
    assert _inode_of(snapshot, blob_name(STEP + 1, "__0_1.distcp")) not in kept

    final = Shelf("final", root=shm / "final")
    publish(state, final.reserve, final=True)
    adopted = {_inode_of(final, n) for n in final.names() if n.endswith(".distcp")} & set(kept)
    assert _mapped_files(weight)[1] in adopted and not any(keep.iterdir())  # renamed: no copy
    for name in final.names():
        final.get(name)  # its bytes match the digest its entry records, hashed from the mapping (raises if not)
    assert not [path for path in handover._LIVE if path.startswith(str(keep))]
    other, fresh = _wide_state(2, iteration=0, seed=1, run_id="run-c")
    take(fresh, step=STEP + 1, locate=lambda name: "here", fetch=_from(final, []), staging=shm / "again")
    assert all(torch.equal(p, trained[n]) for n, p in other.named_parameters())
    assert torch.equal(fresh.optimizer.state[other.fc.weight]["momentum_buffer"],
                       state.optimizer.state[weight]["momentum_buffer"])

    model2, state2 = _wide_state(3, iteration=0, seed=1, run_id="run-d")
    take(state2, step=STEP, locate=lambda name: "there", fetch=wire, staging=shm / "take2", in_place=True,
         map_files=True, keep=shm / "keep2")
    assert any((shm / "keep2").iterdir()) and [path for path in handover._LIVE if "keep2" in path]
    del model2, state2
    gc.collect()
    assert not any((shm / "keep2").iterdir())  # gone with the last view of each
    assert not [path for path in [*handover._LIVE, *handover._AT.values()] if "keep2" in path]


def test_reside_moves_the_state_into_files_a_last_publish_adopts(shm, monkeypatch) -> None:
    """A worker of the first configuration (nothing taken) moves its parameters and optimizer state into files of
    ``keep`` once: the same values, now the files' pages, where training goes on; its last publish then makes them
    blobs without a copy. State already in such files, or with a number in its optimizer state, stays; a full
    tmpfs fails before anything of that parameter is written; off a tmpfs nothing moves."""
    from varuna_core.checkpoint import handover
    from varuna_core.checkpoint.handover import reside

    model, state = _wide_state(0)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.randn_like(p)}
    state.optimizer.state[model.norm.bias]["count"] = 3  # a number: this parameter's file is written at the publish
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    momenta = {n: state.optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    assert reside(state, Path("/var/tmp") / "varuna-not-in-memory") == 0
    keep = shm / "keep"
    moved = reside(state, keep)
    assert moved >= 2 * 4 * (256 * 256 + 256 + 3) and reside(state, keep) == 0  # once
    kept = {p.stat().st_ino for p in keep.iterdir()}
    assert len(kept) == 3  # fc.weight, fc.bias, norm.weight (norm.bias has a number)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and torch.equal(state.optimizer.state[p]["momentum_buffer"], momenta[name])
        assert (_mapped_files(p) is not None) == (name != "norm.bias"), name
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state.optimizer.step()
    final = Shelf("final", root=shm / "final")
    routes: list[bool] = []
    digest_of = handover._digest_of
    monkeypatch.setattr(handover, "_digest_of", lambda path, mapping=None, size=0:
                        routes.append(mapping is not None) or digest_of(path, mapping, size))
    publish(state, final.reserve, final=True)
    assert {_inode_of(final, n) for n in final.names()} & kept == kept and not any(keep.iterdir())
    assert not [path for path in handover._LIVE if path.startswith(str(keep))]
    assert routes == [True] * len(kept)  # each adopted file hashed from the pages it was trained in
    for name in final.names():
        final.get(name)  # its bytes match the digest its entry records (raises if not)
    monkeypatch.setattr(handover, "_digest_of", digest_of)

    model, state = _wide_state(1)

    def no_room(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="No space"):
        reside(state, keep)
    assert not any(keep.iterdir()) and _mapped_files(model.fc.weight) is None


def test_a_last_publish_hashes_its_live_files_before_its_first_collective_and_hashes_each_once(shm,
                                                                                               monkeypatch) -> None:
    """A final publish begins to hash the files its state trains in before it waits for the other ranks (the
    largest stage comes last: [Note: hash while the others finish]); each adopted file is hashed once (begun early,
    or at its adoption if its hash had not begun), and a live file that is not adopted as it is (its tensor moved
    out of it) is written and its early hash goes unused. The blobs are the trained state, bit for bit."""
    import threading

    from varuna_core.checkpoint import handover
    from varuna_core.checkpoint.handover import reside

    model, state = _wide_state(0)
    for p in model.parameters():
        state.optimizer.state[p] = {"momentum_buffer": torch.randn_like(p)}
    keep = shm / "keep"
    reside(state, keep)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state.optimizer.step()
    files = {n: _mapped_files(p) for n, p in model.named_parameters()}
    assert all(files.values())  # each parameter is a view of its own file
    model.norm.weight.data = model.norm.weight.data.clone()  # out of its file: that file is not adopted as it is
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}

    hashed: list[int] = []  # the mapping of each file hashed
    begun = threading.Event()
    digest_of, agree = handover._digest_of, handover._agree
    monkeypatch.setattr(handover, "_digest_of", lambda path, mapping=None, size=0:
                        hashed.append(id(mapping)) or begun.set() or digest_of(path, mapping, size))
    waited: list[bool] = []

    def first_agree(*args, **kwargs):
        if not waited:  # the publish's first collective: the other ranks would still be stepping here
            waited.append(begun.wait(10))
        return agree(*args, **kwargs)

    monkeypatch.setattr(handover, "_agree", first_agree)
    final = Shelf("final", root=shm / "final")
    publish(state, final.reserve, final=True)
    assert waited == [True]  # a hash had begun before the first collective
    assert len(hashed) == len(set(hashed)) and 3 <= len(hashed) <= 4  # each once (norm.weight's maybe not)
    blobs = {_inode_of(final, n) for n in final.names() if n.endswith(".distcp")}
    for name, (_, inode) in files.items():
        assert (inode in blobs) == (name != "norm.weight"), name  # adopted as they are, but the one moved out
    monkeypatch.setattr(handover, "_digest_of", digest_of)
    for name in final.names():
        final.get(name)  # its bytes match the digest its entry records (raises if not)
    other, fresh = _wide_state(2, iteration=0, seed=1, run_id="run-c")
    take(fresh, step=state.iteration, locate=lambda name: "here", fetch=_from(final, []), staging=shm / "again")
    assert all(torch.equal(p, trained[n]) for n, p in other.named_parameters())
