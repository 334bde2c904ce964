"""The original Varuna's import name, for scripts written for it: ``from varuna import CutPoint, Varuna``.

Every name is re-exported from :mod:`varuna_core`; this package holds no logic of its own. What differs from the
original, and why, is in the README ("Coming from the original Varuna").
"""

from __future__ import annotations

from varuna_core import AutoConfig, CutPoint, Profiler, Varuna
from varuna_core.ir.topology import map_shape as get_varuna_config
from varuna_core.ir.topology import rank_place as get_this_rank_config_varuna

__all__ = ["AutoConfig", "CutPoint", "Profiler", "Varuna", "get_varuna_config", "get_this_rank_config_varuna"]
