"""Small models for the tests: every feature the runtime must handle, in a few thousand parameters."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from devtools.models import SleepLayer, SleepModel  # noqa: F401  (shared with the benchmarks)
from varuna_core import CutPoint

VOCAB, SEQ, HIDDEN = 13, 6, 16


class Block(nn.Module):
    """Pre-LN residual MLP block on ``[s, b, h]`` activations."""

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class ToyLM(nn.Module):
    """Tiny language model with a tied input/output embedding (one Parameter object), a root-level
    parameter, a registered buffer, LayerNorm, and cuts that carry ``[s, b, h]`` (not batch-first).

    Segments: embedding | block 0 | block 1 | ... | last block + head (``n_layer + 1`` segments).
    """

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(SEQ, hidden) * 0.1)  # root-level, used as `x + self.pos`
        self.blocks = nn.ModuleList([Block(hidden, dropout) for _ in range(n_layer)])
        self.cuts = nn.ModuleList([CutPoint() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: the same Parameter object
        self.register_buffer("logit_scale", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)  # [s, b, h]
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x)).transpose(0, 1) * self.logit_scale  # [b, s, V]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


SHARED = [("emb.weight", "head.weight")]


class UnusedLM(ToyLM):
    """``ToyLM`` whose blocks hold a parameter no forward reads (``spare``: never a gradient) and a gain that only
    micro-batches whose first token is a multiple of 4 use (``gain``: no gradient from the others, so in some steps
    none from a stage's last micro-batch, or none at all)."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        for block in self.blocks:
            block.spare = nn.Parameter(torch.zeros(hidden))
            block.gain = nn.Parameter(torch.ones(hidden))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)  # [s, b, h]
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if int(idx[0, 0]) % 4 == 0:
                x = x * block.gain
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x)).transpose(0, 1) * self.logit_scale  # [b, s, V]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def init_toy(module: nn.Module) -> None:
    """The initialiser of a ``ToyLM`` built on meta (``materialize(..., init=init_toy)``, ``Varuna(init=...)``):
    the root's own ``pos`` as ``__init__`` draws it, every other module's ``reset_parameters()``."""
    if isinstance(module, ToyLM):
        nn.init.normal_(module.pos, std=0.1)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def batch(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return {"idx": idx, "targets": torch.roll(idx, -1, dims=1)}


class ListCutLM(ToyLM):
    """``ToyLM`` with its cutpoints in a plain Python list, as the original's README writes them
    (``self.cutpoints = [CutPoint() for i in range(n)]``): no CutPoint is a registered submodule. CutPoints hold
    no parameters, so a seed gives it exactly ``ToyLM``'s values."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        cuts = list(self.cuts)
        del self.cuts
        self.cuts = cuts  # a list attribute, not an nn.ModuleList


class SequentialLM(nn.Module):
    """Blocks in an ``nn.Sequential``, no CutPoint, a tied head: ``cutpoints="auto"`` cuts in front of blocks
    1.. (``n_layer`` segments). Positions come from an ``nn.Embedding``."""

    AUTO_CUTS = True

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(SEQ, hidden)
        self.blocks = nn.Sequential(*(Block(hidden, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks((self.emb(idx) + self.wpe(positions)).transpose(0, 1))  # [s, b, h]
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ReusedBlockLM(nn.Module):
    """One block's weights at every depth (Universal-Transformer style, as ALBERT shares its layer): ``block`` is
    called ``n_layer`` times per forward, each call on what the previous returned; no CutPoint and no block stack,
    so ``cutpoints="auto"`` cuts in front of every call but the first (``n_layer`` segments) and the block's weights
    are tied over the stages. A tied head and a buffer, as ``ToyLM``."""

    AUTO_CUTS = True
    REUSED = "block"

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.depth = n_layer
        self.emb = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(SEQ, hidden)
        self.block = Block(hidden, dropout)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("logit_scale", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = (self.emb(idx) + self.wpe(positions)).transpose(0, 1)  # [s, b, h]
        for _ in range(self.depth):
            x = self.block(x)
        logits = self.head(self.ln_f(x)).transpose(0, 1) * self.logit_scale
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class SkipAcrossCut(ToyLM):
    """The embedding output (plus the root-level ``pos``) skips over every cut straight into the head."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        skip = x
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x + skip)).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


_HIDDEN: dict[str, float] = {}  # state kept outside any module


