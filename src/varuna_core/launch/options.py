"""What ``varuna launch`` is asked to do, as plain data: :class:`LaunchOptions` and the parts of it that say how
to reach the hosts (:class:`SSHConfig`, or :class:`SlurmConfig` inside a Slurm allocation), where the code runs on
them (:class:`HostRuntime`) and which cloud to ask for spot notices (:class:`SpotConfig`).

The field defaults of these dataclasses are the launcher's defaults: the CLI's options read theirs from here
(:data:`DEFAULTS`), so a default is written once. No torch and no pydantic here: the CLI imports this module when
it starts.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import FieldError
from ..util.checks import integer, real
from ..util.text import short_repr
from .exclusion import RECHECK_MAX
from .hosts import Host

__all__ = ["DEFAULTS", "LIMITS", "LaunchOptions", "HostRuntime", "SSHConfig", "SlurmConfig", "SpotConfig",
           "check_numbers", "FORWARDED", "forwarded_environ"]

_SSH_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class SSHConfig:
    """How to SSH: defaults for every host (a host's own ``user@``/``:port`` in the hosts file win)."""

    user: str | None = None
    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: int = 10

    def __post_init__(self) -> None:
        """A user name that ssh cannot read as an option, a port, a bounded connect timeout (FieldError)."""
        if self.user is not None and not _SSH_USER.fullmatch(self.user):
            raise FieldError("user", f"{short_repr(self.user)} is not a user name",
                             hint="letters, digits, '.', '_' and '-', not starting with '-'")
        if self.port is not None:
            integer("port", self.port, low=1, high=65535)
        integer("connect_timeout", self.connect_timeout, low=1, high=3600)

    def argv(self, host: Host, command: str) -> list[str]:
        argv = ["ssh"]
        for option in self.options:  # ssh keeps the first value of an option: the user's come first
            argv += ["-o", option]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}",
                 "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        user, port = host.user or self.user, host.port or self.port
        if port:
            argv += ["-p", str(port)]
        if user:
            argv += ["-l", user]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        return [*argv, "--", host.address, command]  # after --, a host named "-o..." is still a host


@dataclass(frozen=True)
class SlurmConfig:
    """The Slurm job the launcher runs in: node agents are job steps started with ``srun``, not SSH sessions."""

    job_id: str
    cluster: str | None = None
    restarts: int = 0  # SLURM_RESTART_COUNT: how many times the job was requeued

    def argv(self, host: Host, command: str) -> list[str]:
        """``srun`` running ``command`` as one task on ``host``, inside this job. ``--overlap``: the step shares
        the node with the batch step and other steps (Slurm would otherwise wait for free CPUs); without
        ``--exact`` it gets every CPU and, by default, every GPU the job has on the node. Its stdin (the agent's
        commands) and stdout (its events) are forwarded unbuffered."""
        return ["srun", f"--jobid={self.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={host.address}",
                "--overlap", "--unbuffered", "--quiet", "--kill-on-bad-exit=0", "--job-name=varuna-agent",
                "/bin/sh", "-c", command]


@dataclass(frozen=True)
class SpotConfig:
    """Which cloud's metadata service each node agent asks for preemption notices (:mod:`.spot`).

    Checked when made, so that a bad source or endpoint fails before anything starts, whoever makes it (the
    CLI, or a program that fills :class:`LaunchOptions`): see :func:`.spot.check_endpoint`.

    Raises:
        ConfigError: an unknown source, or an endpoint that is not ``http://host[:port]`` (the message never
            shows credentials written into the URL).
    """

    source: str
    endpoint: str | None = None
    interval: float = 5.0
    vm_name: str | None = None

    def __post_init__(self) -> None:
        from .spot import SOURCES, check_endpoint

        if self.source not in SOURCES:
            raise FieldError("source", f"{short_repr(self.source, 40)} is not one of {', '.join(SOURCES)}")
        if self.endpoint is not None:
            try:
                check_endpoint(self.endpoint)
            except ValueError as exc:
                raise FieldError("endpoint", f": {exc}", hint=ENDPOINT_HINT) from None
        real("interval", self.interval, low=0.1, high=3600.0)


