"""``ModelSpec``: the one description of a model that every verb uses, and loading it from a reference.

A reference is ``package.module:attr`` or ``path/to/file.py:attr``; ``attr`` is a :class:`ModelSpec` or a
function (without required arguments) returning one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError

__all__ = ["ModelSpec", "load_spec"]


@dataclasses.dataclass
class ModelSpec:
    """How to build a model and its inputs.

    Attributes:
        build: ``() -> nn.Module``: the full model (with CutPoints) on CPU or on the ``meta`` device; its forward
            takes keyword inputs and returns the loss.
        batch: ``n -> dict`` of model inputs for ``n`` examples (tensors with the batch in some dim).
        shared_weights: ``[(name_a, name_b)]`` parameters that hold one tied weight.
        optimizer: ``params -> torch.optim.Optimizer``; used to measure optimizer-state bytes (default AdamW).
        name: a label for reports (default: the reference it was loaded from).
        cutpoints: ``"auto"`` for a model without ``CutPoint``s (a cut in front of every block of its longest
            ``nn.ModuleList``, as ``Varuna(..., cutpoints="auto")`` does).
        init: for a model built on meta, ``init(module)`` initialises a module's own tensors (as
            ``Varuna(init=...)``; default: ``reset_parameters()`` or a Hugging Face model's ``_init_weights``).
            Profiling then allocates one segment at a time.
    """

    build: Callable[[], Any]
    batch: Callable[[int], dict]
    shared_weights: Sequence[tuple[str, str]] | None = None
    optimizer: Callable[[Any], Any] | None = None
    name: str = ""
    cutpoints: str | None = None
    init: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise ConfigError(f"ModelSpec.build must be callable, got {type(self.build).__name__}")
        if not callable(self.batch):
            raise ConfigError(f"ModelSpec.batch must be callable, got {type(self.batch).__name__}")
        if self.init is not None and not callable(self.init):
            raise ConfigError(f"ModelSpec.init must be callable, got {type(self.init).__name__}")
        if self.cutpoints not in (None, "auto"):
            raise ConfigError(f"ModelSpec.cutpoints must be 'auto' or None, got {self.cutpoints!r}")

    def make(self) -> Any:
        """``build()``, with the automatic cut points applied if asked for."""
        model = self.build()
        if self.cutpoints == "auto":
            from .autocut import apply_auto_cutpoints

            apply_auto_cutpoints(model)
        return model


def load_spec(reference: str | ModelSpec) -> ModelSpec:
    """Resolve ``reference`` to a :class:`ModelSpec`.

    Raises:
        ConfigError: the module cannot be imported, the attribute is missing, or it is not a ModelSpec (nor a
            function returning one). The message says which.
    """
    if isinstance(reference, ModelSpec):
        return reference
    if not isinstance(reference, str) or ":" not in reference:
        raise ConfigError(
            f"model spec {reference!r} is not of the form 'package.module:attr' or 'path/to/file.py:attr'",
            hint="e.g. examples/gpt/spec.py:spec",
        )
    target, _, attr = reference.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"model spec {reference!r} lacks a module or an attribute", hint="e.g. examples/gpt/spec.py:spec")
    module = _import(target, reference)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise ConfigError(f"{target!r} has no attribute {attr!r}", hint=f"it defines: {', '.join(public)}")
    value = getattr(module, attr)
    if not isinstance(value, ModelSpec) and callable(value) and not isinstance(value, type):
        try:
            value = value()
        except TypeError as exc:
            raise ConfigError(f"{reference} is a function but calling it without arguments failed: {exc}") from exc
    if not isinstance(value, ModelSpec):
        raise ConfigError(
            f"{reference} is a {type(value).__name__}, not a ModelSpec",
            hint="define `spec = ModelSpec(build=..., batch=...)` (from varuna_core import ModelSpec)",
        )
    if not value.name:
        value.name = reference
    return value


def _import(target: str, reference: str):
    if target.endswith(".py") or "/" in target or target.startswith("."):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"cannot import {reference}: file {target} does not exist")
        name = f"_varuna_spec_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        if str(path.parent) not in sys.path:  # so the file can import its neighbours, now and later
            sys.path.insert(0, str(path.parent))
        try:
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ConfigError(f"cannot import {reference}: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise ConfigError(
            f"cannot import {reference}: {type(exc).__name__}: {exc}",
            hint="check the module path and that it is importable from the current directory (PYTHONPATH)",
        ) from exc
