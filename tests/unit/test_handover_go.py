"""The go of a handover, the launcher's word to the warm workers of the new configuration: signed with the job's
token and bound to the attempt it is for, so that nobody else on the network, and no go of an earlier morph
replayed from the store, can tell a worker where to take its state from; and the worker's side of a morph
(``worker/morph.py``): which old rank holds which file, the configuration it refuses, the wait for the go."""

from __future__ import annotations

import json
import os

import pytest

from varuna_core.env import WorkerEnv
from varuna_core.errors import ConfigError, HandoverError
from varuna_core.launch.protocol import GO_KEY, MAX_GO, Go, ShelfHolder, decode_go, encode_go, parse_command
from varuna_core.worker.morph import Morph, holder_rank

TOKEN = "t" * 64


def _go(**fields) -> Go:
    values = dict(attempt=3, source="shelf", step=12, shelf="job-a2",
                  holders=[ShelfHolder(host="h0", address="10.0.0.1", port=4000),
                           ShelfHolder(host="h1", address="10.0.0.2", port=4001)], fallback_step=10)
    return Go(**{**values, **fields})


def test_a_go_round_trips_for_its_attempt_only() -> None:
    text = encode_go(_go(), TOKEN)
    assert decode_go(text, TOKEN, 3) == _go()
    with pytest.raises(ValueError, match="for attempt 3, not this worker's attempt 4"):
        decode_go(text, TOKEN, 4)  # a go of an earlier morph, left in a store, is not this one's
    with pytest.raises(ValueError, match="not signed with the job's token"):
        decode_go(text, "other", 3)


def _tampered(change) -> str:
    outer = json.loads(encode_go(_go(), TOKEN))
    payload = json.loads(outer["p"])
    change(payload)
    return json.dumps({"p": json.dumps(payload), "mac": outer["mac"]})


@pytest.mark.parametrize("text", [
    "", "not json", "[]", "{}", '{"p": 1, "mac": "x"}', '{"p": "{}", "mac": 5}', "[" * 100_000,
    '{"p": "{}", "mac": "\\u00ff"}', "x" * (MAX_GO + 1),
    _tampered(lambda p: p.update(step=0)),  # another step, the old signature
    _tampered(lambda p: p["holders"][0].update(address="203.0.113.9")),  # a holder of the attacker's
])
def test_anything_but_a_signed_go_is_refused(text) -> None:
    with pytest.raises(ValueError):
        decode_go(text, TOKEN, 3)


