"""Floor L0 — the content digest that checkpoint files and shelf blobs are checked by.

A digest names its algorithm: ``"blake3:<64 hex digits>"``. Every file and blob written now gets BLAKE3 (the
``blake3`` package: the reference implementation, with the SIMD code each CPU has). Why not SHA-256, as before: a
handover's publish and take hash every byte of the training state on the critical path of a morph, and a
checkpoint's save and load hash every byte they move; on the 2-core VM of benchmarks/README.md hashlib's SHA-256
(with the CPU's SHA extensions) runs at 1.8 GB/s on one core, BLAKE2b at 0.9, BLAKE3 at 3.6-4.5 GB/s, and BLAKE3
is as strong a hash. Both let go of the GIL while they hash, so a helper thread overlaps them with I/O.

``"sha256:<hex>"`` is still checked where it is recorded: the manifests written before this format recorded a
bare sha256 (:class:`~varuna_core.checkpoint.manifest.FileEntry` reads that as such), and a file is always
checked with the algorithm its record names (:func:`hasher_for`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import blake3

__all__ = ["ALGORITHM", "DIGEST_PATTERN", "Hasher", "algorithm_of", "hasher_for", "is_digest", "of_bytes"]

ALGORITHM = "blake3"  # what new digests use
_ALGORITHMS: dict[str, Any] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}
DIGEST_PATTERN = r"^(blake3|sha256):[0-9a-f]{64}$"  # the JSON schemas' pattern of a digest
_DIGEST = re.compile(DIGEST_PATTERN)


class Hasher:
    """A running digest: :meth:`update` with buffers (any contiguous buffer; the GIL is released while it
    hashes), :meth:`hexdigest` for the ``"<algorithm>:<hex>"`` of what it saw."""

    __slots__ = ("_hash", "algorithm")

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algorithm!r}")
        self.algorithm = algorithm
        self._hash = _ALGORITHMS[algorithm]()

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"


def is_digest(value: object) -> bool:
    """Whether ``value`` is a digest this module can check: ``"<algorithm>:<64 lower-case hex digits>"``."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def algorithm_of(expected: str) -> str:
    """The algorithm the recorded digest ``expected`` was made with (ValueError if it is not a digest)."""
    if not is_digest(expected):
        raise ValueError(f"not a digest: {str(expected)[:80]!r}")
    return expected.split(":", 1)[0]


def hasher_for(expected: str) -> Hasher:
    """A hasher of the algorithm the recorded digest ``expected`` was made with, to check bytes against it
    (ValueError if ``expected`` is not a digest)."""
    return Hasher(algorithm_of(expected))


def of_bytes(data: Any, algorithm: str = ALGORITHM) -> str:
    """The digest of one buffer."""
    hasher = Hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()
