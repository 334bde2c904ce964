"""Model specs for the profiler tests (importable as ``tests.specs.sleep:...``)."""

from __future__ import annotations

import os

import torch

from tests.models import NoCuts, SleepModel, batch
from varuna_core import ModelSpec

HIDDEN = int(os.environ.get("SLEEP_HIDDEN", "8"))  # changed by a test to change the model
TIMES = [(0.020, 0.030), (0.010, 0.040), (0.030, 0.015)]


def _batch(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, HIDDEN, generator=g), "y": torch.randn(n, HIDDEN, generator=g)}


spec = ModelSpec(build=lambda: SleepModel(TIMES, HIDDEN), batch=_batch, name="sleep")


def make_spec() -> ModelSpec:
    """A function returning a spec is accepted too."""
    return spec


def _short(n: int) -> dict:
    out = _batch(n)
    out["y"] = torch.cat([out["y"], out["y"]])  # 2n examples: wrong
    return out


wrong_batch = ModelSpec(build=lambda: SleepModel(TIMES, HIDDEN), batch=_short, name="wrong-batch")
no_cuts = ModelSpec(build=NoCuts, batch=batch, name="no-cuts")
not_a_spec = 42


def _boom():
    open(os.environ["SLEEP_BUILD_MARKER"], "w").close()
    return SleepModel(TIMES, HIDDEN)


marked = ModelSpec(build=_boom, batch=_batch, name="marked")


def _unet() -> torch.nn.Module:
    from tests.models import UNetLM

    torch.manual_seed(0)
    return UNetLM()


unet = ModelSpec(build=_unet, batch=lambda n: batch(n, seed=n), shared_weights=[("emb.weight", "head.weight")],
                 name="unet")  # values skip over its cuts (tests.models.UNetLM)


def _stamped() -> torch.nn.Module:
    """The sleep model, each layer's forward on real tensors written down as ``pid start end`` (wall clock) to the
    file ``SLEEP_STAMPS`` names: when the profiling processes measured."""
    import time

    from tests.models import SleepLayer

    model = SleepModel(TIMES, HIDDEN)
    path = os.environ["SLEEP_STAMPS"]

    def before(module, args):
        module.began = time.time()

    def after(module, args, out):
        if out.device.type != "meta":
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {module.began} {time.time()} {int(torch.is_grad_enabled())}\n")

    for module in model.modules():
        if isinstance(module, SleepLayer):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
    return model


stamped = ModelSpec(build=_stamped, batch=_batch, name="stamped")
