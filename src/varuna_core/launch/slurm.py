"""The Slurm job the launcher runs in: its nodes and devices, the id of its run, and its requeue.

Inside an allocation (``sbatch``, ``salloc``) Slurm describes the job in the environment; what is read:

* ``SLURM_JOB_ID`` (the job; a requeued job keeps it), ``SLURM_CLUSTER_NAME``, ``SLURM_RESTART_COUNT`` (how many
  times it was requeued);
* ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST`` on old releases), in Slurm's compressed form (``node[01-04,07]``),
  expanded by ``scontrol show hostnames`` — Slurm's own reading of it, so every form Slurm writes is understood;
* the devices of each node: the GPUs of ``--gpus-per-node`` (``SLURM_GPUS_PER_NODE``, ``2`` or ``a100:2``) or,
  when the job asked for GPUs another way, ``SLURM_GPUS_ON_NODE`` (the same on every node); without GPUs, the
  tasks per node (``SLURM_TASKS_PER_NODE``, ``2(x3),1``), so a CPU job of ``--ntasks-per-node=2`` runs two
  workers per node.

Everything is checked: a node list Slurm expands to names that are not host names, counts that do not match the
nodes, or a missing ``scontrol`` are a :class:`~varuna_core.errors.ConfigError` with the variable or command at
fault, never a guess.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..util.artifacts import short_repr
from .hosts import MAX_SLOTS, Host
from .options import SlurmConfig

__all__ = ["Allocation", "in_allocation", "allocation", "expand_counts", "expand_hostnames", "requeue",
           "MAX_NODES"]

MAX_NODES = 65536
_NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")
_COUNT = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?")
_JOB = re.compile(r"[0-9]{1,20}(?:_[0-9]{1,20})?")
_SCONTROL_TIMEOUT = 60.0


@dataclass(frozen=True)
class Allocation:
    """The nodes of the job (in Slurm's order: the first runs the batch script and the job's store) and how
    many workers (devices) each runs."""

    job_id: str
    cluster: str | None
    restarts: int
    nodes: tuple[str, ...]
    slots: tuple[int, ...]
    devices: str  # what a node's slots count: "GPUs" or "tasks"

    @property
    def total(self) -> int:
        return sum(self.slots)

    def hosts(self) -> list[Host]:
        return [Host(name, slots) for name, slots in zip(self.nodes, self.slots)]

    def run_id(self) -> str:
        """The id of the run this job's checkpoints belong to: named after the job, so that a requeued job (same
        id) finds its own checkpoints, and another job's store is not mistaken for its own."""
        cluster = re.sub(r"[^A-Za-z0-9._-]", "_", self.cluster or "")[:24]
        return f"slurm-{cluster + '-' if cluster else ''}{self.job_id}"[:64]

    def config(self) -> SlurmConfig:
        return SlurmConfig(job_id=self.job_id, cluster=self.cluster, restarts=self.restarts)

    def describe(self) -> str:
        nodes = ", ".join(f"{n}×{s}" for n, s in zip(self.nodes[:8], self.slots[:8]))
        more = f" and {len(self.nodes) - 8} more" if len(self.nodes) > 8 else ""
        return f"Slurm job {self.job_id}: {len(self.nodes)} node(s), {self.total} {self.devices} ({nodes}{more})"


def in_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm job."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("SLURM_JOB_ID", "").strip())


