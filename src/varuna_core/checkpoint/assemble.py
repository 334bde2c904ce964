"""``varuna ckpt assemble``: one complete checkpoint from the parts the hosts hold in their own directories.

When each host keeps its checkpoints on its local disk, a host's ``<store>/step_<N>/`` holds ``RUN``,
``manifest.json`` and ``dcp_metadata.json`` (the same on every host), some of the data files
``__<rank>_<i>.distcp``, and a ``PART`` marker (:mod:`varuna_core.checkpoint.part`) instead of ``COMPLETE``.
:func:`assemble` gathers every file the manifest lists from such directories, local or reached over SSH, into
``<out>/step_<N>/``, a complete checkpoint that ``varuna ckpt verify``, ``merge`` and a load accept.

What it trusts, and what it does not:

* **The manifest is the authority.** Every file is copied from a source that lists it with the manifest's size
  and hashed (by its digest's algorithm) as it streams in; a copy of another size or hash is reported and the
  next source holding the file is tried. The manifests of one step must agree between sources (run, step, and
  every file's size and hash); a source whose manifest disagrees with the others' (the most common one, the first
  source's on a tie) is named in a warning and not used for that step.
* **Sources may be hostile.** Names are accepted only as checkpoint file names (``dcp_metadata.json``,
  ``__<rank>_<i>.distcp``: no ``/``, no ``..``), from a listing or a manifest; a manifest is read bounded
  (:data:`~varuna_core.checkpoint.layout.MANIFEST_LIMIT`) and validated; local files are opened without
  following links and only if they are regular files; a remote file is read only if it is a regular file and
  not a link, and a remote that sends more bytes than the manifest records is cut off.
* **SSH needs nothing on the host but a POSIX shell** (``sh``, ``cd``, ``cat``, ``wc``, ``tr``): no Python, no
  varuna. It runs with ``BatchMode=yes`` (never a password prompt) and a connect timeout; every remote word is
  shell-quoted; a connection that sends nothing for :attr:`SSHOptions.timeout` seconds is killed. A source that
  cannot be reached is a warning: the others may hold every file.
* **Nothing half-built looks like a checkpoint.** The step directory is built under a temporary name beside its
  final place, ``COMPLETE`` written last, and renamed into place only when every file has been copied and
  checked; a failure removes it. An existing ``<out>/step_<N>`` is never replaced.

Torch-free, and independent of the launcher. Nothing here prints: :func:`assemble` returns an
:class:`AssembleReport` or raises a :class:`~varuna_core.errors.VarunaError`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import posixpath
import re
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..errors import CheckpointError, ConfigError
from ..util.digest import hasher_for
from ..util.fs import MiB, describe_mode, fsync_dir, open_regular
from ..util.text import one_line, short_repr
from . import layout
from .layout import COMPLETE_FILE, MANIFEST_FILE, PART_FILE, RUN_FILE, check_run_id, is_checkpoint_file
from .manifest import CHECKPOINT_INDEX, Manifest

__all__ = ["SSHOptions", "SourceSummary", "AssembledFile", "AssembleReport", "assemble", "parse_source"]

_STEP_RE = re.compile(r"step_([0-9]{1,18})")  # fullmatch
_RUN_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # fullmatch, as layout's
_USER_RE = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,63}")  # ssh cannot read it as an option
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]{2,45}(%[A-Za-z0-9_.-]{1,32})?")
_REMOTE_RE = re.compile(r"(?:(?P<user>[^@/:]*)@)?(?P<host>\[[^\]/]*\]|[^@/:\[\]]*):(?P<path>.*)", re.DOTALL)
_CHUNK = 4 * MiB
_LISTING_LIMIT = 16 * MiB  # bytes of one remote listing: a line per file
_SMALL_LIMIT = 4096  # bytes of ssh's own error output kept
_MARKERS = (RUN_FILE, MANIFEST_FILE, PART_FILE, COMPLETE_FILE)
_SHOWN = 5  # names listed in one message


@dataclass(frozen=True)
class SSHOptions:
    """How sources ``[user@]host:PATH`` are reached.

    Attributes:
        port: ``ssh -p`` (None: ssh's default or configuration).
        identity: ``ssh -i`` (a private key file).
        options: extra ``-o`` options (``"Key=value"``), given first (ssh keeps the first value of an option).
        connect_timeout: ``ConnectTimeout`` in seconds.
        timeout: seconds a connection may send nothing before it is killed (a hung host or command).
    """

    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: int = 10
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.port is not None and not (isinstance(self.port, int) and 1 <= self.port <= 65535):
            raise ConfigError(f"ssh port {short_repr(self.port)} is not a port", hint="1 to 65535")
        if not (isinstance(self.connect_timeout, int) and 1 <= self.connect_timeout <= 3600):
            raise ConfigError(f"ssh connect timeout {short_repr(self.connect_timeout)} is not 1 to 3600 seconds")
        if not self.timeout > 0:
            raise ConfigError(f"ssh timeout {short_repr(self.timeout)} is not a positive number of seconds")
        for value in (self.identity, *self.options):
            if value is not None and ("\0" in value or not value):
                raise ConfigError(f"ssh option {short_repr(value)} is empty or holds a NUL character")


# ----------------------------------------------------------------------------------------------------------
# Reports


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSummary(_Report):
    source: str = Field(description="as given: a local directory or [user@]host:PATH")
    remote: bool
    reachable: bool = Field(description="its listing could be read")
    files: int = Field(0, description="files of the checkpoint copied from it")
    bytes: int = 0


class AssembledFile(_Report):
    path: str
    bytes: int
    source: str = Field(description="the source the copy came from")


class AssembleReport(_Report):
    output: str = Field(description="the complete checkpoint directory written: <out>/step_<N>")
    step: int
    run: str | None
    files: list[AssembledFile] = Field(description="every file of the manifest, in its order")
    bytes: int
    sources: list[SourceSummary]
    skipped_steps: list[int] = Field(default_factory=list,
                                     description="newer steps of the run the sources do not hold every file of")
    warnings: list[str] = Field(default_factory=list, description="in the order found")


# ----------------------------------------------------------------------------------------------------------
# Sources


class _Warnings(list[str]):
    """The warnings of one assemble, in order, each also passed to ``sink`` as it is found (so a caller shows
    them even when the assemble then fails)."""

    def __init__(self, sink: Callable[[str], None] | None) -> None:
        super().__init__()
        self.sink = sink

    def append(self, warning: str) -> None:
        super().append(warning)
        if self.sink is not None:
            self.sink(warning)


class _SourceFailure(Exception):
    """A source could not deliver what was asked (unreachable, refused, too many bytes, a hang): a warning, and
    the next source is tried."""


class _TooMuch(_SourceFailure):
    """A source holds or sends more bytes than expected: it was cut off."""


@dataclass
class _StepView:
    """What one source holds of one step: its run (``RUN``), and its checkpoint files with their sizes."""

    step: int
    name: str  # the directory's name (step_7, or step_007)
    run: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    manifest: int | None = None  # size of manifest.json (None: none that is a regular file)


class _Source(abc.ABC):
    """A directory holding ``step_<N>/`` directories, or one ``step_<N>`` directory (on this machine, or over SSH:
    the two subclasses)."""

    label: str
    remote = False
    single: bool  # the source is one step_<N> directory, not a store

    @abc.abstractmethod
    def listing(self, warnings: list[str]) -> dict[int, _StepView]:
        """The step directories this source holds, and what is in each."""

    @abc.abstractmethod
    def stream(self, step: int, name: str, limit: int, sink: Callable[[bytes], None]) -> int:
        """Pass the bytes of ``step``'s file ``name`` to ``sink``; never more than ``limit`` of them (a source that
        has more fails). Returns how many were passed."""

    def read(self, step: int, name: str, limit: int) -> bytes:
        parts: list[bytes] = []
        self.stream(step, name, limit, parts.append)
        return b"".join(parts)


def _step_of(name: str) -> int | None:
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


class _LocalSource(_Source):
    def __init__(self, label: str, path: Path) -> None:
        self.label, self.path = label, path
        self.single = _step_of(path.name) is not None
        self.dirs: dict[int, str] = {}  # step -> its directory's name, as listed

    def _dir(self, step: int) -> Path:
        return self.path if self.single else self.path / self.dirs.get(step, f"step_{step}")

    def listing(self, warnings: list[str]) -> dict[int, _StepView]:
        try:
            info = os.stat(self.path)
        except OSError as exc:
            raise _SourceFailure(exc.strerror or str(exc)) from None
        if not stat.S_ISDIR(info.st_mode):
            raise _SourceFailure(f"{describe_mode(info.st_mode)}, not a directory")
        if self.single:
            step = _step_of(self.path.name)
            assert step is not None  # single means the name matched
            dirs = [(step, self.path, layout.read_run(self.path))]
        else:
            try:
                dirs = [(e.step, e.path, e.run) for e in layout.scan(self.path)]
            except CheckpointError as exc:
                raise _SourceFailure(exc.message) from None
        out = {}
        for step, path, run in dirs:
            view = _StepView(step, path.name, run)
            self._list_files(path, view, warnings)
            out[step] = view
            self.dirs[step] = path.name
        return out

    def _list_files(self, directory: Path, view: _StepView, warnings: list[str]) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            warnings.append(f"{self.label}: cannot list {directory.name}: {exc.strerror or exc}")
            return
        for entry in entries:
            name = entry.name
            if not (is_checkpoint_file(name) or name == MANIFEST_FILE):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                warnings.append(f"{self.label}: {directory.name}/{name} is {describe_mode(info.st_mode)}, "
                                "not a plain file: not used")
            elif name == MANIFEST_FILE:
                view.manifest = info.st_size
            else:
                view.files[name] = info.st_size

    def stream(self, step: int, name: str, limit: int, sink: Callable[[bytes], None]) -> int:
        path = self._dir(step) / name
        try:
            fd = open_regular(path, what="file", follow=False, error=CheckpointError)
        except CheckpointError as exc:
            raise _SourceFailure(exc.message) from None
        total = 0
        try:
            while True:
                try:
                    chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
                except OSError as exc:
                    raise _SourceFailure(f"cannot read {path}: {exc.strerror or exc}") from None
                if not chunk:
                    return total
                if total + len(chunk) > limit:
                    raise _TooMuch(f"holds more than the {limit:,} bytes expected")
                total += len(chunk)
                sink(chunk)  # a failure to write the copy is not the source's: it propagates
        finally:
            os.close(fd)


# The remote side: POSIX sh and its utilities only. $1: the directory to enter; $2: one step_N in it, or ''
# for every step_N. Prints `D step_N`, `R step_N RUN` (characters outside a run id as '?'), `F step_N NAME
# SIZE` for a regular file, `L step_N NAME` for anything else (a link, a FIFO), then `END`. Names with other
# characters than [A-Za-z0-9_.-] are never printed (a newline in a name cannot forge a line).
_LIST_SCRIPT = r"""cd -- "$1" || exit 3
if [ -n "$2" ]; then set -- "$2"; else set -- step_*; fi
for d do
  case $d in step_|step_*[!0-9]*) continue;; esac
  if [ -h "$d" ] || [ ! -d "$d" ]; then continue; fi
  echo "D $d"
  r="$d/RUN"
  if [ -f "$r" ] && [ ! -h "$r" ] && [ $(($(wc -c < "$r"))) -le 128 ]; then
    printf 'R %s %s\n' "$d" "$(tr -d '\n' < "$r" | tr -c 'A-Za-z0-9._-' '?')"
  fi
  for f in "$d"/*; do
    n=${f#"$d"/}
    case $n in *[!A-Za-z0-9_.-]*) continue;; esac
    if [ -h "$f" ] || { [ -e "$f" ] && [ ! -f "$f" ]; }; then echo "L $d $n"
    elif [ -f "$f" ]; then printf 'F %s %s %s\n' "$d" "$n" $(($(wc -c < "$f")))
    fi
  done
done
echo END"""
# $1: a file; sent only if it is a regular file and not a link.
_CAT_SCRIPT = r"""if [ -h "$1" ] || [ ! -f "$1" ]; then echo "$1 is not a plain file" >&2; exit 3; fi
exec cat -- "$1"
"""


class _RemoteSource(_Source):
    remote = True

    def __init__(self, label: str, user: str | None, host: str, path: str, ssh: SSHOptions) -> None:
        self.label, self.user, self.host, self.ssh = label, user, host, ssh
        path = path.rstrip("/") or "/"
        if path == "~" or path.startswith("~/"):  # quoted, ~ would not expand; ssh starts in the home directory
            path = path[2:] or "."
        self.path = path
        self.single = _step_of(posixpath.basename(path)) is not None
        self.dirs: dict[int, str] = {}  # step -> its directory's name, as listed

    def _argv(self, script: str, *args: str) -> list[str]:
        argv = ["ssh"]
        for option in self.ssh.options:
            argv += ["-o", option]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.ssh.connect_timeout}",
                 "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        if self.ssh.port is not None:
            argv += ["-p", str(self.ssh.port)]
        if self.user:
            argv += ["-l", self.user]
        if self.ssh.identity:
            argv += ["-i", self.ssh.identity, "-o", "IdentitiesOnly=yes"]
        command = " ".join(shlex.quote(word) for word in ("sh", "-c", script, "sh", *args))
        return [*argv, "--", self.host, command]  # after --, a host is a host whatever it starts with

    def _file(self, step: int, name: str) -> str:
        directory = self.path if self.single else posixpath.join(self.path, self.dirs.get(step, f"step_{step}"))
        return posixpath.join(directory, name)

    def listing(self, warnings: list[str]) -> dict[int, _StepView]:
        if self.single:
            where, only = posixpath.dirname(self.path) or ".", posixpath.basename(self.path)
        else:
            where, only = self.path, ""
        parts: list[bytes] = []
        _run(self._argv(_LIST_SCRIPT, where, only), _LISTING_LIMIT, parts.append, self.ssh.timeout)
        return self._parse_listing(b"".join(parts).decode("ascii", errors="replace"), warnings)

    def _parse_listing(self, text: str, warnings: list[str]) -> dict[int, _StepView]:
        lines = text.split("\n")
        if "END" not in lines:
            raise _SourceFailure("the listing ended early (the connection dropped?)")
        out: dict[int, _StepView] = {}
        odd = []
        for line in lines[:lines.index("END")]:
            words = line.split(" ")
            kind, name = words[0], words[2] if len(words) > 2 else ""
            step = _step_of(words[1]) if len(words) > 1 else None
            view = out.get(step) if step is not None else None
            if view is not None and view.name != words[1]:
                view = None  # step_7 and step_007: the first listed is used
            if step is not None and kind == "D" and len(words) == 2 and step not in out:
                out[step] = _StepView(step, words[1])
                self.dirs[step] = words[1]
            elif view is None or "/" in name or ".." in name:
                odd.append(line)
            elif kind == "R" and len(words) == 3:
                view.run = name if _RUN_RE.fullmatch(name) else None
            elif kind == "F" and len(words) == 4 and words[3].isdigit() and name == MANIFEST_FILE:
                view.manifest = int(words[3])
            elif kind == "F" and len(words) == 4 and words[3].isdigit() and is_checkpoint_file(name):
                view.files[name] = int(words[3])
            elif kind == "L" and len(words) == 3 and (is_checkpoint_file(name) or name == MANIFEST_FILE):
                warnings.append(f"{self.label}: {words[1]}/{name} is a link or not a plain file: not used")
            elif kind not in ("F", "L") or len(words) != (4 if kind == "F" else 3):
                odd.append(line)
            # else another file of the directory (a marker, a leftover): never fetched
        if odd:
            more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
            warnings.append(f"{self.label}: ignored an unexpected listing line {short_repr(odd[0])}{more}")
        return out

    def stream(self, step: int, name: str, limit: int, sink: Callable[[bytes], None]) -> int:
        return _run(self._argv(_CAT_SCRIPT, self._file(step, name)), limit, sink, self.ssh.timeout)


def _run(argv: list[str], limit: int, sink: Callable[[bytes], None], timeout: float) -> int:
    """Run ``argv``, passing its stdout to ``sink``: at most ``limit`` bytes (more raises :class:`_TooMuch`),
    killed when it sends nothing for ``timeout`` seconds or fails. Returns the bytes passed.

    Raises:
        _SourceFailure: ssh could not be started, timed out, or exited with an error (its last words quoted).
    """
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as exc:
        raise _SourceFailure(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    assert proc.stdout is not None and proc.stderr is not None  # both are pipes
    errors = bytearray()
    total = 0
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            selector.register(proc.stderr, selectors.EVENT_READ)
            while selector.get_map():
                ready = selector.select(timeout)
                if not ready:
                    raise _SourceFailure(f"sent nothing for {timeout:g} s; stopped")
                for key, _ in ready:
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is proc.stderr:
                        errors += data
                        del errors[:-_SMALL_LIMIT]
                    elif total + len(data) > limit:
                        raise _TooMuch(f"sent more than the {limit:,} bytes expected; cut off")
                    else:
                        total += len(data)
                        sink(data)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise _SourceFailure(f"did not exit {timeout:g} s after its output ended; stopped") from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: ssh and whatever it started
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    if code != 0:
        said = [line for line in errors.decode("utf-8", errors="replace").splitlines() if line.strip()]
        detail = one_line(said[-1], 300) if said else "no message"
        what = "ssh failed" if code == 255 else f"exit code {code}"
        raise _SourceFailure(f"{what}: {detail}")
    return total


def parse_source(spec: str | os.PathLike[str], ssh: SSHOptions | None = None) -> _Source:
    """The source ``spec`` names: ``[user@]host:PATH`` (a ``:`` before any ``/``) is reached over SSH, anything
    else (and every ``os.PathLike``) is a local directory.

    Raises:
        ConfigError: a remote spec with a bad user or host name or no path, or a NUL character.
    """
    text = os.fspath(spec)
    if "\0" in text:
        raise ConfigError(f"source {short_repr(text)} holds a NUL character")
    if isinstance(spec, os.PathLike):
        return _LocalSource(text, Path(text))
    colon, slash = text.find(":"), text.find("/")
    if colon < 0 or 0 <= slash < colon:
        return _LocalSource(text, Path(text))
    hint = "write a remote source as [user@]host:PATH, and a local path holding ':' as ./NAME"
    match = _REMOTE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(f"source {short_repr(text)} is neither [user@]host:PATH nor a local path", hint=hint)
    user, host, path = match.group("user"), match.group("host"), match.group("path")
    if user is not None and not _USER_RE.fullmatch(user):
        raise ConfigError(f"source {short_repr(text)}: {short_repr(user)} is not a user name", hint=hint)
    if host.startswith("["):
        host = host[1:-1]
        ok = _IPV6_RE.fullmatch(host) is not None
    else:
        ok = _HOST_RE.fullmatch(host) is not None
    if not ok:
        raise ConfigError(f"source {short_repr(text)}: {short_repr(host)} is not a host name", hint=hint)
    if not path:
        raise ConfigError(f"source {short_repr(text)} names no directory on {host}", hint=hint)
    return _RemoteSource(text, user, host, path, ssh or SSHOptions())


# ----------------------------------------------------------------------------------------------------------
# Choosing the step


@dataclass
class _Plan:
    """How one step can be assembled: the manifest (and its bytes), the sources usable for it, and for every
    file the sources that list it with the manifest's size."""

    step: int
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""
    users: list[_Source] = field(default_factory=list)
    holders: dict[str, list[_Source]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    searched: list[_Source] = field(default_factory=list)


def _manifest_key(manifest: Manifest) -> tuple:
    return manifest.run_id, manifest.step, tuple(sorted((f.path, f.bytes, f.digest) for f in manifest.files))


def _read_manifest(source: _Source, view: _StepView, run: str | None) -> tuple[Manifest, bytes]:
    """``source``'s manifest of ``view.step``, checked: bounded, valid, of this step and run, listing only
    checkpoint file names, each once.

    Raises:
        _SourceFailure: why it cannot be used.
    """
    where = f"step_{view.step}/{MANIFEST_FILE}"
    limit = layout.MANIFEST_LIMIT
    if view.manifest is not None and view.manifest > limit:
        raise _SourceFailure(f"{where} is {view.manifest:,} bytes, more than the {limit:,} a manifest may have")
    try:
        data = source.read(view.step, MANIFEST_FILE, limit)
        manifest = layout.parse_manifest(data, where)
    except _TooMuch:
        raise _SourceFailure(f"{where} is larger than the {limit:,} bytes a manifest may have") from None
    except _SourceFailure as exc:
        raise _SourceFailure(f"{where}: {exc}") from None
    except CheckpointError as exc:
        raise _SourceFailure(exc.message) from None
    if manifest.step != view.step:
        raise _SourceFailure(f"{where} records step {manifest.step}")
    if manifest.run_id != run:
        raise _SourceFailure(f"{where} records run {manifest.run_id}, not {run}")
    names = [f.path for f in manifest.files]
    bad = [n for n in names if not is_checkpoint_file(n)]
    if bad:
        raise _SourceFailure(f"{where} lists {short_repr(bad[0])}, which is not a checkpoint file name "
                             f"({CHECKPOINT_INDEX} or __<rank>_<i>.distcp)")
    if len(set(names)) != len(names):
        raise _SourceFailure(f"{where} lists a file twice")
    return manifest, data


def _plan(step: int, run: str | None, views: dict[_Source, dict[int, _StepView]], warnings: list[str]) -> _Plan:
    """Which sources can serve ``step`` of ``run``, with what; ``plan.missing`` names the files none of them
    holds (with the right size), or says that no usable manifest was found."""
    plan = _Plan(step)
    holding = [(s, v[step]) for s, v in views.items() if step in v and v[step].run == run]
    plan.searched = [s for s, _ in holding]
    refused: set[_Source] = set()
    found: list[tuple[_Source, Manifest, bytes]] = []
    for source, view in holding:
        if view.manifest is None:
            continue  # its files may still serve: each copy is checked against the manifest's size and hash
        try:
            manifest, data = _read_manifest(source, view, run)
        except _SourceFailure as exc:
            warnings.append(f"{source.label}: {exc}; not used for step {step}")
            refused.add(source)
            continue
        found.append((source, manifest, data))
    if not found:
        plan.missing = [MANIFEST_FILE]
        return plan
    keys = [_manifest_key(m) for _, m, _ in found]
    best = max(keys, key=keys.count)  # the most common; on a tie the first source's
    reference, plan.manifest, plan.manifest_bytes = found[keys.index(best)]
    for (source, manifest, _), key in zip(found, keys, strict=True):
        if key != best:
            warnings.append(f"{source.label}: its manifest of step {step} disagrees with {reference.label}'s "
                            f"({_difference(plan.manifest, manifest)}); not used for step {step}")
            refused.add(source)
    plan.users = [s for s, _ in holding if s not in refused]
    for entry in plan.manifest.files:
        holders = []
        for source in plan.users:
            size = views[source][step].files.get(entry.path)
            if size is None:
                continue
            if size != entry.bytes:
                warnings.append(f"{source.label}: step_{step}/{entry.path} holds {size:,} bytes, the manifest "
                                f"records {entry.bytes:,}: not used")
                continue
            holders.append(source)
        plan.holders[entry.path] = holders
        if not holders:
            plan.missing.append(entry.path)
    return plan


def _difference(a: Manifest, b: Manifest) -> str:
    if a.run_id != b.run_id:
        return f"run {b.run_id} instead of {a.run_id}"
    ours, theirs = {f.path: f for f in a.files}, {f.path: f for f in b.files}
    for name in sorted(set(ours) | set(theirs)):
        if name not in theirs:
            return f"it does not list {name}"
        if name not in ours:
            return f"it lists {name} too"
        if (ours[name].bytes, ours[name].digest) != (theirs[name].bytes, theirs[name].digest):
            return f"another size or digest for {name}"
    return "another manifest"


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _choose_run(run: str | None, step: int | None, views: dict[_Source, dict[int, _StepView]]) -> str | None:
    """The run to assemble: ``run``, else the one run the sources hold (at ``step`` when given)."""
    present: list[str | None] = []
    for per_step in views.values():
        for view in per_step.values():
            if (step is None or view.step == step) and (view.manifest is not None or view.files) \
                    and view.run not in present:
                present.append(view.run)
    where = "" if step is None else f" at step {step}"
    if not present:
        raise CheckpointError(f"the sources hold no checkpoint{where}",
                              hint="pass each host's checkpoint store (the directory holding step_N/)")
    if run is not None:
        if run not in present:
            raise CheckpointError(f"the sources hold no checkpoint of run {run}{where} (they hold "
                                  f"{_runs(present)})", hint="pass --run with one of these")
        return run
    if len(present) > 1:
        raise ConfigError(f"the sources hold checkpoints of {len(present)} runs{where}: {_runs(present)}",
                          hint="choose one with --run RUN")
    return present[0]


def _runs(present: list[str | None]) -> str:
    return _names([repr(r) if r is not None else "(unrecorded)" for r in present])


def _choose(step: int | None, run: str | None, views: dict[_Source, dict[int, _StepView]],
            warnings: list[str]) -> tuple[_Plan, list[int]]:
    """The plan of ``step``, or of the newest step of ``run`` whose every file some source holds; and the newer
    steps passed over.

    Raises:
        CheckpointError: no such step, or files no source holds (named, with the sources searched).
    """
    steps = sorted({s for per_step in views.values() for s, v in per_step.items()
                    if v.run == run and (v.manifest is not None or v.files)}, reverse=True)
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"no source holds step {step} of run {run}",
                                  hint=f"steps found: {_names([str(s) for s in steps]) or 'none'}")
        steps = [step]
    skipped: list[int] = []
    first: _Plan | None = None
    for candidate in steps:
        plan = _plan(candidate, run, views, warnings)
        if not plan.missing:
            return plan, skipped
        first = first or plan
        skipped.append(candidate)
        if step is None:
            warnings.append(f"step {candidate}: no source holds {_names(plan.missing)}; trying an older step")
    assert first is not None  # steps is not empty (the run was found)
    searched = _names([s.label for s in first.searched]) or "none"
    if first.missing == [MANIFEST_FILE]:
        raise CheckpointError(f"step {first.step} of run {run}: no source holds a usable {MANIFEST_FILE} "
                              f"(searched: {searched})", hint="the warnings say why each one was refused")
    older = "" if step is not None or len(steps) == 1 else " nor any older step of the run"
    raise CheckpointError(f"cannot assemble step {first.step} of run {run}{older}: no source holds "
                          f"{_names(first.missing)} (searched: {searched})",
                          hint="add the host that holds them, or choose a step with --step")


# ----------------------------------------------------------------------------------------------------------
# Copying


def _copy(entry_path: str, size: int, digest: str, plan: _Plan, directory: Path,
          warnings: list[str]) -> _Source:
    """Copy one file of the manifest into ``directory`` from the first source whose copy has its size and
    digest. Returns that source.

    Raises:
        CheckpointError: no source has a good copy (what each one gave is in ``warnings``).
    """
    tried = []
    for source in plan.holders[entry_path]:
        tried.append(source.label)
        problem = _copy_from(source, plan.step, entry_path, size, digest, directory / entry_path)
        if problem is None:
            return source
        warnings.append(f"{source.label}: step_{plan.step}/{entry_path}: {problem}")
    raise CheckpointError(f"step {plan.step}: no good copy of {entry_path} (tried: {_names(tried)})",
                          hint="the warnings say what each source sent; add a host that holds it")


def _copy_from(source: _Source, step: int, name: str, size: int, expected: str, target: Path) -> str | None:
    """Stream ``source``'s copy of ``name`` into the new file ``target``, hashing it on the way (checked against
    the manifest's digest ``expected``); what is wrong with the copy (``target`` removed), or None (``target``
    written and fsynced)."""
    digest = hasher_for(expected)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o644)
    problem: str | None = "not copied"
    try:
        with os.fdopen(fd, "wb") as out:
            def sink(chunk: bytes) -> None:
                digest.update(chunk)
                out.write(chunk)

            try:
                got = source.stream(step, name, size, sink)
            except _SourceFailure as exc:
                problem = str(exc)
            else:
                if got != size:
                    problem = f"sent {got:,} bytes, the manifest records {size:,}"
                elif digest.hexdigest() != expected:
                    problem = "digest mismatch (a corrupt copy)"
                else:
                    out.flush()
                    os.fsync(out.fileno())
                    problem = None
    finally:
        if problem is not None:
            target.unlink(missing_ok=True)
    return problem


def _write_small(directory: Path, name: str, data: bytes) -> None:
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())



def _check_out(out: Path) -> None:
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory",
                          hint="name a new directory or a checkpoint store")


def _target(out: Path, step: int) -> Path:
    target = out / f"step_{step}"
    if os.path.lexists(target):
        raise ConfigError(f"{target} already exists", hint="choose another output directory (-o); an existing "
                          "checkpoint is never replaced")
    return target


def _build(plan: _Plan, out: Path, warnings: list[str]) -> tuple[Path, list[tuple[_Source, AssembledFile]]]:
    """Copy every file into a temporary directory beside ``out/step_<N>``, write ``RUN``, the manifest and
    ``COMPLETE`` last, and rename it into place. A failure leaves no trace but ``out`` itself (kept if it
    existed)."""
    assert plan.manifest is not None  # a plan without a manifest has missing files
    target = _target(out, plan.step)
    created = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".step_{plan.step}.assemble-", dir=out))
    except OSError as exc:
        raise CheckpointError(f"cannot create {out}: {exc.strerror or exc}") from None
    try:
        copied = []
        for entry in plan.manifest.files:
            assert entry.digest is not None  # (a store's manifest lists none without: read_manifest refuses it)
            source = _copy(entry.path, entry.bytes, entry.digest, plan, work, warnings)
            copied.append((source, AssembledFile(path=entry.path, bytes=entry.bytes, source=source.label)))
        if plan.manifest.run_id is not None:
            _write_small(work, RUN_FILE, f"{plan.manifest.run_id}\n".encode())
        _write_small(work, MANIFEST_FILE, plan.manifest_bytes)
        fsync_dir(work)
        _write_small(work, COMPLETE_FILE, f"{plan.step}\n".encode())
        os.chmod(work, 0o755)
        _target(out, plan.step)  # nobody made it meanwhile
        os.rename(work, target)
        fsync_dir(out)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write the checkpoint into {out}: {exc.strerror or exc}") from None
        raise
    return target, copied


# ----------------------------------------------------------------------------------------------------------
# assemble


def assemble(sources: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *, step: int | None = None,
             run: str | None = None, ssh: SSHOptions | None = None,
             on_warning: Callable[[str], None] | None = None) -> AssembleReport:
    """Build the complete checkpoint ``<out>/step_<N>/`` from the parts ``sources`` hold.

    Args:
        sources: local directories (a store holding ``step_<N>/``, or one ``step_<N>``) or ``[user@]host:PATH``
            (:func:`parse_source`), tried in this order for each file.
        out: the store to write into (created if missing).
        step: the step to assemble; None: the newest step of the run for which the sources hold every file.
        run: the run; None: the one run the sources hold (several: refused, naming them).
        ssh: how remote sources are reached.
        on_warning: called with each warning as it is found (they are also in the report; a failed assemble
            has no report, and its warnings say why sources were passed over).

    Raises:
        ConfigError: no sources, a bad source or run id, several runs without ``run``, or ``<out>/step_<N>``
            exists.
        CheckpointError: no source could be read, the step is missing, or a file has no good copy anywhere
            (named, with the sources searched).
    """
    if not sources:
        raise ConfigError("no sources given", hint="pass each host's checkpoint directory (local or host:PATH)")
    if run is not None:
        check_run_id(run, "--run")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"step {short_repr(step)} is not a step number", hint="a step is an integer >= 0")
    ssh = ssh or SSHOptions()
    parsed = [parse_source(spec, ssh) for spec in sources]
    out_path = Path(out)
    _check_out(out_path)
    if step is not None:
        _target(out_path, step)
    warnings = _Warnings(on_warning)
    summaries = {s: SourceSummary(source=s.label, remote=s.remote, reachable=False) for s in parsed}
    views: dict[_Source, dict[int, _StepView]] = {}
    for source in parsed:
        try:
            views[source] = source.listing(warnings)
        except _SourceFailure as exc:
            warnings.append(f"{source.label}: cannot be read: {exc}")
            continue
        summaries[source].reachable = True
    if not views:
        raise CheckpointError(f"none of the {len(parsed)} source(s) could be read: "
                              + "; ".join(w for w in warnings if "cannot be read" in w),
                              hint="check the paths, and that `ssh HOST` works without a password")
    chosen_run = _choose_run(run, step, views)
    plan, skipped = _choose(step, chosen_run, views, warnings)
    target, copied = _build(plan, out_path, warnings)
    for source, item in copied:
        summaries[source].files += 1
        summaries[source].bytes += item.bytes
    return AssembleReport(output=str(target), step=plan.step, run=chosen_run, files=[item for _, item in copied],
                          bytes=sum(item.bytes for _, item in copied), sources=list(summaries.values()),
                          skipped_steps=skipped, warnings=list(warnings))
