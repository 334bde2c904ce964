"""The Slurm job the launcher runs in: its nodes and devices, the id of its run, and its requeue.

Inside an allocation (``sbatch``, ``salloc``) Slurm describes the job in the environment; what is read:

* ``SLURM_JOB_ID`` (the job; a requeued job keeps it), ``SLURM_CLUSTER_NAME``, ``SLURM_RESTART_COUNT`` (how many
  times it was requeued);
* ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST`` on old releases), in Slurm's compressed form (``node[01-04,07]``),
  expanded by ``scontrol show hostnames`` — Slurm's own reading of it, so every form Slurm writes is understood;
* the devices of each node: the GPUs of ``--gpus-per-node`` (``SLURM_GPUS_PER_NODE``: what the job asked for,
  as written, ``[type:]count`` items separated by commas: ``2``, ``a100:2``, ``volta:3,kepler:1``, which counts
  4) or, when the job asked for GPUs another way, ``SLURM_GPUS_ON_NODE`` (a plain count, the same on every
  node); without GPUs, the tasks per node (``SLURM_TASKS_PER_NODE``, ``2(x3),1``), so a CPU job of
  ``--ntasks-per-node=2`` runs two workers per node.

Everything is checked before it is used: a value that is not of Slurm's form is a
:class:`~varuna_core.errors.ConfigError` naming the variable and quoting the value (escaped, shortened), never a
guess. A node list that starts with ``-`` is refused (``scontrol`` would read it as one of its options:
``-V`` prints its version, which would become two "host names"), and ``scontrol`` gets ``--`` before its
command as well; a node list whose ranges name more than :data:`MAX_NODES` nodes is refused before anything is
expanded; names that are not host names, counts that do not match the nodes, or a missing ``scontrol`` are
refused with the variable or command at fault.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..util.versioned_io import short_repr
from .hosts import MAX_SLOTS, Host
from .options import SlurmConfig

__all__ = ["Allocation", "in_allocation", "allocation", "expand_counts", "expand_hostnames", "nodelist_size",
           "requeue", "MAX_NODES"]

MAX_NODES = 65536
_NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")
_COUNT = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?")
_JOB = re.compile(r"[0-9]{1,20}(?:_[0-9]{1,20})?")
_GPU_ITEM = re.compile(r"(?:[A-Za-z0-9_.-]{1,64}:){0,2}([0-9]{1,9})")  # [gpu:][type:]count
_RANGE = re.compile(r"([0-9]{1,64})(?:-([0-9]{1,64}))?")
MAX_CLUSTER_NAME = 255
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
        return [Host(name, slots) for name, slots in zip(self.nodes, self.slots, strict=True)]

    def run_id(self) -> str:
        """The id of the run this job's checkpoints belong to: named after the job, so that a requeued job (same
        id) finds its own checkpoints, and another job's store is not mistaken for its own."""
        room = 64 - len("slurm--") - len(self.job_id)  # the job id is kept whole: it tells two jobs apart
        cluster = re.sub(r"[^A-Za-z0-9._-]", "_", self.cluster or "")[:min(24, room)]
        return f"slurm-{cluster + '-' if cluster else ''}{self.job_id}"

    def config(self) -> SlurmConfig:
        return SlurmConfig(job_id=self.job_id, cluster=self.cluster, restarts=self.restarts)

    def describe(self) -> str:
        nodes = ", ".join(f"{n}×{s}" for n, s in zip(self.nodes[:8], self.slots[:8], strict=True))
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
        raise ConfigError(f"SLURM_JOB_ID {short_repr(job)} is not a Slurm job id", hint=_OVERWRITTEN)
    cluster, restarts = _cluster(environ), _restarts(environ)
    name = "SLURM_JOB_NODELIST" if (environ.get("SLURM_JOB_NODELIST") or "").strip() else "SLURM_NODELIST"
    nodelist = (environ.get(name) or "").strip()
    if not nodelist:
        raise ConfigError("SLURM_JOB_NODELIST is not set: cannot tell the job's nodes",
                          hint="run `varuna launch --slurm` in the job's batch script or salloc shell")
    nodes = expand_hostnames(nodelist, scontrol=scontrol, name=name)
    if gpus_per_node is not None:
        slots, devices, source = [gpus_per_node] * len(nodes), "GPUs", "--gpus-per-node"
    elif (found := _gpus(environ)) is not None:
        gpus, source = found
        slots, devices = [gpus] * len(nodes), "GPUs"
    else:
        tasks = environ.get("SLURM_TASKS_PER_NODE")
        if not tasks:
            raise ConfigError("the job says neither its GPUs nor its tasks per node",
                              hint="submit it with --gpus-per-node or --ntasks-per-node, or give --gpus-per-node")
        slots, devices, source = expand_counts(tasks, "SLURM_TASKS_PER_NODE"), "tasks", "SLURM_TASKS_PER_NODE"
        if len(slots) != len(nodes):
            raise ConfigError(f"SLURM_TASKS_PER_NODE {short_repr(tasks)} counts {len(slots)} node(s) but the "
                              f"job has {len(nodes)}", hint=_OVERWRITTEN)
    bad = next((n for n in slots if not 1 <= n <= MAX_SLOTS), None)
    if bad is not None:
        raise ConfigError(f"a node of the job would run {bad} workers ({source}); a node runs 1 to {MAX_SLOTS}",
                          hint="give the workers per node with --gpus-per-node")
    return Allocation(job_id=job, cluster=cluster, restarts=restarts, nodes=tuple(nodes), slots=tuple(slots),
                      devices=devices)