def allocation(environ: Mapping[str, str] | None = None, *, gpus_per_node: int | None = None,
               scontrol: str = "scontrol") -> Allocation:
    """The allocation this process runs in (see the module docstring). ``gpus_per_node`` overrides what Slurm
    says a node has.

    Raises:
        ConfigError: not inside a Slurm job, or the job's description cannot be read.
    """
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        raise ConfigError("not inside a Slurm job (SLURM_JOB_ID is not set)",
                          hint="run `varuna launch --slurm` in an sbatch script or an salloc shell")
    if not _JOB.fullmatch(job):
        raise ConfigError(f"SLURM_JOB_ID {short_repr(job, 120)} is not a Slurm job id")
    nodelist = (environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "").strip()
    if not nodelist:
        raise ConfigError("SLURM_JOB_NODELIST is not set: cannot tell the job's nodes",
                          hint="run `varuna launch --slurm` in the job's batch script or salloc shell")
    nodes = expand_hostnames(nodelist, scontrol=scontrol)
    if gpus_per_node is not None:
        slots, devices = [gpus_per_node] * len(nodes), "GPUs"
    elif (gpus := _gpus(environ)) is not None:
        slots, devices = [gpus] * len(nodes), "GPUs"
    else:
        tasks = environ.get("SLURM_TASKS_PER_NODE")
        if not tasks:
            raise ConfigError("the job says neither its GPUs nor its tasks per node",
                              hint="submit it with --gpus-per-node or --ntasks-per-node, or give --gpus-per-node")
        slots, devices = expand_counts(tasks, "SLURM_TASKS_PER_NODE"), "tasks"
        if len(slots) != len(nodes):
            raise ConfigError(f"SLURM_TASKS_PER_NODE {short_repr(tasks, 120)} counts {len(slots)} node(s) but the "
                              f"job has {len(nodes)}")
    if any(not 1 <= s <= MAX_SLOTS for s in slots):
        raise ConfigError(f"a node of the job would run {max(slots)} workers (at most {MAX_SLOTS})")
    cluster = environ.get("SLURM_CLUSTER_NAME", "").strip() or None
    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    return Allocation(job_id=job, cluster=cluster, restarts=int(restarts) if restarts.isdigit() else 0,
                      nodes=tuple(nodes), slots=tuple(slots), devices=devices)


def _gpus(environ: Mapping[str, str]) -> int | None:
    """GPUs per node from ``SLURM_GPUS_PER_NODE`` (``2``, ``a100:2``, ``gpu:a100:2``) or ``SLURM_GPUS_ON_NODE``;
    None if the job has none."""
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        value = environ.get(name, "").strip()
        if not value:
            continue
        count = value.rsplit(":", 1)[-1]
        if not count.isdigit() or len(count) > 9:
            raise ConfigError(f"{name} {short_repr(value, 120)} is not a GPU count",
                              hint="give the workers per node with --gpus-per-node")
        return int(count) or None
    return None


def expand_counts(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed per-node counts: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _COUNT.fullmatch(part.strip())
        if match is None:
            raise ConfigError(f"{name} {short_repr(text, 120)} is not a list of counts like 2(x3),1")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_NODES:
            raise ConfigError(f"{name} {short_repr(text, 120)} counts more than {MAX_NODES} nodes")
        counts += [int(match.group(1))] * repeat
    return counts


def expand_hostnames(nodelist: str, *, scontrol: str = "scontrol") -> list[str]:
    """The node names of a Slurm node list, as ``scontrol show hostnames`` expands it."""
    if len(nodelist) > 2**20 or "\0" in nodelist:
        raise ConfigError("SLURM_JOB_NODELIST is not a node list (too long, or holds a NUL byte)")
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)
    except FileNotFoundError:
        raise ConfigError(f"{scontrol} is not installed here: cannot expand the job's node list",
                          hint="run varuna launch where Slurm's client commands are on PATH") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`{scontrol} show hostnames` did not answer within {_SCONTROL_TIMEOUT:g}s",
                          hint="is slurmctld reachable?") from None
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise ConfigError(f"`{scontrol} show hostnames {short_repr(nodelist, 60)}` failed: {detail[:200]}")
    names = done.stdout.split()
    if not names:
        raise ConfigError(f"the job's node list {short_repr(nodelist, 60)} names no node")
    if len(names) > MAX_NODES:
        raise ConfigError(f"the job's node list names {len(names)} nodes (at most {MAX_NODES})")
    for name in names:
        if not _NODE.fullmatch(name):
            raise ConfigError(f"the job's node list names {short_repr(name, 60)}, which is not a host name")
    if len(set(names)) != len(names):
        raise ConfigError(f"the job's node list {short_repr(nodelist, 60)} names a node twice")
    return names


def requeue(job_id: str, *, scontrol: str = "scontrol") -> tuple[bool, str]:
    """Requeue the job if Slurm lets it be (``sbatch --requeue``, or the cluster's default); ``(done, why not)``."""
    try:
        shown = subprocess.run([scontrol, "-o", "show", "job", job_id], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)
        if shown.returncode != 0:
            return False, f"`scontrol show job` failed: {shown.stderr.strip()[:200]}"
        if not re.search(r"(?:^|\s)Requeue=1(?:\s|$)", shown.stdout):
            return False, "the job is not requeueable (submit it with --requeue)"
        done = subprocess.run([scontrol, "requeue", job_id], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol: {exc}"
    if done.returncode != 0:
        return False, f"`scontrol requeue` failed: {done.stderr.strip()[:200]}"
    return True, ""
