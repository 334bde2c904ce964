"""A checkpoint handed over through host memory: published by a pp=2 run into two shelves that share no directory
(one per rank, as two hosts), taken back over the shelf servers under other layouts, and the run continues as if
uninterrupted; a damaged blob or a holder that is gone is refused by name, with the state untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_checkpoint import BATCH, CHUNK, assert_resumed, steps_as, uninterrupted
from varuna_core.errors import HandoverError
from varuna_core.launch.shelf import Shelf, ShelfServer, fetch
from varuna_core.util.fs import in_memory

pytestmark = pytest.mark.dist

JOB, TOKEN = "handover-test", "s3cret-token"
SHM = "/dev/shm"
STEP = 2


def _run(**extra) -> dict:
    return {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, **extra}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Two steps at pp=2, published into one shelf root per rank, in memory (a tmpfs, as the hosts' shelves are:
    a take maps files only there); returns (roots, blob map, work directory)."""
    tmp = tmp_path_factory.mktemp("handover")
    if not in_memory(SHM):
        pytest.skip(f"{SHM} is not a tmpfs here")
    shm = Path(tempfile.mkdtemp(prefix="varuna-test-handover-", dir=SHM))
    try:
        roots = [str(shm / "host0"), str(shm / "host1")]
        yield roots, _publish("0;1", roots, tmp), tmp, shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _publish(layout: str, roots: list[str], tmp: Path, reports: list | None = None, **extra) -> dict[str, int]:
    """Train ``STEP`` steps under ``layout``, rank r then publishes into ``roots[r]``; returns the blob map (the
    same on every rank); each rank's report is appended to ``reports``."""
    run = _run(steps=STEP, publish={"at": STEP, "job": JOB, "roots": roots, **extra})
    results = run_ranks({"map": layout, "timeout": 30, "runs": [run]}, len(roots), tmp / "publish", timeout=90)
    for res in results:
        assert res.returncode == 0, res.error
    owners = results[0].result["runs"][0]["owners"]
    assert all(res.result["runs"][0]["owners"] == owners for res in results)
    if reports is not None:
        reports.extend(res.result["runs"][0] for res in results)
    return owners


def _index(roots) -> dict:
    """The published checkpoint's index (rank 0's, on the first host): tensor -> its chunks and their files."""
    return json.loads(bytes(Shelf(JOB, root=roots[0]).get(f"step_{STEP}/dcp_metadata.json")))["tensors"]


def _key(fqn: str) -> str:
    """The parameter (or buffer, or RNG state) a checkpoint entry belongs to."""
    kind, _, rest = fqn.partition("/")
    return rest.rsplit("/", 1)[0] if kind == "optim" else rest if kind == "model" else fqn


def _serve(roots):
    return [ShelfServer(Shelf(JOB, root=root), TOKEN) for root in roots]


def _take(servers, owners, tmp, name, **extra) -> dict:
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    return {"step": STEP, "job": JOB, "token": TOKEN, "owners": owners, "servers": addresses,
            "roots": [str(r) for r in extra.pop("roots")], "staging": str(tmp / name / "staging"), **extra}


def test_publish_puts_each_rank_files_on_its_own_host(published) -> None:
    roots, owners, *_ = published
    on = [set(Shelf(JOB, root=root).names()) for root in roots]
    small = {f"step_{STEP}/{f}" for f in ("RUN", "COMPLETE", "manifest.json", "dcp_metadata.json")}
    data = [{n for n in names if n.startswith(f"step_{STEP}/__{rank}_")} for rank, names in enumerate(on)]
    assert on[0] == small | data[0] and on[1] == data[1]
    # a file per parameter (with its optimizer state): any stage of another partition takes only its own
    index = _index(roots)
    for rank in (0, 1):
        assert len(data[rank]) > 2 and all(n.endswith(".distcp") for n in data[rank])
        for name in data[rank]:
            keys = {_key(fqn) for fqn, t in index.items() for c in t["chunks"] if f"step_{STEP}/{c['file']}" == name}
            assert len(keys) == 1, (name, keys)
    assert owners == {**dict.fromkeys(on[0], 0), **dict.fromkeys(on[1], 1)}
    for root in roots:  # each file was written once, where it stays: nothing else is left on the shelf
        shelf = Shelf(JOB, root=root)
        assert sorted(p.suffix for p in shelf.path.iterdir() if p.name != ".lock") == [".blob"] * len(shelf.names())
    entry, stream = Shelf(JOB, root=roots[1]).open(f"step_{STEP}/__1_0.distcp")
    stream.close()
    assert entry.meta == {"bytes": entry.size, "digest": entry.digest, "rank": 1}


