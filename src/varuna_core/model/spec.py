"""``ModelSpec``: the one description of a model that every verb uses, and loading it from a reference.

A reference is ``package.module:attr`` or ``path/to/file.py:attr``; ``attr`` is a :class:`ModelSpec` or a
function (without required arguments) returning one.

The spec's functions are the user's code: they are called through :func:`~varuna_core.util.usercode.call_user`,
so that a call their signature does not take is bad input (a ``ConfigError``, exit 2), while an exception raised
inside them -- or while the spec's module is imported -- is a :class:`~varuna_core.errors.UserCodeError` (exit 1)
that names the file and line in the user's code where it happened.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError, UserCodeError
from ..util.usercode import call_user, check_call, user_error

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
        cutpoints: ``"auto"`` for a model without ``CutPoint``s (a cut in front of every block of its block
            stacks, or of every call of a module its forward calls repeatedly, as ``Varuna(..., cutpoints="auto")``
            does).
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
        """``build()``, with the automatic cut points applied if asked for.

        Raises:
            ConfigError: ``build`` takes required arguments.
            UserCodeError: ``build`` raised.
        """
        model = call_user(self.build, what="the model spec's build()")
        if self.cutpoints == "auto":
            from .autocut import apply_auto_cutpoints
            from .discovery import dry_forward
            from .lazy_values import ValueSource

            apply_auto_cutpoints(model, dry_forward(model, self.inputs, values=ValueSource(seed=0, init=self.init)))
        return model

    def inputs(self, n: int) -> Any:
        """``batch(n)``: the model's inputs for ``n`` examples (what it returns is checked by the caller).

        Raises:
            ConfigError: ``batch`` does not take one argument.
            UserCodeError: ``batch`` raised.
        """
        return call_user(self.batch, n, what=f"the model spec's batch({n})")

    def make_optimizer(self, params: Any) -> Any:
        """``optimizer(params)``, or None without an ``optimizer`` (the caller's default applies).

        Raises:
            ConfigError: ``optimizer`` does not take one argument.
            UserCodeError: ``optimizer`` raised.
        """
        if self.optimizer is None:
            return None
        return call_user(self.optimizer, params, what="the model spec's optimizer(params)")


def load_spec(reference: str | ModelSpec) -> ModelSpec:
    """Resolve ``reference`` to a :class:`ModelSpec`.

    Raises:
        ConfigError: the module does not exist, the attribute is missing, or it is not a ModelSpec (nor a
            function without required arguments returning one). The message says which.
        UserCodeError: importing the module, or calling the function, raised (file and line in the message).
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
        raise ConfigError(f"model spec {reference!r} lacks a module or an attribute",
                          hint="e.g. examples/gpt/spec.py:spec")
    module = _import(target, reference)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise ConfigError(f"{target!r} has no attribute {attr!r}", hint=f"it defines: {', '.join(public)}")
    value = getattr(module, attr)
    if not isinstance(value, ModelSpec) and callable(value) and not isinstance(value, type):
        check_call(value, what=f"{reference} (a function, called without arguments)",
                   hint="name a ModelSpec, or a function without required arguments that returns one")
        value = call_user(value, what=f"{reference}()")
    if not isinstance(value, ModelSpec):
        raise ConfigError(
            f"{reference} is a {type(value).__name__}, not a ModelSpec",
            hint="define `spec = ModelSpec(build=..., batch=...)` (from varuna_core import ModelSpec)",
        )
    if not value.name:
        value.name = reference
    return value


def _import(target: str, reference: str) -> ModuleType:
    if target.endswith(".py") or "/" in target or target.startswith("."):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"cannot import {reference}: file {target} does not exist")
        name = f"_varuna_spec_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # a file importlib has no loader for (by its suffix)
            raise ConfigError(f"cannot import {reference}: {target} is not a Python file",
                              hint="name a .py file, or a module on the import path (e.g. examples/gpt/spec.py:spec)")
        module = importlib.util.module_from_spec(spec)
        if str(path.parent) not in sys.path:  # so the file can import its neighbours, now and later
            sys.path.insert(0, str(path.parent))
        try:
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except Exception as exc:  # the file is the user's: whatever it raises is theirs
            sys.modules.pop(name, None)
            raise _import_error(reference, exc) from exc
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (target == exc.name or target.startswith(exc.name + ".")):
            raise ConfigError(
                f"cannot import {reference}: there is no module {exc.name!r}",
                hint="check the module path and that it is importable from the current directory (PYTHONPATH)",
            ) from exc
        raise _import_error(reference, exc) from exc  # the module exists; something it imports does not
    except Exception as exc:
        raise _import_error(reference, exc) from exc


def _import_error(reference: str, exc: Exception) -> UserCodeError:
    """The user's module raised while being imported (a ``SyntaxError`` names its own place: compiling it runs
    none of the user's frames)."""
    where = (exc.filename, exc.lineno or 0, "<module>") if isinstance(exc, SyntaxError) and exc.filename else None
    return user_error(f"importing {reference}", exc, where)
