"""Models built on ``meta``: every rank allocates and initialises only its stage, and training equals one plain
process that built the same model with ``materialize(model, seed=...)`` (fp32, every step's loss and every
parameter, relative difference ≤ 1e-5) at pp 1/2/4 × dp 1/2 -- the values do not depend on the layout.

Models: ``ToyLM`` (CutPoints, a tied embedding, a root-level parameter with its own initialiser) and Hugging
Face GPT-2 and Llama with ``cutpoints="auto"`` (whose start-up validation then runs the unsliced model on
values made as each op reads them). And pretrained weights: a sharded Hugging Face directory loaded per stage
gives the first step the loss of ``from_pretrained``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import hf_models
from tests.dist.harness import run_ranks, train_plain
from tests.dist.test_hf_parity import param_diff
from tests.dist.test_parity import assert_equal_buffers, rel_diff
from tests.dist.worker import make_optimizer
from tests.models import ToyLM, batch, init_toy
from varuna_core import materialize, meta_init

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]')")

BATCH, CHUNK, STEPS, SEED, TOL = 8, 2, 3, 1234, 1e-5
MODELS = ("ToyLM", "hf-gpt2", "hf-llama")
RUNS = [{"model": "ToyLM", "schedule": "varuna", "chunk": 3},
        {"model": "hf-gpt2", "schedule": "1f1b", "chunk": CHUNK},
        {"model": "hf-llama", "schedule": "gpipe", "chunk": CHUNK}]
LAYOUTS = {"pp1 dp1": ("0", 1), "pp2 dp1": ("0;1", 2), "pp1 dp2": ("0,1", 2), "pp4 dp1": ("0;1;2;3", 4),
           "pp2 dp2": ("0,2;1,3", 4)}


def build(name: str) -> tuple[torch.nn.Module, object]:
    """The model on meta and its initialiser."""
    with meta_init():
        if name == "ToyLM":
            return ToyLM(), init_toy
        return hf_models.build(name[3:]), None


def make_batch(name: str, n: int, seed: int) -> dict:
    return batch(n, seed) if name == "ToyLM" else hf_models.batch(name[3:], n, seed)


def loss_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """One plain process: the model built on meta and materialised whole with the workers' seed, trained."""
    model, init = build(name)
    materialize(model, seed=SEED, init=init)
    opt = make_optimizer("sgd", model.parameters())
    buffers: dict[str, torch.Tensor] = {}
    losses, params = train_plain(model, opt, STEPS, lambda step: loss_of(model(**make_batch(name, BATCH, 100 + step))),
                                 buffers)
    return losses, {**params, **buffers}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_built_models_train_as_one_materialised_process(layout, tmp_path) -> None:
    stage_map, world = LAYOUTS[layout]
    runs = [{**run, "meta": True, "optimizer": "sgd", "batch": BATCH, "steps": STEPS, "varuna_seed": SEED}
            for run in RUNS]
    results = run_ranks({"map": stage_map, "timeout": 120, "runs": runs}, world, tmp_path, timeout=300)
    for res in results:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, run in enumerate(runs):
        want_losses, want_params = reference(run["model"])
        seen: set[str] = set()
        for res in results:
            got = res.result["runs"][index]
            label = f"{layout} {run['model']} rank {got['stage']}/{got['replica']}"
            assert rel_diff(got["losses"], want_losses) <= TOL, (label, got["losses"], want_losses)
            for pname, value in got["params"].items():
                assert param_diff(value, want_params[pname]) <= TOL, (label, pname)
                seen.add(pname)
            assert_equal_buffers(got, want_params, label)
            # nothing but the stage was ever given memory: the rank's real parameters are its stage's
            assert got["held_bytes"] == got["stage_bytes"], (label, got["held_bytes"], got["stage_bytes"])
            if world // (2 if "dp2" in layout else 1) > 1:
                assert got["held_bytes"] < 0.75 * got["full_bytes"], label
        every = {n for n, _ in build(run["model"])[0].named_parameters()}
        assert every <= seen, (layout, run["model"], sorted(every - seen)[:5])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """GPT-2 and Llama saved by ``save_pretrained`` in several safetensors shards (GPT-2 without its tied head)."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name in ("gpt2", "llama"):
        torch.manual_seed(5)
        model = hf_models.build(name)
        model.save_pretrained(root / name, max_shard_size="40KB", safe_serialization=True)
        assert (root / name / "model.safetensors.index.json").exists()
        out[name] = root / name
    return out


@pytest.mark.parametrize(("stage_map", "world"), [("0;1", 2), ("0;1;2;3", 4)])
def test_pretrained_sharded_weights_load_per_stage(sharded, stage_map, world, tmp_path) -> None:
    runs = [{"model": f"hf-{name}", "meta": True, "weights": str(sharded[name]), "schedule": "1f1b",
             "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": 1} for name in ("gpt2", "llama")]
    results = run_ranks({"map": stage_map, "timeout": 120, "runs": runs}, world, tmp_path, timeout=300)
    for res in results:
        assert res.returncode == 0, res.error or res.output[-3000:]
    for index, name in enumerate(("gpt2", "llama")):
        cls = type(hf_models.build(name))
        plain = cls.from_pretrained(sharded[name])
        with torch.no_grad():
            want = plain(**hf_models.batch(name, BATCH, 100)).loss.item()
        for res in results:
            got = res.result["runs"][index]["losses"][0].item()
            assert abs(got - want) <= TOL * abs(want), (name, got, want)