def _signed(payload: dict) -> str:
    import hashlib
    import hmac

    text = json.dumps(payload)
    mac = hmac.new(TOKEN.encode(), b"varuna-handover-go\0" + text.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": text, "mac": mac})


@pytest.mark.parametrize(("payload", "why"), [
    ({"attempt": 3, "source": "shelf", "step": 1}, "names the shelf and its holders"),
    ({"attempt": 3, "source": "store"}, "names its step"),
    ({"attempt": 3, "source": "elsewhere"}, "source"),
    ({"attempt": 3, "source": "none", "step": -1}, "step"),
    ({"attempt": True, "source": "none"}, "attempt"),  # strict: a bool is not a number
    ({"attempt": 3, "source": "shelf", "step": "1", "shelf": "s", "holders": []}, "step"),
    ({"attempt": 3, "source": "shelf", "step": 1, "shelf": "s",
      "holders": [{"host": "h", "address": "a", "port": 70000}]}, "port"),
    ({"attempt": 3, "source": "none", "extra": 1}, "extra"),
])
def test_a_signed_but_malformed_go_is_refused_with_the_reason(payload, why) -> None:
    with pytest.raises(ValueError, match=why):
        decode_go(_signed(payload), TOKEN, 3)


def test_the_agent_command_carries_a_go_of_bounded_size() -> None:
    assert parse_command(json.dumps({"cmd": "handover", "message": "x"})).message == "x"
    for bad in ({"cmd": "handover"}, {"cmd": "handover", "message": 5},
                {"cmd": "handover", "message": "x" * (MAX_GO + 1)}):
        with pytest.raises(ValueError):
            parse_command(json.dumps(bad))


@pytest.mark.parametrize(("blob", "rank"), [
    ("step_5/__0_0.distcp", 0), ("step_5/__3_0.distcp", 3), ("step_5/__12_1.distcp", 12),
    ("step_5/.metadata", 0), ("step_5/manifest.json", 0), ("step_5/COMPLETE", 0), ("step_5/RUN", 0),
    ("step_5/__x_0.distcp", 0), ("step_5/__1_0.distcp.tmp", 0),
])
def test_the_holder_of_a_file_is_the_rank_that_wrote_it(blob, rank) -> None:
    assert holder_rank(blob) == rank


def test_a_go_names_holders_by_old_rank() -> None:
    morph = Morph(WorkerEnv(job_id="j", job_token=TOKEN, attempt=3, shelf_dir="/dev/shm", host="h1"))
    locate = morph.locate(_go())
    assert locate("step_12/__1_0.distcp") == ("h1", "10.0.0.2", 4001)
    assert locate("step_12/manifest.json") == ("h0", "10.0.0.1", 4000)
    with pytest.raises(KeyError):
        locate("step_12/__2_0.distcp")  # no old rank 2: the take names the blob and falls back


def test_a_warm_worker_needs_its_shelf_and_a_known_mode() -> None:
    assert Morph.launched(WorkerEnv()) is None
    with pytest.raises(ConfigError, match="VARUNA_HANDOVER=wait needs VARUNA_SHELF_DIR"):
        Morph.launched(WorkerEnv(handover="wait", job_id="j", job_token=TOKEN))
    with pytest.raises(ConfigError, match="VARUNA_HANDOVER is 'later'"):
        Morph.launched(WorkerEnv(handover="later", job_id="j", job_token=TOKEN, shelf_dir="/dev/shm"))


@pytest.fixture
def store():
    import datetime

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield master


def _warm(store) -> Morph:
    told = WorkerEnv(job_id="j", job_token=TOKEN, attempt=3, shelf_dir="/dev/shm", handover="wait")
    return Morph(told, ("127.0.0.1", store.port))


def test_a_warm_worker_takes_the_go_for_its_attempt(store) -> None:
    store.set(GO_KEY, encode_go(_go(), TOKEN))
    assert _warm(store).wait_for_go(timeout=10) == _go()


@pytest.mark.parametrize("message", [encode_go(_go(), "another job's token"), encode_go(_go(attempt=2), TOKEN),
                                     "garbage"])
def test_a_warm_worker_refuses_a_go_that_is_not_its_own(store, message) -> None:
    store.set(GO_KEY, message)
    with pytest.raises(HandoverError, match="refused the launcher's go"):
        _warm(store).wait_for_go(timeout=10)


def test_a_warm_worker_does_not_wait_for_ever(store) -> None:
    with pytest.raises(HandoverError, match=r"did not come within 0\.2 s"):
        _warm(store).wait_for_go(timeout=0.2)


# ------------------------------------------------------------------------------------------------------------
# [Note: receive into touched memory]


def _joining(tmp_path, attempt: int = 3) -> Morph:
    return Morph(WorkerEnv(job_id="j", job_token=TOKEN, attempt=attempt, shelf_dir=str(tmp_path), host="h1",
                           handover="wait"))


def test_only_a_host_without_the_previous_attempts_shelf_counts_as_joining(tmp_path) -> None:
    from varuna_core.launch.shelf import Shelf, shelf_key

    assert not _joining(tmp_path).holds_old_state()
    Shelf(shelf_key("j", 1), root=tmp_path).path.mkdir()  # an older attempt's: not the one handing over
    assert not _joining(tmp_path).holds_old_state()
    Shelf(shelf_key("j", 2), root=tmp_path).path.mkdir()
    assert _joining(tmp_path).holds_old_state()
    assert _joining(tmp_path, attempt=1).holds_old_state()  # a first attempt takes nothing: left alone
    assert Morph(WorkerEnv(attempt=3, host="h1", handover="wait")).holds_old_state()  # unknown: left alone


def _pool(morph: Morph) -> dict[str, int]:
    """The files of touched memory on the shelf: name -> bytes."""
    return {p.name: p.stat().st_size for p in morph.shelf.path.glob("*.prefault")}


def test_prefault_makes_a_file_per_expected_file_within_half_the_free_memory(tmp_path, monkeypatch) -> None:
    from varuna_core.worker import morph as morph_mod

    mib, slack = 1 << 20, morph_mod._POOL_SLACK
    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", mib)  # small writes: the logic, not the volume
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 20 * mib)
    morph = _joining(tmp_path)
    pid = os.getpid()
    # the largest first; a file under a MiB is left out (received into new pages: few faults)
    assert morph.prefault([mib, 3 * mib + 5, mib - 1, 2 * mib]) == 6 * mib + 5 + 3 * slack
    assert _pool(morph) == {f"{pid}-0.prefault": 3 * mib + 5 + slack, f"{pid}-1.prefault": 2 * mib + slack,
                            f"{pid}-2.prefault": mib + slack}
    assert morph.prefault([mib]) == 0  # one pool at a time
    morph.give_back()
    assert _pool(morph) == {} and morph._pool == []
    morph.give_back()  # nothing held: nothing to do
    assert morph.prefault([4 * mib] * 5) == 10 * mib  # half of what is available: the last file cut short
    assert sorted(_pool(morph).values()) == [2 * mib - 2 * slack, 4 * mib + slack, 4 * mib + slack]
    morph.give_back()
    assert morph.prefault([mib - 1, 0]) == 0 and _pool(morph) == {}  # too little to be worth it
    assert morph.prefault([]) == 0
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 0)  # unreadable /proc/meminfo: nothing
    assert morph.prefault([3 * mib]) == 0
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * mib)
    real = os.statvfs(tmp_path)
    small = os.statvfs_result((real.f_bsize, mib, 0, 0, 6, *real[5:]))  # 6 free blocks of a MiB: a small tmpfs
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    assert morph.prefault([10 * mib]) == 3 * mib  # half its free space
    morph.give_back()
    assert _pool(morph) == {}


