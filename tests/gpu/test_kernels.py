"""The extension's CUDA kernel (``csrc/fused.cu``) against its torch twin (``varuna_core.pipeline.fused``), and the
step that uses it against the plain process. A GPU suite without the kernel built FAILS here: the suite checks the
extension the project ships, not a fallback.

Guaranteed and asserted: the unscaled values and the overflow flag bit for bit torch's AMP kernel (bf16, which
torch's CUDA kernel lacks, against its arithmetic spelled out); a tensor's squared norm reproducible and independent
of the list it is in. The squared norms are sums of floats in another order than ``torch._foreach_norm``'s, so they are
compared with float64 sums within a float sum's error bound (each term rounds by at most 2**-24 relative, and a
sum of n non-negative terms drifts by at most n·2**-24 of the total; both sums here are blocked, far below that).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import (
    BATCH,
    DEVICE,
    TOY,
    assert_equal_to_reference,
    needs_real_gpu,
    reference,
    sgd,
    state_of,
    train,
)
from tests.reference import Layout
from varuna_core import Varuna
from varuna_core.pipeline import fused

SIZES = [0, 1, 31, 8191, 8192, 8193, 3 * 8192 + 5, 100_000, 1 << 20]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels():
    needs_real_gpu("the extension's CUDA kernel")
    if fused.cuda_kernels() is None:
        pytest.fail("varuna_core._native has no CUDA kernels: build it where nvcc is found (csrc/README.md)",
                    pytrace=False)


def _grads(dtype, seed=0, sizes=SIZES):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(n, generator=g) * 300).to(dtype).to(DEVICE) for n in sizes]


def _exact_sq(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


def _bound(t: torch.Tensor) -> float:
    return max(t.numel(), 1) * 2.0**-24 * _exact_sq(t) + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled", [True, False])
def test_grad_pass_equals_torch(dtype, scaled) -> None:
    ours, theirs = _grads(dtype), _grads(dtype)
    inv = torch.tensor([1 / 1024], dtype=torch.float32, device=DEVICE) if scaled else None
    inf_ours = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    inf_theirs = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    sq = fused.unscale_sq_norms_cuda(ours, inv, inf_ours)
    sq_ref = fused.unscale_sq_norms_torch(theirs, inv, inf_theirs)
    assert sq.dtype == torch.float64 and sq.shape == (len(SIZES),)
    assert [torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)] == [True] * len(SIZES)
    assert float(inf_ours) == float(inf_theirs) == 0.0
    for t, got, want in zip(ours, sq.tolist(), sq_ref.tolist(), strict=True):
        assert abs(got - _exact_sq(t)) <= _bound(t), (t.numel(), got, _exact_sq(t))
        assert abs(want - _exact_sq(t)) <= _bound(t) + 2 * 2.0**-24 * _exact_sq(t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_non_finite_values_are_flagged(dtype, bad, where) -> None:
    ours, theirs = _grads(dtype), _grads(dtype)
    k = {"first": 1, "last": len(SIZES) - 1, "middle": 6}[where]
    pos = {"first": 0, "last": SIZES[k] - 1, "middle": SIZES[k] // 2}[where]
    for grads in (ours, theirs):
        grads[k][pos] = bad
    inv = torch.tensor([0.5], dtype=torch.float32, device=DEVICE)
    flags = [torch.zeros(1, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    fused.unscale_sq_norms_cuda(ours, inv, flags[0])
    fused.unscale_sq_norms_torch(theirs, inv, flags[1])
    assert [float(f) for f in flags] == [1.0, 1.0]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True) if not a.isnan().any())
    # without a scale the values stay and the flag is still raised
    clean = _grads(dtype)
    clean[k][pos] = bad
    before = [t.clone() for t in clean]
    flag = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    fused.unscale_sq_norms_cuda(clean, None, flag)
    assert float(flag) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(clean, before, strict=True) if not a.isnan().any())


def test_a_tensors_norm_does_not_depend_on_its_list() -> None:
    a = _grads(torch.float32, seed=1, sizes=[300_001])[0]
    alone = fused.unscale_sq_norms_cuda([a], None, torch.zeros(1, device=DEVICE))[0]
    others = _grads(torch.float32, seed=2, sizes=[5, 70_000])
    mixed = fused.unscale_sq_norms_cuda([others[0], a, others[1]], None, torch.zeros(1, device=DEVICE))[1]
    again = fused.unscale_sq_norms_cuda([a], None, torch.zeros(1, device=DEVICE))[0]
    assert torch.equal(alone, mixed) and torch.equal(alone, again)


def test_mixed_dtypes_keep_their_order() -> None:
    grads = [_grads(dt, seed=i, sizes=[10_000 + i])[0] for i, dt in enumerate([torch.float16, torch.float32,
                                                                                torch.bfloat16, torch.float32])]
    sq = fused.unscale_sq_norms_cuda(grads, None, torch.zeros(1, device=DEVICE))
    for t, got in zip(grads, sq.tolist(), strict=True):
        assert abs(got - _exact_sq(t)) <= _bound(t)


def test_bad_arguments_are_refused() -> None:
    flag = torch.zeros(1, device=DEVICE)
    with pytest.raises(ValueError, match="non-contiguous"):
        fused.unscale_sq_norms_cuda([torch.zeros(4, 4, device=DEVICE).t()], None, flag)
    with pytest.raises(ValueError, match="CUDA tensors"):
        fused.unscale_sq_norms_cuda([torch.zeros(4)], None, flag)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        fused.unscale_sq_norms_cuda([torch.zeros(4, dtype=torch.float64, device=DEVICE)], None, flag)
    with pytest.raises(ValueError, match="found_inf must be a float32"):
        fused.unscale_sq_norms_cuda([torch.zeros(4, device=DEVICE)], None, torch.zeros(2, device=DEVICE))


def test_the_dispatcher_picks_the_kernel() -> None:
    grads = _grads(torch.float32, sizes=[10, 20])
    assert fused.fused_grad_pass(grads)
    assert not fused.fused_grad_pass([g.cpu() for g in grads])
    assert not fused.fused_grad_pass([torch.zeros(4, 4, device=DEVICE).t()])


@pytest.mark.parametrize("precision,loss_scale", [("fp16", 2.0**10), ("bf16", None), ("fp32", None)])
def test_the_step_with_the_kernel_equals_the_plain_process(precision, loss_scale, monkeypatch) -> None:
    """The step's gradient pass runs the kernel here; every loss and tensor equal the plain process's, which
    unscales with torch's AMP kernel."""
    calls = []
    kernel = fused.unscale_sq_norms_cuda
    monkeypatch.setattr(fused, "unscale_sq_norms_cuda", lambda *a: calls.append(1) or kernel(*a))
    vm = Varuna(TOY.build(), "0", TOY.batch_at(2, 99), batch_size=BATCH, chunk_size=TOY.chunk,
                shared_weights=TOY.ties, precision=precision)
    opt = sgd(list(vm.parameters()))
    vm.set_optimizer(opt, **({"loss_scale": loss_scale} if loss_scale else {}))
    losses, _ = train(vm, opt, 3, TOY.batch_at)
    assert len(calls) == 3
    ref_losses, ref_state = reference(TOY.build(), 3, TOY.batch_at, Layout(BATCH, TOY.chunk), TOY.ties, vm.device,
                                      precision=precision, loss_scale=loss_scale)
    assert_equal_to_reference(losses, state_of(vm), ref_losses, ref_state)


