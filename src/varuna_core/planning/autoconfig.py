"""The original's ``AutoConfig``, computed by this library's planner.

The original read per-cut-point profile files from the working directory, considered only pipeline depths that
divide the number of cut points (never ``pp=1``, which crashed), picked the largest micro-batch size that fit the
whole device memory, and ran an external simulator per depth. Here one ``profile.json`` (``varuna profile``, or
the original-style ``Profiler``) is read, and for every depth from 1 to the number of segments (any depth: the
partition need not be even) and every profiled micro-batch size the planner's simulation of the ``varuna``
schedule is scored, under ``gpu_memory_capacity`` with the planner's headroom; each depth keeps its fastest
feasible micro-batch size. No torch: the planning floor.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import ConfigError
from ..util.checks import integer
from .artifacts import MAX_DEVICES, Plan, Profile, load_profile
from .planner import PlanInfeasible, PlanRequest, plan_for

__all__ = ["AutoConfig"]

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"


class AutoConfig:
    """Pipeline depth and micro-batch size for ``num_gpus`` devices, as the original's class gave them.

    Args:
        num_gpus: devices of the job.
        gpus_per_vm: devices per machine (a pipeline's stages are placed on consecutive ranks of one machine first).
        batch_size: the global batch.
        profile_folder: a folder holding ``profile.json`` (what ``Profiler(out_folder=...)`` and ``varuna profile
            -o FOLDER/profile.json`` write), or the profile file itself.
        gpu_memory_capacity: bytes per device (default: no limit; the original took the whole device's memory).
        verbose: log each depth's result.
        autofill_missing_compute: accepted for the original's scripts; a profile always covers every segment.

    Attributes:
        batch_times: ``{pp: predicted seconds per global batch}`` for every depth that fits.
        micro_batch: ``{pp: micro-batch size}`` chosen for each of them.
        plans: ``{pp: Plan}``, the planner's full answer per depth (partition, stage-to-rank map, memory per stage).

    Raises:
        ConfigError: a bad argument, a missing or malformed profile, or no depth that fits.
    """

    def __init__(self, num_gpus: int, gpus_per_vm: int, batch_size: int, profile_folder: str | os.PathLike[str],
                 gpu_memory_capacity: int | None = None, verbose: bool = True,
                 autofill_missing_compute: bool = False) -> None:
        num_gpus = integer("num_gpus", num_gpus, low=1, high=MAX_DEVICES)
        gpus_per_vm = integer("gpus_per_vm", gpus_per_vm, low=1, high=MAX_DEVICES)
        batch_size = integer("batch_size", batch_size, low=1)
        if gpu_memory_capacity is not None:
            gpu_memory_capacity = integer("gpu_memory_capacity", gpu_memory_capacity, low=1)
        self.num_gpus, self.gpus_per_vm, self.batch_size = num_gpus, gpus_per_vm, batch_size
        self.gpu_memory_capacity = gpu_memory_capacity
        self.verbose = verbose
        self.profile = _load(profile_folder)
        self.batch_times: dict[int, float] = {}
        self.micro_batch: dict[int, int] = {}
        self.plans: dict[int, Plan] = {}
        self._search()

    def _search(self) -> None:
        request = PlanRequest(gpus=self.num_gpus, batch_size=self.batch_size, gpus_per_node=self.gpus_per_vm,
                              gpu_memory=self.gpu_memory_capacity, schedules=("varuna",))
        for pp in range(1, min(self.num_gpus, self.profile.num_segments) + 1):
            dp = min(self.num_gpus // pp, self.batch_size)
            best = None
            for mbs in self.profile.microbatch_sizes:
                if mbs * dp > self.batch_size:
                    continue  # fewer examples per replica than one micro-batch
                try:
                    plan = plan_for(self.profile, request, pp=pp, dp=dp, microbatch_size=mbs, schedule="varuna")
                except PlanInfeasible:
                    continue
                if best is None or plan.predicted().step_time < best.predicted().step_time:
                    best = plan
            if best is None:
                continue
            self.plans[pp] = best
            self.batch_times[pp] = best.predicted().step_time
            self.micro_batch[pp] = best.microbatch_size
            if self.verbose:
                log.info("pp=%d dp=%d micro-batch %d: %.4f s per batch", pp, dp, best.microbatch_size,
                         best.predicted().step_time)
        if not self.batch_times:
            limit = f"{self.gpu_memory_capacity} bytes per device" if self.gpu_memory_capacity else "the batch"
            raise ConfigError(f"no pipeline depth from 1 to {min(self.num_gpus, self.profile.num_segments)} fits "
                              f"{limit} with any profiled micro-batch size {self.profile.microbatch_sizes}",
                              hint="give more devices or memory, or profile smaller micro-batch sizes")

    def get_min(self) -> tuple[int, int, float]:
        """``(pp, micro-batch size, predicted seconds per global batch)`` of the fastest depth (the smaller depth
        on a tie); the data-parallel width is ``num_gpus // pp``, and ``plans[pp]`` has the rest."""
        pp = min(self.batch_times, key=lambda p: (self.batch_times[p], p))
        return pp, self.micro_batch[pp], self.batch_times[pp]


def _load(folder: str | os.PathLike[str]) -> Profile:
    path = Path(folder)
    if path.is_dir():
        path = path / PROFILE_FILE
    return load_profile(path)
