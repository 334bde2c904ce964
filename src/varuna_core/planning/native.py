"""Import shim for the C++ extension ``varuna_core._native`` (the simulator's hot loop).

``VARUNA_NO_NATIVE=1`` forces the pure-Python reference, e.g. to compare the two.
"""

from __future__ import annotations

import os
from types import ModuleType

from ..env import NO_NATIVE, flag
from ..errors import VarunaError

__all__ = ["module", "require"]

_cached: list[ModuleType | None] = []


def module() -> ModuleType | None:
    """The native module, or ``None`` when it is not built or disabled."""
    if flag(NO_NATIVE):
        return None
    if not _cached:
        try:
            from .. import _native
        except ImportError:
            _native = None  # type: ignore[assignment]
        _cached.append(_native)
    return _cached[0]


def require() -> ModuleType:
    native = module()
    if native is None:
        raise VarunaError("the native extension varuna_core._native is not available",
                          hint="reinstall the package (pip install -e .) so the C++ extension is built")
    return native
