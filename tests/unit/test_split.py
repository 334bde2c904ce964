"""The split backward (``varuna_core.model.split``): B computes input gradients, W the weights', and together
they give every gradient of an unsplit backward bit for bit (compared as bits, so that even the sign of a zero
counts), in fp32 and under bf16 autocast, accumulated over micro-batches into ``.grad`` tensors that may be
views of a flat buffer."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from varuna_core.errors import ConfigError, InternalError
from varuna_core.model.split import SplitRoute, WeightGrads, splitting

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"


# ----------------------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (equal bits: equal values, zeros of equal sign)."""
    kind = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(kind)


def assert_same(a: list[torch.Tensor | None], b: list[torch.Tensor | None], what: str = "") -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x is None) == (y is None), f"{what}[{i}]: one gradient is missing"
        if x is None or y is None:
            continue
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{what}[{i}]: {x.dtype, x.shape} vs {y.dtype, y.shape}"
        assert torch.equal(bits(x), bits(y)), f"{what}[{i}]: max difference {(x.double() - y.double()).abs().max()}"


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """Every ``.grad`` a zeroed view of one flat buffer (as ``pipeline.grads.GradBuffer`` attaches them)."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def autocast(on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def train(model: nn.Module, batches: list[tuple], *, split: bool, amp: bool = False, flat: bool = False,
          w_order: list[int] | None = None, loss: Callable | None = None, route: SplitRoute | None = None) -> dict:
    """Forward and backward of each micro-batch in order (W after all Bs, in ``w_order``; default: each W right
    after its B); returns the parameters' ``.grad`` and the inputs' gradients, and the stores' sizes."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if flat:
        flat_grads(params)
    views = [p.grad for p in params]
    loss = loss or (lambda out: out.float().square().mean())
    stores, input_grads, entries = [], [], []
    for batch in batches:
        inputs = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in batch)
        store = WeightGrads()
        with splitting(store, route) if split else contextlib.nullcontext(), autocast(amp):
            out = model(*(t * 1 if t.is_floating_point() else t for t in inputs))  # inputs reach ops as non-leaves
        loss(out).backward()
        input_grads += [t.grad for t in inputs if t.is_floating_point()]
        entries.append(len(store))
        stores.append(store)
        if w_order is None:
            store.run()
    for k in w_order or []:
        stores[k].run()
    if flat:  # added to in place: each .grad is still the view it was
        assert all(p.grad is view for p, view in zip(params, views, strict=True))
    return {"params": [p.grad.clone() if p.grad is not None else None for p in params], "inputs": input_grads,
            "entries": entries}


def check(make_model: Callable[[], nn.Module], batches: list[tuple], *, amp: bool = False, flat: bool = False,
          split_ops: int | None = None, **kw) -> dict:
    """Split and unsplit runs of ``make_model()`` give equal bits; returns the split run."""
    plain = train(make_model(), batches, split=False, amp=amp, flat=flat, **kw)
    split = train(make_model(), batches, split=True, amp=amp, flat=flat, **kw)
    assert_same(plain["params"], split["params"], "params")
    assert_same(plain["inputs"], split["inputs"], "inputs")
    if "route" not in kw:  # the executor's way: a route (hooked linears, the module route after the first block)
        routed = train(make_model(), batches, split=True, amp=amp, flat=flat, route=SplitRoute(), **kw)
        assert_same(plain["params"], routed["params"], "params (routed)")
        assert_same(plain["inputs"], routed["inputs"], "inputs (routed)")
    if split_ops is None:
        assert all(n > 0 for n in split["entries"]), "nothing was split"
    else:
        assert split["entries"] == [split_ops] * len(batches)
    return split


def seeded(make: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return make()
    return build


def batches_of(shape: tuple[int, ...], n: int = 3, transposed: bool = False) -> list[tuple]:
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(100 + k)
        if transposed:  # the same values, the last two dims swapped in memory: a non-contiguous input
            x = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).transpose(-1, -2)
        else:
            x = torch.randn(*shape, generator=g)
        out.append((x,))
    return out