@pytest.mark.parametrize(("resume_map", "world", "partition", "local", "map_files"), [
    ("0", 1, None, {}, False),  # one rank on a third host: every blob over the wire
    ("0", 1, None, {}, True),  # the same as a warm worker takes: the files it fetched become its memory
    # another partition (the old one is (0, 3), (3, 5)), each rank on an old host: stage 1's tensors are all in
    # old rank 1's file, so it takes no other; as a warm worker, the blobs it linked become its memory
    ("0;1", 2, [(0, 4), (4, 5)], {"0": 0, "1": 1}, True),
])
def test_take_under_another_layout_equals_uninterrupted(published, resume_map, world, partition, local,
                                                        map_files) -> None:
    """The run goes on as if uninterrupted: every loss, parameter and buffer. Taken as a warm worker takes
    (``map_files``), the parameters stored whole at an aligned offset are the taken files' pages (the blobs linked
    from a rank's own shelf included, which its first optimizer step then takes off the shelf)."""
    roots, owners, tmp, shm = published
    name = f"take-{world}-{map_files}"
    if map_files and local:  # its blobs leave their shelves: a publish of its own, the same as the module's
        roots = [str(shm / name / "host0"), str(shm / name / "host1")]
        owners = _publish("0;1", roots, tmp / name)
    servers = _serve(roots)
    try:
        take = _take(servers, owners, tmp, name, roots=roots, local=local, map_files=map_files,
                     staging=str(shm / name / "staging"))
        run = _run(steps=2 * STEP, take=take, **({"partition": partition} if partition else {}))
        results = run_ranks({"map": resume_map, "timeout": 30, "runs": [run]}, world, tmp / name, timeout=60)
    finally:
        for server in servers:
            server.close()
    assert_resumed(results, *uninterrupted(steps_as("0;1", STEP, resume_map, STEP)), first=STEP)
    small = {f"step_{STEP}/{f}" for f in ("COMPLETE", "RUN", "dcp_metadata.json", "manifest.json")}
    tensors = _index(roots)
    taken = {}
    for rank, res in enumerate(results):
        got = res.result["runs"][0]
        assert small <= set(got["taken"]), got["taken"]
        taken[got["stage"]] = files = set(got["taken"]) - small
        mine = {*got["params"], *(f"buffer/{b}" for b in got["buffers"]), f"rng/rank{rank}"}
        for blob in files:  # every file taken holds some tensor of this rank's own
            keys = {_key(fqn) for fqn, t in tensors.items() for c in t["chunks"] if f"step_{STEP}/{c['file']}" == blob}
            assert keys & mine, (blob, keys)
    if partition:
        assert 0 < len(taken[1]) < len(taken[0]), taken  # stage 1 takes its few parameters' files, not a rank's
    assert not any((shm / name / "staging").iterdir())  # the staging directories are removed
    for res in results:
        got = res.result["runs"][0]
        # a file per parameter, the parameter first in it: each is mapped (its own bytes, at offset 0)
        assert bool(got["mapped"]) == map_files and set(got["mapped"]) <= set(got["params"]), got["mapped"]
        if map_files:
            assert len(got["mapped"]) >= len(got["params"]) - 1, (got["mapped"], sorted(got["params"]))
    if map_files and local:  # the blobs a rank mapped in place left the shelf before its first update
        left = set(Shelf(JOB, root=roots[0]).names()) | set(Shelf(JOB, root=roots[1]).names())
        assert not {n for n in set(owners) - left if not n.endswith(".distcp")}, sorted(set(owners) - left)
        assert set(owners) - left, "no blob was mapped in place"


