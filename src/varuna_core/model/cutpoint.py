"""The ``CutPoint`` marker.

A ``CutPoint`` is a parameter-free module the user calls on the value that crosses a potential stage boundary::

    x = self.cut(x)          # x: a tensor, or a tuple/list/dict of tensors

Outside a pipelined run it is the identity. Inside one, the runtime installs a *hook* on the cutpoints it
cares about: discovery records what crosses each cut, and a stage swaps the placeholder arriving at its
incoming cut for the activation received from the previous stage, and leaves the user's ``forward`` at its
outgoing cut carrying the activation out (see :mod:`varuna_core.model.stage`). The hook is a plain attribute, so an
inactive cutpoint costs one attribute lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["CutPoint", "find_cutpoints"]

CutHook = Callable[["CutPoint", Any], Any]


class CutPoint(nn.Module):
    """Marks a potential pipeline-stage boundary. Call it exactly once per forward on the crossing value.

    The value may be a tensor or a (nested) tuple/list/dict of tensors; every tensor in it must carry the
    batch in some dim (``[b, ...]`` and ``[s, b, h]`` layouts both work; discovery finds the dim). Float tensors
    carry gradients back; integer/bool tensors (ids, masks) cross without.
    """

    _hook: CutHook | None  # plain attributes, not submodules: set with object.__setattr__
    _cut_name: str

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_hook", None)
        object.__setattr__(self, "_cut_name", "")

    def forward(self, value: Any) -> Any:  # identity unless a hook is installed
        hook = self._hook
        if hook is None:
            return value
        return hook(self, value)

    def set_hook(self, hook: CutHook | None) -> None:
        """Install (or remove with ``None``) the function that handles values crossing this cut."""
        object.__setattr__(self, "_hook", hook)

    @property
    def cut_name(self) -> str:
        """Qualified name of this cutpoint in the model (set by :func:`find_cutpoints`)."""
        return self._cut_name


def find_cutpoints(model: nn.Module) -> dict[str, CutPoint]:
    """Return ``{qualified name: CutPoint}`` for every CutPoint in ``model``: the registered ones in registration
    order, then those a module holds in a plain list, tuple or dict attribute (the original's README writes
    ``self.cutpoints = [CutPoint() for i in range(n)]``, which registers nothing), named
    ``<module>.<attribute>.<index or key>``. Which of them a forward calls, and in which order, is discovery's to
    find."""
    found: dict[str, CutPoint] = {}
    seen: set[int] = set()
    modules = list(model.named_modules())
    for name, module in modules:
        if isinstance(module, CutPoint):
            _found(found, seen, name, module)
    for name, module in modules:
        for attr, value in vars(module).items():
            if attr.startswith("_") or not isinstance(value, (list, tuple, dict)):
                continue
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(item, CutPoint) and id(item) not in seen:
                    _found(found, seen, f"{name}.{attr}.{key}" if name else f"{attr}.{key}", item)
    return found


def _found(found: dict[str, CutPoint], seen: set[int], name: str, cut: CutPoint) -> None:
    object.__setattr__(cut, "_cut_name", name)
    found[name] = cut
    seen.add(id(cut))
