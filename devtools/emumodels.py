"""Exact-compute models for the emulated cluster: segments whose F, B and W sleep for set times while the tensors
that cross the network have real sizes.

A segment of :class:`EmuModel` stands for ``layers`` transformer layers. Its forward sleeps ``F(n)`` for a
micro-batch of ``n`` examples, the backward to its input sleeps ``B(n)``, and the gradient of its weights sleeps
``W(n)`` (in the backward under an unsplit schedule, in ``W`` under a zero-bubble one); a sleeping process uses no
CPU, so 8-16 workers share 2 cores without slowing each other and the measured step depends only on the runtime
and the network. What crosses is real:

* the activation at each cut is a float32 ``[n, seq, hidden]`` tensor, ``n × seq × hidden × 4`` bytes (and its
  gradient as many back);
* each segment holds ``param_bytes`` of parameters (one float32 table used through ``F.embedding``, whose whole
  backward is its weight's gradient: dense, the table's size, in W under a split schedule), so the
  data-parallel all-reduce moves the bytes a real segment's gradients would.

Where the times come from (a measurement): one GPT-2 XL block (hidden 1600, 25 heads, 30.7 M parameters) profiled
by ``varuna profile`` on an NVIDIA H200 in bf16 (:mod:`devtools.gpt2xl` says how; the medians of 7 repeats are in
``devtools/data/gpt2xl_layer_h200.json``): its forward (the profile's ``forward``), its input gradient
(``split_backward``) and its weights' gradient (``weight``) at micro-batches of 1, 2, 4 and 8 examples (1, 2, 4 at
sequence 4096). Each is fitted by least squares with a line ``t(n) = a + b·n`` (:class:`Line`): ``b`` is the
per-example time the matrix units set (0.12 ms forward at s = 1024, some 580 TFLOP/s), ``a`` the fixed share of a
pass (about 1.3 ms at s = 1024), which dominates at small micro-batches. A synchronous profiler sees that share whole
(kernel launches from one host thread, autocast's casts of the weights); a training step that queues kernels
asynchronously hides part of it, so the emulated layer is, if anything, kinder to large micro-batches than a GPU.
An unsplit backward sleeps ``B + W`` (the profile's unsplit backward is shorter than that at small micro-batches).

Scaling to what 2 cores and a 25-minute benchmark can run: the *times* are the H200's; the *bytes* are the real
layer's divided by :data:`BYTE_SCALE` (the hidden size stays 1600, the sequence that crosses a cut is
``seq / BYTE_SCALE`` tokens long; parameters, ``param_bytes / BYTE_SCALE``). On the emulated link of rate ``R``
such a model meets what the real layer would meet on a link of ``R × BYTE_SCALE`` (1 Gbit/s emulated ~ 256
Gbit/s, 50 Mbit/s ~ 12.8 Gbit/s: the range from a datacenter's commodity Ethernet to a fast interconnect, for a
model whose every step must move hundreds of MB of gradients).

Two models (:data:`MODELS`) whose best configurations differ: ``xl`` (GPT-2 XL's 48 layers at s = 1024, 8 layers
a segment: many parameters for its compute, so data parallelism over a slow link is dear) and ``long`` (12
layers at s = 4096, 2 a segment: 5.3x the per-example forward time of a layer (measured) and 4x the activation
for the same parameters, so the all-reduce weighs less against the compute, and pipelining more). ``small`` is
the suite's. :data:`SPECS` has a :class:`~varuna_core.ModelSpec` per model for ``varuna profile``
(``devtools/emumodels.py:xl``), and ``build_model(name)`` what a training script builds.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `varuna profile devtools/emumodels.py:xl` loads this file by its path
    sys.path.insert(0, str(ROOT))

from devtools.models import Sleep  # noqa: E402
from varuna_core import CutPoint, ModelSpec  # noqa: E402

__all__ = ["Line", "LayerCosts", "EmuConfig", "EmuModel", "MODELS", "SPECS", "BYTE_SCALE", "build_model", "make_batch",
           "gpt2_layer"]

HIDDEN = 1600  # GPT-2 XL
LAYER_PROFILE = Path(__file__).resolve().parent / "data" / "gpt2xl_layer_h200.json"
BYTE_SCALE = 256  # bytes that cross the emulated links: the real layer's / BYTE_SCALE


@dataclasses.dataclass(frozen=True)
class Line:
    """``seconds(n) = intercept + slope · n``: one pass of a layer over a micro-batch of ``n`` examples."""

    intercept: float
    slope: float

    @classmethod
    def fit(cls, points: list[tuple[int, float]]) -> Line:
        """Least squares over ``(n, seconds)``; the intercept is kept >= 0 (refitted through the origin if not)."""
        k = len(points)
        mean_n = sum(n for n, _ in points) / k
        mean_t = sum(t for _, t in points) / k
        var = sum((n - mean_n) ** 2 for n, _ in points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var if var else 0.0
        intercept = mean_t - slope * mean_n
        if intercept < 0 or slope < 0:
            return cls(0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points))
        return cls(intercept, slope)

    def __call__(self, n: int) -> float:
        return self.intercept + self.slope * n


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """One transformer layer: its forward (F), input gradient (B) and weights' gradient (W) as lines over the
    micro-batch size, its parameters' bytes (float32) and the bytes of its output per example (float32)."""

    forward: Line
    input_grad: Line
    weight_grad: Line
    param_bytes: int
    activation_bytes: int


