"""Hugging Face models with ``cutpoints="auto"``: GPT-2, BERT (masked LM), a Llama-style model and RWKV, built from
configs and never edited, trained pipelined equal the same models trained in one plain process (fp32: the
loss of every step and every parameter, relative difference ≤ 1e-5), tied weights found without being
declared; and with dropout, the masks do not depend on the pipeline depth or the data-parallel width."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import hf_models
from tests.dist.harness import run_ranks, train_plain
from tests.dist.test_parity import assert_equal_buffers, rel_diff

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]')")

BATCH, CHUNK, STEPS, TOL = 8, 2, 3, 1e-5


def param_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference, against at least 1e-3: BERT's key bias starts at zero and its gradient is zero in
    exact arithmetic, so both runs hold rounding noise of 1e-14 there, which is as equal as zero can be."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-3)).item()


def optimizer(params):
    """SGD with momentum (the workers' "sgd"). Not Adam: GPT-2's key bias gets a gradient that is zero in exact
    arithmetic (softmax ignores a constant per row), so what it gets is rounding, which Adam's normalisation
    turns into ±lr steps whose sign differs between any two summation orders."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """Losses and final state (parameters and buffers) of the model trained by one plain process (no library)."""
    torch.manual_seed(0)
    model = hf_models.build(name)
    opt = optimizer(model.parameters())
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_plain(model, opt, STEPS, lambda step: model(**hf_models.batch(name, BATCH, 100 + step)).loss,
                                 buffers)
    return losses, {**params, **buffers}


def runs(dropout: float = 0.0) -> list[dict]:
    return [{"model": f"hf-{name}", "schedule": schedule, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "dropout": dropout}
            for name, schedule in (("gpt2", "varuna"), ("bert", "1f1b"), ("llama", "gpipe"))]


@pytest.mark.parametrize(("stage_map", "world"), [("0,2;1,3", 4), ("0;1;2;3", 4)])
def test_hf_models_pipelined_equal_one_plain_process(stage_map, world, tmp_path) -> None:
    results = run_ranks({"map": stage_map, "timeout": 120, "runs": runs()}, world, tmp_path, timeout=300)
    assert_equal_one_process(results, hf_models.NAMES, reference)


def assert_equal_one_process(results, names, reference_of) -> None:
    """Every rank succeeded, and run ``i`` (model ``names[i]``) equals ``reference_of(name)`` in every loss, in
    every parameter (each held by some rank) and in every buffer."""
    for res in results:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, name in enumerate(names):
        want_losses, want_params = reference_of(name)
        seen: set[str] = set()
        for res in results:
            got = res.result["runs"][index]
            assert rel_diff(got["losses"], want_losses) <= TOL, (name, got["losses"], want_losses)
            for pname, value in got["params"].items():
                assert param_diff(value, want_params[pname]) <= TOL, (name, pname)
                seen.add(pname)
            assert_equal_buffers(got, want_params, name)
        every = {n for n, p in hf_models.build(name).named_parameters()}
        assert every <= seen, (name, sorted(every - seen)[:5])  # every parameter lives on some stage


def test_dropout_masks_do_not_depend_on_the_layout(tmp_path) -> None:
    """GPT-2 and BERT with dropout 0.1: 2 stages x 2 replicas draw exactly the masks of one process."""
    def losses(stage_map: str, world: int) -> list[torch.Tensor]:
        done = run_ranks({"map": stage_map, "timeout": 120, "runs": runs(dropout=0.1)[:2]}, world,
                         tmp_path / stage_map.replace(";", "_").replace(",", "-"), timeout=300)
        for res in done:
            assert res.returncode == 0, res.error or res.output[-3000:]
        return [run["losses"] for run in done[0].result["runs"]]

    alone, pipelined = losses("0", 1), losses("0,2;1,3", 4)
    for a, b in zip(alone, pipelined):
        assert rel_diff(b, a) <= TOL, (a, b)


@functools.lru_cache(maxsize=None)
def seq2seq_reference(name: str, dropout: float = 0.0):
    torch.manual_seed(0)
    model = hf_models.build(name, dropout=dropout)
    opt = optimizer(model.parameters())
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_plain(model, opt, STEPS, lambda step: model(**hf_models.batch(name, BATCH, 100 + step)).loss,
                                 buffers)
    return losses, {**params, **buffers}


@pytest.mark.parametrize(("stage_map", "world"), [("0;1", 2), ("0,2;1,3", 4), ("0;1;2;3", 4)])
def test_encoder_decoder_models_pipelined_equal_one_plain_process(stage_map, world, tmp_path) -> None:
    """T5 and BART (ForConditionalGeneration) with cutpoints="auto": cuts in the encoder's and the decoder's
    blocks, the encoder's output (and T5's shared position biases) carried to every decoder stage."""
    runs = [{"model": f"hf-{name}", "schedule": schedule, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS} for name, schedule in (("t5", "1f1b"), ("bart", "varuna"))]
    results = run_ranks({"map": stage_map, "timeout": 120, "runs": runs}, world, tmp_path, timeout=300)
    assert_equal_one_process(results, hf_models.SEQ2SEQ, seq2seq_reference)


def test_layer_type_patterns_pipelined_equal_one_plain_process(tmp_path) -> None:
    """ModernBERT (full, sliding, sliding, full attention) and Gemma 3 (sliding, full, full, sliding): each
    block takes the mask of its type, computed once before the loop; no cut carries a mask (see [Note:
    loop-carried]), every stage builds its own, and two stages train as one process."""
    runs = [{"model": f"hf-{name}", "schedule": schedule, "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS} for name, schedule in (("modernbert", "varuna"), ("gemma3", "1f1b"))]
    results = run_ranks({"map": "0;1", "timeout": 120, "runs": runs}, 2, tmp_path, timeout=300)
    assert_equal_one_process(results, hf_models.PATTERNED, reference)


def test_a_model_computing_otherwise_outside_training_trains_pipelined_and_is_refused_in_eval_mode(tmp_path) -> None:
    """RWKV keeps a recurrent state outside training (``use_cache`` in eval mode) and passes it through every
    block: discovery in eval mode recorded that other computation, so validation refused the model at pp=2 (and
    without validation rank 0 died in ``step`` while rank 1 waited for its timeout). Discovery runs in training
    mode: 2 stages with ``cutpoints="auto"`` and validation train like one plain process, and ``evaluate()`` after
    ``.eval()`` raises on every rank a CutPointError naming the cut that carries another value there."""
    runs = [{"model": "hf-rwkv", "schedule": "varuna", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK,
             "steps": STEPS, "evaluate": BATCH, "evaluate_in_eval_mode": True}]
    results = run_ranks({"map": "0;1", "timeout": 120, "runs": runs}, 2, tmp_path, timeout=300)
    assert_equal_one_process(results, ["rwkv"], reference)
    for res in results:
        got = res.result["runs"][0]
        assert "eval_mode" not in got, "evaluate() ran in eval mode"
        error = got["eval_mode_error"]
        assert error.startswith("CutPointError") and "eval mode" in error and "CutPoint" in error, error
