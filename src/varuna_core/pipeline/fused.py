"""The CUDA kernels of ``varuna_core._native`` (``csrc/fused.cu``) and their torch twins.

Two operations of the step's GPU path, each with a torch twin that is the reference (and the path on the CPU,
without the kernels, or under ``VARUNA_NO_NATIVE=1``):

- :func:`unscale_sq_norms`: one pass over a stage's gradients that unscales them in place (fp16 loss scaling),
  flags non-finite values and returns every tensor's squared norm, where torch needs two passes
  (``torch._amp_foreach_non_finite_check_and_unscale_`` then ``torch._foreach_norm``). The unscaled values and the
  flag are bit for bit torch's; the squared norms are summed in another order (float within 8192 elements, then
  double), so they equal the twin's within a float sum's rounding, and are reproducible run to run.
- :func:`pack` / :func:`unpack`: several tensors cast into one 1-D buffer and back, as
  ``torch.cat([t.reshape(-1).to(dtype) ...])`` does, in one launch.

Whether a kernel is used is measured, not assumed: ``benchmarks/cuda_kernels.py`` times each against its twin
on the GPU, and only the ones that won are used by the step (see :data:`USE_FUSED_GRAD_PASS`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..env import NO_NATIVE, flag

__all__ = ["cuda_kernels", "unscale_sq_norms", "unscale_sq_norms_torch", "unscale_sq_norms_cuda", "pack",
           "pack_torch", "pack_cuda", "unpack", "unpack_torch", "unpack_cuda", "fused_grad_pass",
           "USE_FUSED_GRAD_PASS"]

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TABLES: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
_MAX_TABLES = 32

# The step uses the fused gradient pass on CUDA when the extension has it (see benchmarks/README.md's
# "CUDA kernels" for the measurement that decided this).
USE_FUSED_GRAD_PASS = True


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
    return (USE_FUSED_GRAD_PASS and bool(grads) and all(g.is_cuda and g.dtype in _DTYPE_CODE and g.is_contiguous()
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
        table, chunks = _table(group, device, dtype, offsets=False)
        partials = torch.empty(chunks, dtype=torch.float32, device=device)
        sq = torch.empty(len(group), dtype=torch.float64, device=device)
        native.unscale_sq_norms(table.data_ptr(), len(group), chunks, _DTYPE_CODE[dtype],
                                0 if inv_scale is None else inv_scale.data_ptr(), found_inf.data_ptr(),
                                partials.data_ptr(), sq.data_ptr(), torch.cuda.current_stream(device).cuda_stream)
        if len(idx) == len(grads):
            return sq
        out[torch.tensor(idx, device=device)] = sq
    return out


def unscale_sq_norms(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor | None,
                     found_inf: torch.Tensor) -> torch.Tensor:
    """The kernel where :func:`fused_grad_pass` says so, else the twin."""
    if fused_grad_pass(grads):
        return unscale_sq_norms_cuda(grads, inv_scale, found_inf)
    return unscale_sq_norms_torch(grads, inv_scale, found_inf)


# --- several tensors in one buffer --------------------------------------------------------------------------------

def pack_torch(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The twin: ``tensors`` flattened, cast to ``dtype`` and concatenated (a 1-D tensor on their device)."""
    if not tensors:
        raise ValueError("nothing to pack")
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unpack_torch(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The twin: consecutive slices of ``buffer`` copied, cast, into ``tensors``."""
    at = 0
    for t in tensors:
        t.copy_(buffer[at:at + t.numel()].view(t.shape))
        at += t.numel()
    if at != buffer.numel():
        raise ValueError(f"a buffer of {buffer.numel()} elements does not hold tensors of {at} in all")


def pack_cuda(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The CUDA kernel: :func:`pack_torch` in one launch (the tensors of one device and one type)."""
    native = _require()
    if not tensors:
        raise ValueError("nothing to pack")
    device, src = tensors[0].device, tensors[0].dtype
    _check_tensors(tensors, device, src)
    _check_dtype(dtype)
    table, chunks = _table(tensors, device, src, offsets=True)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    native.pack_cast(table.data_ptr(), len(tensors), chunks, _DTYPE_CODE[src], out.data_ptr(), _DTYPE_CODE[dtype],
                     torch.cuda.current_stream(device).cuda_stream)
    return out


def unpack_cuda(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The CUDA kernel: :func:`unpack_torch` in one launch."""
    native = _require()
    if not tensors:
        raise ValueError("nothing to unpack into")
    device, dst = tensors[0].device, tensors[0].dtype
    _check_tensors(tensors, device, dst)
    _check_tensors([buffer], device, buffer.dtype)
    total = sum(t.numel() for t in tensors)
    if buffer.dim() != 1 or buffer.numel() != total:
        raise ValueError(f"a buffer of shape {list(buffer.shape)} does not hold tensors of {total} elements")
    table, chunks = _table(tensors, device, dst, offsets=True)
    native.unpack_cast(table.data_ptr(), len(tensors), chunks, _DTYPE_CODE[dst], buffer.data_ptr(),
                       _DTYPE_CODE[buffer.dtype], torch.cuda.current_stream(device).cuda_stream)


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """:func:`pack_cuda` where the kernels apply, else :func:`pack_torch`."""
    if dtype in _DTYPE_CODE and _kernels_apply(tensors, [tensors[0].dtype] if tensors else []):
        return pack_cuda(tensors, dtype)
    return pack_torch(tensors, dtype)


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """:func:`unpack_cuda` where the kernels apply, else :func:`unpack_torch`."""
    if buffer.dim() == 1 and _kernels_apply([*tensors, buffer], [tensors[0].dtype, buffer.dtype] if tensors else []):
        unpack_cuda(buffer, tensors)
    else:
        unpack_torch(buffer, tensors)


# --- shared checks and the chunk table ----------------------------------------------------------------------------

def _kernels_apply(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> bool:
    """All of ``tensors`` on one CUDA device, contiguous, of the ``dtypes`` the call allows (the kernels' types),
    and the kernels built."""
    return (bool(tensors) and tensors[0].is_cuda and len({t.device for t in tensors}) == 1
            and all(t.dtype in dtypes and t.dtype in _DTYPE_CODE and t.is_contiguous() for t in tensors)
            and cuda_kernels() is not None)


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


def _table(tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype, *,
           offsets: bool) -> tuple[torch.Tensor, int]:
    """The chunk table of ``csrc/fused.hpp`` on ``device`` (int64: addresses, sizes, first chunks, and with
    ``offsets`` each tensor's place in a packed buffer) and the number of chunks. Cached by the addresses and
    sizes it encodes (a gradient buffer's views keep theirs for the whole run), so a hit is always right."""
    key = (device, dtype, offsets, tuple((t.data_ptr(), t.numel()) for t in tensors))
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
    if offsets:
        at = 0
        for n in numels:
            rows.append(at)
            at += n
    entry = (torch.tensor(rows, dtype=torch.int64).to(device), first[-1])
    _TABLES[key] = entry
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return entry
