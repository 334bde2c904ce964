"""``PART``: the marker of a step directory that holds part of a checkpoint (torch-free).

When each host keeps its checkpoints in its own local directory (no shared file system), a host's
``<store>/step_<N>/`` holds the small files every host has (``RUN``, ``manifest.json``, ``dcp_metadata.json``)
and a subset of the data files ``__<rank>_<i>.distcp``. ``PART`` takes the place of ``COMPLETE`` there: the
directory is not a checkpoint anyone may resume from (:func:`varuna_core.checkpoint.layout.scan` counts only
``COMPLETE``), and it says which step, run and host it is part of and which data files it holds. The manifest
stays the authority on what the checkpoint consists of; ``varuna ckpt assemble``
(:mod:`varuna_core.checkpoint.assemble`) builds the whole checkpoint from the hosts' parts.
``schemas/part.schema.json`` is generated from :class:`PartMarker`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from ..errors import CheckpointError
from ..util.fs import MiB, atomic_write, read_regular
from ..util.versioned_io import ArtifactModel, first_problem
from .layout import PART_FILE

__all__ = ["PART_FILE", "PartMarker", "write_part", "read_part"]

PART_LIMIT = 16 * MiB  # bytes: a name per data file, ~20 bytes each
_FILE_NAME = r"^(__[0-9]+_[0-9]+\.distcp|dcp_metadata\.json)$"


class PartMarker(ArtifactModel):
    """``step_<N>/PART``: this directory holds part of checkpoint ``step``."""

    schema_version: Literal[1] = 1
    step: int = Field(ge=0)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$",
                               description="the run the checkpoint belongs to (as in its manifest)")
    host: str = Field(min_length=1, max_length=255, description="the host whose directory this is")
    files: list[Annotated[str, Field(pattern=_FILE_NAME)]] = Field(
        description="the checkpoint's data files this directory holds (names in the directory, sorted)")


def write_part(directory: str | os.PathLike, *, step: int, run_id: str | None, host: str,
               files: list[str]) -> Path:
    """Write ``directory/PART`` atomically (a temporary file renamed over it, fsynced): the directory holds
    ``files`` of checkpoint ``step`` of run ``run_id``, on ``host``. Returns the marker's path.

    Raises:
        CheckpointError: a value the marker cannot hold (a file name that is not a checkpoint file, a bad run id).
    """
    try:
        marker = PartMarker(step=step, run_id=run_id, host=host, files=sorted(set(files)))
    except ValidationError as exc:
        raise CheckpointError(f"cannot write the {PART_FILE} marker of {directory}: {first_problem(exc)}") from None
    path = Path(directory) / PART_FILE
    atomic_write(path, marker.model_dump_json(indent=2) + "\n", durable=True)
    return path


def read_part(directory: str | os.PathLike) -> PartMarker | None:
    """The ``PART`` marker of ``directory`` (bounded read, no links, validated); None if there is none.

    Raises:
        CheckpointError: the marker is a link, not a regular file, too large, or not a valid marker.
    """
    path = Path(directory) / PART_FILE
    if not os.path.lexists(path):
        return None
    data = read_regular(path, PART_LIMIT, what=f"{PART_FILE} marker", follow=False, error=CheckpointError)
    try:
        return PartMarker.model_validate_json(data)
    except (ValidationError, ValueError, RecursionError) as exc:
        problem = first_problem(exc) if isinstance(exc, ValidationError) else str(exc).splitlines()[0]
        raise CheckpointError(f"{path} is not a valid {PART_FILE} marker: {problem}",
                              hint="it is written by varuna when a host keeps part of a checkpoint") from None
