"""Versioned artifacts exchanged by the verbs, as pydantic models (JSON Schemas in ``schemas/`` are generated
from them; a test keeps the two in sync).

Times are in seconds and sizes in bytes throughout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

__all__ = [
    "Stat", "SegmentMeasure", "SegmentProfile", "LinearFit", "CommCurve", "Environment", "StopReason", "Profile",
    "load_profile", "save_artifact", "SCHEMAS",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Stat(_Model):
    """Distribution of repeated measurements of one duration."""

    median: float = Field(description="median over the measured repeats (s)")
    p10: float = Field(description="10th percentile (s)")
    p90: float = Field(description="90th percentile (s)")
    repeats: int = Field(description="number of measured repeats (after warm-up)")


class SegmentMeasure(_Model):
    """One segment at one micro-batch size."""

    microbatch_size: int
    forward: Stat = Field(description="forward without autograd (the varuna schedule's F)")
    recompute: Stat = Field(description="forward that records the graph (1F1B/GPipe F, varuna R)")
    backward: Stat = Field(description="backward of the segment, from the output gradient to input and weights")
    output_bytes: int = Field(description="bytes of the value leaving the segment at its cut (0 for the last)")
    saved_bytes: int = Field(description="activation bytes autograd keeps for the backward (saved tensors)")
    peak_bytes: int | None = Field(None, description="device max_memory_allocated during the pass (CUDA only)")


class SegmentProfile(_Model):
    """Static sizes of one segment and its measurements per micro-batch size."""

    index: int
    input_cut: str | None = Field(description="cut the segment starts after (None for the first)")
    output_cut: str | None = Field(description="cut the segment ends at (None for the last)")
    param_count: int
    param_bytes: int = Field(description="parameters the segment uses (tied weights count in each segment using them)")
    grad_bytes: int
    optimizer_bytes: int = Field(description="optimizer state after one step with the spec's optimizer (AdamW by default)")
    measures: list[SegmentMeasure]


class LinearFit(_Model):
    """``time = latency + bytes / bandwidth``, least squares over the measured sizes."""

    latency: float = Field(description="s")
    bandwidth: float = Field(description="bytes/s")
    rel_error: float = Field(description="root-mean-square relative error of the fit over the measured points")

    def predict(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


class CommCurve(_Model):
    """Measured time of one communication pattern against message size."""

    op: Literal["p2p", "allreduce"]
    link: Literal["intra", "inter"] = Field(description="intra-node or inter-node")
    group_size: int = Field(description="2 for point-to-point; the number of ranks for all-reduce")
    sizes: list[int] = Field(description="message sizes (bytes)")
    times: list[float] = Field(description="median time per size (s); one-way for p2p")
    fit: LinearFit


class Environment(_Model):
    torch_version: str
    python_version: str
    device_type: str
    devices: list[str]
    threads: int
    hosts: list[str]
    nproc: int
    precision: str


class StopReason(_Model):
    """Why profiling stopped before the largest requested micro-batch size."""

    microbatch_size: int
    segment: int
    reason: str


class Profile(_Model):
    """What ``varuna profile`` measured: the input of ``varuna plan``."""

    schema_version: Literal[1] = 1
    model: str = Field(description="the model spec it was measured from")
    structure_hash: str = Field(description="hash of the model structure and inputs (changes when the model does)")
    num_segments: int
    cut_names: list[str]
    microbatch_sizes: list[int] = Field(description="sizes measured for every segment")
    stopped: StopReason | None = Field(None, description="set when a memory limit or OOM ended the sweep")
    segments: list[SegmentProfile]
    comm: list[CommCurve] = Field(default_factory=list)
    environment: Environment
    created: str = Field(description="ISO 8601 time of the measurement")


SCHEMAS = {"profile.schema.json": Profile}


def save_artifact(model: BaseModel, path: str | Path) -> None:
    """Write ``model`` as indented JSON, atomically (a crash leaves the old file or the new one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(model.model_dump_json(indent=2) + "\n")
    tmp.replace(path)


def load_profile(path: str | Path) -> Profile:
    try:
        return Profile.model_validate(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ConfigError(f"profile {path} does not exist", hint="create it with `varuna profile SPEC -o FILE`") from None
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[0:3]
        raise ConfigError(f"{path} is not a valid profile: {' '.join(first)}") from None


def schema_text(model: type[BaseModel]) -> str:
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


def write_schemas(directory: str | Path) -> list[Path]:
    """(Re)generate every schema file in ``directory``."""
    written = []
    for name, model in SCHEMAS.items():
        path = Path(directory) / name
        path.write_text(schema_text(model))
        written.append(path)
    return written


if __name__ == "__main__":  # python -m varuna_core.artifacts [DIR]: regenerate schemas/
    import sys

    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "schemas"):
        print(p)
