"""Varuna core library: pipeline + data parallel training on commodity machines.

Public names are imported lazily so that planning code and the CLI start without importing torch.

The package is a house of floors; a module imports only from its own floor or lower ones
(``tests/unit/test_layers.py`` enforces it; README.md's "Project layout" maps every module, and its "How a step
runs" follows one training step through them):

* L0 ``errors``, ``env``, ``util/``, ``ir/`` — error hierarchy, every ``VARUNA_*`` name, helpers, the torch-free
  schedule IR (schedules, in-flight counts, topology, partitions, units);
* L1 ``model/`` (torch, no ``torch.distributed``: cut points, discovery, slicing) and ``planning/`` (no torch:
  artifacts, memory model, simulator, planner, timelines);
* L2 ``pipeline/`` (the executor and its communication), ``checkpoint/`` (knows nothing of ``Varuna``),
  ``profiling/``;
* L3 ``worker/`` (supervision inside a worker) and ``launch/`` (the launcher; no torch at module level);
* L4 ``varuna`` (the facade: composition only) and ``schemas``.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("varuna")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without installation
    __version__ = "0.0.0"

_EXPORTS = {
    "CutPoint": "model.cutpoint",
    "Varuna": "varuna",
    "AutoConfig": "planning.autoconfig",
    "Profiler": "profiling.profiler",
    "VarunaError": "errors",
    "ConfigError": "errors",
    "Topology": "ir.topology",
    "Partition": "ir.partition",
    "Schedule": "ir.schedule",
    "Action": "ir.schedule",
    "Op": "ir.schedule",
    "ModelSpec": "model.spec",
    "load_spec": "model.spec",
    "materialize": "model.materialize",
    "meta_init": "model.materialize",
    "load_weights": "model.weights",
    "WeightSource": "model.weights",
    "register_elementwise_optimizer": "pipeline.shard",
}

__all__ = ["__version__", *_EXPORTS]  # noqa: PLE0604 - _EXPORTS' keys are strings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'varuna_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
