"""What ``varuna profile`` (and :func:`varuna_core.profiling.run.profile`) is asked to measure, checked once.

:class:`ProfileOptions` checks itself when made, so the command line, scripts and benchmarks are refused the same
numbers with the same words; a refusal is a :class:`~varuna_core.errors.FieldError` naming the field (the CLI
names its option instead). Whether the machine has the devices asked for is checked when the profile starts.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError, FieldError
from ..ir.units import MAX_BYTES
from ..model.precision import resolve_precision
from ..planning.artifacts import MAX_MICROBATCH_SIZE
from ..util.checks import integer, real

__all__ = ["ProfileOptions", "DEFAULT_MICROBATCH_SIZES", "MAX_SIZES", "MAX_NPROC", "MAX_REPEATS", "DEVICES"]

DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8)
MAX_SIZES = 64  # micro-batch sizes in one sweep
MAX_NPROC = 64
MAX_REPEATS = 10_000
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How to measure a model.

    Attributes:
        microbatch_sizes: sizes to measure (kept sorted, each once; default 1, 2, 4, 8).
        nproc: local processes to spread the segments over; with 2 or more the network is measured too.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast, as in training).
        device: ``cpu`` or ``cuda`` (process ``i`` uses ``cuda:i``).
        repeats: timed repetitions per measurement (the median is kept).
        warmup: untimed repetitions before them.
        memory_limit: bytes a segment may use (parameters, gradients, optimizer state, saved activations); the
            first micro-batch size that exceeds it on any segment ends the sweep.
        timeout: seconds the whole multi-process measurement may take.
    """

    microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCH_SIZES
    nproc: int = 1
    precision: str = "fp32"
    device: str = "cpu"
    repeats: int = 5
    warmup: int = 2
    memory_limit: int | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)

        put("microbatch_sizes", _sizes(self.microbatch_sizes))
        put("nproc", integer("nproc", self.nproc, low=1, high=MAX_NPROC))
        put("precision", resolve_precision(self.precision, False))
        if self.device not in DEVICES:
            raise ConfigError(f"unknown device {self.device!r:.40}", hint=f"use {' or '.join(DEVICES)}")
        put("repeats", integer("repeats", self.repeats, low=1, high=MAX_REPEATS))
        put("warmup", integer("warmup", self.warmup, low=0, high=MAX_REPEATS))
        if self.memory_limit is not None:  # two checks: "must be ≥ 1" says more than a range of 19 digits
            put("memory_limit", integer("memory_limit", integer("memory_limit", self.memory_limit, low=1),
                                        high=MAX_BYTES))
        put("timeout", real("timeout", self.timeout, low=0, low_open=True))

    def measuring(self) -> dict:
        """The options every profiling process measures with (what :func:`~.run.profile_in_job` takes)."""
        return dict(microbatch_sizes=list(self.microbatch_sizes), precision=self.precision, device=self.device,
                    repeats=self.repeats, warmup=self.warmup, memory_limit=self.memory_limit)


def _sizes(sizes) -> tuple[int, ...]:
    if not isinstance(sizes, (list, tuple)):
        raise FieldError("microbatch_sizes", f"must be a list or tuple, got {type(sizes).__name__} {sizes!r:.80}")
    if not 1 <= len(sizes) <= MAX_SIZES:
        raise FieldError("microbatch_sizes", f"must hold 1 to {MAX_SIZES} sizes, got {len(sizes)}")
    return tuple(sorted({integer("microbatch_sizes", n, low=1, high=MAX_MICROBATCH_SIZE) for n in sizes}))