class Chain(nn.Module):
    """Linear → GELU → Linear (→ its output), with optional bias."""

    def __init__(self, d_in: int = 24, d_hidden: int = 40, d_out: int = 16, bias: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, d_hidden, bias=bias)
        self.b = nn.Linear(d_hidden, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


# ----------------------------------------------------------------------------------------------------------
# nn.Linear / F.linear


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(12, 24), (3, 5, 24), (2, 3, 4, 24)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_linear_equals_unsplit(shape, bias, amp, transposed) -> None:
    check(seeded(lambda: Chain(bias=bias)), batches_of(shape, transposed=transposed), amp=amp, split_ops=2)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_larger_layers_and_flat_gradient_buffer(amp) -> None:
    """Sizes where the matmul kernels block and vectorise; ``.grad`` views of one flat buffer keep their
    identity and are added to in place."""
    check(seeded(lambda: Chain(256, 512, 192)), batches_of((4, 64, 256), n=2), amp=amp, flat=True, split_ops=2)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_accumulates_into_existing_grads(amp) -> None:
    check(seeded(lambda: Chain()), batches_of((6, 7, 24), n=3), amp=amp, flat=True, split_ops=2)


def test_column_major_input_and_non_contiguous_weight() -> None:
    """The column-major branches of torch's mm backward formulas: a 2-D input stored transposed, and a weight
    that is the transpose of a contiguous tensor."""
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 16).t())  # [16, 24], column-major
            self.b = nn.Parameter(torch.randn(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.t().contiguous().t(), self.w, self.b)

    for amp in (False, True):
        split = check(seeded(Odd), batches_of((10, 24)), amp=amp, split_ops=1)
        assert split["params"][0].shape == (16, 24)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_first_op_input_without_grad(amp) -> None:
    """The stage's first op: its input needs no gradient (only the weights get one)."""
    model = seeded(lambda: Chain())
    batches = batches_of((4, 5, 24))
    runs = []
    for split in (False, True):
        m = model()
        for p in m.parameters():
            p.grad = None
        for (x,) in batches:
            store = WeightGrads()
            with splitting(store) if split else contextlib.nullcontext(), autocast(amp):
                out = m(x)  # x requires no gradient
            out.float().square().sum().backward()
            assert len(store) == (2 if split else 0)
            store.run()
        runs.append([p.grad.clone() for p in m.parameters()])
    assert_same(runs[0], runs[1])


def test_bf16_and_fp64_parameters() -> None:
    for dtype in (torch.bfloat16, torch.float64):
        batches = [(x.to(dtype),) for (x,) in batches_of((3, 5, 24))]
        check(seeded(lambda dtype=dtype: Chain().to(dtype)), batches, split_ops=2)


def test_functional_linear_in_user_code() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 24) * 0.1)
            self.b = nn.Parameter(torch.randn(16) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(input=x, weight=self.w, bias=self.b) + F.linear(x, weight=self.w)

    for amp in (False, True):
        check(seeded(Functional), batches_of((3, 4, 24)), amp=amp, split_ops=2)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_frozen_weights_and_biases(amp) -> None:
    def frozen_weight() -> nn.Module:
        m = Chain()
        m.a.weight.requires_grad_(False)  # not split: its bias's gradient comes in B
        return m

    def frozen_bias() -> nn.Module:
        m = Chain()
        m.a.bias.requires_grad_(False)
        return m

    check(seeded(frozen_weight), batches_of((3, 4, 24)), amp=amp, split_ops=1)
    check(seeded(frozen_bias), batches_of((3, 4, 24)), amp=amp, split_ops=2)


# ----------------------------------------------------------------------------------------------------------
# F.embedding


class Embed(nn.Module):
    def __init__(self, padding_idx: int | None = None, scale: bool = False, head: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24, padding_idx=padding_idx, scale_grad_by_freq=scale)
        self.out = nn.Linear(24, 8) if head else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.out(h) if self.out is not None else h


def id_batches(n: int = 3) -> list[tuple]:
    out = []
    for k in range(n):
        idx = torch.randint(50, (4, 9), generator=torch.Generator().manual_seed(k))
        idx[0, :4] = 7  # repeated ids: their gradients are summed
        idx[1, 0] = 0
        idx[1, 1] = 49
        out.append((idx,))
    return out


@pytest.mark.parametrize("padding_idx", [None, 0, 7, -1], ids=["nopad", "pad0", "pad7", "pad-1"])
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "scaled"])
def test_embedding_equals_unsplit(padding_idx, scale) -> None:
    check(seeded(lambda: Embed(padding_idx, scale)), id_batches(), flat=True, split_ops=1)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_embedding_then_linear(amp) -> None:
    check(seeded(lambda: Embed(3, head=True)), id_batches(), amp=amp, flat=True, split_ops=2)


