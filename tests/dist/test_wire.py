"""``Varuna(..., wire_dtype=...)``: activations and gradients cross cuts in bf16 or fp16, the stages compute as without it.

One launch of two ranks runs every scenario (starting processes is most of a test's time); each test reads its
runs. The references are plain processes (``tests/reference.py``) whose model rounds the values crossing the
pipeline's cut, and their gradients, to the wire dtype and back, exactly where the pipeline does: so a run with a
wire dtype is compared bit for bit, as the parity tests compare the exact pipeline.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist.harness import run_ranks
from tests.dist.test_parity import TIES, TOL, reference, rel_diff
from tests.dist.worker import make_optimizer
from tests.models import CarryLM, ToyLM, UNetLM, batch
from tests.reference import Layout, train_reference
from varuna_core.model.precision import WIRE_DTYPES, wire_dtype

pytestmark = pytest.mark.dist

BATCH, CHUNK, STEPS = 8, 3, 3
TOY = [(0, 2), (2, 5)]  # ToyLM's and CarryLM's 5 segments on 2 stages: the boundary is cuts.1
UNET = [(0, 3), (3, 6)]  # UNetLM's 6: cuts.2 carries its value with the embedding and cuts.1's value skipping it
BASE = {"schedule": "1f1b", "optimizer": "sgd", "batch": BATCH, "chunk": CHUNK, "steps": STEPS, "partition": TOY}
ACTIVATION = {"rank": 0, "step": 1, "direction": "activation", "factor": 1e6}  # |x| ~ 1 → 1e6 > 65504
GRADIENT = {"rank": 1, "step": 1, "direction": "gradient", "factor": 1e9}  # |g| ~ 1e-2 → 1e7
RUNS = {
    "default": {**BASE, "record": True, "evaluate": 5},  # no wire_dtype keyword at all
    "exact": {**BASE, "wire": "exact", "record": True},
    "bf16": {**BASE, "schedule": "varuna", "wire": "bf16", "record": True, "evaluate": 5},
    "fp16": {**BASE, "wire": "fp16"},
    "carry": {**BASE, "model": "CarryLM", "wire": "fp16", "record": True},
    "unet": {**BASE, "model": "UNetLM", "partition": UNET, "wire": "bf16", "record": True},
    "scaled": {**BASE, "precision": "fp16", "init_loss_scale": 2**10, "wire": "fp16", "blow": ACTIVATION},
    "scaled-exact": {**BASE, "precision": "fp16", "init_loss_scale": 2**10, "blow": ACTIVATION},
    "range-activation": {**BASE, "wire": "fp16", "blow": ACTIVATION},
    "range-gradient": {**BASE, "wire": "fp16", "blow": GRADIENT},
    "range-eval": {**BASE, "wire": "fp16", "steps": 1, "evaluate": 5, "blow": {**ACTIVATION, "step": "eval"}},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, dict]]:
    """Per rank, each scenario's result, from one launch of ``"0;1"``."""
    results = run_ranks({"map": "0;1", "timeout": 60, "runs": list(RUNS.values())}, 2,
                        tmp_path_factory.mktemp("wire"), worker="tests.dist.wire_worker", timeout=240)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    return [dict(zip(RUNS, res.result["runs"], strict=True)) for res in results]