_OVERWRITTEN = "Slurm sets it for the job: is it overwritten by the job script or its environment?"


def _cluster(environ: Mapping[str, str]) -> str | None:
    """``SLURM_CLUSTER_NAME`` (None if unset): one printable line of at most :data:`MAX_CLUSTER_NAME`
    characters. It only names the run (:meth:`Allocation.run_id` keeps the characters a run id may hold)."""
    value = environ.get("SLURM_CLUSTER_NAME", "").strip()
    if value and (len(value) > MAX_CLUSTER_NAME or not value.isprintable()):
        raise ConfigError(f"SLURM_CLUSTER_NAME {short_repr(value)} is not a cluster name (one printable line of at "
                          f"most {MAX_CLUSTER_NAME} characters)", hint=_OVERWRITTEN)
    return value or None


def _restarts(environ: Mapping[str, str]) -> int:
    """``SLURM_RESTART_COUNT``: how many times the job was requeued (0 when unset)."""
    value = environ.get("SLURM_RESTART_COUNT", "").strip()
    if value and not re.fullmatch(r"[0-9]{1,9}", value):
        raise ConfigError(f"SLURM_RESTART_COUNT {short_repr(value)} is not a count of restarts", hint=_OVERWRITTEN)
    return int(value or 0)


def _gpus(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """GPUs per node and the variable that says so: ``SLURM_GPUS_PER_NODE`` (``[type:]count`` items separated
    by commas, as the job asked for them: ``volta:3,kepler:1`` is 4) or else ``SLURM_GPUS_ON_NODE`` (a count);
    None if the job has none."""
    hint = "give the workers per node with --gpus-per-node"
    per_node = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        items = [_GPU_ITEM.fullmatch(item.strip()) for item in per_node.split(",")]
        matched = [item for item in items if item is not None]
        if len(items) > MAX_SLOTS or len(matched) < len(items):
            raise ConfigError(f"SLURM_GPUS_PER_NODE {short_repr(per_node)} is not a GPU count like 4, a100:4 or "
                              f"volta:3,kepler:1", hint=hint)
        total = sum(int(item.group(1)) for item in matched)
        return (total, "SLURM_GPUS_PER_NODE") if total else None
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node:
        if not re.fullmatch(r"[0-9]{1,9}", on_node):
            raise ConfigError(f"SLURM_GPUS_ON_NODE {short_repr(on_node)} is not a GPU count", hint=hint)
        return (int(on_node), "SLURM_GPUS_ON_NODE") if int(on_node) else None
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


def expand_hostnames(nodelist: str, *, scontrol: str = "scontrol", name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The node names of a Slurm node list (the value of the variable ``name``), as ``scontrol show hostnames``
    expands it."""
    shown = short_repr(nodelist)
    if len(nodelist) > 2**20 or "\0" in nodelist:
        raise ConfigError(f"{name} {shown} is not a node list (too long, or holds a NUL byte)", hint=_OVERWRITTEN)
    if nodelist.startswith("-"):
        raise ConfigError(f"{name} {shown} starts with '-': it is not a node list (scontrol would read it as an "
                          f"option)", hint=_OVERWRITTEN)
    size = nodelist_size(nodelist)
    if size is not None and size > MAX_NODES:
        raise ConfigError(f"{name} {shown} names {_count(size)} nodes, more than the {MAX_NODES:,} a job can have",
                          hint=_OVERWRITTEN)
    try:  # `--`: whatever the list holds, scontrol reads no option after it
        done = subprocess.run([scontrol, "--", "show", "hostnames", nodelist], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)
    except FileNotFoundError:
        raise ConfigError(f"{scontrol} is not installed here: cannot expand the job's node list",
                          hint="run varuna launch where Slurm's client commands are on PATH") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`{scontrol} show hostnames` did not answer within {_SCONTROL_TIMEOUT:g}s",
                          hint="is slurmctld reachable?") from None
    said = (done.stderr.strip().splitlines() or [""])[-1][:200]
    if done.returncode != 0:
        raise ConfigError(f"{name}: `{scontrol} show hostnames {shown}` failed: "
                          f"{said or f'exit code {done.returncode}'}")
    names = done.stdout.split()
    if not names:  # scontrol prints "Invalid hostlist" on stderr and exits 0
        raise ConfigError(f"{name} {shown} names no node" + (f" (scontrol: {said})" if said else ""),
                          hint=_OVERWRITTEN)
    if len(names) > MAX_NODES:
        raise ConfigError(f"{name} {shown} names {len(names):,} nodes, more than the {MAX_NODES:,} a job can have")
    for node in names:
        if not _NODE.fullmatch(node):
            raise ConfigError(f"{name} {shown} names {short_repr(node, 60)}, which is not a host name")
    if len(set(names)) != len(names):
        raise ConfigError(f"{name} {shown} names a node twice")
    return names


def nodelist_size(nodelist: str) -> int | None:
    """How many names a Slurm node list (``gpu[01-04,07],login1``, ``rack[1-2]n[1-8]``) expands to, counted
    from its ranges without expanding them; None for a form this does not read (``scontrol`` then decides)."""
    total, depth = 0, 0
    item: list[str] = []
    for char in nodelist + ",":
        depth += (char == "[") - (char == "]")
        if depth not in (0, 1):
            return None
        if char == "," and depth == 0:
            count = _item_size("".join(item))
            if count is None:
                return None
            total, item = total + count, []
        else:
            item.append(char)
    return total if depth == 0 else None


def _item_size(item: str) -> int | None:
    """The names of one item of a node list: the product of its bracket groups' sizes."""
    count = 1
    for group in re.findall(r"\[([^\]]*)\]", item):
        size = 0
        for part in group.split(","):
            match = _RANGE.fullmatch(part.strip())
            if match is None:
                return None
            low, high = int(match.group(1)), int(match.group(2) or match.group(1))
            if high < low:
                return None
            size += high - low + 1
        count *= size
    return count


def _count(number: int) -> str:
    return f"{number:,}" if number < 10**15 else f"about 10^{len(str(number)) - 1}"


def requeue(job_id: str, *, scontrol: str = "scontrol") -> tuple[bool, str]:
    """Requeue the job if Slurm lets it be (``sbatch --requeue``, or the cluster's default); ``(done, why not)``.

    A requeue stops the job's processes, and ``scontrol`` runs as one of them: it may be killed by the very requeue
    it asked for, before it exits 0. So a ``scontrol requeue`` ended by a signal is not taken as a failure, nor as a
    success: the job is asked again (the launcher outlives the requeue's SIGTERM) and counts as requeued when its
    ``Restarts`` went up or it is back in the queue.
    """
    try:
        shown = _show_job(job_id, scontrol)
        if shown.returncode != 0:
            return False, f"`scontrol show job` failed: {shown.stderr.strip()[:200]}"
        if not re.search(r"(?:^|\s)Requeue=1(?:\s|$)", shown.stdout):
            return False, "the job is not requeueable (submit it with --requeue)"
        restarts = _field(shown.stdout, "Restarts")
        done = subprocess.run([scontrol, "requeue", job_id], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)
        if done.returncode < 0:  # killed by a signal: perhaps by the requeue itself
            signame = _signal_name(-done.returncode)
            again = _show_job(job_id, scontrol)
            if again.returncode != 0:
                return False, (f"`scontrol requeue` was stopped by {signame} and the job's state could not be read "
                               f"again: {again.stderr.strip()[:200]}")
            state, now = _field(again.stdout, "JobState"), _field(again.stdout, "Restarts")
            if (state or "").startswith(("PENDING", "REQUEUE")) or (
                    now is not None and restarts is not None and now.isdigit() and restarts.isdigit()
                    and int(now) > int(restarts)):
                return True, ""
            still = state or "in an unknown state"
            return False, f"`scontrol requeue` was stopped by {signame}; the job is still {still}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol: {exc}"
    if done.returncode != 0:
        return False, f"`scontrol requeue` failed: {done.stderr.strip()[:200] or f'exit code {done.returncode}'}"
    return True, ""


def _show_job(job_id: str, scontrol: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([scontrol, "-o", "show", "job", job_id], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, errors="replace", timeout=_SCONTROL_TIMEOUT)


def _field(shown: str, name: str) -> str | None:
    """The value of ``name=`` in one line of ``scontrol -o show job`` (None when absent)."""
    match = re.search(rf"(?:^|\s){name}=(\S*)", shown)
    return match.group(1) if match else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