def test_a_damaged_blob_or_a_holder_gone_is_refused_by_name(published, tmp_path) -> None:
    roots, owners, *_ = published
    shelf = Shelf(JOB, root=roots[1])
    blob = max(shelf.manifest().values(), key=lambda e: e.size).name  # a parameter's file: every take needs it
    path = shelf.path / f"{hashlib.sha256(blob.encode()).hexdigest()}.blob"
    original = path.read_bytes()
    servers = _serve(roots)
    try:
        damaged = bytearray(original)
        damaged[2] ^= 0xFF  # a byte of the data (its entry follows it)
        path.write_bytes(bytes(damaged))
        take = _take(servers, owners, tmp_path, "damaged", roots=roots, expect_error=True)
        got = _one(run_ranks({"map": "0", "timeout": 30, "runs": [_run(steps=4, take=take)]}, 1, tmp_path / "d",
                             timeout=60))
        assert got["error"].startswith("HandoverError"), got["error"]
        assert blob in got["error"] and f"127.0.0.1:{servers[1].port}" in got["error"], got["error"]
        _untouched(got)
        path.write_bytes(original)
        servers[1].close()  # the holder of that file is gone
        take = _take(servers, owners, tmp_path, "gone", roots=roots, expect_error=True)
        got = _one(run_ranks({"map": "0", "timeout": 30, "runs": [_run(steps=4, take=take)]}, 1, tmp_path / "g",
                             timeout=60))
        assert got["error"].startswith("HandoverError"), got["error"]
        assert f"step_{STEP}/__1_" in got["error"] and f"127.0.0.1:{servers[1].port}" in got["error"], got["error"]
        _untouched(got)
    finally:
        path.write_bytes(original)
        for server in servers:
            server.close()


def _one(results) -> dict:
    (res,) = results
    assert res.returncode == 0, res.error
    return res.result["runs"][0]


def _untouched(got: dict) -> None:
    assert got["iteration"] == 0
    for name, value in got["params"].items():
        assert torch.equal(value, got["params_before"][name]), name


def test_under_data_parallelism_each_host_keeps_its_stage_whole_and_a_holder_gone_costs_nothing(tmp_path) -> None:
    """pp=1 x dp=2 published on two hosts: each rank writes half of the stage's files and keeps a copy of the other
    half (its replica's, byte for byte, from its own tensors), but not its replica's RNG state. Host 1 is then
    gone before the take: one rank on a third host takes everything from host 0, and the run goes on as if
    uninterrupted."""
    roots = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    owners = _publish("0,1", roots, tmp_path)
    shelves = [Shelf(JOB, root=root) for root in roots]
    written = [{n for n, r in owners.items() if r == rank and n.endswith(".distcp")} for rank in (0, 1)]
    assert written[0] and written[1]  # the writes are shared between the replicas
    for rank, other in ((0, 1), (1, 0)):
        held = {n for n in shelves[rank].names() if n.endswith(".distcp")}
        copies = held - written[rank]
        assert copies and copies < written[other], (rank, sorted(copies))
        missing = written[other] - copies  # only the replica's first file, with its RNG state
        assert missing == {f"step_{STEP}/__{other}_0.distcp"}, missing
        for name in copies:
            assert bytes(shelves[rank].get(name)) == bytes(shelves[other].get(name)), name
    _resume_without_host1(roots, owners, tmp_path, "take")


