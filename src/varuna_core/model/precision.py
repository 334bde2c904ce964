"""Mixed precision: autocast contexts and a loss scaler whose overflow decision is global.

Parameters and optimizer state stay fp32; ``torch.autocast`` runs the forward in bf16 or fp16. In fp16 the
last stage multiplies its loss by the *loss scale*, so every stage back-propagates scaled gradients (what
arrives at a cut is already scaled, as with the original's patched apex). After the gradient syncs, each rank
unscales its gradients and flags non-finite values with torch's own AMP kernels; the flag is summed over
*all* ranks with the step's loss, so every rank agrees to skip the step and halve the scale, or to keep it and
grow the scale after ``growth_interval`` clean steps. (A per-rank ``GradScaler`` cannot do this: stages must
agree, or one stage would step while another skipped.)

[Note: wire dtype] ``Varuna(..., wire_dtype="bf16" | "fp16")`` narrows what crosses a cut, whatever the stages
compute in: a floating-point leaf of a cut's value (activations forward, their gradients back, skipped tensors
with them) wider than the wire dtype is cast to it by the sender and back to its recorded dtype by the receiver,
so the stages' compute and the dtypes autograd sees are those of an exact run; only the values are rounded, once
per crossing. Integer and bool leaves (ids, masks) cross as they are, and so does a float leaf as narrow as the
wire dtype or narrower (:func:`wire_dtype`): a bf16 activation under autocast stays bf16 on an fp16 wire, since
recasting it saves no byte and fp16 cannot hold bf16's range. Where the wire dtype's exponent range is narrower
than the leaf's (fp16 under fp32 or fp64), a finite value at least :func:`overflow_threshold` in magnitude becomes
inf: the sender counts such leaves, and the step treats the count as an overflow (fp16 precision: skipped, the
scale lowered) or as an error on every rank (fp32, bf16). bf16 has fp32's exponent, so under fp32 only values
above 3.39e38 (sentinels such as ``torch.finfo(torch.float32).min`` in an additive mask) round to inf, and are
not counted.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..errors import ConfigError

__all__ = ["PRECISIONS", "WIRE_DTYPES", "resolve_precision", "autocast", "LossScaler", "wire_dtype",
           "overflow_threshold"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_DTYPES = dict(_DTYPES)  # the narrow dtypes a cut's values may cross in ([Note: wire dtype])


def resolve_precision(precision: str | None, fp16: bool) -> str:
    """The precision from the modern ``precision=`` keyword or the original's ``fp16=`` flag."""
    if precision is None:
        return "fp16" if fp16 else "fp32"
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}", hint=f"choose one of {', '.join(PRECISIONS)}")
    if fp16 and precision != "fp16":
        raise ConfigError(f"fp16=True contradicts precision={precision!r}", hint="pass only one of them")
    return precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def wire_dtype(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    """The dtype a leaf recorded as ``dtype`` crosses a cut in under the wire dtype ``wire`` (``None``: exact): the
    wire dtype for a real floating-point leaf wider than it, else ``dtype`` itself ([Note: wire dtype])."""
    if wire is None or not dtype.is_floating_point or dtype.itemsize <= wire.itemsize:
        return dtype
    return wire


def overflow_threshold(source: torch.dtype, wire: torch.dtype) -> float | None:
    """The smallest magnitude at which a finite ``source`` value rounds to inf in ``wire`` (the largest finite
    ``wire`` value plus half its spacing: 65520 for fp16), where ``wire``'s exponent range is narrower than
    ``source``'s; ``None`` where it is not (bf16 under fp32: see [Note: wire dtype])."""
    big = torch.finfo(wire).max
    if 2 * big > torch.finfo(source).max:
        return None
    _, exponent = math.frexp(big)  # big = m · 2**exponent with 0.5 <= m < 1: its spacing is eps · 2**(exponent-1)
    return big + math.ldexp(torch.finfo(wire).eps / 2, exponent - 1)


class LossScaler:
    """Dynamic (or static) loss scale, identical on every rank because every rank applies the same global
    overflow flag.

    Args:
        init_scale: starting scale (``2**20`` as in the original).
        min_scale: the scale never drops below this.
        dynamic: ``False`` keeps ``init_scale`` forever (overflowing steps are still skipped).
        growth_interval: clean steps before the scale doubles.
        device: where the scale tensors live.
    """

    def __init__(self, init_scale: float = 2.0**20, min_scale: float = 1.0, *, dynamic: bool = True,
                 growth_interval: int = 2000, device: torch.device | str = "cpu") -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ConfigError(f"loss scales must be positive, got init {init_scale}, min {min_scale}")
        self.dynamic = dynamic
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.scale = torch.tensor([float(init_scale)], dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def value(self) -> float:
        return float(self.scale.item())

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; returns a float tensor ``[1]`` that is 1 if any is non-finite."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        inv_scale = self.inv_scale()
        for group in by_kind.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return found_inf

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` (float32 ``[1]`` on the scale's device), rounded once from float64 as the unscale uses it."""
        return self.scale.double().reciprocal().float()

    def update(self, overflow: bool) -> None:
        """Apply the step's global overflow decision: halve (floored at ``min_scale``) or count a clean step."""
        if not self.dynamic:
            return
        found = torch.full((1,), 1.0 if overflow else 0.0, dtype=torch.float32, device=self.scale.device)
        torch._amp_update_scale_(self.scale, self._growth_tracker, found, 2.0, 0.5, self.growth_interval)
        if self.scale.item() < self.min_scale:
            self.scale.fill_(self.min_scale)

    def state_dict(self) -> dict:
        return {"scale": self.value, "growth_tracker": int(self._growth_tracker.item()), "dynamic": self.dynamic,
                "min_scale": self.min_scale, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))

