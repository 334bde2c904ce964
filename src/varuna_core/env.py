"""Every environment variable the toolkit reads or sets, in one place (floor L0).

Two kinds: the user's switches (``VARUNA_DEBUG``, ``VARUNA_TIMEOUT``, ...), and the contract between
``varuna launch`` and its workers (:class:`WorkerEnv`): the launcher writes it with :meth:`WorkerEnv.to_environ`,
the node agent passes it on, and ``Varuna(...)`` in the worker reads it back with :meth:`WorkerEnv.from_environ`.
A name written as a string literal anywhere else is a bug waiting for a typo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError
from .util.checks import env_integer

__all__ = ["DEBUG", "TIMEOUT", "TRACE", "PLAN", "RUN_ID", "NO_NATIVE", "CACHE_DIR", "TORCHRUN", "WorkerEnv",
           "LAUNCHER_SET", "flag", "debug", "text", "exact", "HOST", "JOB_ID", "JOB_TOKEN", "ATTEMPT",
           "MANAGER", "OVERLAP_SYNC", "overlap_sync"]

# the user's switches
DEBUG = "VARUNA_DEBUG"  # 1: tracebacks instead of one-line errors
TIMEOUT = "VARUNA_TIMEOUT"  # seconds any single communication wait may take
TRACE = "VARUNA_TRACE"  # directory for Chrome traces of one step
NO_NATIVE = "VARUNA_NO_NATIVE"  # 1: the pure-Python simulator instead of the C++ one
CACHE_DIR = "VARUNA_CACHE_DIR"  # where structure discovery caches its dry runs
OVERLAP_SYNC = "VARUNA_OVERLAP_SYNC"  # 0: gradient sync after the pipeline, not during the last backward (debugging)
# set by the launcher (and read by the worker): see WorkerEnv
PLAN = "VARUNA_PLAN"
RUN_ID = "VARUNA_RUN_ID"
HOST = "VARUNA_HOST"
JOB_ID = "VARUNA_JOB_ID"
JOB_TOKEN = "VARUNA_JOB_TOKEN"
ATTEMPT = "VARUNA_ATTEMPT"
MANAGER = "VARUNA_MANAGER"
SHELF_SERVER = "VARUNA_SHELF_SERVER"

# torchrun's variables, which the launcher's agent sets for every worker
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE")

_TRUE = ("1", "true", "yes", "on")


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` without surrounding blanks; None when unset or blank."""
    value = (os.environ if environ is None else environ).get(name)
    return value.strip() if value and value.strip() else None