def _resume_without_host1(roots: list[str], owners: dict[str, int], tmp: Path, name: str) -> None:
    """Host 1 of a pp=1 x dp=2 publish is gone: one rank on a third host takes everything from host 0 and goes
    on as if uninterrupted."""
    servers = _serve(roots)
    try:
        servers[1].close()
        take = _take(servers, owners, tmp, name, roots=roots)
        resumed = run_ranks({"map": "0", "timeout": 30, "runs": [_run(steps=2 * STEP, take=take)]}, 1,
                            tmp / name, timeout=90)
    finally:
        for server in servers:
            server.close()
    assert_resumed(resumed, *uninterrupted(steps_as("0,1", STEP, "0", STEP)), first=STEP)


def test_a_host_that_leaves_leaves_the_writes_to_its_replicas_and_keeps_no_copies(tmp_path) -> None:
    """pp=1 x dp=2 published for a handover to host 0 alone (host 1 leaves: a preemption): rank 0 writes every file
    of the stage, rank 1 only its own RNG state and no copies, so host 0 holds all the next configuration takes
    and nothing was written twice; host 1 is then gone, and the run goes on from host 0 as if uninterrupted."""
    roots = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    owners = _publish("0,1", roots, tmp_path, final=True, leaving=[1])
    held = [{n for n in Shelf(JOB, root=root).names() if n.endswith(".distcp")} for root in roots]
    written = [{n for n, r in owners.items() if r == rank and n.endswith(".distcp")} for rank in (0, 1)]
    assert written[1] == held[1] == {f"step_{STEP}/__1_0.distcp"}, (written[1], held[1])
    assert held[0] == written[0] and len(written[0]) > 1, sorted(held[0])
    _resume_without_host1(roots, owners, tmp_path, "take")


def test_two_ranks_of_a_host_share_out_the_copies_it_keeps(tmp_path) -> None:
    """pp=1 x dp=4 on two hosts of two ranks: each host keeps every file of the stage once -- its own ranks' and
    a copy of each of the other host's (but their RNG files) -- and its two ranks made half of the copies each."""
    host0, host1 = str(tmp_path / "host0"), str(tmp_path / "host1")
    owners = _publish("0,1,2,3", [host0, host0, host1, host1], tmp_path)
    for root, mine, theirs in ((host0, (0, 1), (2, 3)), (host1, (2, 3), (0, 1))):
        shelf = Shelf(JOB, root=root)
        entries = {n: e for n, e in shelf.manifest().items() if n.endswith(".distcp")}
        own = {n for n, r in owners.items() if r in mine and n.endswith(".distcp")}
        other = {n for n, r in owners.items() if r in theirs and n.endswith(".distcp")}
        rng = {f"step_{STEP}/__{r}_0.distcp" for r in theirs}
        assert set(entries) == own | (other - rng), root
        copiers = [entries[n].meta["copy"] for n in other - rng]
        assert sorted(set(copiers)) == list(mine) and abs(copiers.count(mine[0]) - copiers.count(mine[1])) <= 1


def test_without_copies_each_file_is_published_once(tmp_path) -> None:
    """``copies=False`` (``varuna launch --no-handover-copies``): under data parallelism each host holds only the
    files its own ranks wrote."""
    roots = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    owners = _publish("0,1", roots, tmp_path, copies=False)
    for rank, root in enumerate(roots):
        held = {n for n in Shelf(JOB, root=root).names() if n.endswith(".distcp")}
        assert held == {n for n, r in owners.items() if r == rank and n.endswith(".distcp")}, rank