def test_clipping_with_the_kernels_norm_matches_the_plain_process() -> None:
    """With clipping the norm decides the update, and the kernel sums in another order: norms and tensors agree
    to the float rounding of a sum (the tolerance the CPU tests of clipping state)."""
    clip = 0.05
    vm = Varuna(TOY.build(), "0", TOY.batch_at(2, 99), batch_size=BATCH, chunk_size=TOY.chunk,
                shared_weights=TOY.ties)
    opt = sgd(list(vm.parameters()))
    vm.set_optimizer(opt)
    norms = []
    for step in range(3):
        vm.step(TOY.batch_at(BATCH, step), clip_grad_max_norm=clip)
        norms.append(vm.grad_norm)
        opt.step()
        opt.zero_grad()
    ref_norms: list[float] = []
    _, ref_state = reference(TOY.build(), 3, TOY.batch_at, Layout(BATCH, TOY.chunk), TOY.ties, vm.device,
                             clip=clip, norms=ref_norms)
    assert min(ref_norms) > clip, "the test must exercise clipping"
    for got, want in zip(norms, ref_norms, strict=True):
        assert abs(got - want) <= 1e-6 * want, (norms, ref_norms)
    for name, t in state_of(vm).items():
        torch.testing.assert_close(t.cpu(), ref_state[name].cpu(), rtol=1e-5, atol=1e-6, msg=name)
