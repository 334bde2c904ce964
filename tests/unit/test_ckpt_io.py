"""Checkpoint byte I/O: what is written is what is read back, byte for byte, with the right hash, through the
O_DIRECT path (aligned and unaligned tensors, small and large, bounce buffer boundaries) and the ordinary one."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from varuna_core.checkpoint import io as ckpt_io
from varuna_core.checkpoint.io import BackgroundHasher, FileSink, copy_file, open_source, scatter_file
from varuna_core.checkpoint.storage import METADATA_FILE, RawReader, RawWriter, dcp_load, dcp_save, read_metadata
from varuna_core.errors import CheckpointError
from varuna_core.util.digest import of_bytes


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of a few pages, so that a few hundred KiB cross many block and buffer boundaries."""
    monkeypatch.setattr(ckpt_io, "BLOCK", 64 * 1024)
    monkeypatch.setattr(ckpt_io, "READ_BLOCK", 48 * 1024)
    monkeypatch.setattr(ckpt_io, "ALIGNED_MIN", 16 * 1024)


def arrays(seed: int = 0) -> list[np.ndarray]:
    """Byte arrays of awkward sizes, some views at odd offsets into a larger buffer (unaligned addresses)."""
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, size=3 * 2**20, dtype=np.uint8)
    return [
        rng.integers(0, 256, size=n, dtype=np.uint8)
        for n in (1, 7, 4096, 4095, 70_000, 200_003)
    ] + [big[13:13 + 123_457], big[4096:4096 + 300_000], big[100:101], rng.integers(0, 256, 0, dtype=np.uint8)]


def write(path: Path, data: list[np.ndarray], durable: bool = True) -> tuple[list[int], int, str]:
    sink = FileSink(path, durable=durable)
    offsets = []
    for a in data:
        offsets.append(sink.place(a))
        sink.write(a)
    size, sha = sink.close()
    return offsets, size, sha


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_round_trip_and_hash(tmp_path, where, small_disk) -> None:
    # tmpfs refuses O_DIRECT: a private one of our own, not /dev/shm, whose size and presence vary by machine
    base = tmp_path if where == "disk" else small_disk(16 * 2**20)
    path = base / f"varuna-test-{os.getpid()}.bin"
    try:
        data = arrays()
        offsets, size, sha = write(path, data)
        raw = path.read_bytes()
        assert size == len(raw) and sha == of_bytes(raw)
        for off, a in zip(offsets, data, strict=True):
            assert raw[off:off + a.nbytes] == a.tobytes()
        # read back whole (hashing) and in parts, into fresh arrays of both alignments
        for whole in (True, False):
            outs = [np.empty_like(a) for a in data]
            keep = list(range(len(data))) if whole else [1, 4, 6, 7]
            fd = open_source(path)
            try:
                digest = BackgroundHasher() if whole else None
                scatter_file(fd, [(offsets[i], outs[i]) for i in keep], digest)
                if digest is not None:
                    assert digest.hexdigest() == sha
            finally:
                os.close(fd)
            for i in keep:
                assert np.array_equal(outs[i], data[i]), i
    finally:
        path.unlink(missing_ok=True)


def test_large_tensors_are_placed_for_direct_io(tmp_path) -> None:
    data = [np.ones(5, np.uint8), np.arange(100_000, dtype=np.uint8)]
    offsets, _, _ = write(tmp_path / "f.bin", data)
    assert (offsets[1] - ckpt_io.address(data[1])) % 4096 == 0
    assert offsets[0] == 0


def test_copy_file(tmp_path) -> None:
    data = arrays(1)
    _, size, sha = write(tmp_path / "a.bin", data)
    assert copy_file(tmp_path / "a.bin", tmp_path / "b.bin") == size
    assert of_bytes((tmp_path / "b.bin").read_bytes()) == sha


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"model/w": torch.randn(300, 257, generator=g), "model/b": torch.randn(7, generator=g),
            "optim/w/step": torch.tensor(4.0), "model/h": torch.randn(64, 65, generator=g).to(torch.bfloat16),
            "buffer/ids": torch.arange(10_000), "model/t": torch.randn(40, 50, generator=g).t()}


def _save(directory: Path, state: dict) -> RawWriter:
    writer = RawWriter(directory)
    dcp_save(state, writer)
    return writer


def _load(directory: Path, target: dict, expected=None) -> None:
    dcp_load(target, RawReader(directory, expected), no_dist=True)


