"""The content digest of checkpoint files and shelf blobs (``varuna_core.util.digest``): BLAKE3 for what is
written, the recorded algorithm for what is checked, and nothing else accepted as a digest."""

from __future__ import annotations

import hashlib
import sys
import threading

import pytest

from varuna_core.util.digest import ALGORITHM, Hasher, algorithm_of, hasher_for, is_digest, of_bytes

# BLAKE3's published test vector for the empty input, and SHA-256's
BLAKE3_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
SHA256_EMPTY = hashlib.sha256(b"").hexdigest()


def test_new_digests_are_blake3_and_name_it() -> None:
    assert ALGORITHM == "blake3"
    assert of_bytes(b"") == f"blake3:{BLAKE3_EMPTY}"
    assert of_bytes(b"", "sha256") == f"sha256:{SHA256_EMPTY}"


def test_a_digest_is_the_same_however_the_bytes_are_fed() -> None:
    data = bytes(range(256)) * 40_000  # ~10 MB: several of BLAKE3's chunks and SIMD lanes
    whole = of_bytes(data)
    for size in (1, 1000, 1 << 20, 3 << 20):
        hasher = Hasher()
        view = memoryview(data)
        for start in range(0, len(data), size):
            hasher.update(view[start:start + size])
        assert hasher.hexdigest() == whole, size
    assert of_bytes(bytearray(data)) == whole and of_bytes(memoryview(data)) == whole
    assert of_bytes(data[:-1] + bytes([data[-1] ^ 1])) != whole


def test_a_recorded_digest_is_checked_by_its_own_algorithm() -> None:
    for recorded in (of_bytes(b"abc"), of_bytes(b"abc", "sha256")):
        hasher = hasher_for(recorded)
        hasher.update(b"abc")
        assert hasher.hexdigest() == recorded and algorithm_of(recorded) == recorded.split(":")[0]


@pytest.mark.parametrize("bad", [
    "", "blake3:", "0" * 64, "blake3:" + "0" * 63, "blake3:" + "0" * 65, "blake3:" + "A" * 64, "md5:" + "0" * 64,
    "BLAKE3:" + "0" * 64, " blake3:" + "0" * 64, "blake3:" + "0" * 64 + "\n", "sha256:" + "g" * 64,
    "blake3:" + "0" * 32 + "/" + "0" * 31, None, 5, b"blake3:" + b"0" * 64, ["blake3:" + "0" * 64],
    "blake3:" + "0" * 10_000_000,
])
def test_anything_else_is_not_a_digest(bad) -> None:
    assert not is_digest(bad)
    with pytest.raises(ValueError, match="not a digest"):
        hasher_for(bad)
    with pytest.raises(ValueError, match="not a digest"):
        algorithm_of(bad)


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        Hasher("md5")


def test_hashing_lets_other_threads_run() -> None:
    """The hash runs outside the GIL (what lets a receiver or a writer hash on a helper thread while its own
    thread moves the next bytes). With a switch interval of a second, a thread that holds the GIL keeps it for
    the whole of a 256 MiB hash; so a counting thread advances during the hash only if the hash let the GIL go."""
    data = memoryview(bytes(256 << 20))
    ticks, done, running = [0], threading.Event(), threading.Event()

    def count() -> None:
        running.set()
        while not done.is_set():
            ticks[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    counter = threading.Thread(target=count)
    try:
        counter.start()
        running.wait()
        before = ticks[0]  # the counter gave the GIL back to let this run: it waits for it now
        of_bytes(data)
        during = ticks[0] - before  # read before the counter could run again under a GIL held throughout
    finally:
        done.set()
        counter.join()
        sys.setswitchinterval(interval)
    assert during > 0