def exact(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` as it is set, blanks and line breaks included; None when unset or blank. For
    names (a run id), where ``"run\n"`` is a mistake to report, not to strip into another name."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value and value.strip() else None


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch ``name`` is on (``1``, ``true``, ``yes`` or ``on``, in any case)."""
    return (text(name, environ) or "").lower() in _TRUE


def debug() -> bool:
    """``VARUNA_DEBUG``: show tracebacks instead of one-line errors (CLI and workers alike)."""
    return flag(DEBUG)


def overlap_sync() -> bool:
    """``VARUNA_OVERLAP_SYNC``: the gradient sync starts during the stage's last backward (default); ``0`` (or
    ``false``, ``no``, ``off``) runs it after the pipeline, as a comparison for tests and when debugging."""
    return (text(OVERLAP_SYNC) or "1").lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class WorkerEnv:
    """What ``varuna launch`` tells each worker, besides torchrun's variables (:data:`TORCHRUN`).

    Every field is optional: a script started by hand (or by torchrun) sees an empty ``WorkerEnv`` and runs
    without supervision. ``name`` metadata is the variable's name; :data:`LAUNCHER_SET` says which launch
    option sets it, for the env file's error messages.

    The worker reads it once (``Varuna(...)`` calls :meth:`from_environ`) and hands the values to whoever needs
    them (supervision, heartbeats, the run id, checkpoints, the plan): one parsing, and one answer to a malformed
    value, a :class:`~varuna_core.errors.ConfigError` naming the variable.
    """

    plan: str | None = None  # VARUNA_PLAN: the plan file the agent wrote beside the worker
    ckpt_dir: str | None = None  # VARUNA_CKPT_DIR: the checkpoint store
    run_dir: str | None = None  # VARUNA_RUN_DIR: logs, metrics, preemption notices
    resume_step: int | None = None  # VARUNA_RESUME_STEP: load this step of the store once the optimizer is set
    ckpt_every: int | None = None  # VARUNA_CKPT_EVERY: a checkpoint every N steps
    ckpt_keep: int | None = None  # VARUNA_CKPT_KEEP: how many of this run's checkpoints to keep
    ckpt_tempdir: str | None = None  # VARUNA_CKPT_TEMPDIR: staging directory of background checkpoints
    # 1: VARUNA_CKPT_DIR is each host's own directory (no shared store): each host keeps its ranks' files and a
    # copy of another host's (worker.local_store)
    ckpt_local: int | None = None  # VARUNA_CKPT_LOCAL
    # 1: the launcher regroups the survivors of a lost replica in their processes (worker.regroup): a worker that
    # loses a peer waits for its decision instead of exiting
    regroup: int | None = None  # VARUNA_REGROUP
    total_steps: int | None = None  # VARUNA_TOTAL_STEPS: for the launcher's ETA
    job_id: str | None = None  # VARUNA_JOB_ID
    job_token: str | None = None  # VARUNA_JOB_TOKEN: HMAC key of heartbeats and checkpoint reports (secret)
    attempt: int | None = None  # VARUNA_ATTEMPT: which start of the job this is (heartbeats are bound to it)
    run_id: str | None = None  # VARUNA_RUN_ID: the run the checkpoints belong to
    manager: str | None = None  # VARUNA_MANAGER: host:port of the launcher's heartbeat listener
    host: str | None = None  # VARUNA_HOST: this worker's host as the launcher names it
    on_sigterm: str | None = None  # VARUNA_ON_SIGTERM: "checkpoint" under a scheduler that signals every process
    # a morph by handover: "wait" = this worker was started warm, beside the old configuration: it waits at its
    # resume point for the launcher's go (where its state is), instead of loading VARUNA_RESUME_STEP
    handover: str | None = None  # VARUNA_HANDOVER
    shelf_dir: str | None = None  # VARUNA_SHELF_DIR: the tmpfs of the hosts' shelves (publish on SIGUSR2)
    shelf_budget: int | None = None  # VARUNA_SHELF_BUDGET: bytes the job's shelf may hold on one host
    handover_copies: int | None = None  # VARUNA_HANDOVER_COPIES: 0 = keep no copies of replicas' files (default 1)
    # in-memory snapshots: every N steps each rank's state on its host's shelf and a copy on the next host
    snapshot_every: str | None = None  # VARUNA_SNAPSHOT_EVERY: N steps, or "auto" (0 or unset: none)
    shelf_server: str | None = None  # VARUNA_SHELF_SERVER: address:port of this host's shelf server (its agent's)

    @staticmethod
    def variable(field_name: str) -> str:
        return "VARUNA_" + field_name.upper()

    def to_environ(self) -> dict[str, str]:
        """The variables to set: every field that is not None (and not an empty string)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != "":
                out[self.variable(f.name)] = str(value)
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read and check the variables (a malformed number or manager address is a ConfigError naming the
        variable). Names are read as they are set (``exact``): ``"run\n"`` is a mistake to report, not a name."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}  # the fields' values, of their several types
        for f in fields(cls):
            name = cls.variable(f.name)
            if f.name in _INTEGERS:
                values[f.name] = env_integer(name, environ.get(name), low=_INTEGERS[f.name])
            else:
                values[f.name] = (exact if f.name in _EXACT else text)(name, environ)
        told = cls(**values)
        told.manager_address  # noqa: B018 - checked now, not when the first heartbeat is due
        told.shelf_server_address  # noqa: B018 - and this, not at the first snapshot
        told.snapshot_interval  # noqa: B018 - and this
        return told

    @property
    def snapshot_interval(self) -> int | None:
        """``snapshot_every`` as steps: 0 for none (unset), None for ``auto`` (see ``worker.snapshots``).

        Raises:
            ConfigError: neither ``auto`` nor a whole number of steps.
        """
        value = (self.snapshot_every or "0").strip()
        if value == "auto":
            return None
        return env_integer(self.variable("snapshot_every"), value, low=0)

    @property
    def shelf_server_address(self) -> tuple[str, int] | None:
        """``shelf_server`` as ``(address, port)``; None when unset.

        Raises:
            ConfigError: it is not ``address:port`` with a port in 1..65535.
        """
        if self.shelf_server is None:
            return None
        return _host_port(self.shelf_server, SHELF_SERVER)

    @property
    def manager_address(self) -> tuple[str, int] | None:
        """``manager`` as ``(host, port)`` (an IPv6 host may be in brackets); None when unset.

        Raises:
            ConfigError: it is not ``host:port`` with a port in 1..65535.
        """
        if self.manager is None:
            return None
        return _host_port(self.manager, MANAGER)


def _host_port(value: str, name: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host may be in brackets) as ``(host, port)``; a ConfigError naming ``name``."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name}={value[:80]!r} is not host:port with a port in 1..65535",
                          hint="it is set by varuna launch; unset it to run without the launcher")
    return host, int(port)


_INTEGERS = {"resume_step": 0, "ckpt_every": 0, "ckpt_keep": 1, "total_steps": 0, "attempt": 0, "shelf_budget": 0,
             "handover_copies": 0, "ckpt_local": 0, "regroup": 0}
_EXACT = {"run_id"}

# Variables the launcher sets for every worker, and the `varuna launch` option that sets each (None: no option;
# every worker gets its own value). An env file may not set them.
LAUNCHER_SET: dict[str, str | None] = {
    **dict.fromkeys(TORCHRUN),
    **{WorkerEnv.variable(f.name): None for f in fields(WorkerEnv)},
    PLAN: "the PLAN argument", "VARUNA_CKPT_DIR": "--ckpt-dir", "VARUNA_RUN_DIR": "--run-dir",
    "VARUNA_RESUME_STEP": "--resume", "VARUNA_CKPT_EVERY": "--ckpt-every", "VARUNA_CKPT_KEEP": "--ckpt-keep",
    "VARUNA_CKPT_TEMPDIR": "--ckpt-tempdir", "VARUNA_TOTAL_STEPS": "--steps", "VARUNA_CKPT_LOCAL": "--ckpt-local",
    "VARUNA_SHELF_DIR": "--shelf-dir", "VARUNA_SHELF_BUDGET": "--shelf-budget",
    "VARUNA_HANDOVER_COPIES": "--no-handover-copies", "VARUNA_SNAPSHOT_EVERY": "--snapshot-every",
}