def test_a_full_tmpfs_keeps_what_was_prefaulted_and_a_planted_file_is_not_written(tmp_path, monkeypatch) -> None:
    import errno

    from varuna_core.worker import morph as morph_mod

    mib = 1 << 20
    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", mib)  # small writes: the logic, not the volume
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * mib)
    writes = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        if len(writes) == 4:  # (the first file takes three writes: two of a MiB and its slack)
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    morph = _joining(tmp_path)
    assert morph.prefault([2 * mib] * 3) == 3 * mib + morph_mod._POOL_SLACK  # the first whole, the second in part
    assert sorted(_pool(morph).values()) == [mib, 2 * mib + morph_mod._POOL_SLACK]
    morph.give_back()
    monkeypatch.setattr(os, "pwrite", real)
    target = tmp_path / "elsewhere"
    (morph.shelf.path / f"{os.getpid()}-0.prefault").symlink_to(target)  # planted: never followed
    assert morph.prefault([2 * mib]) == 0 and not target.exists()
    (morph.shelf.path / f"{os.getpid()}-0.prefault").unlink()
    morph.shelf.path.chmod(0o777)  # a shelf directory others can write: not used
    assert morph.prefault([2 * mib]) == 0 and not list(morph.shelf.path.iterdir())


def test_a_file_arriving_is_received_into_the_smallest_file_of_touched_memory_that_holds_it(tmp_path,
                                                                                            monkeypatch) -> None:
    from varuna_core.worker import morph as morph_mod

    mib, slack = 1 << 20, morph_mod._POOL_SLACK
    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", mib)
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * mib)
    morph = _joining(tmp_path)
    morph.prefault([3 * mib, mib, 2 * mib])
    inodes = {size: os.stat(morph.shelf.path / name).st_ino for name, size in _pool(morph).items()}
    into = tmp_path / "take"
    into.mkdir()
    assert morph.claim(2 * mib, into / "a")  # the 2 MiB file (with its slack), not the 3 MiB one
    assert os.stat(into / "a").st_ino == inodes[2 * mib + slack]
    assert not morph.claim(mib - 1, into / "small")  # a small file is made new
    assert not morph.claim(mib, into / "a")  # never over a file that exists; the one picked is dropped
    assert sorted(_pool(morph).values()) == [3 * mib + slack]
    assert morph.claim(5 * mib, into / "b")  # none large enough: the largest, made larger by the take
    assert os.stat(into / "b").st_ino == inodes[3 * mib + slack]
    assert not morph.claim(mib, into / "c") and _pool(morph) == {}  # none left
    assert morph.claimed == 7 * mib


