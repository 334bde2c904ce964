"""The devices this machine has, and checking a device a user names against them.

Torch's own error for an unknown device type lists every type torch knows (none of which may be here), and a
CUDA device that does not exist fails only when something is first put on it, far from the argument that named
it: :func:`check_device` says which argument, what it was, and what this machine has, before anything is built.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["check_device", "machine_devices"]


def machine_devices() -> str:
    """The devices a rank of this machine can run on, in words: ``cpu`` and ``cuda:0..N-1`` if there are GPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cpu" + ("" if not count else ", cuda:0" if count == 1 else f", cuda:0..{count - 1}")


def check_device(device: Any, local_rank: int = -1, *, stage: bool = True) -> torch.device:
    """The device ``device`` names, if this machine has it (nothing is set or allocated).

    ``device`` is ``-1`` (CUDA ``local_rank``, default ``LOCAL_RANK``, if CUDA is available, else CPU), a CUDA
    index, a string such as ``"cpu"`` or ``"cuda:1"``, or a ``torch.device``. A CUDA device must exist on this
    machine. With ``stage`` (the device of a pipeline stage) only CPU and CUDA devices are allowed (gloo and NCCL
    are the backends); without it (a place to allocate tensors) any other device type torch knows is let
    through, ``meta`` excepted.

    Raises:
        ConfigError: anything else, naming the argument and the devices this machine has. Torch's own error for
            an unknown device type lists every type torch knows, none of which may be here.
    """
    hint = (f"this machine has {machine_devices()}; pass device='cpu', a CUDA index, or -1 (the local rank's GPU "
            "if there is one, else the CPU)")
    shown = f"device={device!r}" if len(repr(device)) <= 80 else f"device={repr(device)[:77]}..."
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise ConfigError(f"{shown} is not a device: give an int, a string or a torch.device", hint=hint)
    if isinstance(device, int):
        if device < -1:
            raise ConfigError(f"{shown} is not a device index", hint=hint)
        if device == -1:
            if not torch.cuda.is_available():
                return torch.device("cpu")
            if local_rank < 0:
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            index = local_rank
            if index >= torch.cuda.device_count():
                raise ConfigError(f"{shown} picks the GPU of local rank {index}, but this machine has "
                                  f"{machine_devices()}", hint="start at most one process per GPU on each host")
            return torch.device("cuda", index)
        resolved = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            resolved = torch.device(device)
        except (RuntimeError, ValueError):  # torch lists every device type it knows
            raise ConfigError(f"{shown} is not a device name", hint=hint) from None
    else:
        resolved = device
    if resolved.type == "cpu" and resolved.index in (None, 0):
        return resolved
    if not stage and resolved.type not in ("cpu", "cuda", "meta"):
        return resolved
    if resolved.type == "cuda" and torch.cuda.is_available() and (
            resolved.index is None or resolved.index < torch.cuda.device_count()):
        return resolved
    raise ConfigError(f"{shown} is not a device of this machine", hint=hint)
