"""``varuna_core.pipeline.fused`` without a GPU: the torch twin (the reference the CUDA kernel is compared with in
tests/gpu/test_kernels.py), the chunk table that tells each CUDA thread block its tensor and elements (checked by
walking it as the kernel does), and the clear refusal where the kernel is not built."""

from __future__ import annotations

import bisect

import pytest
import torch

from varuna_core.pipeline import fused


def test_the_grad_pass_twin_unscales_flags_and_norms() -> None:
    grads = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([], dtype=torch.float32),
             torch.tensor([4.0, 0.5], dtype=torch.bfloat16)]
    found = torch.zeros(1)
    sq = fused.unscale_sq_norms_torch(grads, torch.tensor([0.5]), found)
    assert grads[0].tolist() == [0.5, -1.0, 1.5] and grads[2].tolist() == [2.0, 0.25]
    assert sq.dtype == torch.float64
    assert sq.tolist() == pytest.approx([3.5, 0.0, 4.0625], rel=1e-6)  # torch's norm is a float sqrt, squared
    assert float(found) == 0.0
    grads[0][1] = float("inf")
    fused.unscale_sq_norms_torch(grads, None, found)
    assert float(found) == 1.0 and grads[2].tolist() == [2.0, 0.25]  # no scale: values kept, flag raised
    assert fused.unscale_sq_norms_torch([], None, found).shape == (0,)


def _walk(table: torch.Tensor, n: int, chunks: int, chunk: int) -> list[list[tuple[int, int]]]:
    """The element ranges each tensor's chunks cover, found as ``csrc/fused.cu`` finds them (the largest i < n
    with first[i] <= block)."""
    rows = table.tolist()
    first = rows[2 * n:3 * n + 1]
    assert first[-1] == chunks
    covered: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for b in range(chunks):
        i = bisect.bisect_right(first[:n], b) - 1
        start = (b - first[i]) * chunk
        covered[i].append((start, min(start + chunk, rows[n + i])))
    return covered


@pytest.mark.parametrize("sizes", [[5], [0], [0, 0, 3], [4, 0, 9, 1, 0], [8, 8, 8], [1] * 50 + [13]])
def test_the_chunk_table_covers_every_element_once(sizes, monkeypatch) -> None:
    chunk = 4

    class Native:
        FUSED_CHUNK = chunk

    monkeypatch.setattr(fused, "_require", lambda: Native)
    fused._TABLES.clear()
    tensors = [torch.zeros(n) for n in sizes]
    table, chunks = fused._table(tensors, torch.device("cpu"), torch.float32)
    n = len(sizes)
    rows = table.tolist()
    assert len(rows) == 3 * n + 1
    assert rows[:n] == [t.data_ptr() for t in tensors] and rows[n:2 * n] == sizes
    for size, ranges in zip(sizes, _walk(table, n, chunks, chunk), strict=True):
        assert [e for lo, hi in ranges for e in range(lo, hi)] == list(range(size))
    again, _ = fused._table(tensors, torch.device("cpu"), torch.float32)
    assert again is table  # cached by the addresses and sizes it encodes
    fused._TABLES.clear()


def test_the_table_cache_is_bounded(monkeypatch) -> None:
    class Native:
        FUSED_CHUNK = 8

    monkeypatch.setattr(fused, "_require", lambda: Native)
    fused._TABLES.clear()
    keep = [torch.zeros(i + 1) for i in range(fused._MAX_TABLES + 10)]
    for t in keep:
        fused._table([t], torch.device("cpu"), torch.float32)
    assert len(fused._TABLES) == fused._MAX_TABLES
    fused._TABLES.clear()


def test_without_the_kernels_the_twins_run_and_the_kernels_refuse(monkeypatch) -> None:
    monkeypatch.setattr(fused, "cuda_kernels", lambda: None)
    grads = [torch.ones(3)]
    assert not fused.fused_grad_pass(grads)
    with pytest.raises(RuntimeError, match="built without its CUDA kernels"):
        fused.unscale_sq_norms_cuda(grads, None, torch.zeros(1))


def test_cpu_tensors_never_take_the_kernel_path() -> None:
    assert not fused.fused_grad_pass([torch.ones(3)])
    assert not fused.fused_grad_pass([])


def test_no_native_switch_hides_the_kernels(monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_NO_NATIVE", "1")
    assert fused.cuda_kernels() is None


def test_the_extension_says_whether_it_has_cuda_kernels() -> None:
    from varuna_core import _native as native

    assert isinstance(native.CUDA, bool)
    assert native.CUDA == hasattr(native, "unscale_sq_norms") == hasattr(native, "FUSED_CHUNK")


def test_the_bound_kernel_checks_its_counts_and_fails_cleanly_without_a_gpu() -> None:
    """Where the extension was built with nvcc (this holds on a machine with a CUDA toolkit and no GPU): bad counts
    and type codes are refused before any launch, and a launch without a driver is a RuntimeError, not a crash."""
    from varuna_core import _native as native

    if not native.CUDA:
        assert not hasattr(native, "unscale_sq_norms")
        return
    with pytest.raises(ValueError, match="out of range"):
        native.unscale_sq_norms(8, -1, 0, 0, 0, 8, 8, 8, 0)
    with pytest.raises(ValueError, match="must be 0, 1 or 2"):
        native.unscale_sq_norms(8, 1, 1, 3, 0, 8, 8, 8, 0)
    with pytest.raises(ValueError, match="null"):
        native.unscale_sq_norms(0, 1, 1, 0, 0, 8, 8, 8, 0)
    native.unscale_sq_norms(0, 0, 0, 0, 0, 0, 0, 0, 0)  # an empty list launches nothing
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="unscale_sq_norms failed: cuda"):
            native.unscale_sq_norms(8, 1, 1, 0, 0, 8, 8, 8, 0)
