"""Varuna core library: pipeline + data parallel training on commodity machines.

Public names are imported lazily so that planning code (``schedule``, ``topology``, ``partition``) and the
CLI start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    from importlib.metadata import version as _version

    __version__ = _version("varuna")
except Exception:  # pragma: no cover - running from a source tree without installation
    __version__ = "0.0.0"

_EXPORTS = {
    "CutPoint": "cutpoint",
    "Varuna": "varuna",
    "VarunaError": "errors",
    "ConfigError": "errors",
    "Topology": "topology",
    "Partition": "partition",
    "Schedule": "schedule",
    "Action": "schedule",
    "Op": "schedule",
    "ModelSpec": "spec",
    "load_spec": "spec",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'varuna_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