# ----------------------------------------------------------------------------------------------------------
# tied weights, weights used elsewhere


class TiedHead(nn.Module):
    """An embedding whose weight is also the output head (``F.linear(h, wte.weight)``), GPT style."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(40, 24)
        self.mix = nn.Linear(24, 24)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.wte(idx)))
        return F.linear(h, self.wte.weight)


class Shared(nn.Module):
    """One Linear applied three times (ALBERT-style shared layers): under autocast its three uses share one
    cached cast, whose bf16 gradients are summed before the cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.layer(x))
        return x


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_tied_embedding_and_head(amp) -> None:
    check(seeded(TiedHead), [(idx[:, :6] % 40,) for (idx,) in id_batches()], amp=amp, flat=True, split_ops=3)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_one_weight_in_three_linears(amp) -> None:
    check(seeded(Shared), batches_of((4, 6, 24)), amp=amp, flat=True, split_ops=3)


class UsedElsewhere(nn.Module):
    """A Linear whose weight (and bias) other ops use too, before or after the Linear."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 24)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        if self.where == "before":  # the first use is not split: the Linear then runs unsplit
            y = x @ w.t()
            return self.lin(y) + self.lin.bias.sum()
        if self.where == "after":  # split first: the later uses queue their gradients for W too
            y = self.lin(x)
            return y * w.square().sum() + torch.matmul(y, w) + self.lin.bias
        y = self.lin(x)  # "matmul": a low-precision op under autocast gets the cached cast's alias
        return torch.matmul(y, w.t()) + F.linear(y[0, 0], w)  # a 1-D input: F.linear unsplit, on the alias


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["before", "after", "matmul"])
def test_weight_used_elsewhere(where, amp) -> None:
    # before: nothing is split; after: the Linear and three other uses; matmul: the Linear and two other uses
    check(seeded(lambda: UsedElsewhere(where)), batches_of((3, 5, 24)), amp=amp, flat=True,
          split_ops={"before": 0, "after": 4, "matmul": 3}[where])


# ----------------------------------------------------------------------------------------------------------
# order of W, hooks, memory, interception


def test_w_in_another_order() -> None:
    """Ws run in another order than the Bs: each micro-batch's part is exact, and the parts are added to .grad
    in W's order, as an unsplit run of the micro-batches in that order adds them."""
    batches = batches_of((3, 5, 24), n=3)
    make = seeded(lambda: Chain())
    split = train(make(), batches, split=True, w_order=[2, 0, 1])
    plain = train(make(), [batches[k] for k in (2, 0, 1)], split=False)
    assert_same(plain["params"], split["params"])
    in_order = train(make(), batches, split=True, w_order=[0, 1, 2])
    assert_same(train(make(), batches, split=False)["params"], in_order["params"])


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_hooks_see_the_same_values(amp) -> None:
    """A tensor hook on a (tied) weight is called with the same gradient, once per backward and in W (never with
    None in B); a post-accumulate hook sees the same ``.grad``."""
    batches = [(idx[:, :6] % 40,) for (idx,) in id_batches(2)]
    seen: dict[bool, dict[str, list]] = {}
    for split in (False, True):
        model = seeded(TiedHead)()
        calls: dict[str, list] = {"hook": [], "post": []}
        model.wte.weight.register_hook(lambda g, calls=calls: calls["hook"].append(g.clone()))
        model.mix.bias.register_post_accumulate_grad_hook(lambda p, calls=calls: calls["post"].append(p.grad.clone()))
        for (idx,) in batches:
            store = WeightGrads()
            with splitting(store) if split else contextlib.nullcontext(), autocast(amp):
                out = model(idx)
            before = {k: len(v) for k, v in calls.items()}
            out.float().square().mean().backward()
            if split:
                assert {k: len(v) for k, v in calls.items()} == before  # nothing in B
                store.run()
            assert {k: len(v) - before[k] for k, v in calls.items()} == {"hook": 1, "post": 1}
        seen[split] = calls
    assert_same(seen[False]["hook"], seen[True]["hook"])
    assert_same(seen[False]["post"], seen[True]["post"])


