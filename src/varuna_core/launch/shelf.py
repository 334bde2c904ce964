"""A job's training state in host memory that outlives its workers, and the wire that hands it to a peer.

A morph by handover (DESIGN.md §3.8) stops the old workers at one step and starts the new ones from their state
without the checkpoint store: each old worker publishes its tensors, as bytes under the checkpoints'
layout-independent names (``blocks.3.attn.weight/exp_avg``), onto the job's :class:`Shelf` on its host and exits;
each new worker takes the blobs of its stage from its own host's shelf, else from the host that holds them through
:func:`fetch` from that host's :class:`ShelfServer`. No torch here: bytes only (the worker turns tensors into bytes
and back), so the node agent that owns the shelf imports nothing heavy.

**The shelf** is one directory per job on a tmpfs (``/dev/shm`` by default): memory that stays when the process
that wrote it exits, and that any process of the job on the host can read. Each blob is one file, named after the
SHA-256 of the blob's name (a name is never a path, so ``../x`` cannot leave the directory), holding its bytes
followed by its own manifest entry (name, size, digest (:mod:`varuna_core.util.digest`), a small JSON ``meta`` such
as dtype and shape)::

    size bytes of data | L bytes of JSON {"name", "size", "digest", "meta"} | u32 big-endian L | b"VSHB"

so that the entry and the data are replaced together by one atomic rename: two processes putting blobs at once
(or the same blob) never leave an entry that describes other bytes, and a reader that opened a file reads one
consistent blob even if it is replaced meanwhile. The entry comes *after* the data so that a file written where
it will stay (a checkpoint's data file, whose offsets are the index's) becomes a blob by appending its entry and
renaming it, without a copy: :meth:`Shelf.reserve` gives a writer a private directory on the shelf's file system
and the room it asked for, :meth:`Space.adopt` turns each file written there into a blob. A put or a reservation
takes its bytes under a lock on the directory after checking the shelf's byte budget, so that state which does not
fit in host memory is refused (:class:`~varuna_core.errors.ShelfFullError`) before anything is copied, and the
caller falls back to the store. Reads check size and hash against the entry; :meth:`Shelf.link` gives a reader on
the same host the blob's file itself (a hard link), whose first ``size`` bytes are the data. A blob adopted
without a hash (its entry's digest null: the next configuration runs on this host alone and links it, see
:meth:`Shelf.mark_alone`) is hashed by the server when a peer asks for it after all (a take tried again on other
hosts), and a read that verifies refuses it.

**The wire** (TCP; one request per connection). Every frame is ``b"VSH1" | u32 big-endian L | L bytes of JSON``
with ``L`` at most :data:`MAX_HEADER`, checked before anything is allocated. The client sends
``{"p": PAYLOAD, "mac": HEX}``: ``PAYLOAD`` is the text of ``{"kind": "shelf-request", "job", "ts", "nonce",
"names", "max_bytes"}`` and ``HEX`` the HMAC-SHA256 of ``b"varuna-shelf-request\\0" + PAYLOAD`` keyed by the job's
token (as heartbeat datagrams are signed, see :mod:`varuna_core.launch.protocol`; the prefix keeps a signature of
one kind of message from passing for another). The server checks the MAC, the job, that ``ts`` is within
:data:`WINDOW` seconds of its clock, that the nonce was not seen in that window (a replayed request), and that
every name is on the shelf, at most :data:`MAX_NAMES` of them, with at most ``max_bytes`` in all (and a reply
header within :data:`MAX_HEADER`: a peer asks for a stage's thousands of names in several requests). It answers
either a refusal ``{"error": REASON}`` (unsigned: it only ever ends a transfer) and closes, or
``{"p": PAYLOAD, "mac": HEX}`` where ``PAYLOAD`` is ``{"kind": "shelf-reply", "job", "nonce", "blobs": [{"name",
"size", "digest", "meta"}, ...]}`` (the request's nonce and names, in its order) signed with the prefix
``b"varuna-shelf-reply\\0"``, followed by the blobs' bytes back to back, straight from the shelf's files
(``sendfile``). The client checks the reply's MAC and nonce (a server without the token, or a replayed reply, is
refused), every size against what it asked and allowed, and every blob's digest as it arrives. Nothing is
unpickled; every socket operation has a timeout, and reading a header has a deadline, so a peer that stalls is cut
off and named. The wire authenticates both ends and checks every byte, but does not encrypt: like the training's
own gloo or NCCL traffic, it belongs on the cluster's network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import hmac
import io
import json
import logging
import os
import queue
import secrets
import selectors
import shutil
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import HandoverError, ShelfFullError
from ..util.digest import ALGORITHM, Hasher, hasher_for, is_digest
from ..util.text import printable, short_repr

__all__ = ["MAX_NAME", "MAX_META", "MAX_JOB", "MAX_HEADER", "MAX_NAMES", "WINDOW", "DEFAULT_ROOT", "Entry",
           "check_name", "shelf_key", "Shelf", "Space", "ShelfServer", "fetch", "fetch_into"]

log = logging.getLogger(__name__)

MAX_NAME = 1024  # characters of a blob's name
MAX_META = 4096  # bytes of a blob's meta, as JSON
MAX_JOB = 256  # characters of a job id
MAX_HEADER = 1 << 20  # bytes of a frame's JSON (a request for a stage's thousands of names fits)
MAX_NAMES = 16384  # names in one request
WINDOW = 300.0  # seconds a request stays valid (clock skew between hosts included); nonces are kept that long
DEFAULT_ROOT = Path("/dev/shm")
CHUNK = 1 << 20  # bytes per read when streaming
_HASH_SPAN = 8 << 20  # bytes a receiver hashes at a time on its hashing thread

_BLOB_MAGIC = b"VSHB"
_PLACEHOLDER = f"{ALGORITHM}:{'0' * 64}"  # a digest's length, before the bytes are hashed
_FRAME_MAGIC = b"VSH1"
_PREFIX = struct.Struct(">4sI")
_TRAILER = struct.Struct(">I4s")  # after a blob's entry: its length, the magic
_MAX_ENTRY = MAX_META + MAX_NAME * 12 + 256  # bytes of a blob's entry as JSON (a name escaped at worst)
_REQUEST = b"varuna-shelf-request\0"
_REPLY = b"varuna-shelf-reply\0"


@dataclass(frozen=True)
class Entry:
    """A blob's manifest entry: what a reader checks the bytes against."""

    name: str
    size: int
    digest: str | None  # None: never hashed, for a link on its own host alone (Space.adopt); hashed when served
    meta: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "digest": self.digest, "meta": self.meta}