ENDPOINT_HINT = "e.g. http://169.254.169.254 or http://127.0.0.1:8080; leave it out for the cloud's own address"


@dataclass(frozen=True)
class HostRuntime:
    """Where the job's code runs on every host: the Python interpreter and the working directory."""

    python: str = sys.executable
    code_dir: str = field(default_factory=os.getcwd)

    def command(self, *words: str, env: dict[str, str] | None = None) -> str:
        """A shell command that runs ``python WORDS`` in the code directory (each word quoted), with ``env``
        (names and values that are not secret: they show in ``ps``)."""
        assignments = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
        return f"cd {shlex.quote(self.code_dir)} && {assignments}exec {shlex.quote(self.python)} " + " ".join(
            shlex.quote(w) for w in words)


# Variables of the launcher's environment that every worker gets, on every host: those that choose the kernels (and
# so the rounding) and the communication of torch's CPU and GPU code. A local worker inherits the launcher's
# environment; one started over SSH gets its sshd's, so without this a job spread over hosts would compute with
# other kernels on some of them (ONEDNN_MAX_CPU_ISA=AVX2 set for the job would hold only on the launcher's host).
# Not forwarded: what is decided per host (the GPUs it shows, the interface towards the master, which the node
# agent picks; paths: *_HOME, *_DIR, *_PATH, *_FILE). An --env-file line wins over a forwarded value.
FORWARDED = ("ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "ATEN_", "TORCH_", "PYTORCH_",
             "CUBLAS_", "CUDNN_", "NCCL_", "GLOO_", "NVIDIA_TF32_")
_PER_HOST = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT")
_PATHS = ("_HOME", "_DIR", "_PATH", "_FILE")


def forwarded_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` (the launcher's) that every worker gets: see :data:`FORWARDED`."""
    return {name: value for name, value in environ.items()
            if name.startswith(FORWARDED) and name not in _PER_HOST and not name.endswith(_PATHS)
            and "\0" not in value}


# The range of every number LaunchOptions holds, by field: ``(low, high, low_open)``, integers where both ends are.
# A value beyond is a typo, not a wish; waits are bounded because the OS calls that implement them refuse waits
# far longer than a day.
LIMITS: Mapping[str, tuple[float, float, bool]] = MappingProxyType({
    "ckpt_every": (0, 10**9, False), "ckpt_keep": (1, 10**6, False), "total_steps": (1, 10**12, False),
    "max_restarts": (0, 10**4, False), "backoff": (0.0, 3600.0, False),
    "heartbeat_timeout": (1.0, 86400.0, False), "start_timeout": (1.0, 86400.0, False),
    "morph_timeout": (1.0, 86400.0, False), "preempt_margin": (0.0, 86400.0, False), "grace": (0.0, 3600.0, False),
    "straggler_threshold": (0.0, 100.0, True), "recheck_max": (1.0, 3600.0, False),
    "shelf_budget": (0, 2**62, False), "snapshot_every": (0, 10**9, False),
})
# None: keep every checkpoint, train until the script ends, a shelf as large as its tmpfs, snapshots as often as
# they cost at most 2% of the training time
_OPTIONAL = frozenset({"ckpt_keep", "total_steps", "shelf_budget", "snapshot_every"})


def check_numbers(values: Mapping[str, Any]) -> None:
    """Each of ``values`` (a field of :class:`LaunchOptions` -> its value) within :data:`LIMITS`, or a
    :class:`~varuna_core.errors.FieldError` naming the field. :class:`LaunchOptions` runs it when made; the CLI
    runs it first, before anything slow (its message then names the option that sets the field)."""
    for name, value in values.items():
        if value is None and name in _OPTIONAL:
            continue
        low, high, low_open = LIMITS[name]
        if isinstance(low, int) and isinstance(high, int):
            integer(name, value, low=low, high=high)
        else:
            real(name, value, low=low, high=high, low_open=low_open)


def check_ckpt_local(ckpt_local: bool, *, morph: bool, handover: bool, tempdir: str | None) -> None:
    """Checkpoints on the hosts' own disks need the shelves (a :class:`~varuna_core.errors.FieldError` naming
    ``ckpt_local`` otherwise): they are written through a snapshot, and read from another host through its agent."""
    if ckpt_local and not (morph and handover):
        raise FieldError("ckpt_local", "needs --morph with the handover (the copies and the reads of another host's "
                         "files go through the hosts' shelves)", hint="add --morph, or drop --no-handover")
    if ckpt_local and tempdir:
        raise FieldError("ckpt_local", "and --ckpt-tempdir do not go together (a checkpoint on the hosts' own disks "
                         "is staged in host memory already)", hint="drop --ckpt-tempdir")


@dataclass
class LaunchOptions:
    """Everything ``varuna launch`` was asked to do (see its ``--help`` for each). Checks its numbers when made
    (:data:`LIMITS`), so a program that fills it is refused what the CLI refuses."""

    script: list[str]
    run_dir: Path
    ckpt_dir: Path
    runtime: HostRuntime = field(default_factory=HostRuntime)
    ssh: SSHConfig | None = None  # None: local processes (or Slurm job steps)
    slurm: SlurmConfig | None = None  # inside a Slurm allocation: agents by srun, scheduler signals
    spot: SpotConfig | None = None
    env: dict[str, str] = field(default_factory=dict)
    legacy_args: bool = False
    morph: bool = False
    morph_any_microbatch: bool = False
    handover: bool = True  # with morph: warm start + state through host memory (else a restart through the store)
    shelf_dir: str = "/dev/shm"  # the tmpfs of each host's shelf
    shelf_budget: int | None = None  # bytes a host's shelf may hold (None: its tmpfs's free space)
    handover_copies: bool = True  # under dp > 1 each host keeps a copy of its replicas' published files
    snapshot_every: int | None = None  # with a handover: in-memory snapshots every N steps (0: none, None: auto)
    resume: bool = False
    resume_or_start: bool = False  # with resume and run_id: start that run when the store holds nothing of it
    ckpt_every: int = 0
    ckpt_keep: int | None = None
    ckpt_tempdir: str | None = None
    ckpt_local: bool = False  # ckpt_dir is each host's own directory: each keeps its files and a copy of another's
    regroup: bool = True  # with a handover: the survivors of a lost host that held whole replicas go on in-process
    fork_server: bool = True  # workers are forked by a pre-imported server per host: where a host runs several,
    # from the first attempt on; with a handover, every later attempt's too
    total_steps: int | None = None
    max_restarts: int = 3
    backoff: float = 2.0
    heartbeat_timeout: float = 60.0
    start_timeout: float = 600.0
    morph_timeout: float = 300.0
    preempt_margin: float = 30.0
    grace: float = 10.0
    straggler_threshold: float = 0.3
    recheck_max: float = RECHECK_MAX  # the longest wait between two checks of a host left out (launch.exclusion)
    run_id: str | None = None  # the run to resume (--resume) or to start under; default: found or new

    def __post_init__(self) -> None:
        check_numbers({name: getattr(self, name) for name in LIMITS})
        if self.resume_or_start and not self.resume:
            raise FieldError("resume_or_start", "needs resume", hint="it says what a resume that finds nothing does")
        if self.snapshot_every and not (self.morph and self.handover):
            raise FieldError("snapshot_every", "needs --morph with the handover (snapshots live on the shelves)",
                             hint="add --morph, or drop --no-handover, or leave snapshots off (0)")
        check_ckpt_local(self.ckpt_local, morph=self.morph, handover=self.handover, tempdir=self.ckpt_tempdir)
        if not self.shelf_dir or not os.path.isabs(self.shelf_dir) or "\0" in self.shelf_dir:
            raise FieldError("shelf_dir", f"{short_repr(self.shelf_dir)} is not an absolute path",
                             hint="a tmpfs directory present on every host, e.g. /dev/shm")


# Every plain field default of LaunchOptions, by field name: what the CLI's options default to.
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in fields(LaunchOptions) if f.default is not MISSING})
