"""Facts about the running environment, for bug reports (``varuna env``).

:func:`collect` returns a flat ``{key: text}`` mapping; it prints nothing. Keys are stable snake_case names
(environment variables appear as ``env.NAME``), so the same mapping serves the human rendering and ``--json``.
torch is imported inside :func:`collect`, never at module import.

The output is meant to be pasted into public bug reports, so the value of every variable whose name looks
secret (:data:`SECRET_MARKERS`, e.g. ``VARUNA_JOB_TOKEN``, which authenticates a running job's control messages)
is replaced by :data:`REDACTED`: whether it is set is useful, its value never is.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

__all__ = ["collect", "RELEVANT_ENV_VARS", "RELEVANT_ENV_PREFIXES", "SECRET_MARKERS", "REDACTED", "is_secret"]

# Environment variables that change how a distributed job starts or communicates.
RELEVANT_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "CUDA_VISIBLE_DEVICES",
)
RELEVANT_ENV_PREFIXES = ("VARUNA_",)
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")
REDACTED = "<redacted>"

_UNKNOWN = "not installed"


def is_secret(name: str) -> bool:
    """Whether the environment variable ``name`` may hold a secret (by its name, case-insensitively)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return _UNKNOWN


def _os_name() -> str:
    try:
        release = platform.freedesktop_os_release()
    except (OSError, AttributeError):  # not Linux / no os-release file / Python < 3.10
        return platform.system()
    return release.get("PRETTY_NAME") or release.get("NAME") or platform.system()


def _cpu_count() -> str:
    total = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return str(total)
    return str(total) if usable == total else f"{total} ({usable} usable by this process)"


def _memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "unknown"
    return f"{total / 2**30:.1f} GiB"


def _torch_facts() -> dict[str, str]:
    try:
        import torch
    except ImportError as exc:
        return {"torch": f"{_UNKNOWN} ({exc})"}
    facts: dict[str, str] = {"torch": torch.__version__}
    if getattr(torch.version, "cuda", None):
        facts["torch_build"] = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        facts["torch_build"] = f"ROCm {torch.version.hip}"
    else:
        facts["torch_build"] = "CPU"
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001 - a broken driver must not break the bug report
        available = False
        facts["cuda_error"] = f"{type(exc).__name__}: {exc}"
    facts["cuda_available"] = "yes" if available else "no"
    if available:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["cuda_devices"] = f"{len(names)}: " + ", ".join(names)
    else:
        facts["cuda_devices"] = "none"
    import torch.distributed as dist

    if dist.is_available():
        checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
        backends = [name for name, check in checks.items() if check()]
        facts["distributed_backends"] = ", ".join(backends) or "none"
    else:
        facts["distributed_backends"] = "none (torch.distributed is not available in this build)"
    facts["torch_threads"] = str(torch.get_num_threads())
    facts["torch_interop_threads"] = str(torch.get_num_interop_threads())
    return facts


def collect() -> dict[str, str]:
    """Describe this machine and installation. Every value is a string; nothing is printed."""
    info: dict[str, str] = {
        "varuna": _dist_version("varuna"),
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "os": _os_name(),
        "cpus": _cpu_count(),
        "memory": _memory(),
    }
    info.update(_torch_facts())
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "(unset)")
    for name in ("numpy", "typer", "rich", "pydantic"):
        info[name] = _dist_version(name)
    for name in sorted(os.environ):
        if name in RELEVANT_ENV_VARS or name.startswith(RELEVANT_ENV_PREFIXES):
            info[f"env.{name}"] = REDACTED if is_secret(name) else os.environ[name]
    return info
