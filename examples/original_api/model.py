"""The model and data of the original-API example, written as the original Varuna's README shows a model.

``SampleModel`` keeps its cut points in a plain Python list (``self.cutpoints = [CutPoint() ...]``), has the
output projection as a separate parameter tied to the embedding by ``shared_weights``, and takes a non-tensor
flag among its inputs. The data are character windows of the shipped text (``examples/gpt/data/input.txt``):

    inputs, targets: LongTensor [n, BLOCK_SIZE]; targets are inputs shifted by one character
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from varuna import CutPoint

TEXT = Path(__file__).resolve().parent.parent / "gpt" / "data" / "input.txt"
BLOCK_SIZE = 16
SHARED_WEIGHTS = [("embedding.weight", "lm_head_weight")]


class Block(nn.Module):
    """A residual MLP block: ``x + fc2(gelu(fc1(norm(x))))`` on [n, T, d]."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SampleModel(nn.Module):
    """Embedding, ``num_blocks`` blocks, a norm and a tied output projection; a cut point after the embedding
    and after every block but the last (``num_blocks`` cut points, ``num_blocks + 1`` segments)."""

    def __init__(self, vocab_size: int, d: int = 32, num_blocks: int = 4) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.position = nn.Parameter(torch.randn(BLOCK_SIZE, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d) for _ in range(num_blocks)])
        self.cutpoints = [CutPoint() for i in range(num_blocks)]  # a plain list, as the original's README
        self.norm = nn.LayerNorm(d)
        # Weight sharing between stages: a separate parameter holding the same tensor, listed in SHARED_WEIGHTS.
        self.lm_head_weight = nn.Parameter(self.embedding.weight.detach().clone())

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, extra_norm: bool = True) -> torch.Tensor:
        x = self.embedding(inputs) + self.position[: inputs.size(1)]
        x = self.cutpoints[0](x)  # marked as a potential stage boundary
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i + 1 < len(self.cutpoints):
                x = self.cutpoints[i + 1](x)  # each cut point is used once per forward
        if extra_norm:
            x = self.norm(x)
        logits = F.linear(x, self.lm_head_weight)  # [n, T, vocab]
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


class Text:
    """The shipped text as character ids, and deterministic batches of windows of it."""

    def __init__(self, path: Path = TEXT) -> None:
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, size: int, seed: int) -> dict:
        """``size`` windows drawn by a generator seeded with ``seed``: the same on every process."""
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(self.data) - BLOCK_SIZE - 1, (size,), generator=gen)
        inputs = torch.stack([self.data[s: s + BLOCK_SIZE] for s in starts.tolist()])
        targets = torch.stack([self.data[s + 1: s + 1 + BLOCK_SIZE] for s in starts.tolist()])
        return {"inputs": inputs, "targets": targets, "extra_norm": True}

    def step_batch(self, step: int, size: int, seed: int) -> dict:
        """The global batch of training step ``step``."""
        return self.batch(size, seed * 1_000_003 + step)
