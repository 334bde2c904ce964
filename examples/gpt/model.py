"""A small character-level GPT (nanoGPT style) marked up with CutPoints for pipeline training.

Shapes in comments use B = batch, T = sequence length (<= block_size), C = n_embd, V = vocab_size,
H = n_head, D = C // H.

The model has ``n_layer`` CutPoints: one after the embeddings and one after every block except the last, so
it splits into ``n_layer + 1`` segments::

    segment 0:          wte, wpe          -> cut 0
    segment 1..L-1:     block i           -> cut i
    segment L:          block L-1, ln_f, lm_head, loss

``lm_head.weight`` is the same Parameter as ``wte.weight`` (weight tying), and those two live in the first and
last segment; ``SHARED_WEIGHTS`` declares the pair for the pipeline runtime.

``forward(idx, targets)`` returns the mean cross-entropy loss, because in a pipeline the last stage returns
the loss. Use :meth:`GPT.logits` (and :func:`generate`) on an unpartitioned model to get predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from varuna_core import CutPoint

__all__ = ["GPTConfig", "GPT", "SHARED_WEIGHTS", "generate"]

# (name, name) pairs of parameters that must stay equal when the model is split into stages.
SHARED_WEIGHTS = [("wte.weight", "lm_head.weight")]


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # bias in Linear and LayerNorm layers


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        # Biases for q and v only: a bias of k adds the same number to every score of a query, which softmax
        # ignores, so its gradient is zero in exact arithmetic and an optimizer like Adam would move it by
        # rounding noise alone (as Whisper's attention, which has no key bias either). The Linear is made with
        # its bias and then loses it, so that every other weight draws the same initial values as before.
        self.c_attn.register_parameter("bias", None)
        self.qv_bias = nn.Parameter(torch.zeros(2 * cfg.n_embd)) if cfg.bias else None
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        if self.qv_bias is not None:
            q_bias, v_bias = self.qv_bias.split(C)
            q, v = q + q_bias.to(q.dtype), v + v_bias.to(v.dtype)  # in the matmul's dtype, as a Linear's bias
        # [B, T, C] -> [B, H, T, D]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, H, T, D]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # hidden: [B, T, 4C]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding  [V, C]
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # position embedding [block_size, C]
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # cuts[0] follows the embeddings; cuts[i] (i >= 1) follows blocks[i - 1]. No cut after the last block.
        self.cuts = nn.ModuleList(CutPoint() for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: the very same Parameter object

        # GPT-2 style: the projections that write into the residual stream start smaller.
        for name, module in self.named_modules():
            if name.endswith("c_proj"):
                module.init_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @staticmethod
    def init_module(module: nn.Module) -> None:
        """Initialise ``module``'s own tensors with the distributions ``__init__`` uses, for a model built on
        meta (``with varuna_core.meta_init(): GPT(cfg)``): ``Varuna(..., init=GPT.init_module)`` or
        ``varuna_core.materialize(model, seed=..., init=GPT.init_module)`` call it on each module whose tensors
        a process holds, each from its own seeded stream, so the values do not depend on the pipeline layout
        (they differ from a CPU-built model's, which draws all of them from one stream in order)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, CausalSelfAttention) and module.qv_bias is not None:
            nn.init.zeros_(module.qv_bias)

    def num_parameters(self) -> int:
        """Number of distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def _hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> final hidden states [B, T, C], passing every CutPoint once."""
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # [T]
        tok_emb = self.wte(idx)  # [B, T, C]
        pos_emb = self.wpe(pos)  # [T, C], broadcast over B
        x = self.drop(tok_emb + pos_emb)  # [B, T, C]
        x = self.cuts[0](x)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < last:
                x = self.cuts[i + 1](x)
        return self.ln_f(x)  # [B, T, C]

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> next-token logits [B, T, V]. For unpartitioned use (sampling, evaluation)."""
        return self.lm_head(self._hidden(idx))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] and next-token targets [B, T] -> mean cross-entropy loss (a scalar)."""
        logits = self.lm_head(self._hidden(idx))  # [B, T, V]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after the prompt ``idx`` [B, T]; returns [B, T + max_new_tokens].

    Works on an unpartitioned model. ``temperature`` must be > 0; lower is greedier.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    was_training = model.training
    model.eval()
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]  # [B, <=block_size]
        logits = model.logits(context)[:, -1, :] / temperature  # [B, V]
        probs = F.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # [B, 1]
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx
