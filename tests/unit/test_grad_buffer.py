"""``GradBuffer``: gradients as views of one flat buffer per dtype, freed by ``release`` (a worker about to publish
its state and exit) and allocated again, zeroed, by the next ``attach``."""

from __future__ import annotations

import torch
import torch.nn as nn

from varuna_core.pipeline.grads import GradBuffer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _backward(model: nn.Module) -> None:
    model(torch.ones(5, 4)).sum().backward()


def test_grads_are_views_of_one_flat_buffer_and_release_frees_it() -> None:
    model = _model()
    buffer = GradBuffer(list(model.parameters()))
    buffer.attach()
    _backward(model)
    flat = buffer.flats[0]
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in model.parameters())
    expected = [p.grad.clone() for p in model.parameters()]

    buffer.release()
    assert buffer.flats == [] and buffer.views == [] and not buffer.allocated
    assert all(p.grad is None for p in model.parameters())

    buffer.attach()  # allocated again, zeroed: the next backward's gradients are exactly the first's
    assert buffer.allocated and all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    _backward(model)
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, want)
        assert p.grad.untyped_storage().data_ptr() == buffer.flats[0].untyped_storage().data_ptr()


def test_zero_after_release_leaves_no_gradient() -> None:
    model = _model()
    buffer = GradBuffer(list(model.parameters()))
    buffer.attach()
    _backward(model)
    buffer.release()
    buffer.zero()  # nothing allocated: nothing to zero, and no gradient appears
    assert all(p.grad is None for p in model.parameters()) and not buffer.allocated


def test_touch_allocates_and_writes_the_buffers_that_the_first_attach_then_uses() -> None:
    """A warm worker touches its buffers before its go; its first step's ``attach`` uses them, zeroed, and the
    gradients are those of a buffer allocated at the first backward."""
    model = _model()
    fresh = GradBuffer(list(model.parameters()))
    fresh.attach()
    _backward(model)
    expected = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None

    buffer = GradBuffer(list(model.parameters()))
    assert buffer.nbytes == 4 * sum(p.numel() for p in model.parameters()) and not buffer.allocated
    assert buffer.touch() == buffer.nbytes and buffer.allocated
    storage = buffer.flats[0].untyped_storage().data_ptr()
    assert all(p.grad is None for p in model.parameters())  # nothing attached yet
    buffer.attach()
    assert buffer.flats[0].untyped_storage().data_ptr() == storage  # the touched buffer, not a new one
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    _backward(model)
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, want)
        assert p.grad.untyped_storage().data_ptr() == storage


def test_the_overlapped_sync_hooks_only_the_parameters_a_sum_waits_for() -> None:
    """At dp = 1 only a tied weight's sum is overlapped: the other parameters get no hook (a hook is a Python call
    per parameter per backward); with replicas every parameter is in a bucket and gets one."""
    from varuna_core.model.stage import TieSet
    from varuna_core.pipeline.overlap import OverlappedSync

    model = _model()
    params = list(model.parameters())
    buffer = GradBuffer(params)
    tie = TieSet(("0.weight", "9.weight"), "0.weight", (0, 1))
    tied_only = OverlappedSync(buffer, [(tie, None, params[0])], None, timeout=1.0, describe=str)
    assert tied_only.active and len(tied_only._hooks) == 1
    tied_only.close()
    nothing = OverlappedSync(buffer, [], None, timeout=1.0, describe=str)
    assert not nothing.active and nothing._hooks == []
    everything = OverlappedSync(buffer, [], object(), timeout=1.0, describe=str)
    assert len(everything._hooks) == len(params)
    everything.close()