def test_a_last_publish_of_state_that_lives_in_files_copies_nothing_and_equals_uninterrupted(published) -> None:
    """pp=1 x dp=2 on two hosts whose shelves are in memory: after its first step each rank moves its state into
    files of its shelf (``reside``) and trains in them; the handover's publish (``final``) makes each file a blob
    as it is, its own or as the copy of its replica's (the same bytes, checked against the writer's hash), so
    that nothing is left of them; host 1 is then gone, and one rank on a third host takes everything from host 0
    and goes on as if uninterrupted."""
    _, _, tmp, shm = published
    roots = [str(shm / "resident" / "host0"), str(shm / "resident" / "host1")]
    reports: list[dict] = []
    owners = _publish("0,1", roots, tmp / "resident", reports, reside_at=1, final=True)
    assert all(report["resided"] > 0 for report in reports), [r["resided"] for r in reports]
    for root in roots:
        # every file became a blob, its own or its replica's copy: written once, in training (a group's entries are
        # written by one replica: a parameter on one and its moments on the other would leave both to copy)
        assert not any((Path(root) / "keep").iterdir())
    shelves = [Shelf(JOB, root=root) for root in roots]
    written = [{n for n, r in owners.items() if r == rank and n.endswith(".distcp")} for rank in (0, 1)]
    held = {n for n in shelves[0].names() if n.endswith(".distcp")}
    assert written[1] - held == {f"step_{STEP}/__1_0.distcp"}  # a copy of each but the replica's RNG file
    _resume_without_host1(roots, owners, tmp, "resident-take")


def test_a_lone_hosts_last_publish_leaves_its_live_files_unhashed_and_only_that_host_takes_them(published) -> None:
    """pp=1 x dp=2, each rank's state in files of its shelf, published for a handover to host 0 alone (host 1 leaves;
    [Note: a lone host's files are not hashed]): the files host 0 trained in become blobs without a digest, in their
    entries and in the manifest; host 1's and the files written anew are hashed. A read that verifies refuses them;
    host 0's server hashes them to send them. A rank on host 0 takes them, copied from the shelf or linked in place,
    and a rank on a third host over the wire (a new configuration tried again elsewhere): each goes on as if
    uninterrupted."""
    _, _, tmp, shm = published
    roots = [str(shm / "alone" / "host0"), str(shm / "alone" / "host1")]
    owners = _publish("0,1", roots, tmp / "alone", reside_at=1, final=True, leaving=[1], alone=[0])
    shelves = [Shelf(JOB, root=root) for root in roots]
    entries = shelves[0].manifest()
    written = {n for n, r in owners.items() if r == 0 and n.endswith(".distcp")}
    bare = {n for n in written if entries[n].digest is None}
    trained_in = {f"step_{STEP}/{c['file']}" for fqn, t in _index(roots).items() for c in t["chunks"]
                  if fqn.startswith("model/")}  # (the RNG's and the buffers' files are written anew)
    assert bare == trained_in & written and len(bare) > 1, sorted(written - bare)
    assert all(e.digest is not None for e in shelves[1].manifest().values())
    listed = {f"step_{STEP}/{f['path']}": f["digest"]
              for f in json.loads(bytes(shelves[0].get(f"step_{STEP}/manifest.json")))["files"]}
    assert {n for n, digest in listed.items() if digest is None} == bare
    blob = sorted(bare)[0]
    with pytest.raises(HandoverError, match="never hashed"):
        shelves[0].get(blob)
    servers = _serve(roots)
    try:
        sent = fetch("127.0.0.1", servers[0].port, job=JOB, token=TOKEN, names=[blob], max_bytes=1 << 40)[blob]
        assert sent[0].digest is not None and shelves[0].manifest()[blob].digest is None
        runs = {"elsewhere": {}, "copied": {"local": {"0": 0}, "no_links": True},
                "linked": {"local": {"0": 0}, "map_files": True}}  # (the last: its blobs leave the shelf)
        got = {}
        for name, extra in runs.items():
            take = _take(servers, owners, tmp, f"alone-{name}", roots=roots, **extra,
                         staging=str(shm / "alone" / name))
            got[name] = run_ranks({"map": "0", "timeout": 30, "runs": [_run(steps=2 * STEP, take=take)]}, 1,
                                  tmp / f"alone-{name}", timeout=60)
    finally:
        for server in servers:
            server.close()
    for name, results in got.items():
        assert_resumed(results, *uninterrupted(steps_as("0,1", STEP, "0", STEP)), first=STEP)
        assert _one(results)["mapped"] if name == "linked" else not _one(results)["mapped"], name
