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


def test_prefault_touches_what_it_is_asked_within_half_the_free_memory_and_gives_it_back(tmp_path,
                                                                                         monkeypatch) -> None:
    from varuna_core.worker import morph as morph_mod

    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", 1 << 20)  # small chunks: the logic, not the volume
    chunk = morph_mod._PREFAULT_CHUNK
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 10 * chunk)
    morph = _joining(tmp_path)
    path = morph.shelf.path / f"{os.getpid()}.prefault"
    assert morph.prefault(3 * chunk + 5) == 3 * chunk + 5 and path.stat().st_size == 3 * chunk + 5
    assert morph.prefault(chunk) == 0  # one at a time
    morph.give_back(chunk)
    assert path.stat().st_size == 2 * chunk + 5
    morph.give_back(10 * chunk)  # more than it holds: all of it
    assert not path.exists() and morph._pool is None
    morph.give_back()  # nothing held: nothing to do
    assert morph.prefault(100 * chunk) == 5 * chunk  # half of what is available
    morph.give_back()
    assert not path.exists()
    assert morph.prefault(chunk - 1) == 0 and not path.exists()  # too little to be worth it
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 0)  # unreadable /proc/meminfo: nothing
    assert morph.prefault(3 * chunk) == 0
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * chunk)
    real = os.statvfs(tmp_path)
    small = os.statvfs_result((real.f_bsize, chunk, 0, 0, 6, *real[5:]))  # 6 free blocks of a chunk: a small tmpfs
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    assert morph.prefault(10 * chunk) == 3 * chunk  # half its free space
    morph.give_back()


def test_a_full_tmpfs_keeps_what_was_prefaulted_and_a_planted_file_is_not_written(tmp_path, monkeypatch) -> None:
    import errno

    from varuna_core.worker import morph as morph_mod

    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", 1 << 20)  # small chunks: the logic, not the volume
    chunk = morph_mod._PREFAULT_CHUNK
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * chunk)
    writes = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        if writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    morph = _joining(tmp_path)
    assert morph.prefault(4 * chunk) == chunk
    morph.give_back()
    monkeypatch.setattr(os, "pwrite", real)
    target = tmp_path / "elsewhere"
    (morph.shelf.path / f"{os.getpid()}.prefault").symlink_to(target)  # planted: never followed
    assert morph.prefault(2 * chunk) == 0 and not target.exists()
    (morph.shelf.path / f"{os.getpid()}.prefault").unlink()
    morph.shelf.path.chmod(0o777)  # a shelf directory others can write: not used
    assert morph.prefault(2 * chunk) == 0 and not list(morph.shelf.path.iterdir())


def test_a_fetch_over_the_wire_gives_back_its_bytes_before_they_arrive(tmp_path, monkeypatch) -> None:
    from varuna_core.launch.protocol import Go, ShelfHolder
    from varuna_core.worker import morph as morph_mod

    monkeypatch.setattr(morph_mod, "_PREFAULT_CHUNK", 1 << 20)  # small chunks: the logic, not the volume
    chunk = morph_mod._PREFAULT_CHUNK
    monkeypatch.setattr(morph_mod, "_available_memory", lambda: 100 * chunk)
    morph = _joining(tmp_path)
    morph.prefault(4 * chunk)
    path = morph.shelf.path / f"{os.getpid()}.prefault"
    sizes = []

    def fetch_into(address, port, *, names, max_bytes, **kwargs):
        sizes.append(path.stat().st_size if path.exists() else 0)
        return {}

    monkeypatch.setattr(morph_mod, "fetch_into", fetch_into)
    go = Go(attempt=3, source="shelf", step=1, shelf="j-a2",
            holders=[ShelfHolder(host="h2", address="10.0.0.2", port=7)])
    fetch = morph.fetch(go)
    fetch(("h2", "10.0.0.2", 7), ["step_1/__0_0.distcp"], lambda name, size: None, chunk)
    fetch(("h2", "10.0.0.2", 7), ["step_1/__0_1.distcp"], lambda name, size: None, 5 * chunk)
    assert sizes == [3 * chunk, 0] and not path.exists()

