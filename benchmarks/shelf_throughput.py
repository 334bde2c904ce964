"""How fast does the shelf move state: put and get on this host, and fetch from a peer over the loopback?

In one invocation this script puts ``--size-mb`` MiB of random bytes onto a job's shelf in ``--root`` (a tmpfs:
``/dev/shm`` by default) as ``--blobs`` blobs (a stage's tensors, roughly), then times, ``--repeats`` times each:

* ``put``: every blob onto the shelf (hash, reservation, copy into the tmpfs, rename);
* ``get``: every blob back, size and SHA-256 checked;
* ``fetch``: every blob from a :class:`~varuna_core.launch.shelf.ShelfServer` on 127.0.0.1, in one signed request,
  into buffers allocated beforehand (:func:`~varuna_core.launch.shelf.fetch_into`), every hash checked.

and, as references on the same machine, SHA-256 over the same bytes (every path hashes once) and a plain copy of
them. Rates are MB/s (10^6 bytes) of blob bytes over the median time. The loopback has no link to fill, so the
fetch figure bounds what the wire costs per byte on top of a network's own rate.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from varuna_core.launch.shelf import DEFAULT_ROOT, Shelf, ShelfServer, fetch_into
from varuna_core.util.digest import of_bytes


def _median_seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="MiB of state in all (default 256)")
    parser.add_argument("--blobs", type=int, default=16, help="blobs it is cut into (default 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=str(DEFAULT_ROOT), help="where the shelf goes (default /dev/shm)")
    args = parser.parse_args()

    size = args.size_mb * 2**20 // args.blobs
    blobs = {f"blocks.{i}.weight": os.urandom(size) for i in range(args.blobs)}
    total = size * args.blobs
    token, job = os.urandom(16).hex(), f"bench-{os.getpid()}"
    shelf = Shelf(job, root=tempfile.mkdtemp(prefix="shelf-bench-", dir=args.root))
    buffers = {name: bytearray(size) for name in blobs}
    rows = []
    try:
        rows.append(("sha256 (reference)", _median_seconds(lambda: [hashlib.sha256(b).digest()
                                                                    for b in blobs.values()], args.repeats)))
        rows.append(("digest (reference)", _median_seconds(lambda: [of_bytes(b) for b in blobs.values()],
                                                           args.repeats)))
        rows.append(("copy (reference)", _median_seconds(lambda: [bytearray(b) for b in blobs.values()],
                                                         args.repeats)))
        rows.append(("put", _median_seconds(lambda: [shelf.put(n, b, {"dtype": "uint8", "shape": [size]})
                                                     for n, b in blobs.items()], args.repeats)))
        rows.append(("get", _median_seconds(lambda: [shelf.get(n) for n in blobs], args.repeats)))
        with ShelfServer(shelf, token) as server:
            def one_fetch() -> None:
                fetch_into("127.0.0.1", server.port, job=job, token=token, names=list(blobs),
                           into=lambda e: memoryview(buffers[e.name]), max_bytes=total)
            rows.append(("fetch (loopback)", _median_seconds(one_fetch, args.repeats)))
        if any(bytes(buffers[n]) != b for n, b in blobs.items()):
            raise SystemExit("fetch returned other bytes than were put")
    finally:
        shelf.clear()
        os.rmdir(shelf.path.parent)
    print(f"{total / 2**20:.0f} MiB in {args.blobs} blobs, shelf in {args.root}, median of {args.repeats}")
    for what, seconds in rows:
        print(f"  {what:<20} {seconds * 1e3:8.1f} ms  {total / seconds / 1e6:8.0f} MB/s")


if __name__ == "__main__":
    main()
