"""Moving checkpoint bytes between tensors and files at the disk's speed, hashing them on the way.

Measurements (``benchmarks/checkpoint_io.py``, a 2-core VM on ext4) decided how:

* Through the page cache, a write or a cold read costs whatever the kernel pays for fresh pages: on a VM that
  hands freed memory back to its host, 0.3-1 GB/s, varying from run to run. ``O_DIRECT`` moves the bytes
  between the device and the tensors' own memory at the device's rate every time, and several reads in
  flight keep the device busy. So files are written and read with ``O_DIRECT`` where the file system allows
  it (not on tmpfs or some network file systems: there, ordinary I/O with early write-back).
* ``O_DIRECT`` needs 4 KiB-aligned memory, file offsets and lengths. A large tensor is therefore stored at a
  file offset congruent to its address modulo 4 KiB (zero padding before it), so the aligned middle of its
  bytes goes straight between the tensor and the disk; only its first and last partial pages, and small
  tensors, pass through a 32 MiB aligned bounce buffer. PyTorch allocates tensors of the same size at the
  same offset within a page, so the load finds its targets aligned the same way and reads into them directly.
* The digest (:mod:`varuna_core.util.digest`: BLAKE3, 3.6-4.5 GB/s on one core here; SHA-256 ran at ~1.8 GB/s,
  about the disk's rate) must overlap the I/O, not follow it. Hashing and file I/O release the GIL, so
  :class:`BackgroundHasher` hashes buffer ``k`` on a helper thread while the caller writes or reads the next.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import CheckpointError, VarunaError
from ..util.digest import ALGORITHM, Hasher
from ..util.fs import open_regular

__all__ = ["BackgroundHasher", "FileSink", "bounce_buffers", "open_source", "scatter_file", "copy_file", "address"]

BLOCK = 32 * 2**20  # bytes per write of the bounce buffer (a multiple of the alignment)
READ_BLOCK = 16 * 2**20  # bytes per read
READ_DEPTH = 3  # reads in flight
ALIGNED_MIN = 64 * 2**10  # tensors at least this large are placed for direct I/O
_ALIGN = 4096


def address(data: np.ndarray) -> int:
    return int(data.ctypes.data)


class BackgroundHasher:
    """The digest (:mod:`varuna_core.util.digest`) of a stream of buffers, computed on a helper thread.

    :meth:`update` returns at once; the buffer must stay unchanged until :meth:`wait` (or the next
    :meth:`update`, which waits for the previous one) returns. ``algorithm``: that of a recorded digest the
    bytes are checked against (a file written before BLAKE3 was checked by SHA-256); new files get the default.
    """

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        self._hash = Hasher(algorithm)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="varuna-hash")
        self._pending: Future | None = None

    def update(self, data: memoryview) -> None:
        self.wait()
        self._pending = self._pool.submit(self._hash.update, data)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def hexdigest(self) -> str:
        self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class FileSink:
    """Append-only writer of one new file that hashes everything written to it.

    Args:
        path: the file, created: it must not exist yet (a link planted there is never written through).
        durable: fsync before :meth:`close` returns (else the data may still sit in the page cache).

    Use: ``offset = sink.place(arr)`` then ``sink.write(arr)`` for each tensor's bytes (a contiguous uint8
    array); ``place`` pads a large array to its direct-I/O position and returns the file offset where it lands.
    ``close`` returns ``(bytes, digest)`` of the file.
    """

    def __init__(self, path: str | os.PathLike, durable: bool = True,
                 buffers: list[memoryview] | None = None) -> None:
        """``buffers``: two aligned bounce buffers of :data:`BLOCK` bytes to use (:func:`bounce_buffers`), when
        one writer writes many files one after another (allocating 64 MiB per file would cost more than small
        files' writes)."""
        self.durable = durable
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)  # new files only: no link followed
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self.offset = 0  # bytes taken (the logical end of the file)
        self._flushed = 0  # bytes handed to the kernel (direct: a multiple of the alignment until close)
        self.digest = BackgroundHasher()
        self._buffers = (buffers or bounce_buffers()) if self.direct else []
        self._current = 0
        self._fill = 0

    def place(self, data: np.ndarray) -> int:
        if data.nbytes >= ALIGNED_MIN:
            pad = (address(data) - self.offset) % _ALIGN
            if pad:
                self.write(np.zeros(pad, dtype=np.uint8))
        return self.offset

    def write(self, data: np.ndarray) -> None:
        view = data.data.cast("B")  # ndarray.data: the array's memoryview
        if not self.direct:
            self._write_buffered(view)
            return
        head = (-self.offset) % _ALIGN
        body = (len(view) - head) // _ALIGN * _ALIGN if len(view) > head else 0
        if body < ALIGNED_MIN or (address(data) + head) % _ALIGN:
            self._append(view)
            return
        self._append(view[:head])
        self._flush_bounce()  # ends on an aligned offset: the body goes straight from the tensor's memory
        for start in range(head, head + body, BLOCK):
            piece = view[start:min(start + BLOCK, head + body)]
            self.digest.update(piece)
            self._write(piece, piece)
        self.offset += body
        self._append(view[head + body:])
        self.digest.wait()  # ``data`` may be a temporary the caller frees on return

    def _write_buffered(self, view: memoryview) -> None:
        for start in range(0, len(view), BLOCK):
            piece = view[start:start + BLOCK]
            self.digest.update(piece)
            _write_all(self.fd, piece)
            if self.durable:
                _start_writeback(self.fd, self._flushed, len(piece))
            self._flushed += len(piece)
        self.offset += len(view)
        self.digest.wait()

    def _append(self, view: memoryview) -> None:
        """Copy into the bounce buffer, writing it out whenever it is full."""
        done = 0
        while done < len(view):
            buf = self._buffers[self._current]
            n = min(len(view) - done, BLOCK - self._fill)
            buf[self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            self.offset += n
            if self._fill == BLOCK:
                self._flush_bounce()

    def _flush_bounce(self) -> None:
        """Hash the bounce buffer's bytes (helper thread) while writing them (this thread), then switch to the
        other buffer: its previous hash finished when this one's began (``BackgroundHasher.update`` waits)."""
        if not self._fill:
            return
        buf, length = self._buffers[self._current], self._fill
        self.digest.update(buf[:length])
        padded = -(-length // _ALIGN) * _ALIGN  # only the last write of the file is padded; close truncates
        if padded > length:
            buf[length:padded] = bytes(padded - length)
        self._write(buf[:padded], buf[:length])
        self._current ^= 1
        self._fill = 0

    def _write(self, aligned: memoryview, exact: memoryview) -> None:
        try:
            _write_all(self.fd, aligned)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # the file system took the O_DIRECT open but not the aligned write: continue without O_DIRECT
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.lseek(self.fd, self._flushed, os.SEEK_SET)
            _write_all(self.fd, exact)
        self._flushed += len(exact)

    def close(self) -> tuple[int, str]:
        try:
            if self.direct and self._fill:
                self._flush_bounce()
                os.ftruncate(self.fd, self._flushed)  # drop the alignment padding of the last write
            if self.durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            digest = self.digest.hexdigest()
        return self._flushed, digest


def open_source(path: str | os.PathLike, *, what: str = "checkpoint file",
                error: type[VarunaError] = CheckpointError) -> int:
    """A read-only descriptor of the regular file ``path``, with ``O_DIRECT`` where the file system allows it.

    A checkpoint's files are named by the checkpoint itself, so ``path`` is opened as
    :func:`~varuna_core.util.fs.open_regular` does with ``follow=False``: a link planted under a data file's
    name could make ``varuna ckpt merge`` copy any readable file, and a FIFO would block the reader forever.
    ``O_DIRECT`` is set on the descriptor afterwards (``F_SETFL``), where a file system without it says EINVAL.

    Raises:
        ``error``: missing, unreadable, a link, or not a regular file.
    """
    fd = open_regular(path, what=what, follow=False, error=error)
    if hasattr(os, "O_DIRECT"):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError:
            pass  # no O_DIRECT on this file system: ordinary reads
    return fd


def scatter_file(fd: int, pieces: list[tuple[int, np.ndarray]], digest: BackgroundHasher | None = None, *,
                 size: int | None = None) -> None:
    """Fill each ``(file offset, destination)`` piece (a contiguous uint8 array) with the file's bytes there.

    The aligned middle of a piece whose address matches its offset modulo 4 KiB is read straight into it; the
    rest passes through aligned bounce buffers. ``READ_DEPTH`` reads are in flight at once (helper threads).
    With ``digest``, the whole file is read in order and hashed, block ``k``'s hash running while this thread
    copies block ``k + 1`` out; without, only what the pieces need is read. Pieces must not overlap and must
    lie inside the file (the caller checks the size first). ``size``: the file's first bytes that are read (and
    hashed) at most; default, all of it.
    """
    size = os.fstat(fd).st_size if size is None else size
    order = sorted(pieces, key=lambda p: p[0])
    segments = _segments(size, order, whole=digest is not None)
    nbuf = READ_DEPTH + 1
    bounced = [length for _, length, into in segments if into is None]
    block = min(READ_BLOCK, -(-max(bounced, default=0) // _ALIGN) * _ALIGN)  # a small file: small buffers
    buffers = _lend(min(nbuf, len(bounced)), block)
    slot: dict[int, int] = {}  # segment index -> bounce buffer index
    free = list(range(len(buffers)))
    first = 0

    def target(i: int) -> memoryview:
        _, length, into = segments[i]
        if into is None:
            slot[i] = free.pop(0)
            return buffers[slot[i]][:length]
        return into

    with ThreadPoolExecutor(max_workers=READ_DEPTH, thread_name_prefix="varuna-read") as pool:
        reads: dict[int, Future] = {}
        ahead = 0

        def refill() -> None:
            nonlocal ahead
            while ahead < len(segments) and len(reads) < READ_DEPTH and (segments[ahead][2] is not None or free):
                reads[ahead] = pool.submit(_pread_all, fd, target(ahead), segments[ahead][0])
                ahead += 1

        refill()
        for i, (start, length, into) in enumerate(segments):
            n = min(reads.pop(i).result(), max(size - start, 0))  # a rounded-up read may see past ``size``
            data = into if into is not None else buffers[slot[i]]
            if digest is not None:
                digest.update(data[:n])  # also waits for the previous segment's hash
            if i and segments[i - 1][2] is None:  # the previous bounce buffer is hashed and copied: reuse it
                free.append(slot.pop(i - 1))
            refill()
            if into is None:
                end = start + n
                while first < len(order) and order[first][0] + order[first][1].nbytes <= start:
                    first += 1
                for off, out in order[first:]:
                    if off >= end:
                        break
                    a, b = max(off, start), min(off + out.nbytes, end)
                    if a < b:
                        out.data[a - off:b - off] = data[a - start:b - start]
            if n < length:
                break  # the end of the file
        for future in reads.values():
            future.result()
    if digest is not None:
        digest.wait()
    _return(buffers, block)


_SPARE: list[memoryview] = []  # bounce buffers of READ_BLOCK bytes a finished read left (a load reads many files)
_SPARE_LOCK = threading.Lock()


def _lend(n: int, block: int) -> list[memoryview]:
    """``n`` aligned buffers of ``block`` bytes: spare ones of a finished read where they fit, else new ones."""
    taken: list[memoryview] = []
    if block == READ_BLOCK:
        with _SPARE_LOCK:
            while _SPARE and len(taken) < n:
                taken.append(_SPARE.pop())
    return taken + [_aligned(block) for _ in range(n - len(taken))]


def _return(buffers: list[memoryview], block: int) -> None:
    """Keep up to one read's worth of full-size buffers for the next read (a failed read keeps none: a helper
    thread may still write into them)."""
    if block == READ_BLOCK:
        with _SPARE_LOCK:
            _SPARE.extend(buffers[: max(0, READ_DEPTH + 1 - len(_SPARE))])


def copy_file(src: str | os.PathLike, dst: str | os.PathLike, durable: bool = True) -> int:
    """Copy ``src`` to a new file ``dst`` (returns the bytes copied), with ``O_DIRECT`` on both sides where
    allowed: the device moves the bytes to and from one aligned buffer, so the copy costs the CPU next to
    nothing and the page cache nothing (it runs beside training: see ``checkpoint(background=True)``)."""
    fin = open_source(src)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)  # a new file: no link followed
    try:
        try:
            sink = os.open(dst, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            sink = os.open(dst, flags, 0o644)  # no O_DIRECT here: the same loop, through the page cache
    except BaseException:
        os.close(fin)
        raise
    buf = _aligned(READ_BLOCK)
    copied = 0
    try:
        while True:
            n = _pread_all(fin, buf, copied)
            if n == 0:
                break
            padded = -(-n // _ALIGN) * _ALIGN
            if padded > n:
                buf[n:padded] = bytes(padded - n)
            try:
                _write_all(sink, buf[:padded])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                fcntl.fcntl(sink, fcntl.F_SETFL, fcntl.fcntl(sink, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
                os.lseek(sink, copied, os.SEEK_SET)
                _write_all(sink, buf[:n])
            copied += n
            if n < READ_BLOCK:
                break
        os.ftruncate(sink, copied)
        if durable:
            os.fsync(sink)
    finally:
        os.close(fin)
        os.close(sink)
    return copied


def _segments(size: int, order: list[tuple[int, np.ndarray]], whole: bool) -> list[tuple[int, int, memoryview | None]]:
    """The reads that cover the pieces (or the whole file): ``(offset, length, destination)``, destination None
    for a read into a bounce buffer. Every offset is aligned; only the last read may run past the end."""
    spans: list[tuple[int, int]] = []
    if whole:
        spans = [(0, size)]
    else:
        for off, out in order:
            lo, hi = off // _ALIGN * _ALIGN, off + out.nbytes
            if spans and lo <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
            else:
                spans.append((lo, hi))
    out_segments: list[tuple[int, int, memoryview | None]] = []

    def bounce(lo: int, hi: int) -> None:
        out_segments.extend((b, -(-(min(hi, b + READ_BLOCK) - b) // _ALIGN) * _ALIGN, None)
                            for b in range(lo, hi, READ_BLOCK))

    for lo, hi in spans:
        cursor = lo
        for off, out in order:
            if off + out.nbytes <= cursor or off >= hi:
                continue
            a = -(-off // _ALIGN) * _ALIGN
            b = (off + out.nbytes) // _ALIGN * _ALIGN
            if b - a < ALIGNED_MIN or (address(out) + (a - off)) % _ALIGN or a < cursor:
                continue
            bounce(cursor, a)
            view = out.data
            for s in range(a, b, READ_BLOCK):
                e = min(s + READ_BLOCK, b)
                out_segments.append((s, e - s, view[s - off:e - off]))
            cursor = b
        bounce(cursor, hi)
    return out_segments


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
        if done % _ALIGN:  # a short read that is not a multiple of the alignment is the end of the file
            break
    return done


def bounce_buffers() -> list[memoryview]:
    """The two aligned buffers a :class:`FileSink` writes through with direct I/O (reusable once it is closed)."""
    return [_aligned(BLOCK), _aligned(BLOCK)]


def _aligned(n: int) -> memoryview:
    """``n`` writable bytes starting at a page boundary (what ``O_DIRECT`` needs): an anonymous mapping, whose
    pages the kernel provides as they are first written. (A zero-filled ``bytearray`` touched all of them: 64 MiB
    per pair of buffers, which cost 50 ms per file where a writer made a pair per small file; the handover's
    replica copies did, 1.3 s of a 1.5 s snapshot of the example GPT at dp=4.)"""
    return memoryview(mmap.mmap(-1, n))


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` to the device now (``sync_file_range(SYNC_FILE_RANGE_WRITE)``)
    so that the final fsync has little left to wait for."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, 2)
