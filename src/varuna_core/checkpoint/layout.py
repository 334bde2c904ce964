"""Where checkpoints are in a store, whose they are, and which one is the latest: the one place that knows.

A store holds ``step_<N>/`` directories. Each belongs to a **run**: the run id is written to ``step_<N>/RUN``
when the directory is created (so even an incomplete one says whose it is) and recorded in its manifest. A run
is one training job and its continuations: the launcher makes an id per job (``VARUNA_RUN_ID``), a script
without the launcher gets a random one from ``Varuna(...)``, and loading a checkpoint adopts its run's id, so
a resumed run keeps writing under the same identity.

Why runs matter: a store reused by a second job must not let the jobs see each other's checkpoints as their
own — retention (``keep``) would delete the new job's checkpoints in favour of an old run's higher steps, and a
restart would resume the old run. So retention, "latest" and the overwrite of a leftover directory consider
only one run's checkpoints; another run's directories are never touched. Torch-free (the launcher uses it).

A directory that holds only part of a checkpoint (a host's own directory when each host keeps its checkpoints
on its local disk) has a ``PART`` marker instead of ``COMPLETE`` (:mod:`varuna_core.checkpoint.part`): it is
never complete, so nothing resumes from it; ``varuna ckpt assemble`` builds the whole checkpoint from such parts.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Collection, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, ConfigError
from ..util.fs import read_regular
from ..util.text import printable, short_repr

if TYPE_CHECKING:  # pragma: no cover
    from .manifest import Manifest

__all__ = ["StepDir", "RUN_FILE", "COMPLETE_FILE", "MANIFEST_FILE", "PART_FILE", "scan", "step_dir", "read_run",
           "new_run_id", "check_run_id", "latest", "runs", "list_runs", "describe_runs", "read_manifest",
           "parse_manifest", "quick_check", "is_checkpoint_file"]

RUN_FILE = "RUN"
COMPLETE_FILE = "COMPLETE"
MANIFEST_FILE = "manifest.json"
PART_FILE = "PART"  # instead of COMPLETE: this directory holds part of the checkpoint (varuna_core.checkpoint.part)
MANIFEST_LIMIT = 256 * 2**20  # bytes: a manifest lists files and parameters, never tensor data
_DATA_RE = re.compile(r"__[0-9]+_[0-9]+\.distcp|dcp_metadata\.json")  # fullmatch: no newline, ASCII digits
_STEP_RE = re.compile(r"^step_(\d{1,18})$")
_RUN_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # fullmatch: a trailing newline is not part of a name
MAX_RUNS_SHOWN = 5


@dataclass(frozen=True)
class StepDir:
    """One ``step_<N>/`` directory: its step, path, whether ``COMPLETE`` exists, and its run (None: written by
    a release that did not record runs, or unreadable)."""

    step: int
    path: Path
    complete: bool
    run: str | None


def is_checkpoint_file(name: object) -> bool:
    """``name`` is a file a manifest may list: ``dcp_metadata.json`` or ``__<rank>_<i>.distcp``, a plain name in
    the step directory itself (no ``/``, no ``..``, nothing around it)."""
    return isinstance(name, str) and _DATA_RE.fullmatch(name) is not None


def step_dir(store: str | os.PathLike, step: int) -> Path:
    return Path(store) / f"step_{int(step)}"


def new_run_id() -> str:
    """A fresh run id: 16 random hex digits."""
    return secrets.token_hex(8)


def check_run_id(run: str, source: str = "run id") -> str:
    """``run`` if it is a valid run id (1-64 of ``A-Z a-z 0-9 . _ -``, nothing around them: no line break, no
    path separator), else a ConfigError naming ``source`` and quoting the value (escaped, shortened)."""
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
        raise ConfigError(f"{source} {short_repr(run)} is not a valid run id",
                          hint="1 to 64 letters, digits, '.', '_' or '-'")
    return run


def read_run(directory: str | os.PathLike) -> str | None:
    """The run id in ``directory/RUN`` (None if missing, not a small regular file, or not a valid id)."""
    path = Path(directory) / RUN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 128).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text if _RUN_RE.fullmatch(text) else None


def _is_complete(directory: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(directory / COMPLETE_FILE).st_mode)
    except OSError:
        return False


def scan(store: str | os.PathLike) -> list[StepDir]:
    """Every ``step_<N>/`` directory of ``store`` (not following links), by step; [] if there is no store."""
    root = Path(store)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list the checkpoint store {root}: {exc.strerror or exc}") from None
    out = []
    for name in names:
        match = _STEP_RE.match(name)
        path = root / name
        if match is None:
            continue
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        out.append(StepDir(int(match.group(1)), path, _is_complete(path), read_run(path)))
    return sorted(out, key=lambda d: d.step)


def runs(entries: list[StepDir]) -> dict[str | None, list[StepDir]]:
    """The entries grouped by run, each group by step."""
    out: dict[str | None, list[StepDir]] = {}
    for entry in entries:
        out.setdefault(entry.run, []).append(entry)
    return out


def list_runs(entries: list[StepDir], limit: int = MAX_RUNS_SHOWN) -> str:
    """The runs that have a step directory in ``entries`` (complete or not), at most ``limit`` of them named:
    ``'3fa2…', 'slurm-lab-77' and 4 more``; for error messages."""
    names = [repr(run) if run is not None else "(unrecorded)" for run in runs(entries)]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def describe_runs(entries: list[StepDir]) -> str:
    """``run 3fa2… (steps 200, 400), run ? (step 1000)``: what a store holds, for error messages."""
    parts = []
    for run, group in runs([e for e in entries if e.complete]).items():
        steps = [str(e.step) for e in group]
        shown = ", ".join(steps[-3:]) if len(steps) <= 3 else f"{steps[0]} … {steps[-1]}, {len(steps)} in all"
        parts.append(f"run {run or '(unrecorded)'} (step{'s' if len(steps) > 1 else ''} {shown})")
    return "; ".join(parts) or "no complete checkpoint"


def latest(store: str | os.PathLike | Sequence[StepDir], *, of_runs: Collection[str | None] | None = None,
           complete: bool = True, refused: MutableMapping[int, str] | None = None,
           check: bool = False) -> StepDir | None:
    """The newest checkpoint to resume from: the one function that decides it (loads, the launcher, the tools
    and the CLI all ask it). None if there is none.

    Args:
        store: a store's path, or what :func:`scan` found in it.
        of_runs: only checkpoints of these runs (``None`` in it: those that record no run); ``None``: of any
            run (a caller that must not mix runs checks first that the store holds one, see :func:`runs`).
        complete: only complete checkpoints (``COMPLETE`` written).
        refused: steps set aside, with why; they are skipped.
        check: run :func:`quick_check` on each candidate, newest first, and take the first that passes; one that
            fails is added to ``refused`` with the reason (when given), so it is looked at once.
    """
    entries = scan(store) if isinstance(store, (str, os.PathLike)) else store
    for entry in reversed(entries):
        if (of_runs is not None and entry.run not in of_runs) or (complete and not entry.complete) \
                or (refused is not None and entry.step in refused):
            continue
        if check:
            problem = quick_check(entry)
            if problem is not None:
                if refused is not None:
                    refused[entry.step] = problem
                continue
        return entry
    return None


def read_manifest(directory: str | os.PathLike, *, unhashed: bool = False) -> Manifest:
    """The manifest of a checkpoint directory (bounded read, no links, validated). ``unhashed``: a file may be
    listed without a digest (a handover's take, whose reader refuses such a file unless it linked it from its
    writer's host); a checkpoint store's manifest never lists one.

    Raises:
        CheckpointError: missing, unreadable, too large, or not a valid manifest.
    """
    path = Path(directory) / MANIFEST_FILE
    data = read_regular(path, MANIFEST_LIMIT, what="checkpoint manifest", follow=False, error=CheckpointError)
    return parse_manifest(data, str(path), unhashed=unhashed)


def parse_manifest(data: bytes, where: str, *, unhashed: bool = False) -> Manifest:
    """The manifest in ``data`` (the bytes of the ``manifest.json`` at ``where``, already bounded), validated
    (``unhashed``: see :func:`read_manifest`).

    Raises:
        CheckpointError: not a valid manifest; the message names ``where``.
    """
    from pydantic import ValidationError

    from .manifest import Manifest

    try:
        manifest = Manifest.model_validate_json(data)
    except (ValidationError, ValueError, RecursionError) as exc:
        lines = str(exc).splitlines()
        raise CheckpointError(f"{where} is not a valid manifest: {' '.join(x.strip() for x in lines[:3])}",
                              hint="the checkpoint is corrupt or not written by varuna; load another one") from None
    bare = next((f.path for f in manifest.files if f.digest is None), None)
    if bare is not None and not unhashed:
        raise CheckpointError(f"{where} is not a valid manifest: it lists {printable(bare)} without a digest",
                              hint="only a handover's manifest on the hosts' shelves may; load another checkpoint")
    return manifest


def quick_check(entry: StepDir) -> str | None:
    """Why the checkpoint ``entry`` cannot be loaded, as far as can be told without reading its data (complete,
    a valid manifest of its step, every listed file present, regular and of its recorded size); None if it
    looks loadable. The hashes are checked when it is loaded."""
    if not entry.complete:
        return f"{entry.path.name} is incomplete"
    try:
        manifest = read_manifest(entry.path)
    except CheckpointError as exc:
        return exc.message
    if manifest.step != entry.step:
        return f"{entry.path.name}/{MANIFEST_FILE} records step {manifest.step}"
    for item in manifest.files:
        if not is_checkpoint_file(item.path):
            return f"{entry.path.name}/{MANIFEST_FILE} lists {item.path!r}, which is not a checkpoint file name"
        try:
            info = os.lstat(entry.path / item.path)
        except OSError as exc:
            return f"{entry.path.name}/{item.path}: {exc.strerror or exc}"
        if not stat.S_ISREG(info.st_mode):
            return f"{entry.path.name}/{item.path} is not a regular file"
        if info.st_size != item.bytes:
            return f"{entry.path.name}/{item.path} holds {info.st_size} bytes; the manifest records {item.bytes}"
    return None