def gpt2_layer(seq: int, hidden: int = HIDDEN, profile: Path = LAYER_PROFILE) -> LayerCosts:
    """A GPT-2 XL layer at sequence length ``seq`` (1024 or 4096): the H200 profile's medians fitted by lines."""
    layers = json.loads(profile.read_text())["layers"]
    if str(seq) not in layers:
        raise ValueError(f"{profile.name} has sequences {sorted(layers)}, not {seq}")
    measures = layers[str(seq)]["measures"]

    def line(key: str) -> Line:
        return Line.fit([(m["microbatch_size"], m[key]) for m in measures])

    return LayerCosts(forward=line("forward_s"), input_grad=line("split_backward_s"), weight_grad=line("weight_s"),
                      param_bytes=4 * (12 * hidden * hidden + 13 * hidden), activation_bytes=4 * seq * hidden)


@dataclasses.dataclass(frozen=True)
class EmuConfig:
    """An emulated model: ``segments`` segments of ``layers`` layers of ``layer``, bytes scaled by ``byte_scale``."""

    name: str
    layer: LayerCosts
    segments: int
    layers: int
    byte_scale: int = BYTE_SCALE
    describe: str = ""

    @property
    def seq(self) -> int:
        """Tokens of ``HIDDEN`` floats per example at a cut (the real sequence over ``byte_scale``)."""
        return max(1, round(self.layer.activation_bytes / (4 * HIDDEN) / self.byte_scale))

    @property
    def param_numel(self) -> int:
        """Float32 elements of one segment's parameter table."""
        return max(HIDDEN, self.layers * self.layer.param_bytes // (4 * self.byte_scale) // HIDDEN * HIDDEN)

    def times(self, n: int) -> tuple[float, float, float]:
        """(F, B, W) seconds of one segment for a micro-batch of ``n`` examples."""
        layer = self.layer
        return (self.layers * layer.forward(n), self.layers * layer.input_grad(n), self.layers * layer.weight_grad(n))


MODELS: dict[str, EmuConfig] = {
    "xl": EmuConfig("xl", gpt2_layer(1024), segments=6, layers=8,
                    describe="GPT-2 XL: 48 layers at seq 1024, 8 a segment"),
    "long": EmuConfig("long", gpt2_layer(4096), segments=6, layers=2,
                      describe="12 GPT-2 XL layers at seq 4096, 2 a segment"),
    # the suite's shortened regret test (tests/launch/test_plan_regret.py): 2 segments
    "small": EmuConfig("small", gpt2_layer(1024), segments=2, layers=4,
                       describe="8 GPT-2 XL layers at seq 1024, 4 a segment"),
}


class EmuSegment(nn.Module):
    """One segment: sleeps F and B around the activation, and W when its weights' gradient is made."""

    def __init__(self, cfg: EmuConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rows = cfg.param_numel // HIDDEN
        self.table = nn.Parameter(torch.zeros(rows, HIDDEN))  # the segment's parameters: real bytes, no compute
        self.register_buffer("row", torch.zeros(1, dtype=torch.long), persistent=False)
        self._n = 1  # the micro-batch size of the last forward (every micro-batch of a step has the same size)
        self._hooked: set[int] = set()

    def _hook(self, weight: torch.Tensor) -> None:
        """W's sleep, on the parameter the forward uses (the runtime may replace it when it places the stage)."""
        if weight.requires_grad and not weight.is_meta and id(weight) not in self._hooked:
            self._hooked.add(id(weight))

            def sleep(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(self.cfg.times(self._n)[2])
                return grad

            weight.register_hook(sleep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        self._n = n
        f, b, _ = self.cfg.times(n)
        self._hook(self.table)
        y = Sleep.apply(x, f, b)
        # one row of the table, times zero: its gradient is the whole table's (dense), made in W under a split
        # schedule; its value adds nothing
        return y + F.embedding(self.row, self.table).sum() * 0.0


class EmuModel(nn.Module):
    """``cfg.segments`` :class:`EmuSegment` with a :class:`CutPoint` between each two; the loss is the MSE of the
    output against ``y``. Inputs: ``x`` and ``y``, float32 ``[n, seq, HIDDEN]``."""

    def __init__(self, cfg: EmuConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.segments = nn.ModuleList([EmuSegment(cfg) for _ in range(cfg.segments)])
        self.cuts = nn.ModuleList([CutPoint() for _ in range(cfg.segments - 1)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, seg in enumerate(self.segments):
            x = seg(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return F.mse_loss(x, y)


def build_model(name: str) -> EmuModel:
    torch.manual_seed(0)
    return EmuModel(MODELS[name])


def make_batch(name: str, n: int) -> dict:
    cfg = MODELS[name]
    g = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, cfg.seq, HIDDEN, generator=g), "y": torch.randn(n, cfg.seq, HIDDEN, generator=g)}


def _sgd(params):
    """The runs' optimizer, also given to the profiler (which times one step of it per segment)."""
    return torch.optim.SGD(params, lr=1e-3)


def _spec(name: str) -> ModelSpec:
    return ModelSpec(build=lambda: build_model(name), batch=lambda n: make_batch(name, n), optimizer=_sgd,
                     name=f"emu-{name}")


SPECS: dict[str, ModelSpec] = {name: _spec(name) for name in MODELS}
xl, long, small = SPECS["xl"], SPECS["long"], SPECS["small"]  # for `varuna profile devtools/emumodels.py:xl`


def summary(name: str) -> str:
    """One line: what the model is, per segment (F/B/W at a micro-batch of 1, bytes)."""
    cfg = MODELS[name]
    f, b, w = cfg.times(1)
    return (f"{name}: {cfg.describe}; {cfg.segments} segments, each F/B/W {f * 1e3:.1f}/{b * 1e3:.1f}/{w * 1e3:.1f} ms "
            f"at micro-batch 1, {cfg.param_numel * 4 / 1e6:.2f} MB of parameters; "
            f"{cfg.seq * HIDDEN * 4 / 1e3:.1f} kB per example at a cut")
