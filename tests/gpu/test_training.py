"""Training on one GPU equals one plain CUDA process that adds micro-batch by micro-batch (``tests/reference.py`` on
the device): every loss, parameter and buffer ``torch.equal``, in fp32, bf16 and fp16, for every schedule, a model
with CutPoints, one cut automatically, and one built on meta. Every batch is given on the CPU: the library moves
it."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import (
    BATCH,
    DEVICE,
    STEPS,
    TOY,
    Case,
    assert_equal_to_reference,
    gpt_case,
    reference,
    sgd,
    state_of,
    train,
)
from tests.models import SHARED, SequentialLM, ToyLM, batch, init_toy
from tests.reference import Layout
from varuna_core import Varuna, materialize, meta_init

CASES = {"ToyLM": lambda: TOY, "GPT": gpt_case}


def _run(case, steps=STEPS, precision="fp32", loss_scale=None, **kw):
    """``case`` trained by ``Varuna`` at pp=1 and by the reference on the same device; both compared."""
    vm = Varuna(case.build(), "0", case.batch_at(2, 99), batch_size=BATCH, chunk_size=case.chunk,
                shared_weights=case.ties, precision=precision, **kw)
    assert vm.device.type == DEVICE
    assert {p.device.type for p in vm.parameters()} == {DEVICE}
    opt = sgd(list(vm.parameters()))
    vm.set_optimizer(opt, **({"loss_scale": loss_scale} if loss_scale is not None else {}))
    losses, overflows = train(vm, opt, steps, case.batch_at)
    assert not any(overflows)
    ref_losses, ref_state = reference(case.build(), steps, case.batch_at, Layout(BATCH, case.chunk), case.ties,
                                      vm.device, precision=precision, loss_scale=loss_scale)
    assert_equal_to_reference(losses, state_of(vm), ref_losses, ref_state)
    return vm


@pytest.mark.parametrize("schedule", ["varuna", "1f1b", "gpipe"])
@pytest.mark.parametrize("model", list(CASES))
@pytest.mark.parametrize("device", ["default", "named"])
def test_pp1_equals_the_plain_process(model, schedule, device) -> None:
    """``device`` left at its default (``-1``: the GPU of ``LOCAL_RANK`` where CUDA is) or named."""
    kw = {} if device == "default" else {"device": DEVICE}
    _run(CASES[model](), schedule=schedule, **kw)


def test_evaluate_equals_the_plain_forward() -> None:
    vm = Varuna(TOY.build(), "0", batch(2, 99), batch_size=BATCH, chunk_size=3, shared_weights=SHARED, device=DEVICE)
    inputs = batch(7, 3)
    got = vm.evaluate(inputs)
    assert inputs["idx"].device.type == "cpu"
    plain = TOY.build().to(DEVICE)
    with torch.no_grad():
        want = plain(**{k: v.to(DEVICE) for k, v in inputs.items()})
    assert got == pytest.approx(float(want), rel=1e-6)  # micro-batches of 3, 3, 1 against one forward of 7


def test_auto_cutpoints_with_validation() -> None:
    """``cutpoints="auto"`` on a model without CutPoints; start-up validation (on by default) runs on the device."""
    def build():
        torch.manual_seed(0)
        return SequentialLM()

    _run(Case("SequentialLM", build, batch, (), 3), steps=2, cutpoints="auto")


def test_hf_gpt2_auto_cutpoints() -> None:
    pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]')")
    from tests import hf_models

    def build():
        torch.manual_seed(0)
        return hf_models.build("gpt2")

    _run(Case("hf-gpt2", build, lambda n, s: hf_models.batch("gpt2", n, s), (), 2), steps=2,
         cutpoints="auto")


@pytest.mark.parametrize("model", list(CASES))
@pytest.mark.parametrize("precision, loss_scale", [("bf16", None), ("fp16", 1024.0)])
def test_mixed_precision_equals_plain_autocast(model, precision, loss_scale) -> None:
    """bf16, and fp16 with a fixed loss scale: the reference runs under ``torch.autocast`` of the device and
    scales and unscales as the pipeline does."""
    _run(CASES[model](), precision=precision, loss_scale=loss_scale, device=DEVICE)


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_overflow_is_reported_and_skipped(dynamic) -> None:
    """A loss scale so large that every fp16 gradient overflows: the step says so, the parameters stay as they
    were, and a dynamic scale halves (a fixed one stays)."""
    vm = Varuna(TOY.build(), "0", batch(2, 99), batch_size=BATCH, chunk_size=3, shared_weights=SHARED,
                precision="fp16", device=DEVICE)
    opt = sgd(list(vm.parameters()))
    huge = 2.0**100
    if dynamic:
        vm.set_optimizer(opt, loss_scale="dynamic", init_loss_scale=huge)
    else:
        vm.set_optimizer(opt, loss_scale=huge)
    before = state_of(vm)
    _, overflow = vm.step(batch(BATCH, 0))
    assert overflow is True
    opt.zero_grad()
    after = state_of(vm)
    assert [n for n in before if not torch.equal(before[n], after[n])] == []
    assert vm.get_loss_scale() == (huge / 2 if dynamic else huge)


def test_meta_built_model_materialised_on_the_device() -> None:
    """Built on meta, allocated and initialised by ``Varuna(seed=, init=)`` on the device: it trains as the same
    model materialised whole (``materialize(..., seed=, init=)``) by the plain process."""
    seed = 1234

    def on_meta():
        with meta_init():
            return ToyLM()

    vm = Varuna(on_meta(), "0", batch(2, 99), batch_size=BATCH, chunk_size=3, shared_weights=SHARED, seed=seed,
                init=init_toy, device=DEVICE)
    assert {p.device.type for p in vm.parameters()} == {DEVICE}
    opt = sgd(list(vm.parameters()))
    vm.set_optimizer(opt)
    losses, _ = train(vm, opt, STEPS, batch)
    plain = materialize(on_meta(), seed=seed, init=init_toy, device=vm.device)
    ref_losses, ref_state = reference(plain, STEPS, batch, Layout(BATCH, 3), SHARED, vm.device)
    assert_equal_to_reference(losses, state_of(vm), ref_losses, ref_state)