def test_no_hook_call_in_b() -> None:
    model = seeded(lambda: Chain())()
    calls: list = []
    model.a.weight.register_hook(lambda g: calls.append(g))
    model.a.weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    store = WeightGrads()
    with splitting(store):
        out = model(torch.randn(3, 24))
    out.sum().backward()
    assert calls == [] and model.a.weight.grad is None and model.b.weight.grad is None
    store.run()
    assert len(calls) == 2 and model.a.weight.grad is not None


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_nbytes_is_the_saved_inputs_and_output_gradients(amp) -> None:
    model = seeded(lambda: Chain())()
    x = torch.randn(4, 5, 24)
    store = WeightGrads()
    with splitting(store), autocast(amp):
        out = model(x)
    assert len(store) == 0 and store.nbytes == 0
    out.float().square().sum().backward()  # fresh output gradients (a sum's would be an expanded scalar)
    size = 2 if amp else 4
    saved = 4 * 5 * (24 + 40) * size  # the inputs of both matmuls (cast under autocast)
    gradients = 4 * 5 * (40 + 16) * size  # the gradients of their outputs
    assert len(store) == 2 and store.nbytes == saved + gradients
    store.run()
    assert len(store) == 0 and store.nbytes == 0
    store.run()  # a second run does nothing


def test_graph_freed_after_b() -> None:
    """B frees the graph's saved tensors as usual (the split nodes' too); the store keeps only what W needs."""
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    store = WeightGrads()
    with splitting(store):
        h = torch.sigmoid(lin1(torch.randn(3, 8)))
        out = lin2(h * 2)
    sigmoid, split_node = h.grad_fn, out.grad_fn
    assert sigmoid._saved_result is not None and len(split_node.saved_tensors) == 2
    out.sum().backward()
    for freed in (lambda: sigmoid._saved_result, lambda: split_node.saved_tensors):
        with pytest.raises(RuntimeError, match="after they have already been freed"):
            freed()
    assert len(store) == 2
    store.run()


def test_no_interception_outside_the_block_or_without_grad() -> None:
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    store = WeightGrads()
    assert type(lin(x).grad_fn).__name__ == "AddmmBackward0"
    with splitting(store):
        assert "Split" in type(lin(x).grad_fn).__name__
        with torch.no_grad():
            assert lin(x).grad_fn is None
        with torch.inference_mode():
            assert lin(torch.randn(3, 8)).grad_fn is None
        meta = nn.Linear(8, 4, device="meta")
        assert type(meta(torch.randn(3, 8, device="meta")).grad_fn).__name__ == "AddmmBackward0"
    assert type(lin(x).grad_fn).__name__ == "AddmmBackward0"
    assert len(store) == 0


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_recompute(amp) -> None:
    """A forward without graph (not intercepted), then the recompute with graph under ``splitting``: R → B → W."""
    make = seeded(lambda: Chain())
    batches = batches_of((3, 5, 24), n=2)
    reference = train(make(), batches, split=False, amp=amp)
    model = make()
    for (x,) in batches:
        store = WeightGrads()
        with splitting(store), torch.no_grad(), autocast(amp):
            model(x)
        assert len(store) == 0
        xr = x.detach().requires_grad_()
        with splitting(store), autocast(amp):
            out = model(xr * 1)
        out.float().square().mean().backward()
        store.run()
    assert_same(reference["params"], [p.grad for p in model.parameters()])


