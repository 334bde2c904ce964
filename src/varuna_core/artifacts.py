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
    "load_profile", "save_artifact", "SCHEMAS", "StagePlan", "Prediction", "Candidate", "Plan", "save_plan",
    "load_plan", "write_schemas", "FileEntry", "TensorEntry", "Manifest",
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
    optimizer_time: float = Field(0.0, description="one optimizer step over the segment's parameters (s, median)")
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
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and data.get("schema_version") not in (None, 1):
            raise ConfigError(f"{path} has profile format version {data.get('schema_version')}; this release reads "
                              "version 1", hint="re-measure with this release's `varuna profile`")
        return Profile.model_validate(data)
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


# ----------------------------------------------------------------------------------------------------------
# Plan


class StagePlan(_Model):
    """One pipeline stage of a plan."""

    stage: int
    segments: tuple[int, int] = Field(description="half-open range of segments")
    forward: float = Field(description="predicted F time per full micro-batch (s)")
    recompute: float = Field(description="predicted R time per full micro-batch (s); 0 when the stage does not recompute")
    backward: float = Field(description="predicted B time per full micro-batch (s)")
    send_activation: float = Field(0.0, description="predicted time to send one activation to the next stage (s)")
    send_gradient: float = Field(0.0, description="predicted time to send one gradient to the previous stage (s)")
    allreduce: float = Field(0.0, description="predicted data-parallel gradient all-reduce time (s)")
    optimizer: float = Field(0.0, description="predicted optimizer step time (s)")
    busy: float = Field(description="simulated compute time in one step (s)")
    memory_bytes: int = Field(description="predicted peak memory per device, headroom included")
    held_microbatches: int = Field(description="micro-batches whose state the stage holds at once")


class Prediction(_Model):
    step_time: float = Field(description="s")
    samples_per_second: float
    bubble_fraction: float
    pipeline_time: float = Field(description="s, before the gradient all-reduce")
    allreduce_time: float = Field(description="s, the slowest stage's gradient all-reduce")


class Candidate(_Model):
    """A configuration the search scored (the winner or an alternative)."""

    pp: int
    dp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    step_time: float
    samples_per_second: float
    bubble_fraction: float
    peak_memory_bytes: int
    reason: str = Field("", description="why it lost to the plan (empty for the plan itself)")


class Plan(_Model):
    """What ``varuna plan`` chose, and what ``Varuna(..., plan=...)`` and ``varuna launch`` run."""

    schema_version: Literal[1] = 1
    model: str
    profile_hash: str = Field(description="structure hash of the profiled model")
    num_segments: int
    gpus: int
    gpus_per_node: int
    batch_size: int = Field(description="global batch")
    pp: int
    dp: int
    microbatch_size: int
    num_microbatches: int = Field(description="per replica (the first replicas may hold one example more)")
    schedule: str
    partition: list[tuple[int, int]] = Field(description="half-open segment range per stage")
    stage_to_rank_map: str = Field(description="the original's format: stages ';'-separated, replicas ','")
    nodes: list[list[int]] = Field(description="global ranks on each node")
    memory_limit: int | None = Field(None, description="bytes per device the plan had to fit (None: unlimited)")
    schedules: list[str] = Field(default_factory=lambda: ["varuna", "1f1b", "gpipe"],
                                 description="schedules the search considered")
    headroom: float = Field(0.1, description="fraction of memory the plan kept free")
    profile_path: str | None = Field(None, description="the profile the plan was made from (absolute path): "
                                     "`varuna launch --morph` plans again from it when the device count changes")
    prediction: Prediction
    stages: list[StagePlan]
    alternatives: list[Candidate] = Field(default_factory=list)
    assumptions: list[str] = Field(default_factory=list, description="defaults and approximations used")
    created: str


SCHEMAS["plan.schema.json"] = Plan


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as YAML (``.yaml``/``.yml``) or JSON, atomically."""
    import yaml

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix in (".yaml", ".yml"):
        tmp.write_text(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False, width=110))
    else:
        tmp.write_text(plan.model_dump_json(indent=2) + "\n")
    tmp.replace(path)


def load_plan(path: str | Path | Plan) -> Plan:
    import yaml

    if isinstance(path, Plan):
        return path
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"plan {path} does not exist", hint="create it with `varuna plan PROFILE -o FILE`") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if isinstance(data, dict) and data.get("schema_version") not in (None, 1):
        raise ConfigError(f"{path} has plan format version {data.get('schema_version')}; this release reads version 1",
                          hint="re-create the plan with this release's `varuna plan`")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path} is not a valid plan: {str(exc).splitlines()[0]} ...") from None


# ----------------------------------------------------------------------------------------------------------
# Checkpoint manifest


CHECKPOINT_INDEX = "dcp_metadata.json"  # the index of a checkpoint's tensors (varuna_core.ckpt_storage)


class FileEntry(_Model):
    path: str = Field(description="relative to the checkpoint directory")
    bytes: int
    sha256: str


class TensorEntry(_Model):
    key: str = Field(description="key in the checkpoint, e.g. 'model/blocks.0.attn.weight'")
    shape: list[int]
    dtype: str


class Manifest(_Model):
    """``manifest.json`` of a checkpoint directory ``<store>/step_<N>/``.

    The tensors are in ``torch.distributed.checkpoint`` files beside it, under keys ``model/<name>`` (each
    parameter once, tied weights under their canonical name), ``buffer/<name>`` and
    ``optim/<name>/<state>``. ``COMPLETE`` is written after the manifest, once every rank has finished.
    """

    schema_version: Literal[1] = 1
    step: int
    created: str
    model: str = Field(description="model class or spec name")
    structure_hash: str
    num_segments: int
    pp: int
    dp: int
    stage_to_rank_map: str
    partition: list[tuple[int, int]]
    precision: str
    iteration: int = Field(description="optimizer steps taken (what resumes the dropout seed stream)")
    samples_seen: int = Field(description="examples consumed: the data position to resume from")
    seed: int
    loss_scaler: dict | None = None
    optimizer: dict | None = Field(None, description="optimizer class and hyper-parameters of each group")
    tied: list[list[str]] = Field(default_factory=list, description="tied weights: canonical name first")
    parameters: list[TensorEntry] = Field(description="every model parameter (checkpoint key, shape, dtype)")
    plan: dict | None = None
    files: list[FileEntry]


SCHEMAS["manifest.schema.json"] = Manifest


if __name__ == "__main__":  # python -m varuna_core.artifacts [DIR]: regenerate schemas/
    import sys

    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "schemas"):
        print(p)
