"""Reading and writing files that other people may have prepared: bounded, never blocking, never following a
link where one is not expected, and replacing files atomically under names nobody can predict.

Why each rule:

* **Bounded reads.** Every file the toolkit loads (plans, profiles, hosts and env files, manifests, checkpoint
  indexes) is parsed whole; a multi-GB file, or ``/dev/zero`` passed by mistake, must end in an error naming it,
  not in the machine running out of memory.
* **Regular files only, opened without blocking.** Opening a FIFO for reading waits for a writer forever; a
  directory or a device is never what was meant. The file is opened with ``O_NONBLOCK`` and checked with
  ``fstat`` on the descriptor that is then read (no window between the check and the use).
* **No links where none belong.** A checkpoint's data files are named by the checkpoint itself; a link there
  could make ``varuna ckpt merge`` copy any readable file into its output. ``follow=False`` opens with
  ``O_NOFOLLOW``.
* **Atomic writes under unpredictable names.** A temporary file beside the target, created with ``O_EXCL`` under
  a random name (:func:`tempfile.mkstemp`), then renamed over the target: a crash leaves the old file or the new
  one, and a link planted at a predictable temporary name cannot redirect the write.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from ..errors import ConfigError, VarunaError

__all__ = ["read_regular", "read_text", "open_regular", "atomic_write", "fsync_dir", "describe_mode", "MiB"]

MiB = 2**20


def describe_mode(mode: int) -> str:
    """What kind of file ``mode`` (``st_mode``) is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], *, what: str = "file", follow: bool = True, extra_flags: int = 0,
                 error: type[VarunaError] = ConfigError) -> int:
    """A read-only descriptor of the regular file ``path`` (``O_NONBLOCK`` is cleared again once it is known to
    be one). ``follow=False`` refuses a symbolic link as the last component.

    Raises:
        ``error``: missing, unreadable, a link (with ``follow=False``), or not a regular file; the message names
        ``what`` and the path.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | extra_flags
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise error(f"{what} {path} is a symbolic link", hint="these files must be plain files written by "
                        "varuna; a link could point anywhere") from None
        if exc.errno == errno.EISDIR:
            raise error(f"{what} {path} is a directory, not a file") from None
        if exc.errno == errno.ENOENT:
            raise error(f"{what} {path} does not exist") from None
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {path} is {describe_mode(info.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], limit: int, *, what: str = "file", follow: bool = True,
                 error: type[VarunaError] = ConfigError) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (see :func:`open_regular`).

    Raises:
        ``error``: as :func:`open_regular`, or the file holds more than ``limit`` bytes.
    """
    fd = open_regular(path, what=what, follow=follow, error=error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{what} {path} is {size:,} bytes, more than the {limit:,} such a file may have",
                        hint="is it the right file?")
        chunks, total = [], 0
        while True:  # the size may change while reading: never read more than limit + 1 bytes
            chunk = os.read(fd, min(limit + 1 - total, 8 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{what} {path} holds more than the {limit:,} bytes such a file may have",
                            hint="is it the right file?")
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], limit: int, *, what: str = "file",
              error: type[VarunaError] = ConfigError) -> str:
    """The UTF-8 text (a byte-order mark allowed) of the regular file ``path`` of at most ``limit`` bytes; a byte
    that is not UTF-8 is an ``error`` naming its line."""
    data = read_regular(path, limit, what=what, error=error)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})",
                    hint="is it the right file?") from None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically: written to a new file of a random name beside it (``O_EXCL``,
    created with mode 0600 and given ``mode`` once written), fsynced with ``durable``, then renamed over
    ``path``. A crash leaves the old content or the new one; the temporary file never outlives a failure."""
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def in_memory(path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``path`` is on a file system kept in memory (tmpfs, ramfs): a file there mapped shared is memory, not
    a disk's cache written back while it changes. False wherever it cannot be told (no ``/proc``)."""
    try:
        target = os.path.realpath(path)
        with open(mountinfo, encoding="utf-8", errors="replace") as stream:
            lines = stream.read(1 << 20).splitlines()
    except OSError:
        return False
    best, kind = "", ""
    for line in lines:  # "<id> <parent> <dev> <root> <mount point> <options> [optional...] - <type> <source> ..."
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        point = parts[4].encode().decode("unicode_escape") if "\\" in parts[4] else parts[4]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, tail.split()[0]
    return kind in _MEMORY_FS