def test_dcp_round_trip_every_dtype_and_layout(tmp_path) -> None:
    state = _state()
    writer = _save(tmp_path / "c", state)
    names = {f.path for f in writer.files}
    assert names == {"__0_0.distcp", METADATA_FILE}
    for f in writer.files:
        assert of_bytes((tmp_path / "c" / f.path).read_bytes()) == f.digest
    expected = {f.path: (f.bytes, f.digest) for f in writer.files}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["model/t"] = torch.zeros(40, 50).t()  # a non-contiguous target is filled through a staging copy
    _load(tmp_path / "c", target, expected)
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    meta = read_metadata(tmp_path / "c", expected)
    assert meta.state_dict_metadata["model/h"].properties.dtype == torch.bfloat16


def test_corruption_and_truncation_are_refused_by_name(tmp_path) -> None:
    state = _state()
    writer = _save(tmp_path / "c", state)
    expected = {f.path: (f.bytes, f.digest) for f in writer.files}
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: digest mismatch"):
        _load(tmp_path / "c", target, expected)
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated"):
        _load(tmp_path / "c", target, expected)
    (tmp_path / "c" / METADATA_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match=r"dcp_metadata\.json"):
        _load(tmp_path / "c", target, expected)


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["VARUNA_TEST_CANARY"]),))


def test_loading_executes_nothing_from_the_directory(tmp_path, monkeypatch) -> None:
    """A pickle planted where DCP's own reader would unpickle its index is never opened."""
    state = _state()
    writer = _save(tmp_path / "c", state)
    canary = tmp_path / "canary"
    monkeypatch.setenv("VARUNA_TEST_CANARY", str(canary))
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    _load(tmp_path / "c", target, {f.path: (f.bytes, f.digest) for f in writer.files})
    assert not canary.exists()
    assert torch.equal(target["model/w"], state["model/w"])


def test_new_files_only_never_through_a_link(tmp_path) -> None:
    """Checkpoint files are always new: a file or a link planted at their name is refused, never overwritten or
    written through."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "link").symlink_to(victim)
    for name in ("link", "victim"):
        with pytest.raises(FileExistsError):
            FileSink(tmp_path / name)
        (tmp_path / "src.bin").write_bytes(b"x" * 10)
        with pytest.raises(FileExistsError):
            copy_file(tmp_path / "src.bin", tmp_path / name)
    assert victim.read_bytes() == b"keep me"


def _local_plan(state: dict[str, torch.Tensor]):
    """DCP's local save plan of ``state`` (what each rank sends the coordinator)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=False)
    return planner.create_local_plan()


def _written(plans) -> list[set[str]]:
    return [{item.index.fqn for item in plan.items} for plan in plans]


def test_replicated_groups_are_written_whole_by_one_replica_and_not_by_one_that_leaves() -> None:
    """Two data-parallel replicas hold the same parameters with their moments, and each a state of its own. Each
    parameter group is written whole by one replica, the groups shared out between them; with rank 1 to be
    avoided (its host leaves), rank 0 writes every group and rank 1 only what no other rank holds; with every
    rank avoided, the groups are shared out as before."""
    from varuna_core.checkpoint.handover import by_parameter
    from varuna_core.checkpoint.storage import dedup_by_group

    shared = {f"model/{p}": torch.ones(n) for p, n in (("a", 300), ("b", 200), ("c", 100))}
    shared |= {f"optim/{p}/exp_avg": torch.ones(n) for p, n in (("a", 300), ("b", 200), ("c", 100))}
    plans = [_local_plan(shared | {f"rng/{rank}": torch.ones(4)}) for rank in (0, 1)]
    groups = {"a", "b", "c"}

    def groups_of(fqns: set[str]) -> set[str]:
        return {by_parameter(f) for f in fqns if not f.startswith("rng/")}

    balanced = _written(dedup_by_group(plans, by_parameter))
    assert groups_of(balanced[0]) | groups_of(balanced[1]) == groups
    assert groups_of(balanced[0]) and groups_of(balanced[1]) and not groups_of(balanced[0]) & groups_of(balanced[1])
    for fqns in balanced:  # a parameter and its moment in the same plan
        mine = groups_of(fqns)
        assert {f"optim/{g}/exp_avg" for g in mine} | {f"model/{g}" for g in mine} <= fqns
    assert "rng/0" in balanced[0] and "rng/1" in balanced[1]
    avoided = _written(dedup_by_group(plans, by_parameter, avoid={1}))
    assert avoided[0] == set(shared) | {"rng/0"} and avoided[1] == {"rng/1"}
    assert _written(dedup_by_group(plans, by_parameter, avoid={0, 1})) == balanced