def test_partial_backward_defers_nothing() -> None:
    """``autograd.grad`` for the input only (no weight gradients wanted) queues no W work, as the unsplit
    backward computes no weight gradient."""
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    store = WeightGrads()
    with splitting(store):
        out = lin(x * 1)
    (gx,) = torch.autograd.grad(out.sum(), [x])
    assert len(store) == 0 and lin.weight.grad is None
    (ref,) = torch.autograd.grad(lin(x * 1).sum(), [x])
    assert_same([ref], [gx])


@pytest.mark.parametrize("routed", [False, True], ids=["split-node", "hooked"])
def test_two_backwards_of_one_forward_accumulate_separately(routed: bool) -> None:
    """Under a route the linears are hooked ([Note: hooked linear]): their pre-hooks queue once per backward too."""
    make = seeded(lambda: Chain())
    x = torch.randn(3, 5, 24) if routed else torch.randn(3, 24)
    grads = []
    for split in (False, True):
        model = make()
        flat_grads(list(model.parameters()))
        store = WeightGrads()
        with splitting(store, SplitRoute() if routed else None) if split else contextlib.nullcontext():
            out = model(x)
        out.square().sum().backward(retain_graph=True)
        out.sum().backward()
        store.run()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert_same(*grads)


def test_stacks_with_a_mode_inside() -> None:
    """A TorchFunctionMode entered inside the block (as the stage's watch before its incoming cut) sees the
    calls first and passes them on; they are still split."""
    class Counting(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.linears = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.linears += func is F.linear
            return func(*args, **(kwargs or {}))

    make = seeded(lambda: Chain())
    x = torch.randn(3, 5, 24)
    plain = make()
    plain(x).square().sum().backward()
    model = make()
    store = WeightGrads()
    with splitting(store), Counting() as counting:
        out = model(x)
    out.square().sum().backward()
    store.run()
    assert counting.linears == 2 and len(store) == 0
    assert_same([p.grad for p in plain.parameters()], [p.grad for p in model.parameters()])


def test_misuse() -> None:
    store = WeightGrads()
    with splitting(store), pytest.raises(ConfigError, match="do not nest"), splitting(WeightGrads()):
        pass
    with pytest.raises(ConfigError, match="takes a WeightGrads"), splitting([]):  # type: ignore[arg-type]
        pass
    store.run()
    store.run()
    # a kept tensor changed in place between B and W
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with splitting(store):
        out = lin(x)
    out.sum().backward()
    x.add_(1)
    with pytest.raises(InternalError, match="modified in place between B and W"):
        store.run()
    assert len(store) == 0


def test_a_store_dropped_with_work_warns(caplog) -> None:
    lin = nn.Linear(8, 4)
    store = WeightGrads()
    with splitting(store):
        out = lin(torch.randn(3, 8))
    out.sum().backward()
    del out  # its graph (the split node's site) holds the store too
    with caplog.at_level(logging.WARNING, logger="varuna_core.model.split"):
        del store
    assert "lost" in caplog.text


# ----------------------------------------------------------------------------------------------------------
# a transformer block, the example GPT, and the GPT cut into stages


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention with nn.Linear q/k/v and projection, GELU MLP, no dropout."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_transformer_block(amp) -> None:
    make = seeded(lambda: nn.Sequential(Block(), Block()))
    check(make, batches_of((4, 16, 64), n=2), amp=amp, flat=True, split_ops=8)


def _gpt_module():
    name = "_split_example_gpt_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GPT_DIR / "model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tiny_gpt():
    gpt = _gpt_module()
    return gpt.GPT(gpt.GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _gpt_batches(n: int = 2) -> list[tuple]:
    out = []
    for k in range(n):
        idx = torch.randint(20, (3, 13), generator=torch.Generator().manual_seed(k))
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_example_gpt(amp) -> None:
    """The whole example GPT: tied embedding and head, position embedding, q/v biases added outside the Linear."""
    split = check(seeded(_tiny_gpt), _gpt_batches(), amp=amp, flat=True, loss=lambda out: out)
    assert split["entries"][0] == 2 + 2 * 4 + 1  # wte, wpe, 4 Linears per block, the head


def test_example_gpt_cut_into_stages(monkeypatch) -> None:
    """The GPT sliced into 3 stages, each stage's forward under ``splitting`` and its W right after its B (the
    stages after the first enter their own mode before the incoming cut, inside the block): gradients equal the
    unsplit pipeline's bit for bit."""
    from tests.stage_chain import pipelined

    (idx, targets), = _gpt_batches(1)
    inputs = {"idx": idx, "targets": targets}
    shared = _gpt_module().SHARED_WEIGHTS
    ranges = [(0, 1), (1, 2), (2, 3)]
    loss, reference, _ = pipelined(seeded(_tiny_gpt), ranges, inputs, shared=shared)
    stores: list[WeightGrads] = []
    ran: list[int] = []
    run = WeightGrads.run
    monkeypatch.setattr(WeightGrads, "run", lambda self: (ran.append(len(self)), run(self))[1])
    split_loss, grads, _ = pipelined(seeded(_tiny_gpt), ranges, inputs, shared=shared, split=stores)
    assert len(stores) == 3 and split_loss == loss
    assert ran == [4 + 1, 4, 2]  # the last stage (a block, the head), the middle one (a block), the first (wte, wpe)
    assert sorted(reference) == sorted(grads)
    assert_same([reference[n] for n in sorted(reference)], [grads[n] for n in sorted(grads)])


# ----------------------------------------------------------------------------------------------------------
# the module route


ROUTED = {  # model, batches, whether the later blocks may skip the mode
    "chain": (lambda: Chain(), lambda: batches_of((4, 6, 24)), True),
    "shared": (lambda: Shared(), lambda: batches_of((4, 6, 24)), True),
    "gpt": (_tiny_gpt, lambda: _gpt_batches(3), True),
    "tied-functional-head": (lambda: TiedHead(), lambda: [(idx[:, :6] % 40,) for (idx,) in id_batches()], False),
    "used-after": (lambda: UsedElsewhere("after"), lambda: batches_of((3, 5, 24)), False),
    "used-before": (lambda: UsedElsewhere("before"), lambda: batches_of((3, 5, 24)), False),
}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTED))
def test_the_module_route_splits_as_the_mode_does(name: str, amp: bool) -> None:
    """[Note: split route]: the first block of a route runs under the mode; when every split call came from an
    nn.Linear or nn.Embedding forward and nothing needed the mode, the later ones run without it, and the
    gradients are the mode's (and the unsplit backward's) bit for bit; otherwise the mode stays."""
    make, batches, modules_only = ROUTED[name]
    loss = (lambda out: out) if name == "gpt" else None
    plain = train(seeded(make)(), batches(), split=False, amp=amp, flat=True, loss=loss)
    route = SplitRoute()
    routed = train(seeded(make)(), batches(), split=True, amp=amp, flat=True, loss=loss, route=route)
    assert route.modules_only is modules_only, route
    # the leaves' gradient edges are found once per route, and hold the leaves' own accumulators (under autocast
    # a split linear's edges are those of autocast's casts, found once per block)
    assert bool(route.leaf_edges) or amp or name != "gpt"
    assert all(t.is_leaf and edge.node is get_gradient_edge(t).node for t, edge in route.leaf_edges.values())
    assert_same(plain["params"], routed["params"], "params")
    assert_same(plain["inputs"], routed["inputs"], "inputs")
    moded = train(seeded(make)(), batches(), split=True, amp=amp, flat=True, loss=loss)
    # a hooked linear's bias takes its gradient in B, so its later use needs no alias ([Note: hooked linear])
    hooked_bias_uses = 1 if name == "used-after" and not amp else 0
    assert routed["entries"] == [n - hooked_bias_uses for n in moded["entries"]]


