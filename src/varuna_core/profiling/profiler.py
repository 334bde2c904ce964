"""The original's ``Profiler``, over this library's profiler: for scripts written for the original.

Every rank of the job calls it, as in the original (``torchrun``, ``varuna launch`` or one process); the ranks
share the segments, measure the network between them (two ranks or more), and rank 0 writes the same
``profile.json`` as ``varuna profile`` into ``out_folder``, which ``varuna plan`` and :class:`AutoConfig`
read. Unlike the original, it works in fp32 and bf16 as well as fp16, on CPU as well as CUDA, and with any
number of ranks (the original needed one process per cut point and fp16 on CUDA).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..model.precision import resolve_precision
from ..model.spec import ModelSpec
from ..pipeline.groups import ensure_process_group, resolve_device
from ..pipeline.p2p import default_timeout
from ..planning.artifacts import Profile
from ..util.fs import atomic_write
from .run import DEFAULT_MICROBATCH_SIZES, profile_in_job

__all__ = ["Profiler"]

log = logging.getLogger(__name__)


class Profiler:
    """Measure ``model`` per segment and micro-batch size, and the network; the original's class.

    Both of the original's forms work::

        profiler = Profiler(model, get_batch, device=-1, fp16=False, out_folder="profiles")
        profiler.set_optimizer(optimizer)
        profiler.profile_all([1, 2, 4, 8])

        profiler = Profiler(model, device, fp16=False)          # the README's older form
        profiler.initialize(get_batch)
        profiler.profile_all(get_batch, [1, 2, 4, 8], out_folder="profiles")

    Args:
        model: the whole model with ``CutPoint``s, on CPU (or built under ``meta_init``); it is not modified (each
            segment is measured on a copy).
        get_batch: ``get_batch(size, device=None) -> dict`` of model inputs (or ``get_batch(size)``).
        device: ``-1`` (CUDA ``local_rank`` if available, else CPU), a CUDA index, ``"cpu"`` or ``"cuda"``.
        gpus_per_node, pstages_to_profile, from_cache, add_to_existing: the original's; every segment is always
            measured (``pstages_to_profile`` other than ``None`` is refused), ``gpus_per_node`` is found from
            the hosts.
        fp16, precision: ``fp16=True`` is ``precision="fp16"``; ``"bf16"`` and ``"fp32"`` work too.
        shared_weights: ``[(name_a, name_b)]`` parameters that hold one tied weight.
        repeats, warmup: timed and untimed repetitions per measurement.
    """

    def __init__(self, model: nn.Module, get_batch: Callable[..., dict] | Any = None, device: Any = -1,
                 gpus_per_node: int | None = None, fp16: bool = False, out_folder: str | os.PathLike = "profiles",
                 pstages_to_profile: Sequence[int] | None = None, from_cache: bool = True,
                 add_to_existing: bool = False, *, precision: str | None = None,
                 shared_weights: Sequence[tuple[str, str]] | None = None, repeats: int = 5, warmup: int = 2) -> None:
        if get_batch is not None and not callable(get_batch):  # the older form: Profiler(model, device, ...)
            device, get_batch = get_batch, None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Profiler needs the model (an nn.Module), got {type(model).__name__}")
        if pstages_to_profile is not None:
            raise ConfigError("pstages_to_profile is not supported: every segment is measured (spread over the ranks)",
                              hint="drop the argument; run with more ranks to measure faster")
        self.model = model
        self.get_batch = get_batch
        self.precision = resolve_precision(precision, fp16)
        self.out_folder = Path(out_folder)
        self.shared_weights = list(shared_weights or [])
        self.repeats, self.warmup = repeats, warmup
        self.optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None
        self.device = resolve_device(device, int(os.environ.get("LOCAL_RANK", "-1")))  # checked before joining
        self.world_size, self.rank = ensure_process_group(default_timeout(), self.device)
        del gpus_per_node, from_cache, add_to_existing  # the original's knobs, nothing to do here

    def initialize(self, get_batch: Callable[..., dict], from_cache: bool = True) -> None:
        """The older form's second step: the input function."""
        self.get_batch = get_batch

    def set_optimizer(self, optimizer: torch.optim.Optimizer, init_loss_scale: float = 2**20,
                      min_loss_scale: float = 1.0) -> None:
        """The optimizer whose state and step time are measured: one of the same class and hyperparameters is
        made per segment (default AdamW)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"set_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        kind = type(optimizer)
        accepted = inspect.signature(kind.__init__).parameters  # defaults may hold keys __init__ does not take
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.optimizer_factory = lambda params: kind(params, **defaults)

    def profile_all(self, *args: Any, out_folder: str | os.PathLike | None = None) -> Profile | None:
        """``profile_all(microbatch_sizes)`` or the older ``profile_all(get_batch, microbatch_sizes,
        out_folder=...)``. Collective. Rank 0 writes ``<out_folder>/profile.json`` and returns the profile; the
        other ranks return None."""
        if args and callable(args[0]):
            self.get_batch, args = args[0], args[1:]
        if len(args) > 1:
            raise ConfigError(f"profile_all takes the micro-batch sizes (and before them the batch function), got "
                              f"{len(args) + 1} arguments")
        sizes = _sizes(args[0] if args else None)
        if self.get_batch is None:
            raise ConfigError("Profiler has no batch function",
                              hint="pass it as Profiler(model, get_batch) or to initialize(get_batch)")
        folder = Path(out_folder) if out_folder is not None else self.out_folder
        model = self.model
        spec = ModelSpec(build=lambda: copy.deepcopy(model), batch=self.get_batch, name=type(model).__name__,
                         shared_weights=self.shared_weights, optimizer=self.optimizer_factory)
        options = dict(microbatch_sizes=sizes, precision=self.precision, device=self.device.type,
                       repeats=self.repeats, warmup=self.warmup, memory_limit=None)
        result = profile_in_job(spec, options)
        if result is not None:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(folder / "profile.json", result.model_dump_json(indent=1))
            log.info("profile of %d segments at micro-batch sizes %s written to %s", result.num_segments,
                     result.microbatch_sizes, folder / "profile.json")
        return result


def _sizes(value: Any) -> list[int]:
    sizes = DEFAULT_MICROBATCH_SIZES if value is None else value
    if (isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)):
        raise ConfigError(f"micro-batch sizes must be a non-empty list of positive integers, got {value!r}")
    return sorted(set(sizes))
