"""The CUDA kernel of ``varuna_core._native`` (``csrc/fused.cu``) and its torch twin: one pass over a stage's
gradients for the step's end.

:func:`unscale_sq_norms_cuda` unscales the gradients in place (fp16 loss scaling), flags non-finite values and returns
every tensor's squared norm (for global clipping and the reported norm) in one pass, where torch needs two
(``torch._amp_foreach_non_finite_check_and_unscale_`` then ``torch._foreach_norm``). The unscaled values and the
flag are bit for bit torch's; the squared norms are summed in another order (float within 8192 elements, then
double), so they equal the twin's within a float sum's rounding, and are reproducible run to run and independent
of the other tensors in the list.

The twin is the reference, and the path on the CPU, without the kernel, or under ``VARUNA_NO_NATIVE=1``. The
kernel is used because it was measured faster (``benchmarks/cuda_kernels.py``; ``csrc/README.md`` has the numbers,
and those of a pack/cast kernel that was not faster than torch's and was dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..env import NO_NATIVE, flag

__all__ = ["cuda_kernels", "unscale_sq_norms_torch", "unscale_sq_norms_cuda", "fused_grad_pass"]

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
_MAX_TABLES = 32


def cuda_kernels() -> Any | None:
    """``varuna_core._native`` when it was built with its CUDA kernels (and ``VARUNA_NO_NATIVE`` is not set), else
    ``None``."""
    if flag(NO_NATIVE):
        return None
    try:
        from .. import _native
    except ImportError:
        return None
    return _native if getattr(_native, "CUDA", False) else None


def fused_grad_pass(grads: Sequence[torch.Tensor]) -> bool:
    """Whether the step's gradient pass over ``grads`` runs the CUDA kernel: all on a CUDA device, of a type
    the kernel reads, contiguous, and the kernel built."""
    return (bool(grads) and all(g.is_cuda and g.dtype in _DTYPE_CODE and g.is_contiguous()
                                                         for g in grads)
            and cuda_kernels() is not None)


def _groups(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(i)
    return by_kind


# --- one pass over the gradients ----------------------------------------------------------------------------------

def unscale_sq_norms_torch(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor | None,
                           found_inf: torch.Tensor) -> torch.Tensor:
    """The twin: unscale ``grads`` in place by ``inv_scale`` (float32 ``[1]``; ``None``: leave the values), set
    ``found_inf`` (float32 ``[1]``) to 1 if any value is not finite, and return the squared norms, float64
    ``[len(grads)]`` on ``found_inf``'s device."""
    for (device, dtype), idx in _groups(grads).items():
        group = [grads[i] for i in idx]
        scale = inv_scale if inv_scale is not None else torch.ones(1, dtype=torch.float32, device=found_inf.device)
        if device.type == "cuda" and dtype == torch.bfloat16:
            # torch's CUDA kernel has no bf16 case: its arithmetic, spelled out (float product, rounded once)
            if not all(bool(torch.isfinite(g).all()) for g in group):
                found_inf.fill_(1.0)
            if inv_scale is not None:
                for g in group:
                    g.copy_(g.float() * scale)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, scale)
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=found_inf.device)
    norms = torch._foreach_norm(list(grads), 2, dtype=torch.float32)  # a bf16 norm would round to 8 bits
    return torch.stack([n.to(found_inf.device) for n in norms]).double().pow(2)


def unscale_sq_norms_cuda(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor | None,
                          found_inf: torch.Tensor) -> torch.Tensor:
    """The CUDA kernel: what :func:`unscale_sq_norms_torch` does, in one pass per (device, dtype) group."""
    native = _require()
    out = torch.empty(len(grads), dtype=torch.float64, device=found_inf.device)
    _check_scalar(found_inf, "found_inf")
    if inv_scale is not None:
        _check_scalar(inv_scale, "inv_scale")
    for (device, dtype), idx in _groups(grads).items():
        group = [grads[i] for i in idx]
        _check_tensors(group, device, dtype)
        if (inv_scale is not None and inv_scale.device != device) or found_inf.device != device:
            raise ValueError(f"inv_scale and found_inf must be on {device}, with the gradients")
        table, chunks = _table(group, device, dtype)
        partials = torch.empty(chunks, dtype=torch.float32, device=device)
        sq = torch.empty(len(group), dtype=torch.float64, device=device)
        native.unscale_sq_norms(table.data_ptr(), len(group), chunks, _DTYPE_CODE[dtype],
                                0 if inv_scale is None else inv_scale.data_ptr(), found_inf.data_ptr(),
                                partials.data_ptr(), sq.data_ptr(), torch.cuda.current_stream(device).cuda_stream)
        if len(idx) == len(grads):
            return sq
        out[torch.tensor(idx, device=device)] = sq
    return out


# --- shared checks and the chunk table ----------------------------------------------------------------------------

def _require() -> Any:
    native = cuda_kernels()
    if native is None:
        raise RuntimeError("varuna_core._native was built without its CUDA kernels (or VARUNA_NO_NATIVE=1): "
                           "rebuild it where nvcc is found (csrc/README.md)")
    return native


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"the CUDA kernels handle float32, float16 and bfloat16, not {dtype}")


def _check_scalar(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.numel() != 1 or not t.is_cuda:
        raise ValueError(f"{name} must be a float32 CUDA tensor of one element, got {t.dtype} {list(t.shape)} "
                         f"on {t.device}")


def _check_tensors(tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
    """Every pointer the kernel follows is checked here: on ``device`` (a CUDA one), of ``dtype``, contiguous."""
    _check_dtype(dtype)
    if device.type != "cuda":
        raise ValueError(f"the CUDA kernels need CUDA tensors, not tensors on {device}")
    for t in tensors:
        if t.device != device or t.dtype != dtype:
            raise ValueError(f"a {t.dtype} tensor on {t.device} among {dtype} tensors on {device}")
        if not t.is_contiguous():
            raise ValueError(f"a non-contiguous tensor of shape {list(t.shape)}: the kernels read memory in order")


def _table(tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The chunk table of ``csrc/fused.hpp`` on ``device`` (int64: addresses, sizes, first chunks) and the number
    of chunks. Cached by the addresses and sizes it encodes (a gradient buffer's views keep theirs for the whole
    run), so a hit is always right."""
    key = (device, dtype, tuple((t.data_ptr(), t.numel()) for t in tensors))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    chunk = int(_require().FUSED_CHUNK)
    numels = [t.numel() for t in tensors]
    first = [0]
    for n in numels:
        first.append(first[-1] + -(-n // chunk))
    rows = [t.data_ptr() for t in tensors] + numels + first
    entry = (torch.tensor(rows, dtype=torch.int64).to(device), first[-1])
    _TABLES[key] = entry
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return entry
