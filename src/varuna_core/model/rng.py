"""Deterministic randomness per (seed, step, micro-batch, segment).

[Note: deterministic dropout] Before each segment of a micro-batch runs, the device's generator is seeded from
``(seed, step, micro-batch, segment)``, where the micro-batch is named by the position of its first example in
the global batch. Dropout masks therefore do not depend on the schedule, on the partition (segments, not
stages, are the key, so a 2-stage run draws the same masks as a 1-stage run), on the data-parallel width (a
micro-batch of replica 1 is the same examples, hence the same masks, as in a 1-replica run with the same
micro-batch size; a morph keeps that size), or on whether the forward is a recompute. Around every forward the
live generator state is saved and restored, so user code outside the pipeline sees the random stream it would
have seen without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["segment_seed", "preserve_rng", "seed_segment", "MASK64"]

MASK64 = (1 << 64) - 1  # seeds are unsigned 64-bit: every seed of the toolkit is taken modulo 2**64 with it


def _mix(x: int) -> int:
    """splitmix64 finaliser: decorrelates nearby keys."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def segment_seed(seed: int, step: int, mb: int, segment: int) -> int:
    """A 63-bit seed from the key (negative steps are allowed, e.g. for evaluation passes)."""
    h = _mix(seed & MASK64)
    for part in (step, mb, segment):
        h = _mix(h ^ (part & MASK64))
    return h >> 1


def seed_segment(device: torch.device, seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def preserve_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU (and this CUDA device's) generator state on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