def test_the_module_route_leaves_the_classes_as_they_were() -> None:
    linear, embedding = nn.Linear.forward, nn.Embedding.forward
    route = SplitRoute()
    for _ in range(2):
        with splitting(WeightGrads(), route):
            assert nn.Linear.forward is not linear
    assert route.modules_only is True  # nothing was split, nothing needed the mode
    assert (nn.Linear.forward, nn.Embedding.forward) == (linear, embedding)
    with pytest.raises(RuntimeError), splitting(WeightGrads(), route):
        raise RuntimeError("a forward that fails")
    assert (nn.Linear.forward, nn.Embedding.forward) == (linear, embedding)


# ----------------------------------------------------------------------------------------------------------
# the hooked linear ([Note: hooked linear])


@pytest.mark.parametrize("shape", [(12, 24), (3, 5, 24), (2, 3, 4, 24)], ids=["2d", "3d", "4d"])
def test_a_routed_linear_with_a_bias_is_torchs_own_op_with_a_hook(shape) -> None:
    """Under a route, a linear with a bias (fp32, a contiguous input) is torch's linear on the detached weight: its
    node is torch's, the bias takes its gradient in B, the weight in W; bits equal the unsplit backward's."""
    make = seeded(lambda: Chain())
    batches = batches_of(shape)
    plain = train(make(), batches, split=False, flat=True)
    model = make()
    params = list(model.parameters())
    flat_grads(params)
    for (x,) in batches:
        store = WeightGrads()
        with splitting(store, SplitRoute()):
            out = model(x.detach().requires_grad_() * 1)
        assert type(out.grad_fn).__name__ in ("AddmmBackward0", "ViewBackward0")  # torch's own nodes
        before = model.a.weight.grad.clone(), model.a.bias.grad.clone()
        out.float().square().mean().backward()
        assert torch.equal(model.a.weight.grad, before[0]) and not torch.equal(model.a.bias.grad, before[1])
        assert len(store) == 2 and store.leaf_ids() == {id(model.a.weight), id(model.b.weight)}
        store.run()
    assert_same(plain["params"], [p.grad for p in params])


