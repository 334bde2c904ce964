"""Models shared by the tests and the benchmarks (the tests re-export them from ``tests.models``)."""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from varuna_core import CutPoint

__all__ = ["Sleep", "SleepLayer", "SleepModel", "SplitSleepModel"]


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a set time without using the CPU."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """A layer that sleeps ``forward_s`` in forward and ``backward_s`` in backward (no CPU used)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x, self.forward_s, self.backward_s)


class SleepModel(nn.Module):
    """Segments whose forward and backward take set times: segment ``i`` is a ``Linear(h, h)`` and a
    :class:`SleepLayer` of ``times[i] = (forward_s, backward_s)``. The cuts carry ``[b, h]`` float32."""

    def __init__(self, times: list[tuple[float, float]], hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden), SleepLayer(f, b)) for f, b in times])
        self.cuts = nn.ModuleList([CutPoint() for _ in times[1:]])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return F.mse_loss(x, y)


class SplitSleepModel(nn.Module):
    """Segments whose ``F``, ``B`` and ``W`` take set times, for the split schedules: segment ``i`` is a
    ``Linear(h, h, bias=False)`` whose weight's gradient sleeps ``weight_s`` when it is computed (a hook on the
    weight: in the backward of an unsplit schedule, in ``W`` under a split one), then a :class:`SleepLayer` of
    ``forward_s`` and ``backward_s`` (the input's gradient, ``B``). ``times[i] = (forward_s, backward_s,
    weight_s)``; the cuts carry ``[b, h]`` float32."""

    def __init__(self, times: list[tuple[float, float, float]], hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden, bias=False) for _ in times])
        self.sleeps = nn.ModuleList([SleepLayer(f, b) for f, b, _ in times])
        self.weight_s = [w for _, _, w in times]
        self.cuts = nn.ModuleList([CutPoint() for _ in times[1:]])
        self._hooked: set[int] = set()  # the weights (by id) whose gradient sleeps already

    def _hook(self, weight: torch.Tensor, seconds: float) -> None:
        """The hook goes on the parameter the forward uses (the runtime may replace a module's parameters when it
        places the stage), once."""
        if weight.requires_grad and not weight.is_meta and id(weight) not in self._hooked:
            self._hooked.add(id(weight))

            def sleep(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(seconds)
                return grad

            weight.register_hook(sleep)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, (linear, sleep) in enumerate(zip(self.linears, self.sleeps, strict=True)):
            self._hook(linear.weight, self.weight_s[i])
            x = sleep(linear(x))
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return F.mse_loss(x, y)