class _Round(torch.autograd.Function):
    """The wire in one process: the value rounded to ``dtype`` and back, and so is its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype).to(grad.dtype), None


def rounded(value, wire: torch.dtype):
    """``value`` as it arrives over a ``wire`` cut: each leaf the wire narrows rounded, the others as they are."""
    def leaf(t):
        narrow = isinstance(t, torch.Tensor) and wire_dtype(t.dtype, wire) != t.dtype
        return _Round.apply(t, wire) if narrow else t

    return torch.utils._pytree.tree_map(leaf, value)


def wire_reference(model_cls, wire: str | None, cut: int, evaluate: int = 0):
    """Losses and parameters of one plain process (summing as 2 stages do) whose ``cuts[cut]`` rounds to ``wire``,
    and with ``evaluate`` the loss of an evaluation of that many examples after training, as ``Varuna.evaluate``
    adds it (each micro-batch's loss weighted by its share, in float64)."""
    torch.manual_seed(0)
    model = model_cls()
    if wire is not None:
        model.cuts[cut].set_hook(lambda _, value: rounded(value, WIRE_DTYPES[wire]))
    losses, params = train_reference(model, lambda ps: make_optimizer("sgd", ps), STEPS,
                                     lambda step: batch(BATCH, seed=100 + step), Layout(BATCH, CHUNK, 1, 2), ties=TIES)
    if not evaluate:
        return losses, params, None
    inputs, total = batch(evaluate, seed=999), torch.zeros((), dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for start in range(0, evaluate, CHUNK):
                n = min(CHUNK, evaluate - start)
                total += model(**{k: v[start:start + n] for k, v in inputs.items()}).double() * (n / evaluate)
    finally:
        torch.set_num_threads(threads)
    return losses, params, float(total * evaluate / evaluate)


def assert_equal(got: dict, losses: torch.Tensor, params: dict[str, torch.Tensor], label: str) -> None:
    assert torch.equal(got["losses"], losses), (label, got["losses"], losses)
    for name, value in got["params"].items():
        assert torch.equal(value, params[name]), (label, name, rel_diff(value, params[name]))


def entries(got: dict, key: str) -> list:
    return [e for e in got["log"] if key in e]


def test_without_a_wire_dtype_the_messages_are_todays(ranks) -> None:
    """No keyword, or ``"exact"``: the same messages to the byte (every leaf in its own dtype), and the pipeline
    equals one plain process bit for bit (the parity tests' reference)."""
    losses, state, _ = reference("sgd", 2, 1)
    for rank, runs in enumerate(ranks):
        default, exact = runs["default"], runs["exact"]
        assert default["wire_dtype"] is None and exact["wire_dtype"] is None
        assert_equal(default, losses, state, f"default rank {rank}")
        assert_equal(exact, losses, state, f"exact rank {rank}")
        sent, sent_exact = entries(default, "sent"), entries(exact, "sent")
        assert len(sent_exact) == STEPS * 3  # a message per micro-batch (3, 3, 2), each way
        for a, b in zip(sent[: len(sent_exact)], sent_exact, strict=True):  # then the default's evaluation's
            assert a["dtypes"] == b["dtypes"] == ["torch.float32"], (rank, a["dtypes"], b["dtypes"])
            assert all(torch.equal(x, y) for x, y in zip(a["values"], b["values"], strict=True))


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_a_wire_dtype_equals_one_process_rounding_at_the_cut(ranks, wire) -> None:
    """Tied embedding on both stages, AdamW-free SGD: every loss and parameter equals one process whose cut rounds
    the activation and its gradient to the wire dtype, bit for bit. The stage computes as without the option: what
    arrives is cast back to fp32, and autograd gets fp32 gradients."""
    losses, state, evaluated = wire_reference(ToyLM, wire, cut=1, evaluate=5 if wire == "bf16" else 0)
    exact_losses, _, _ = wire_reference(ToyLM, None, cut=1)
    assert not torch.equal(losses, exact_losses), "the rounding must change something for the test to see it"
    for rank, runs in enumerate(ranks):
        got = runs[wire]
        assert got["wire_dtype"] == wire
        assert_equal(got, losses, state, f"{wire} rank {rank}")
    if wire == "fp16":
        return
    for rank, runs in enumerate(ranks):
        got, default = runs["bf16"], runs["default"]
        kind = "activation" if rank == 0 else "gradient"  # what this rank sends
        assert {d for e in entries(got, "sent") for d in e["dtypes"]} == {"torch.bfloat16"}, (rank, kind)
        assert {d for e in entries(default, "sent") for d in e["dtypes"]} == {"torch.float32"}, (rank, kind)
        for key in ("arrived", "backward"):  # the receiver's dtypes and the gradients autograd gets
            assert [e[key] if key == "backward" else e["dtypes"] for e in entries(got, key)] == \
                [e[key] if key == "backward" else e["dtypes"] for e in entries(default, key)], (rank, key)
        assert {d for e in entries(got, "arrived") for d in e["dtypes"]} == {"torch.float32"}
        assert got["eval"] == evaluated, (rank, got["eval"], evaluated)  # evaluate() crosses the same wire


def test_integer_bool_and_narrow_leaves_cross_as_they_are(ranks) -> None:
    """CarryLM's cut carries fp32, bf16, int64 and bool leaves: on an fp16 wire only the fp32 leaf is narrowed (and
    its gradient); the bf16 leaf and its gradient stay bf16 (the same bytes, and bf16's range), ids and mask cross
    untouched; the run equals one process rounding only the fp32 leaf."""
    losses, state, _ = wire_reference(CarryLM, "fp16", cut=1)
    for rank, runs in enumerate(ranks):
        got = runs["carry"]
        assert_equal(got, losses, state, f"carry rank {rank}")
        want = ["torch.float16", "torch.bfloat16", "torch.int64", "torch.bool"] if rank == 0 else \
            ["torch.float16", "torch.bfloat16"]  # gradients: of the float leaves only
        assert all(e["dtypes"] == want for e in entries(got, "sent")), (rank, entries(got, "sent")[0]["dtypes"])
        arrived = ["torch.float32", "torch.bfloat16"] + (["torch.int64", "torch.bool"] if rank == 1 else [])
        assert all(e["dtypes"] == arrived for e in entries(got, "arrived")), rank
        if rank == 0:  # the last step's ids, as the batch holds them
            ids = [e["values"][2] for e in entries(got, "sent")[-3:]]
            assert torch.equal(torch.cat(ids, dim=1), batch(BATCH, seed=100 + STEPS - 1)["idx"].t())


class _RoundedUNet(UNetLM):
    """UNetLM as a 2-stage pipeline over ``UNET`` computes it on a bf16 wire: what stage 1 reads from stage 0 (the
    value of cuts.2, the embedding ``h0`` and the value of cuts.1 ``h1`` skipping it) rounded once, gradients too."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = self.pos[: idx.shape[1]]
        h0 = self.emb(idx)
        h1 = self.down1(h0 + pos) + h0
        h2, h0, h1 = rounded((self.down2(h1), h0, h1), torch.bfloat16)
        u2 = self.up2(self.mid(h2)) + h2
        u1 = self.up1(u2) * 0.5 + h1 + (h0 + pos)
        return F.cross_entropy(self.head(u1).reshape(-1, self.head.out_features), targets.reshape(-1))


def test_values_skipping_over_the_cut_cross_in_the_wire_dtype(ranks) -> None:
    """The embedding and cuts.1's value skip over cuts.2 with its value: all three, and their gradients, cross in
    bf16. The first step's loss (the forward alone) equals one process rounding the three where stage 1 reads them,
    bit for bit, and not the exact one's; the later steps are held to the U-Net parity test's tolerance (its root
    ``pos`` is a tied copy on both stages, whose gradients one process adds in another order)."""
    losses, params, _ = wire_reference(_RoundedUNet, None, cut=0)
    exact, _, _ = wire_reference(UNetLM, None, cut=0)
    assert losses[0] != exact[0]
    for rank, runs in enumerate(ranks):
        got = runs["unet"]
        assert all(e["dtypes"] == ["torch.bfloat16"] * 3 for e in entries(got, "sent")), rank
        assert got["losses"][0] == losses[0], (rank, got["losses"], losses)
        assert rel_diff(got["losses"], losses) <= TOL, (rank, got["losses"], losses)
        for name, value in got["params"].items():
            assert rel_diff(value, params[name]) <= TOL, (rank, name)


REPLICA_RUNS = {  # on "0,1": one stage, two replicas
    "reduce-bf16": {**BASE, "partition": None, "reduce": "bf16"},
    "reduce-fp16": {**BASE, "partition": None, "reduce": "fp16", "precision": "fp16", "init_loss_scale": 2**10},
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[dict[str, dict]]:
    results = run_ranks({"map": "0,1", "timeout": 60, "runs": list(REPLICA_RUNS.values())}, 2,
                        tmp_path_factory.mktemp("reduce"), worker="tests.dist.wire_worker", timeout=240)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} failed:\n{res.error or res.output[-3000:]}"
    return [dict(zip(REPLICA_RUNS, res.result["runs"], strict=True)) for res in results]


@pytest.mark.parametrize("reduce", ["bf16", "fp16"])
def test_the_all_reduce_in_a_narrow_dtype_equals_one_process_summing_in_it(replicas, reduce) -> None:
    """Two replicas: each one's gradient rounded to the reduce dtype, the two summed in it (two terms: one rounding,
    whatever the collective's order), cast back; fp16 only under fp16 precision, whose loss scale keeps the sum in
    range. Bit for bit against one process that sums so."""
    run = REPLICA_RUNS[f"reduce-{reduce}"]
    precision = run.get("precision", "fp32")
    torch.manual_seed(0)
    losses, params = train_reference(ToyLM(), lambda ps: make_optimizer("sgd", ps), STEPS,
                                     lambda step: batch(BATCH, seed=100 + step), Layout(BATCH, CHUNK, 2, 1), ties=TIES,
                                     precision=precision, loss_scale=run.get("init_loss_scale"),
                                     reduce_dtype=WIRE_DTYPES[reduce])
    torch.manual_seed(0)
    exact, _ = train_reference(ToyLM(), lambda ps: make_optimizer("sgd", ps), STEPS,
                               lambda step: batch(BATCH, seed=100 + step), Layout(BATCH, CHUNK, 2, 1), ties=TIES,
                               precision=precision, loss_scale=run.get("init_loss_scale"))
    assert not torch.equal(losses, exact), "the narrow sum must change something for the test to see it"
    for rank, runs in enumerate(replicas):
        got = runs[f"reduce-{reduce}"]
        assert not got["overflows"].any(), rank
        assert_equal(got, losses, params, f"reduce {reduce} rank {rank}")


def test_an_fp16_overflow_on_the_wire_skips_the_step_on_every_rank(ranks) -> None:
    """fp16 precision: an activation made 1e6 times larger on stage 0 at step 1 (its value, not its gradient)
    overflows the fp16 wire; every rank skips the step, the loss scale halves, the next step trains. Through an
    exact wire the same activation is fine (the next stage's LayerNorm runs in fp32): the overflow is the wire's."""
    for rank, runs in enumerate(ranks):
        got, exact = runs["scaled"], runs["scaled-exact"]
        assert got["overflows"].tolist() == [False, True, False], rank
        assert got["scales"].tolist() == [2.0**10, 2.0**10, 2.0**9, 2.0**9], rank
        assert torch.isfinite(got["losses"][2]), rank
        counts = [c[0] for c in got["counts"]]  # activations that overflowed, per step
        assert (counts[1] > 0) == (rank == 0) and counts[0] == counts[2] == 0, (rank, got["counts"])
        assert not exact["overflows"].any() and exact["scales"].tolist() == [2.0**10] * 4, rank


@pytest.mark.parametrize(("run", "what", "arrow"), [("range-activation", "activation", "stage 0 → 1"),
                                                    ("range-gradient", "gradient", "stage 1 → 0"),
                                                    ("range-eval", "activation", "stage 0 → 1")])
def test_fp16_wire_out_of_range_is_an_error_on_every_rank(ranks, run, what, arrow) -> None:
    """fp32 precision, fp16 wire, a value beyond 65504 crossing: not a silent inf, but a ``WireRangeError`` on both
    ranks (agreed in the step's all-reduce, so no rank waits for another), naming the cut and the direction."""
    for rank, runs in enumerate(ranks):
        got = runs[run]
        error = got.get("error", "")
        assert error.startswith("WireRangeError: wire_dtype='fp16'"), (rank, error)
        assert f"{what} message(s) crossing CutPoint 'cuts.1' ({arrow})" in error, (rank, error)
        assert "use wire_dtype='bf16'" in error, error
        assert ("evaluate()" in error) == (run == "range-eval"), error
        assert len(got["losses"]) == 1, (rank, got["losses"])  # the step before
