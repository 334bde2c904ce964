"""The training flag and the structure: a pipeline is sliced for the computation of one mode.

[Note: discovery mode] Discovery runs the model in the mode it is in when ``Varuna(...)`` is built (training,
normally), because that is what training computes. Some models compute something else in the other mode: a
Hugging Face RWKV turns its recurrent state on outside training (``use_cache`` defaults to true in eval) and
passes a state list through every block, so its cuts carry other values. A pipeline sliced for one mode and run
in the other would fail somewhere far away (an ``IndexError`` on one rank while its peers wait for a timeout).

So the facade also discovers the structure of the other mode (every module flipped; local and deterministic,
cached like any structure) and, when ``step`` or ``evaluate`` finds the model in that mode (the user called
``.eval()``), compares the two: equal, the run goes on; different, every rank raises one
:class:`~varuna_core.errors.CutPointError` naming the difference, before any communication. A model whose
modules are in a mix of modes (e.g. a frozen BatchNorm in ``eval()`` during training) is not checked: only the
two uniform modes are discovered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.nn as nn

from ..errors import CutPointError, VarunaError
from .discovery import Structure

__all__ = ["mode_of", "all_in_mode", "structure_difference", "ModeCheck"]


def mode_of(model: nn.Module) -> tuple[bool, ...]:
    """Every module's training flag, in ``modules()`` order."""
    return tuple(m.training for m in model.modules())


@contextlib.contextmanager
def all_in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module in ``training`` mode for the block; each module's own flag restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _name(training: bool) -> str:
    return "training mode" if training else "eval mode"


def structure_difference(a: Structure, b: Structure, label_a: str, label_b: str) -> str | None:
    """The first difference between two structures that slicing depends on, in words (``None``: none)."""
    if a.cut_names != b.cut_names:
        return f"the cutpoints run as {list(a.cut_names)} in {label_a} and as {list(b.cut_names)} in {label_b}"
    for name, x, y in zip(a.cut_names, a.cuts, b.cuts, strict=True):
        if x != y:
            return f"CutPoint {name!r} carries {x.describe(1)} in {label_a} and {y.describe(1)} in {label_b}"
    if a.skips != b.skips:
        only_a = [s.describe() for s in a.skips if s not in b.skips]
        only_b = [s.describe() for s in b.skips if s not in a.skips]
        return (f"values skip over cuts differently: {only_a or 'nothing'} only in {label_a}, "
                f"{only_b or 'nothing'} only in {label_b}")
    for name in sorted(set(a.module_calls) | set(b.module_calls)):
        calls_a, calls_b = a.module_calls.get(name, ()), b.module_calls.get(name, ())
        if calls_a != calls_b:
            return (f"module {name!r} runs {len(calls_a)} time(s) in {label_a} and {len(calls_b)} time(s) in "
                    f"{label_b}" if len(calls_a) != len(calls_b)
                    else f"module {name!r} is called differently (segments or output)")
    for kind, uses_a, uses_b in (("parameter", a.param_uses, b.param_uses), ("buffer", a.buffer_uses, b.buffer_uses)):
        for name in sorted(set(uses_a) | set(uses_b)):
            if uses_a.get(name) != uses_b.get(name):
                return (f"{kind} {name!r} is used in segments {list(uses_a.get(name, ()))} in {label_a} and "
                        f"{list(uses_b.get(name, ()))} in {label_b}")
    return None


class ModeCheck:
    """Says, before a run, whether the model's current mode computes what the pipeline was sliced for.

    Args:
        model: the user's model (its flags are read at each :meth:`check`).
        structure: discovered in the mode the model was in (``sliced_mode``).
        discover_other: ``discover`` for the other mode (all modules flipped); called once, at construction,
            before the model is sliced. A dry run that raises is kept and named when the model is found in that
            mode (a model may never be run in it).
    """

    def __init__(self, model: nn.Module, structure: Structure, discover_other: Callable[[], Structure]) -> None:
        self.model = model
        self._modules = list(model.modules())  # the flags are read at every step: no module walk then
        self.mode = mode_of(model)
        self.training = model.training
        self.flipped = tuple(not m for m in self.mode)
        self.other: Structure | None = None
        self.other_error: str | None = None
        with all_in_mode(model, not self.training):
            try:
                self.other = discover_other()
            except Exception as exc:  # noqa: BLE001 - the model may never run in that mode: said if it does
                self.other_error = exc.message if isinstance(exc, VarunaError) else f"{type(exc).__name__}: {exc}"
        self.difference = None if self.other is None else structure_difference(
            structure, self.other, _name(self.training), _name(not self.training))

    @property
    def other_writes(self) -> tuple[str, ...]:
        """The buffers the other mode's forward writes."""
        return self.other.buffer_writes if self.other is not None else ()

    def check(self, what: str) -> None:
        """Raise :class:`CutPointError` if the model is now in the other mode and that mode's structure differs."""
        now = tuple(m.training for m in self._modules)
        if now == self.mode or now != self.flipped:
            return
        hint = (f"call .{'train' if self.training else 'eval'}() on the model before {what}, or build Varuna with "
                f"the model in {_name(not self.training)} (the mode it is discovered in is the one the pipeline "
                f"computes)")
        if self.other_error is not None:
            raise CutPointError(
                f"{what} runs the model in {_name(not self.training)}, in which it cannot be pipelined: "
                f"{self.other_error}", hint=hint)
        if self.difference is not None:
            raise CutPointError(
                f"{what} runs the model in {_name(not self.training)}, which computes another structure than "
                f"the {_name(self.training)} the pipeline was sliced for: {self.difference}", hint=hint)