class HiddenState(ToyLM):
    """Wrong on purpose: after block 0 the forward leaves a value in a global that is read after block 2, so a
    stage that does not run block 0 silently computes something else. Discovery follows module attributes, not
    globals: only validation can notice."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:  # branches on data: on a placeholder it takes the other branch
                _HIDDEN["gain"] = 1.0 + float(x.detach().abs().mean()) if x.device.type != "meta" else 2.0
            if i == 2:
                x = x * _HIDDEN["gain"]
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ReducedCut(ToyLM):
    """Wrong on purpose: the first cut carries a value averaged over the batch (no batch dim)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        x = self.cuts[0](x.mean(0))
        return F.cross_entropy(self.head(x).expand(idx.shape[0], -1, -1).reshape(-1, VOCAB), targets.reshape(-1))


class CutTwice(ToyLM):
    """Wrong on purpose: the same CutPoint instance is called for two boundaries."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.emb(idx))
        x = self.cuts[0](self.blocks[0](x))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


class NoCuts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(SEQ, 1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lin(idx.float()).mean()


class SeqFirstLM(ToyLM):
    """Takes sequence-first inputs ``[s, b]``: the batch is dim 1 of every input."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.t(), targets.t())


def seq_first_batch(n: int, seed: int = 0) -> dict:
    return {k: v.t().contiguous() for k, v in batch(n, seed).items()}


class CarryLM(ToyLM):
    """Every cut carries ``(x, lo, ids, keep)``: the hidden state ``[s, b, h]`` in fp32, a bf16 copy of it (with a
    gradient), the token ids (int64 ``[s, b]``) and a mask (bool ``[s, b]``), all read after the cut: each kind of
    leaf a wire dtype narrows or leaves alone."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)  # [s, b, h]
        ids = idx.t().contiguous()
        value = self.cuts[0]((x, x.to(torch.bfloat16), ids, ids >= VOCAB // 4))
        for i, block in enumerate(self.blocks):
            x, lo, ids, keep = value
            x = block(x + 0.5 * lo.float()) * keep.unsqueeze(-1)
            value = (x, x.to(torch.bfloat16), ids, keep)
            if i + 1 < len(self.cuts):
                value = self.cuts[i + 1](value)
        x, _, ids, _ = value
        logits = self.head(self.ln_f(x)) + 0.1 * F.one_hot(ids, VOCAB)  # [s, b, V]
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), targets.reshape(-1))


class UNetLM(nn.Module):
    """U-Net-like: a down path, a bottleneck and an up path whose blocks add the down path's features, so
    values skip over cuts: the embedding (``h0``, a module output) reaches the head across every cut, ``h1``
    (the value leaving cut 0) skips cuts 1..3, ``h2`` (leaving cut 1) skips cuts 2 and 3. The root-level
    ``self.pos`` is added to the skipped embedding both before the cuts and in the head's input, so the
    stage computing the head holds it too (a tie found by discovery); the head is tied to the embedding.
    6 segments."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(SEQ, hidden) * 0.1)
        self.down1, self.down2 = Block(hidden, dropout), Block(hidden, dropout)
        self.mid = Block(hidden, dropout)
        self.up2, self.up1 = Block(hidden, dropout), Block(hidden, dropout)
        self.cuts = nn.ModuleList([CutPoint() for _ in range(5)])
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as ToyLM (SHARED)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(idx)  # [b, s, h]
        x = self.cuts[0](h0 + self.pos[: idx.shape[1]])
        h1 = self.cuts[1](self.down1(x) + h0)  # a later stage mixes the carried h0 with a placeholder here
        h2 = self.cuts[2](self.down2(h1))
        m = self.cuts[3](self.mid(h2))
        u2 = self.cuts[4](self.up2(m) + h2)
        u1 = self.up1(u2) * 0.5 + h1 + (h0 + self.pos[: idx.shape[1]])
        return F.cross_entropy(self.head(u1).reshape(-1, VOCAB), targets.reshape(-1))


class _KeepingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = self.ln(x)  # an inner value left behind in an attribute
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.kept))))