def test_a_host_with_old_state_in_shelf_files_touches_memory_for_the_rest_and_leaves_room_to_publish(
        tmp_path, monkeypatch) -> None:
    from varuna_core.launch.shelf import Shelf, shelf_key
    from varuna_core.worker import morph as morph_mod

    mib, slack = 1 << 20, morph_mod._POOL_SLACK
    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", mib)
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 1000 * mib)
    sizes = [4 * mib] * 6 + [2 * mib] * 6  # 36 MiB of state expected
    joining = _joining(tmp_path)
    assert joining.prepare_take(sizes) == 36 * mib + 12 * slack  # a host that joins: all of it
    joining.give_back()
    old = Shelf(shelf_key("j", 2), root=tmp_path).path
    old.mkdir()
    morph = _joining(tmp_path)
    assert morph.old_live_bytes() == 0 and morph.prepare_take(sizes) == 0  # old state in process memory: none
    (old / "7.live").mkdir()
    (old / "7.live" / "a.live").write_bytes(bytes(18 * mib))
    (old / "8.live").symlink_to(tmp_path)  # a link is not the old workers' state
    (old / "9.live").write_bytes(bytes(mib))  # nor a plain file
    (old / "x.blob").write_bytes(bytes(mib))  # nor a blob (a snapshot: its take may come over the wire)
    assert morph.old_live_bytes() == 18 * mib
    assert morph.prepare_take(sizes) == 18 * mib  # half the state is here: a half of each size class is touched
    # three of each size, the last cut to the 18 MiB
    assert sorted(_pool(morph).values()) == [2 * mib - 5 * slack] + [2 * mib + slack] * 2 + [4 * mib + slack] * 3
    morph.give_back()
    two = _joining(tmp_path)
    two.local_workers = 2  # the old state is shared by two new workers here: each touches its share of the rest
    assert 23 * mib < two.prepare_take(sizes) <= 27 * mib  # (a sample of whole files: within one file of it)
    two.give_back()
    real = os.statvfs(tmp_path)  # a tmpfs of 40 MiB free, 18 of which the old workers' publish will ask for
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((real.f_bsize, mib, 0, 0, 40, *real[5:])))
    assert morph.prefault(sizes, keep_free=30 * mib) == 10 * mib
    morph.give_back()
    (old / "7.live" / "a.live").write_bytes(bytes(40 * mib))  # more than the stage: nothing to receive
    assert morph.prepare_take(sizes) == 0
    assert _joining(tmp_path, attempt=1).prepare_take(sizes) == 0  # a first attempt takes nothing


def test_a_sample_keeps_each_size_in_its_proportion() -> None:
    from varuna_core.worker.morph import _sample

    sizes = [9] * 10 + [5] * 20 + [1] * 30
    picked = _sample(sizes, 0.5)
    assert (picked.count(9), picked.count(5), picked.count(1)) == (5, 10, 15)
    assert _sample(sizes, 1.0) == sizes and _sample([7], 0.1) == [] and _sample([7], 0.6) == [7]
