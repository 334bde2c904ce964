"""Where a model's values come from when ``Varuna`` builds its stage: its own (a model built for real), or a
seed, an initialiser and pretrained weights (a model built on ``meta``), decided once, before discovery.

[Note: one source of values] Discovery, the start-up validation and the stage itself all see the same values:
for a model built on meta, :func:`~varuna_core.model.lazy_values.on_touch` gives the unsliced runs the values the
stage will :func:`~varuna_core.model.materialize.materialize` and load, so the validation compares the stage
with exactly the model a single process would build with ``materialize(model, seed=...)`` and
``load_weights(...)``. A model built for real that is given ``weights`` loads them whole, up front: it is in
memory already, and everything after sees the loaded values.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import ConfigError
from .lazy_values import ValueSource
from .materialize import has_meta
from .weights import WeightSource, load_weights

__all__ = ["value_source", "load_stage_weights"]

log = logging.getLogger(__name__)


def value_source(model: nn.Module, groups: list[tuple[str, tuple[str, ...]]], seed: int,
                 init: Callable[[nn.Module], Any] | None, weights: str | os.PathLike | None) -> ValueSource | None:
    """The :class:`~varuna_core.model.lazy_values.ValueSource` of a model built on meta, else None (after loading
    ``weights`` into the whole real model, if given). ``groups``: the model's
    :func:`~varuna_core.model.stage.weight_groups`. A bad ``init`` or ``weights`` fails here, before any
    collective work."""
    if init is not None and not callable(init):
        raise ConfigError(f"init must be a callable init(module), got {type(init).__name__} {init!r}")
    if not has_meta(model):
        if init is not None:
            log.warning("init= is ignored: the model holds no tensor on the meta device (it is initialised already)")
        if weights is not None:
            load_stage_weights(model, weights, groups)
        return None
    if weights is not None:
        WeightSource.open(weights).close()  # a missing file or malformed index: said now, not mid-start-up
    aliases = {name: canonical for canonical, names in groups for name in names if name != canonical}
    return ValueSource(seed=seed, init=init, weights=weights, aliases=aliases)


def load_stage_weights(model: nn.Module, weights: str | os.PathLike,
                       groups: list[tuple[str, tuple[str, ...]]]) -> None:
    """Load ``weights`` into every real tensor of ``model`` (a stage's, once sliced), reading a tied weight under
    any of its names (the source holds one copy; a stage may hold another)."""
    also = {name: names for _, names in groups for name in names}
    report = load_weights(model, weights, also=also)
    log.info("loaded %d tensors from %s (%d shard(s) opened)", len(report.loaded), weights, len(report.shards_opened))
