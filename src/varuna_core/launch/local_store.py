"""A host's own checkpoint directory, served read only over the shelves' wire (``varuna launch --ckpt-local``).

With ``--ckpt-local`` the checkpoint store is a directory on each host's own disk, at the same path everywhere,
and each host's ``step_<N>/`` holds only part of checkpoint ``N`` (what its ranks wrote and a copy of another
host's: :mod:`varuna_core.worker.local_store`). When a new configuration resumes from such a checkpoint, each rank
takes the files its stage needs from its own host's directory, else from a host that holds them: the node agent's
:class:`~varuna_core.launch.shelf.ShelfServer` then also serves its store, read only, under the names
``ckpt/step_<N>/<file>`` (:func:`store_name`), with the same authentication, bounds and hash checks as the blobs of
its shelf. Only a checkpoint's own files are served (the data files ``__<r>_<i>.distcp``, the index, the
manifest, ``RUN``), each a regular file reached without following a link, and each data file's entry carries the
size and SHA-256 that the directory's manifest records for it, so that a file changed on disk is refused by the
receiver as it arrives. No torch here: the agent serves it.
"""

from __future__ import annotations

import io
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from ..checkpoint.layout import MANIFEST_FILE, RUN_FILE, read_manifest
from ..checkpoint.manifest import CHECKPOINT_INDEX
from ..errors import CheckpointError, ConfigError, HandoverError
from ..util.digest import of_bytes
from ..util.fs import open_regular, read_regular
from ..util.text import printable
from .shelf import Entry

__all__ = ["PREFIX", "StoreFiles", "store_name", "split_store_name"]

PREFIX = "ckpt/"  # the names of a store's files on the wire
_NAME = re.compile(r"ckpt/step_([0-9]{1,18})/(__[0-9]{1,9}_[0-9]{1,9}\.distcp|dcp_metadata\.json|manifest\.json|RUN)")
_SMALL_LIMIT = 256 * 2**20  # bytes of RUN or of a manifest (the layout's bound on a manifest)


def store_name(step: int, file: str) -> str:
    """The wire name of ``file`` of ``step_<step>/`` in a host's store."""
    return f"{PREFIX}step_{int(step)}/{file}"


def split_store_name(name: str) -> tuple[int, str] | None:
    """``(step, file)`` of a wire name of a store's file, None for any other name."""
    match = _NAME.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


class StoreFiles:
    """Opens the files of this host's checkpoint store ``root`` for a :class:`~varuna_core.launch.shelf.ShelfServer`
    (its ``files`` argument)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def open(self, name: str) -> tuple[Entry, BinaryIO]:
        """The entry of the store's file ``name`` (``ckpt/step_<N>/<file>``) and the file, at its start.

        Raises:
            HandoverError: not such a name, no such file, a link or not a regular file, or a data file whose size
                is not the manifest's (it was changed on disk).
        """
        parsed = split_store_name(name)
        if parsed is None:
            raise HandoverError(f"{printable(name)} names no file of a checkpoint store")
        step, file = parsed
        directory = self.root / f"step_{step}"
        try:
            info = os.lstat(directory)
        except OSError:
            raise HandoverError(f"no checkpoint step_{step} in this host's store {self.root}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise HandoverError(f"{directory} is not a directory (a link is not followed)")
        try:
            if file in (MANIFEST_FILE, RUN_FILE):
                data = read_regular(directory / file, _SMALL_LIMIT, what="checkpoint file", follow=False,
                                    error=HandoverError)
                return Entry(name, len(data), of_bytes(data), {}), io.BytesIO(data)
            manifest = read_manifest(directory)
        except (CheckpointError, ConfigError) as exc:
            raise HandoverError(exc.message) from None
        listed = {f.path: f for f in manifest.files}
        if file not in listed:
            raise HandoverError(f"{printable(file)} is not a file of checkpoint step_{step}")
        fd = open_regular(directory / file, what="checkpoint file", follow=False, error=HandoverError)
        size = os.fstat(fd).st_size
        if size != listed[file].bytes or (file == CHECKPOINT_INDEX and size > _SMALL_LIMIT):
            os.close(fd)
            raise HandoverError(f"{directory / file} has {size} bytes, not the {listed[file].bytes} of its manifest")
        return Entry(name, size, listed[file].digest, {}), os.fdopen(fd, "rb")
