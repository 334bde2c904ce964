"""``manifest.json`` of a checkpoint directory, as pydantic models (torch-free: the launcher and the offline
tools read manifests without importing torch; ``schemas/manifest.schema.json`` is generated from them).

The manifest is what makes a checkpoint checkable without the model: every file with its size and digest
(:mod:`varuna_core.util.digest`: so a load or ``varuna ckpt verify`` detects a truncated or changed file), every
parameter with its shape and dtype (so a load refuses a checkpoint of another model before touching a live
tensor), and the run, step, world and plan it was written under.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..util.digest import DIGEST_PATTERN
from ..util.versioned_io import ArtifactModel

__all__ = ["CHECKPOINT_INDEX", "FileEntry", "Manifest", "TensorEntry"]

CHECKPOINT_INDEX = "dcp_metadata.json"  # the index of a checkpoint's tensors (varuna_core.checkpoint.storage)


class FileEntry(ArtifactModel):
    path: str = Field(description="a file of the checkpoint directory: __<rank>_<i>.distcp or dcp_metadata.json")
    bytes: int = Field(ge=0)
    digest: str | None = Field(pattern=DIGEST_PATTERN,
                               description="'blake3:<hex>' (written since BLAKE3) or 'sha256:<hex>' (read from older "
                                           "manifests, whose entries had a bare 'sha256'); null only in a handover's "
                                           "manifest on the hosts' shelves, for a file left unhashed because only "
                                           "its own host links it (never in a checkpoint store)")

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        """A manifest written before digests named their algorithm: ``{"sha256": hex}`` is ``"sha256:hex"``."""
        if isinstance(data, dict) and "sha256" in data and "digest" not in data:
            legacy = data["sha256"]
            data = {k: v for k, v in data.items() if k != "sha256"}
            data["digest"] = f"sha256:{legacy}" if isinstance(legacy, str) else legacy
        return data


class TensorEntry(ArtifactModel):
    key: str = Field(description="key in the checkpoint, e.g. 'model/blocks.0.attn.weight'")
    shape: list[int]
    dtype: str


class Manifest(ArtifactModel):
    """``manifest.json`` of a checkpoint directory ``<store>/step_<N>/``.

    The tensors are in ``torch.distributed.checkpoint`` files beside it, under keys ``model/<name>`` (each
    parameter once, tied weights under their canonical name), ``buffer/<name>`` and
    ``optim/<name>/<state>``. ``COMPLETE`` is written after the manifest, once every rank has finished.
    """

    schema_version: Literal[1] = 1
    step: int = Field(ge=0)
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$",
                               description="the run that wrote it (None: written by a release without run ids)")
    created: str
    model: str = Field(description="model class or spec name")
    structure_hash: str
    num_segments: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    stage_to_rank_map: str
    partition: list[tuple[int, int]]
    precision: str
    iteration: int = Field(ge=0, description="optimizer steps taken (what resumes the dropout seed stream)")
    samples_seen: int = Field(ge=0, description="examples consumed: the data position to resume from")
    seed: int = Field(ge=-(2**63), lt=2**64, description="the dropout seed (stored as given; used modulo 2**64)")
    loss_scaler: dict | None = None
    optimizer: dict | None = Field(None, description="optimizer class and hyper-parameters of each group")
    tied: list[list[str]] = Field(default_factory=list, description="tied weights: canonical name first")
    parameters: list[TensorEntry] = Field(description="every model parameter (checkpoint key, shape, dtype)")
    plan: dict | None = None
    files: list[FileEntry]
