"""Model specs whose own code fails, each in its own way (importable as ``tests.specs.failing:...``).

A line that raises carries a ``# raises: NAME`` comment: the tests find the line number they expect in the
error message from it.
"""

from __future__ import annotations

import torch

from tests.models import ToyLM, batch
from varuna_core import ModelSpec


def _build_value_error():
    raise ValueError("the config has no 'n_layer'")  # raises: build


def _deep(x):
    return torch.ones(2) + x  # raises: deep


def _build_type_error():
    return _deep("two")  # a TypeError deep inside, in a torch call: not a signature problem


def _batch_key_error(n):
    return {"idx": batch(n)["idx"], "targets": {}["targets"]}  # raises: batch


class ForwardTypeError(ToyLM):
    def forward(self, idx, targets):
        return super().forward(idx, targets.float() @ "x")  # raises: forward


class BigBatchFails(ToyLM):
    """Fails only when measured at more than 2 examples (after the dry run at 1 and 2)."""

    def forward(self, idx, targets):
        if idx.shape[0] > 2:
            raise RuntimeError(f"cannot take {idx.shape[0]} examples")  # raises: late
        return super().forward(idx, targets)


def _optimizer(params):
    raise ValueError("unknown optimizer 'adamw2'")  # raises: optimizer


build_value_error = ModelSpec(build=_build_value_error, batch=batch)
build_type_error = ModelSpec(build=_build_type_error, batch=batch)
batch_key_error = ModelSpec(build=ToyLM, batch=_batch_key_error)
forward_type_error = ModelSpec(build=ForwardTypeError, batch=batch)
late = ModelSpec(build=BigBatchFails, batch=batch)
optimizer_error = ModelSpec(build=ToyLM, batch=batch, optimizer=_optimizer)


def factory_type_error():
    return ModelSpec(build=ToyLM, batch=batch, shared_weights=len(1, 2))  # raises: factory


def factory_with_an_argument(size):
    return ModelSpec(build=lambda: ToyLM(size), batch=batch)


batch_without_n = ModelSpec(build=ToyLM, batch=lambda: batch(2))
build_with_an_argument = ModelSpec(build=lambda n_layer: ToyLM(n_layer), batch=batch)
wrong_input_names = ModelSpec(build=ToyLM, batch=lambda n: {"tokens": batch(n)["idx"], "targets": batch(n)["targets"]})