class SkipInsideBlock(ToyLM):
    """Wrong on purpose: block 0 leaves an inner value in an attribute that the head reads; a later stage stands
    in for block 0 as a whole, so the value cannot be carried (discovery names it)."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        self.blocks[0] = _KeepingBlock(hidden, dropout)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        x = self.cuts[0](x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.ln_f(x) + self.blocks[0].kept).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class _ScaleWriter(Block):
    """Leaves a Python number computed from its input on itself."""

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__(hidden, dropout)
        self.scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = float(x.detach().mean())
        return super().forward(x)


class _ScaleReader(Block):
    """Reads the number another block left (a reference in a plain list: not a submodule)."""

    def __init__(self, hidden: int, dropout: float, source: nn.Module) -> None:
        super().__init__(hidden, dropout)
        self.source = [source]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 + self.source[0].scale)


class StateAcrossCut(ToyLM):
    """Block 0 (segment 1) keeps ``self.scale = float(x.mean())``, which block 2 (segment 3) reads: a stage
    that holds block 2 but not block 0 would read a stale number; discovery finds it and slicing refuses such a
    cut. With segments 1 to 3 on one stage it trains as one process."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        self.blocks[0] = _ScaleWriter(hidden, dropout)
        self.blocks[2] = _ScaleReader(hidden, dropout, self.blocks[0])


class _CountingBlock(Block):
    """Counts its forwards in a Python attribute, and its output depends on the count."""

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__(hidden, dropout)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * (1.0 + 0.01 * self.calls)


class CountingLM(ToyLM):
    """Every block counts its forwards (``self.calls += 1``) and scales its output by the count: a recompute,
    the dry runs or the start-up validation that counted too would change the model."""

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        self.blocks = nn.ModuleList([_CountingBlock(hidden, dropout) for _ in range(n_layer)])


class ConvBNBlock(nn.Module):
    """Residual conv + BatchNorm block on ``[b, h, s]`` activations (a ResNet block over a sequence)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class ResNetLM(nn.Module):
    """ResNet-like: conv + BatchNorm residual blocks in an ``nn.ModuleList`` (``cutpoints="auto"`` cuts in front
    of blocks 1..), a final BatchNorm and a head tied to the embedding. Every forward in training mode updates
    the BatchNorm statistics (``running_mean``, ``running_var``, ``num_batches_tracked``)."""

    AUTO_CUTS = True

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList([ConvBNBlock(hidden) for _ in range(n_layer)])
        self.bn_f = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # [b, h, s], contiguous: a cut's value arrives contiguous on the next stage, and an op on another memory
        # layout may round its sums in another order than one process does
        x = self.emb(idx).transpose(1, 2).contiguous()
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.bn_f(x).transpose(1, 2))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class CountingBlock(ConvBNBlock):
    """:class:`ConvBNBlock` with a call counter (a buffer) that scales its output: in training mode a forward reads
    what the earlier forwards wrote, so a forward run twice (a recompute) computes something else unless it sees
    the buffers of its first run."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x) * (1.0 + 0.1 * self.calls)


class BatchNormLM(ResNetLM):
    """``ResNetLM`` with CutPoints after the embedding and after each block but the last, and blocks whose call
    counters scale their output: buffers written by every forward on every stage, and read by later forwards."""

    AUTO_CUTS = False

    def __init__(self, n_layer: int = 4, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__(n_layer, hidden, dropout)
        self.blocks = nn.ModuleList([CountingBlock(hidden) for _ in range(n_layer)])
        self.cuts = nn.ModuleList([CutPoint() for _ in range(n_layer)])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](self.emb(idx).transpose(1, 2).contiguous())  # [b, h, s]
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x)
        logits = self.head(self.bn_f(x).transpose(1, 2))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ModeDependentLM(ToyLM):
    """Computes another structure in eval mode: there the cut after block 0 carries an extra tensor (a state that
    training does not keep, as a recurrent model's cache)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        x = self.cuts[0](x)
        state = None
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and not self.training:
                state = x.detach() * 0
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x if state is None else (x, state))
                if state is not None:
                    x, state = x
        logits = self.head(self.ln_f(x)).transpose(0, 1) * self.logit_scale
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ReadsANumber(ToyLM):
    """Wrong on purpose: after block 0 the forward turns an activation into a Python number, which a later stage
    (standing in a placeholder for block 0) cannot compute: every stage after the first fails in its forward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.emb(idx) + self.pos[: idx.shape[1]]).transpose(0, 1)
        x = self.cuts[0](x)
        gain = 1.0
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                gain = 1.0 + float(x.detach().abs().mean())
            if i + 1 < len(self.cuts):
                x = self.cuts[i + 1](x * gain if i == 2 else x)
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
