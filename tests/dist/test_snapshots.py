"""In-memory snapshots: a pp=2 run on two "hosts" (one shelf root each, no directory shared) snapshots every two
steps; each host then holds its own ranks' files and a copy of the other host's, only of the newest snapshot; with
one host lost, a new rank takes the snapshot from the survivor alone and the run goes on as if uninterrupted."""

from __future__ import annotations

import shutil
import socket

import pytest

from tests.dist.harness import run_ranks
from tests.dist.test_checkpoint import BATCH, CHUNK, assert_resumed, steps_as, uninterrupted
from varuna_core.launch.shelf import Shelf, ShelfServer, shelf_key

pytestmark = pytest.mark.dist

JOB, TOKEN = "snapshot-test", "s3cret-token"
EVERY, STEPS = 2, 5
SMALL = ("COMPLETE", "RUN", "dcp_metadata.json", "manifest.json")


def _run(**extra) -> dict:
    return {"schedule": "1f1b", "optimizer": "adamw", "batch": BATCH, "chunk": CHUNK, **extra}


@pytest.fixture(scope="module")
def snapshotted(tmp_path_factory):
    """Five steps at pp=2 with a snapshot every two; returns (shelf roots, each rank's reports, tmp)."""
    tmp = tmp_path_factory.mktemp("snapshots")
    roots = [str(tmp / "host0"), str(tmp / "host1")]
    run = _run(steps=STEPS, snapshot={"every": EVERY, "job": JOB, "token": TOKEN, "roots": roots})
    results = run_ranks({"map": "0;1", "timeout": 30, "runs": [run]}, 2, tmp / "train", timeout=90)
    for res in results:
        assert res.returncode == 0, res.error
    return roots, [res.result["runs"][0]["snapshots"] for res in results], tmp


def _shelf(root: str) -> Shelf:
    return Shelf(shelf_key(JOB, 1), root=root)


def test_each_host_keeps_its_own_files_and_the_other_hosts_of_the_newest_snapshot_only(snapshotted) -> None:
    roots, reports, _ = snapshotted
    for mine in reports:
        assert [(r["step"], r["peer"]) for r in mine] == [(2, True), (4, True)]
    on = [set(_shelf(root).names()) for root in roots]
    assert on[0] == on[1], "each host holds the whole snapshot: its own files and the other host's copy"
    last = f"step_{STEPS - 1}/"
    assert all(name.startswith(last) for name in on[0]), sorted(on[0])  # step 2 was dropped once 4 was whole
    assert {f"{last}{f}" for f in SMALL} <= on[0]
    writers = {name.split("/")[1].split("_")[2] for name in on[0] if name.endswith(".distcp")}
    assert writers == {"0", "1"}
    for root in roots:  # a copy is the writer's bytes, and says so on every read
        shelf = _shelf(root)
        for name in shelf.names():
            shelf.get(name)


def _dead_address() -> str:
    with socket.socket() as sock:  # a port that was free and is closed again: nobody answers there
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_with_a_host_lost_the_snapshot_is_taken_from_the_other_and_the_run_goes_on(snapshotted) -> None:
    roots, _, tmp = snapshotted
    server = ShelfServer(_shelf(roots[1]), TOKEN)  # host 0 is gone: only host 1's shelf answers
    step = STEPS - 1
    try:
        take = {"step": step, "job": shelf_key(JOB, 1), "token": TOKEN,
                "servers": [_dead_address(), f"127.0.0.1:{server.port}"], "roots": roots,
                "staging": str(tmp / "recover" / "staging")}
        run = _run(steps=step + 2, take=take)
        results = run_ranks({"map": "0", "timeout": 30, "runs": [run]}, 1, tmp / "recover", timeout=60)
    finally:
        server.close()
    assert_resumed(results, *uninterrupted(steps_as("0;1", step, "0", 2)), first=step)


def test_a_damaged_file_of_the_snapshot_is_taken_from_its_copy_and_named(snapshotted, tmp_path) -> None:
    roots, _, _ = snapshotted
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for root, host in zip(roots, hosts, strict=True):
        shutil.copytree(root, host)
    shelf = _shelf(str(hosts[1]))
    damaged = next(n for n in shelf.names() if "/__1_" in n)  # a file rank 1 wrote, on its own host
    with open(shelf._file(damaged), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    servers = [ShelfServer(_shelf(str(h)), TOKEN) for h in hosts]
    step = STEPS - 1
    try:
        take = {"step": step, "job": shelf_key(JOB, 1), "token": TOKEN,
                "servers": [f"127.0.0.1:{s.port}" for s in servers], "roots": [str(h) for h in hosts],
                "staging": str(tmp_path / "take" / "staging")}
        run = _run(steps=step + 2, take=take)
        results = run_ranks({"map": "0;1", "timeout": 30, "runs": [run]}, 2, tmp_path / "take", timeout=60)
    finally:
        for server in servers:
            server.close()
    assert_resumed(results, *uninterrupted(steps_as("0;1", step, "0;1", 2)), first=step)
    logs = "".join(res.output for res in results)
    assert damaged in logs and "digest" in logs and "from another copy instead" in logs, logs[-3000:]