def test_a_hooked_linear_sees_the_gradient_after_the_outputs_hooks_and_before_in_place_changes() -> None:
    """A tensor hook on the output that changes its gradient, and an in-place change of the output after the
    linear: W computes from the gradient torch's own node would have received."""

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(24, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.register_hook(lambda g: g * 3)
            y.mul_(2)
            return y.square()

    make = seeded(Hooked)
    batches = batches_of((3, 5, 24))
    plain = train(make(), batches, split=False, flat=True)
    routed = train(make(), batches, split=True, flat=True, route=SplitRoute())
    assert routed["entries"] == [1, 1, 1]
    assert_same(plain["params"], routed["params"])
    assert_same(plain["inputs"], routed["inputs"])


def test_a_hooked_linear_defers_nothing_in_a_partial_backward() -> None:
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    store = WeightGrads()
    with splitting(store, SplitRoute()):
        out = lin(x * 1)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"
    (gx,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    assert len(store) == 0 and lin.weight.grad is None and lin.bias.grad is None
    (ref,) = torch.autograd.grad(lin(x * 1).sum(), [x])
    assert_same([ref], [gx])
    out.sum().backward()  # the plain one after it defers
    assert len(store) == 1 and lin.weight.grad is None and lin.bias.grad is not None
    store.run()
    assert lin.weight.grad is not None


def test_a_hooked_linears_input_changed_in_place_before_w_is_refused() -> None:
    lin = nn.Linear(8, 4)
    h = torch.randn(3, 8, requires_grad=True) * 1
    store = WeightGrads()
    with splitting(store, SplitRoute()):
        out = lin(h)
    out.sum().backward()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(InternalError, match="modified in place between B and W"):
        store.run()