def shelf_key(job: str, attempt: int) -> str:
    """The name of the shelf that attempt ``attempt`` of job ``job`` publishes on: one per attempt, so that the
    agent that serves (and at its end clears) an old attempt's shelf never touches a newer attempt's."""
    return f"{job}-a{attempt}"


def check_name(name: object) -> str:
    """``name`` if it can name a blob (1 to :data:`MAX_NAME` printable characters); raises HandoverError."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise HandoverError(f"bad blob name {short_repr(name)}: a name is 1 to {MAX_NAME} printable characters")
    return name


def _meta_text(meta: object) -> str:
    """``meta`` as compact JSON, if it is a dict of at most :data:`MAX_META` bytes; raises HandoverError."""
    try:
        text = json.dumps(meta, separators=(",", ":"), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise HandoverError(f"the meta of a blob must be plain JSON: {exc}") from None
    if not isinstance(meta, dict) or len(text.encode()) > MAX_META:
        raise HandoverError(f"the meta of a blob must be a JSON object of at most {MAX_META} bytes, "
                            f"got {short_repr(meta)}")
    return text


def _entry(obj: object, *, unhashed: bool = False) -> Entry:
    """An entry read from a file or a peer, every field checked; raises ValueError. ``unhashed``: the digest may be
    null (a blob's file on this host's shelf: see :meth:`Space.adopt`; a peer never sends one)."""
    if not isinstance(obj, dict) or set(obj) != {"name", "size", "digest", "meta"}:
        raise ValueError("not an entry")
    size, digest, meta = obj["size"], obj["digest"], obj["meta"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"bad size {short_repr(size)}")
    if not is_digest(digest) and not (unhashed and digest is None):
        raise ValueError(f"bad digest {short_repr(digest)}")
    try:
        _meta_text(meta)
        name = check_name(obj["name"])
    except HandoverError as exc:
        raise ValueError(exc.message) from None
    return Entry(name, size, digest, meta)


_LEAVING = ".leaving"  # the mark of a host the next configuration leaves out (Shelf.mark_leaving)
_ALONE = ".alone"  # the mark of the one host the next configuration runs on (Shelf.mark_alone)


def _key(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# The shelf

class Shelf:
    """The blobs of job ``job`` on this host: ``root/varuna-shelf-<hash of job>/``. Any number of
    :class:`Shelf` objects, in any processes of the host, may use one job's shelf at once.

    Args:
        job: the job id (the same on every host).
        root: the directory to keep shelves in: a tmpfs, so that the blobs are memory (default ``/dev/shm``).
        budget: the most bytes the job's shelf may hold on this host (None: what the file system has free).
    """

    def __init__(self, job: str, *, root: str | os.PathLike[str] = DEFAULT_ROOT, budget: int | None = None) -> None:
        if not isinstance(job, str) or not 0 < len(job) <= MAX_JOB or not job.isprintable():
            raise HandoverError(f"bad job id {short_repr(job)}: 1 to {MAX_JOB} printable characters")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise HandoverError(f"a shelf's budget is a number of bytes >= 0, got {short_repr(budget)}")
        self.job = job
        self.budget = budget
        self.path = Path(root) / f"varuna-shelf-{_key(job)[:32]}"

    def _file(self, name: str) -> Path:
        return self.path / f"{_key(name)}.blob"

    def _check_dir(self) -> bool:
        """Whether the job's directory exists; raises HandoverError if it is not one this user alone can write
        (``/dev/shm`` is shared by every user of the host: a link or a directory planted there by someone else
        would take the job's state out of its memory, or feed it other state)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise HandoverError(f"the shelf of job {printable(self.job)} at {self.path} is not a directory that only "
                                f"this user can write (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid})",
                                hint="remove it, or give the shelf another root")
        return True

    def make_dir(self) -> Path:
        """The job's directory, made if it is missing; raises HandoverError if it is not one this user alone can
        write (see :meth:`_check_dir`). Files of the job's own put there go with the shelf (:meth:`clear`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o700)
        self._check_dir()
        return self.path

    def mark_leaving(self) -> None:
        """Tell the writers of this shelf that this host is not in the job's next configuration (the agent does,
        before it asks its workers to publish for a handover to other hosts): under data parallelism their
        publish then leaves the files to their replicas on staying hosts (``checkpoint.handover.publish``'s
        ``leaving``). Raises HandoverError for a directory others can write, OSError if it cannot be written."""
        self._mark(_LEAVING)

    def mark_alone(self) -> None:
        """Tell the writers of this shelf that the job's next configuration runs on this host and no other (the
        agent does, before it asks its workers to publish for such a handover): no other host will take their
        files, so their last publish need not hash what the new workers link in place (``publish``'s ``hashed``;
        see :attr:`alone`). Raises as :meth:`mark_leaving`."""
        self._mark(_ALONE)

    def _mark(self, mark: str) -> None:
        fd = os.open(self.make_dir() / mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)

    def _marked(self, mark: str) -> bool:
        try:
            return self._check_dir() and stat.S_ISREG(os.lstat(self.path / mark).st_mode)
        except (OSError, HandoverError):
            return False

    @property
    def leaving(self) -> bool:
        """Whether this host was marked as leaving (:meth:`mark_leaving`); False for a shelf others could write,
        or whose mark is anything but a plain file."""
        return self._marked(_LEAVING)

    @property
    def alone(self) -> bool:
        """Whether this host was marked as the only one of the next configuration (:meth:`mark_alone`), and not as
        leaving as well (hosts that share the shelf's tmpfs share its marks: then neither holds for every writer,
        and leaving is the safe one); False for a shelf others could write, or a mark that is not a plain file."""
        return self._marked(_ALONE) and not self._marked(_LEAVING)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's lock: a put's budget check and reservation are one step for every process."""
        self.make_dir()
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _used(self, replacing: Path | None = None) -> int:
        """Bytes of the shelf's files (blobs, puts under way, and what reservations have left: a ``.resv`` file's
        size, sparse), but the one ``replacing``."""
        used = 0
        with os.scandir(self.path) as it:
            for item in it:
                if item.name.endswith((".blob", ".part", ".resv")) and item.path != str(replacing):
                    with contextlib.suppress(FileNotFoundError):
                        used += item.stat(follow_symlinks=False).st_size
        return used

    def put(self, name: str, data: bytes | bytearray | memoryview, meta: dict[str, Any] | None = None, *,
            digest: str | None = None) -> Entry:
        """Puts ``data`` on the shelf under ``name`` (replacing a blob of that name) and returns its entry.

        ``digest``: the data's hash, when its writer computed it while writing (a checkpoint's files are hashed as
        they are written): recorded as it is, which spares a second pass over the bytes. A wrong one is not a
        risk to a reader: every read checks the bytes against the entry (a checkpoint load against its manifest).

        Raises:
            ShelfFullError: the blob does not fit in the budget or in the file system's free space (nothing is
                left of it).
            HandoverError: a bad name or meta.
        """
        check_name(name)
        if digest is not None and not is_digest(digest):
            raise HandoverError(f"a blob's digest is '<algorithm>:<64 lower-case hex digits>', got "
                                f"{short_repr(digest)}")
        meta_text = _meta_text({} if meta is None else meta)
        view = memoryview(data).cast("B")
        entry = Entry(name, view.nbytes, _PLACEHOLDER, json.loads(meta_text))  # hashed as it is written, below
        total = view.nbytes + len(_tail(entry))  # the entry's length does not depend on the hash
        target = self._file(name)
        part = self.path / f"{target.stem}.{secrets.token_hex(8)}.part"
        with self._locked():
            used = self._used(target) if self.budget is not None else 0
            if self.budget is not None and used + total > self.budget:
                raise ShelfFullError(f"blob {printable(name)} ({view.nbytes} bytes) does not fit on the shelf of job "
                                     f"{printable(self.job)}: {used} of {self.budget} bytes are taken",
                                     hint="the state does not fit in host memory: use the checkpoint store")
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _reserve(fd, total, part)
            except BaseException:
                os.close(fd)
                part.unlink(missing_ok=True)
                raise
        try:
            with os.fdopen(fd, "wb") as out:
                hasher = Hasher() if digest is None else None
                for start in range(0, view.nbytes, CHUNK):  # one pass: each chunk hashed while it is in cache
                    if hasher is not None:
                        hasher.update(view[start:start + CHUNK])
                    out.write(view[start:start + CHUNK])
                entry = dataclasses.replace(entry, digest=hasher.hexdigest() if hasher is not None else str(digest))
                out.write(_tail(entry))
            os.replace(part, target)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return entry

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[Space]:
        """Room for ``nbytes`` of blobs written in place: a private directory on the shelf's file system, where a
        writer puts files that :meth:`Space.adopt` then turns into blobs by a rename (no copy). Everything left in
        the directory, and whatever of the room was not used, is given back when the block ends.

        The room is a sparse ``.resv`` file of ``nbytes`` that counts against the budget until blobs take its
        place; the file system's free space is checked too (best effort: a tmpfs that fills up meanwhile fails
        the writer's write, which the caller treats as the shelf being full).

        Raises:
            ShelfFullError: ``nbytes`` do not fit in the budget or in the file system's free space.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise HandoverError(f"a reservation is a number of bytes >= 0, got {short_repr(nbytes)}")
        token = secrets.token_hex(8)
        resv, directory = self.path / f"{token}.resv", self.path / f"{token}.staging"
        with self._locked():
            used = self._used() if self.budget is not None else 0
            if self.budget is not None and used + nbytes > self.budget:
                raise ShelfFullError(f"{nbytes} bytes do not fit on the shelf of job {printable(self.job)}: {used} of "
                                     f"{self.budget} bytes are taken",
                                     hint="the state does not fit in host memory: use the checkpoint store")
            free = shutil.disk_usage(self.path).free
            if free < nbytes:
                raise ShelfFullError(f"{nbytes} bytes do not fit in {self.path.parent} ({free} bytes free)",
                                     hint="the state does not fit in host memory: use the checkpoint store")
            fd = os.open(resv, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            directory.mkdir(mode=0o700)
        try:
            yield Space(self, directory, resv)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            resv.unlink(missing_ok=True)

    def link(self, name: str, path: str | os.PathLike[str]) -> Entry:
        """Makes ``path`` (a new name on the shelf's file system) the blob's file itself, a hard link: its first
        ``entry.size`` bytes are the data, then the entry. Nothing is copied, and the link stays whole whatever
        happens to the blob on the shelf afterwards (replaced, removed). The entry is checked, not the data's hash.

        Raises:
            HandoverError: no such blob, or its file is damaged (``path`` is then not left behind).
            OSError: the link cannot be made (another file system, ``path`` exists): the caller copies instead.
        """
        check_name(name)
        if not self._check_dir():
            raise HandoverError(f"no blob {printable(name)} on the shelf of job {printable(self.job)}")
        try:
            os.link(self._file(name), path, follow_symlinks=False)
        except FileNotFoundError:
            if not Path(path).parent.is_dir():
                raise
            raise HandoverError(f"no blob {printable(name)} on the shelf of job {printable(self.job)}") from None
        try:
            with open(path, "rb") as stream:  # the linked file, not the name: it may have been replaced meanwhile
                entry = self._checked(name, stream)
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        return entry

    @property
    def identity(self) -> str:
        """A random id of this shelf's directory, made by the first process that asks: two processes see the same
        id exactly when they share the directory (the same host, or hosts sharing the shelf's tmpfs)."""
        with self._locked():
            path = self.path / ".id"
            try:
                text = path.read_text().strip()
            except FileNotFoundError:
                text = ""
            if len(text) != 32 or text.strip("0123456789abcdef"):
                text = secrets.token_hex(16)
                path.write_text(text + "\n")
            return text

    def has(self, name: str) -> bool:
        """Whether a blob ``name`` is on the shelf (its file exists; :meth:`open` checks it)."""
        return self._check_dir() and self._file(check_name(name)).is_file()

    def open(self, name: str) -> tuple[Entry, io.BufferedReader]:
        """The blob's entry and its file, positioned at the data (offset 0; the caller closes it, and reads no more
        than ``entry.size`` bytes). The entry is checked, and the file's size against it; the data's hash is not
        (:meth:`get` checks it).

        Raises:
            HandoverError: no such blob, or its file is damaged.
        """
        check_name(name)
        try:
            self._check_dir()
            stream = open(self._file(name), "rb")  # noqa: SIM115 (the caller closes it)
        except FileNotFoundError:
            raise HandoverError(f"no blob {printable(name)} on the shelf of job {printable(self.job)}") from None
        try:
            entry = self._checked(name, stream)
        except BaseException:
            stream.close()
            raise
        return entry, stream

    def _checked(self, name: str, stream: BinaryIO) -> Entry:
        """The entry of the blob file ``stream`` (left at the data's start), if it is blob ``name``'s; raises
        HandoverError."""
        try:
            entry = _read_entry(stream)
            if entry.name != name:
                raise ValueError(f"it holds {printable(entry.name)}")
        except (ValueError, struct.error, OSError) as exc:
            raise HandoverError(f"blob {printable(name)} on the shelf of job {printable(self.job)} is damaged: "
                                f"{printable(exc)}") from None
        return entry

    def get_into(self, name: str, into: Callable[[Entry], memoryview], *, verify: bool = True) -> Entry:
        """Reads the blob into the buffer ``into(entry)`` returns (a writable memoryview of exactly ``entry.size``
        bytes, e.g. pinned memory) and returns its entry, once its size and digest were checked.

        ``verify=False`` leaves the digest to the caller, who checks the bytes anyway (a checkpoint load checks
        every file it reads against its manifest's hash): the size is still checked, the bytes are read once.

        Raises:
            HandoverError: no such blob, or its bytes do not match its entry.
        """
        entry, stream = self.open(name)
        what = f"blob {printable(name)} on the shelf of job {printable(self.job)}"
        with stream:
            view = _writable(into(entry), entry.size, what)
            if verify and entry.digest is None:
                raise HandoverError(f"{what} was never hashed (it was published to be linked on this host): its "
                                    f"bytes cannot be checked", hint="read it with verify=False and check it "
                                    "otherwise, or link it")
            digest, got = hasher_for(entry.digest) if verify and entry.digest is not None else None, 0
            while got < entry.size:
                n = stream.readinto(view[got:got + CHUNK])
                if not n:
                    break
                if digest is not None:
                    digest.update(view[got:got + n])
                got += n
        if got != entry.size or (digest is not None and digest.hexdigest() != entry.digest):
            raise HandoverError(f"{what} is damaged: its bytes do not match its entry's size and digest")
        return entry

    def get(self, name: str) -> memoryview:
        """The blob's bytes (read only), checked against its entry's size and digest (see :meth:`get_into`)."""
        buffers: list[bytearray] = []

        def into(entry: Entry) -> memoryview:
            buffers.append(bytearray(entry.size))
            return memoryview(buffers[0])

        self.get_into(name, into)
        return memoryview(buffers[0]).toreadonly()

    def manifest(self) -> dict[str, Entry]:
        """Every blob's entry, by name. A damaged file is left out (with a warning): :meth:`get` refuses it."""
        entries: dict[str, Entry] = {}
        if not self._check_dir():
            return entries
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as it:
            for item in it:
                if not item.name.endswith(".blob"):
                    continue
                try:
                    with open(item.path, "rb") as stream:
                        entry = _read_entry(stream)
                except FileNotFoundError:
                    continue  # removed meanwhile
                except (ValueError, struct.error, OSError) as exc:
                    log.warning("shelf of job %s: leaving out damaged file %s: %s", printable(self.job), item.name,
                                printable(exc))
                    continue
                entries[entry.name] = entry
        return entries

    def names(self) -> list[str]:
        """The names of the blobs on the shelf, sorted."""
        return sorted(self.manifest())

    def remove(self, names: Iterable[str]) -> None:
        """Takes the blobs ``names`` off the shelf (a name not on it is no error)."""
        for name in names:
            self._file(check_name(name)).unlink(missing_ok=True)

    def clear(self) -> None:
        """Removes the job's shelf from this host, every blob with it."""
        shutil.rmtree(self.path, ignore_errors=True)


class Space:
    """Room reserved on a shelf (:meth:`Shelf.reserve`): :attr:`directory` is private to its writer, on the
    shelf's own file system, and each file written there becomes a blob with :meth:`adopt`."""

    def __init__(self, shelf: Shelf, directory: Path, resv: Path) -> None:
        self.shelf, self.directory, self._resv = shelf, directory, resv

    @property
    def home(self) -> str:
        """The shelf's :attr:`Shelf.identity`: writers on one host tell each other apart from peers elsewhere."""
        return self.shelf.identity

    def adopt(self, name: str, path: str | os.PathLike[str], meta: dict[str, Any] | None = None, *,
              digest: str | None) -> Entry:
        """Turns the file ``path`` of :attr:`directory` into blob ``name`` (replacing a blob of that name): its
        entry is appended and the file renamed onto the shelf, where it takes the room it was written in.

        ``digest`` is the writer's hash of the file's bytes (a checkpoint's files are hashed as they are written);
        as for :meth:`Shelf.put`, every reader that verifies checks the bytes against it. None: the bytes were
        never hashed, for a blob that only a reader on this host links (:attr:`Shelf.alone`): a hash guards what
        crosses a wire or a disk, and a link crosses neither. :meth:`Shelf.get` refuses such a blob; a server
        hashes it before it sends it (a peer's entry always has a digest).

        Raises:
            ShelfFullError: the file is larger than the room left and the rest does not fit in the budget.
            HandoverError: a bad name, meta or hash, or ``path`` is not a regular file of :attr:`directory`.
        """
        shelf = self.shelf
        check_name(name)
        if digest is not None and not is_digest(digest):
            raise HandoverError(f"a blob's digest is '<algorithm>:<64 lower-case hex digits>' or None, got "
                                f"{short_repr(digest)}")
        meta_text = _meta_text({} if meta is None else meta)
        path = Path(path)
        if path.parent != self.directory:
            raise HandoverError(f"only a file of {self.directory} can become a blob, not {printable(str(path))}")
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise HandoverError(f"cannot adopt {printable(str(path))} as blob {printable(name)}: "
                                f"{printable(exc.strerror or exc)}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise HandoverError(f"{printable(str(path))} is not a regular file: it cannot become a blob")
            entry = Entry(name, info.st_size, digest, json.loads(meta_text))
            tail = _tail(entry)
            try:
                os.pwrite(fd, tail, info.st_size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise ShelfFullError(f"blob {printable(name)} does not fit in {shelf.path.parent}",
                                         hint="the state does not fit in host memory: use the checkpoint store") \
                        from None
                raise
        finally:
            os.close(fd)
        total, target = info.st_size + len(tail), shelf._file(name)
        with shelf._locked():
            left = os.stat(self._resv).st_size
            over = max(0, total - left)  # bytes beyond the room reserved: new to the budget
            if over and shelf.budget is not None and shelf._used(target) + over > shelf.budget:
                raise ShelfFullError(f"blob {printable(name)} ({info.st_size} bytes) does not fit on the shelf of job "
                                     f"{printable(shelf.job)}: {over} bytes more than were reserved, over the "
                                     f"budget of {shelf.budget}",
                                     hint="the state does not fit in host memory: use the checkpoint store")
            os.replace(path, target)
            os.truncate(self._resv, left - min(left, total))
        return entry


def _tail(entry: Entry) -> bytes:
    """What a blob's file holds after its data (its length does not depend on the hash)."""
    text = json.dumps(entry.as_json(), separators=(",", ":")).encode()
    return text + _TRAILER.pack(len(text), _BLOB_MAGIC)


def _digest_of(stream: BinaryIO, size: int) -> str:
    """The digest of the first ``size`` bytes of the open blob file ``stream`` (read from its start, by offset: the
    stream's position is left as it was)."""
    digest, view, got = Hasher(), memoryview(bytearray(CHUNK)), 0
    fd = stream.fileno()
    while got < size:
        n = os.preadv(fd, [view[:min(CHUNK, size - got)]], got)
        if not n:
            raise HandoverError("a blob's file shrank while it was hashed")
        digest.update(view[:n])
        got += n
    return digest.hexdigest()


def _writable(buffer: memoryview, size: int, what: str) -> memoryview:
    """``buffer`` as bytes, if it is a writable ``size`` bytes; raises HandoverError."""
    view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
    if view.readonly or view.nbytes != size:
        raise HandoverError(f"the buffer for {what} must be a writable {size} bytes, got {view.nbytes} "
                            f"({'read only' if view.readonly else 'writable'})")
    return view


def _reserve(fd: int, size: int, path: Path) -> None:
    """Takes ``size`` bytes of the file system for ``fd`` now, so that a blob that cannot fit is refused before it
    is copied (a tmpfs would otherwise fail, or swap, half way)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSPC, errno.EFBIG):
            raise
        free = shutil.disk_usage(path.parent).free
        if exc.errno in (errno.ENOSPC, errno.EFBIG) or free < size:
            raise ShelfFullError(f"{size} bytes do not fit in {path.parent} ({free} bytes free)",
                                 hint="the state does not fit in host memory: use the checkpoint store") from None
        os.ftruncate(fd, size)  # a file system without fallocate: its free space was checked above


def _read_entry(stream: BinaryIO) -> Entry:
    """The entry at the end of a blob's file, checked against the file's size; leaves ``stream`` at the data's
    start. Raises ValueError or struct.error."""
    end = os.fstat(stream.fileno()).st_size
    if end < _TRAILER.size:
        raise ValueError("not a blob")
    stream.seek(end - _TRAILER.size)
    length, magic = _TRAILER.unpack(stream.read(_TRAILER.size))
    if magic != _BLOB_MAGIC or length > _MAX_ENTRY or length + _TRAILER.size > end:
        raise ValueError("not a blob")
    data = end - _TRAILER.size - length
    stream.seek(data)
    text = stream.read(length)
    if len(text) != length:
        raise ValueError("its entry is cut short")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("its entry is nested too deeply") from None
    entry = _entry(doc, unhashed=True)
    if entry.size != data:
        raise ValueError(f"{data} bytes of data where its entry says {entry.size}")
    stream.seek(0)
    return entry


# ----------------------------------------------------------------------------------------------------------
# The wire

def _mac(token: str, prefix: bytes, payload: bytes) -> str:
    return hmac.new(token.encode(), prefix + payload, hashlib.sha256).hexdigest()


def _signed(token: str, prefix: bytes, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False)
    return _frame({"p": payload, "mac": _mac(token, prefix, payload.encode())})


def _frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return _PREFIX.pack(_FRAME_MAGIC, len(data)) + data


def _opened(outer: object, token: str, prefix: bytes) -> dict[str, Any]:
    """The payload of a signed frame if its MAC is right; raises ValueError."""
    if not isinstance(outer, dict) or not isinstance(outer.get("p"), str) or not isinstance(outer.get("mac"), str):
        raise ValueError("malformed")
    payload, mac = outer["p"].encode("utf-8", "surrogatepass"), outer["mac"]
    if not mac.isascii() or not hmac.compare_digest(_mac(token, prefix, payload), mac):
        raise ValueError("bad_mac")
    body = json.loads(payload)
    if not isinstance(body, dict):
        raise ValueError("malformed")
    return body


class _Timeout(Exception):
    """A peer did not send what it owed within the deadline."""


def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``sock`` by ``deadline`` (a peer trickling bytes does not extend it); fewer if the
    peer closed. Raises :class:`_Timeout`."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise _Timeout from None
        if n == 0:
            break
        got += n
    return bytes(buf[:got])


def _read_frame(sock: socket.socket, deadline: float) -> object:
    """One frame's JSON; raises ValueError (``truncated``, ``bad_magic``, ``oversize``, ``malformed``) or
    :class:`_Timeout`. An oversized length is refused before anything of that size is allocated."""
    prefix = _recv_exactly(sock, _PREFIX.size, deadline)
    if len(prefix) < _PREFIX.size:
        raise ValueError("truncated")
    magic, length = _PREFIX.unpack(prefix)
    if magic != _FRAME_MAGIC:
        raise ValueError("bad_magic")
    if length > MAX_HEADER:
        raise ValueError("oversize")
    data = _recv_exactly(sock, length, deadline)
    if len(data) < length:
        raise ValueError("truncated")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError("malformed") from None


class ShelfServer:
    """Serves ``shelf`` to the job's peers over TCP, one thread per connection (see the module's docstring).

    Args:
        shelf: the shelf to serve (read only).
        token: the job's secret.
        host, port: the address to listen on (port 0: any free port; :attr:`port` says which).
        timeout: seconds a peer may take to send its request, and to take each chunk of the reply.
        max_connections: connections served at once; more are refused (``busy``).
        files: ``files(name)``, the entry and the open file of a name under ``ckpt/`` (a host's own checkpoint
            store, :class:`~varuna_core.launch.local_store.StoreFiles`), served as blobs are; None: no such names.
    """

    def __init__(self, shelf: Shelf, token: str, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 30.0,
                 max_connections: int = 64,
                 files: Callable[[str], tuple[Entry, BinaryIO]] | None = None) -> None:
        if not token:
            raise HandoverError("a shelf server needs the job's token")
        if not timeout > 0 or max_connections < 1:
            raise HandoverError(f"a shelf server needs timeout > 0 and max_connections >= 1, got {timeout} and "
                                f"{max_connections}")
        self.shelf, self.timeout, self.max_connections = shelf, timeout, max_connections
        self._token, self._files = token, files
        self._seen: dict[str, float] = {}  # nonce -> when it expires
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closing = threading.Event()
        self.refused: dict[str, int] = {}  # reason -> count, for monitoring and tests
        self.served = 0
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"shelf-server:{self.port}", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> ShelfServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops serving: no new connections, the open ones cut off, every thread joined."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._acceptor.join()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._listener and not self._closing.is_set():
                        with contextlib.suppress(OSError):
                            self._start(*self._listener.accept())

    def _start(self, sock: socket.socket, peer: Any) -> None:
        with self._lock:
            busy = len(self._conns) >= self.max_connections
            if not busy:
                thread = threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                                          name=f"shelf-conn:{peer}")
                self._conns[sock] = thread
        if busy:
            with sock:
                self._refuse(sock, peer, "busy", linger=False)  # the acceptor does not wait on this peer
            return
        thread.start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            with sock:
                self._answer(sock, peer)
        except OSError as exc:
            if not self._closing.is_set():
                log.warning("shelf server of job %s: peer %s: %s", printable(self.shelf.job), peer, printable(exc))
        finally:
            with self._lock:
                self._conns.pop(sock, None)

    def _refuse(self, sock: socket.socket, peer: Any, reason: str, *, linger: bool = True) -> None:
        """Tells the peer why (best effort) and counts it (but for a peer cut off by :meth:`close`)."""
        if self._closing.is_set():
            return
        log.warning("shelf server of job %s: refused peer %s: %s", printable(self.shelf.job), peer, reason)
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        with contextlib.suppress(OSError):
            sock.settimeout(1.0 if linger else 0.1)
            sock.sendall(_frame({"error": reason}))
            sock.shutdown(socket.SHUT_WR)
            if not linger:
                return
            # take what the peer still sends (a little, for a second) so that closing does not reset the
            # connection, which could discard the reason before the peer reads it
            deadline, drained = time.monotonic() + 1.0, 0
            while drained < MAX_HEADER and time.monotonic() < deadline:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                drained += len(chunk)

    def _answer(self, sock: socket.socket, peer: Any) -> None:
        try:
            body = _opened(_read_frame(sock, time.monotonic() + self.timeout), self._token, _REQUEST)
            names, nonce, max_bytes = self._check(body)
            entries, files = self._open(names, max_bytes)
        except _Timeout:
            return self._refuse(sock, peer, "timed_out")
        except (ValueError, RecursionError) as exc:
            return self._refuse(sock, peer, str(exc) if str(exc).isidentifier() else "malformed")
        except HandoverError as exc:
            return self._refuse(sock, peer, f"unavailable: {exc.message}")
        try:
            reply = _signed(self._token, _REPLY, {"kind": "shelf-reply", "job": self.shelf.job, "nonce": nonce,
                                                  "blobs": [e.as_json() for e in entries]})
            if len(reply) - _PREFIX.size > MAX_HEADER:
                return self._refuse(sock, peer, "reply_oversize")  # the peer asks for fewer names at once
            sock.settimeout(self.timeout)
            sock.sendall(reply)
            for entry, stream in zip(entries, files, strict=True):
                if entry.size and sock.sendfile(stream, 0, entry.size) != entry.size:
                    log.warning("shelf server of job %s: blob %s shrank on the shelf while sent to peer %s",
                                printable(self.shelf.job), printable(entry.name), peer)
                    return None  # the peer sees the transfer cut short
        except TimeoutError:
            log.warning("shelf server of job %s: peer %s stopped taking the reply for %.1f s: cut off",
                        printable(self.shelf.job), peer, self.timeout)
            with self._lock:
                self.refused["stalled"] = self.refused.get("stalled", 0) + 1
            return None
        finally:
            for stream in files:
                stream.close()
        with self._lock:
            self.served += 1
        return None

    def _open(self, names: list[str], max_bytes: int) -> tuple[list[Entry], list[BinaryIO]]:
        """The blobs' entries and files; raises HandoverError (a blob not on the shelf) or ValueError."""
        entries: list[Entry] = []
        files: list[BinaryIO] = []
        try:
            for name in names:
                if name.startswith("ckpt/") and self._files is not None:
                    entry, stream = self._files(name)
                else:
                    entry, stream = self.shelf.open(name)
                files.append(stream)
                if entry.digest is None:  # published for its own host (Space.adopt): hashed now, for the wire
                    entry = dataclasses.replace(entry, digest=_digest_of(stream, entry.size))
                entries.append(entry)
            if sum(e.size for e in entries) > max_bytes:
                raise ValueError("over_max_bytes")
        except BaseException:
            for stream in files:
                stream.close()
            raise
        return entries, files

    def _check(self, body: dict[str, Any]) -> tuple[list[str], str, int]:
        """The names asked for, the request's nonce and its bound; raises ValueError (the reason of a refusal)."""
        if body.get("kind") != "shelf-request":
            raise ValueError("bad_kind")
        if body.get("job") != self.shelf.job:
            raise ValueError("other_job")
        ts, nonce, names, max_bytes = body.get("ts"), body.get("nonce"), body.get("names"), body.get("max_bytes")
        now = time.time()
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not abs(now - ts) <= WINDOW:
            raise ValueError("stale")
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64 or not (nonce.isascii() and nonce.isalnum()):
            raise ValueError("malformed")
        with self._lock:
            if len(self._seen) > 4096:  # forget the nonces of requests too old to be accepted again
                self._seen = {n: t for n, t in self._seen.items() if t > time.monotonic()}
            if nonce in self._seen:
                raise ValueError("replayed")
            self._seen[nonce] = time.monotonic() + 2 * WINDOW
        if not isinstance(names, list) or len(names) > MAX_NAMES:
            raise ValueError("too_many_names")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError("malformed")
        try:
            checked = [check_name(n) for n in names]
        except HandoverError:
            raise ValueError("bad_name") from None
        if len(set(checked)) != len(checked):
            raise ValueError("duplicate_name")
        return checked, nonce, max_bytes


# ----------------------------------------------------------------------------------------------------------
# The client

def fetch_into(host: str, port: int, *, job: str, token: str, names: list[str],
               into: Callable[[Entry], memoryview], timeout: float = 30.0,
               max_bytes: int) -> dict[str, Entry]:
    """Takes the blobs ``names`` of job ``job`` from the shelf server at ``host:port``, each straight into the
    buffer ``into(entry)`` returns (a writable memoryview of exactly ``entry.size`` bytes, e.g. pinned memory),
    and returns their entries by name once every blob arrived whole and hashed right.

    Args:
        timeout: seconds to connect, to get the reply's header, and for each chunk of the data.
        max_bytes: the most bytes to take in all (the peer is told, and held to it).

    Raises:
        HandoverError: the peer refused, stalled, sent less or other than it announced, or could not show that it
            holds the job's token; the message names the peer and the blob.
    """
    peer = f"[{printable(host)}]:{port}" if ":" in host else f"{printable(host)}:{port}"
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0 or not timeout > 0:
        raise HandoverError(f"fetch needs max_bytes >= 0 and timeout > 0, got {short_repr(max_bytes)} and "
                            f"{short_repr(timeout)}")
    checked = [check_name(n) for n in names]
    if len(set(checked)) != len(checked) or len(checked) > MAX_NAMES:
        raise HandoverError(f"a request names each blob once, at most {MAX_NAMES} of them")
    nonce = secrets.token_hex(16)
    request = _signed(token, _REQUEST, {"kind": "shelf-request", "job": job, "ts": time.time(), "nonce": nonce,
                                        "names": checked, "max_bytes": max_bytes})
    if len(request) - _PREFIX.size > MAX_HEADER:
        raise HandoverError(f"a request for {len(checked)} names is over {MAX_HEADER} bytes: ask in several")
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(request)
            entries = _reply(sock, peer, token, job, nonce, checked, max_bytes, timeout)
            for entry in entries:
                _receive(sock, peer, entry, into(entry), timeout)
    except TimeoutError:
        raise HandoverError(f"shelf peer {peer} did not answer within {timeout} s") from None
    except OSError as exc:
        raise HandoverError(f"shelf peer {peer}: {printable(exc)}") from None
    return {e.name: e for e in entries}


class _Hasher:
    """``digest.update`` of each span put, in order, on a thread of its own (at most two spans waiting)."""

    def __init__(self, digest: Any) -> None:
        self._spans: queue.Queue[memoryview | None] = queue.Queue(maxsize=2)
        self.failed: BaseException | None = None  # the digest is then wrong, and the blob refused by its hash
        self._thread = threading.Thread(target=self._run, args=(digest,), name="varuna-recv-hash", daemon=True)
        self._thread.start()

    def _run(self, digest: Any) -> None:
        while (span := self._spans.get()) is not None:  # drained to the end whatever happens: put never blocks
            if self.failed is None:
                try:
                    digest.update(span)
                except BaseException as exc:  # noqa: BLE001 - kept, and the hash then cannot match
                    self.failed = exc

    def put(self, span: memoryview) -> None:
        self._spans.put(span)

    def close(self) -> None:
        """Wait until every span put is hashed."""
        self._spans.put(None)
        self._thread.join()


def fetch(host: str, port: int, *, job: str, token: str, names: list[str], timeout: float = 30.0,
          max_bytes: int) -> dict[str, tuple[Entry, memoryview]]:
    """:func:`fetch_into` into new buffers: ``{name: (entry, its bytes, read only)}``."""
    buffers: dict[str, bytearray] = {}

    def into(entry: Entry) -> memoryview:
        buffers[entry.name] = bytearray(entry.size)
        return memoryview(buffers[entry.name])

    entries = fetch_into(host, port, job=job, token=token, names=names, into=into, timeout=timeout,
                         max_bytes=max_bytes)
    return {n: (e, memoryview(buffers[n]).toreadonly()) for n, e in entries.items()}


def _reply(sock: socket.socket, peer: str, token: str, job: str, nonce: str, names: list[str], max_bytes: int,
           timeout: float) -> list[Entry]:
    """The entries the peer's reply announces, checked against the request; raises HandoverError."""
    try:
        outer = _read_frame(sock, time.monotonic() + timeout)
    except _Timeout:
        raise HandoverError(f"shelf peer {peer} sent no reply within {timeout} s") from None
    except ValueError as exc:
        raise HandoverError(f"shelf peer {peer} sent a bad reply: {exc}") from None
    if isinstance(outer, dict) and set(outer) == {"error"}:
        raise HandoverError(f"shelf peer {peer} refused the request: {short_repr(outer['error'], 300)}")
    try:
        body = _opened(outer, token, _REPLY)
    except (ValueError, RecursionError) as exc:
        raise HandoverError(f"shelf peer {peer} sent a reply it could not sign with the job's token ({exc})",
                            hint="a peer of another job, or one that is not a peer") from None
    if body.get("kind") != "shelf-reply" or body.get("job") != job or body.get("nonce") != nonce:
        raise HandoverError(f"shelf peer {peer} sent a reply to another request (replayed or of another job)")
    blobs = body.get("blobs")
    try:
        if not isinstance(blobs, list):
            raise ValueError("no blob list")
        entries = [_entry(b) for b in blobs]
    except ValueError as exc:
        raise HandoverError(f"shelf peer {peer} sent a bad entry: {exc}") from None
    if [e.name for e in entries] != names:
        raise HandoverError(f"shelf peer {peer} announced other blobs than the ones asked for")
    total = sum(e.size for e in entries)
    if total > max_bytes:
        raise HandoverError(f"shelf peer {peer} announced {total} bytes, over the {max_bytes} allowed")
    return entries


def _receive(sock: socket.socket, peer: str, entry: Entry, buffer: memoryview, timeout: float) -> None:
    """One blob's bytes into ``buffer``, hashed as they come; raises HandoverError.

    A blob of more than ``_HASH_SPAN`` bytes is hashed by a thread of its own, a span behind the socket (the hash
    and ``recv_into`` both let go of the GIL): receiving and hashing then take two cores rather than adding up on
    one. The bytes hashed are the buffer's, which nothing writes again once they arrived."""
    what = f"blob {printable(entry.name)} from shelf peer {peer}"
    view = _writable(buffer, entry.size, what)
    assert entry.digest is not None  # (a peer's entry always has one: _entry refuses null from the wire)
    digest, got, hashed = hasher_for(entry.digest), 0, 0
    hasher = _Hasher(digest) if entry.size > _HASH_SPAN else None
    sock.settimeout(timeout)
    try:
        while got < entry.size:
            try:
                n = sock.recv_into(view[got:got + CHUNK])
            except TimeoutError:
                raise HandoverError(f"{what} stalled after {got} of {entry.size} bytes (nothing for {timeout} s)") \
                    from None
            if n == 0:
                raise HandoverError(f"{what} was cut short: {got} of {entry.size} bytes")
            got += n
            if hasher is None:
                digest.update(view[got - n:got])
            elif got - hashed >= _HASH_SPAN or got == entry.size:
                hasher.put(view[hashed:got])
                hashed = got
    finally:
        if hasher is not None:
            hasher.close()
    if digest.hexdigest() != entry.digest:
        raise HandoverError(f"{what} does not match its digest (damaged on the peer's shelf or on the way)")
