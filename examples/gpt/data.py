"""Character-level data for the example GPT: the shipped text, its vocabulary, and deterministic batches.

    ds = CharDataset.load()                       # examples/gpt/data/input.txt
    batch = ds.get_batch("train", 32, 64, torch.Generator().manual_seed(0))
    batch["idx"], batch["targets"]               # LongTensor [32, 64] each; targets = idx shifted by one

The module-level ``encode``, ``decode`` and ``get_batch`` use the shipped text.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["DEFAULT_TEXT", "CharDataset", "default_dataset", "encode", "decode", "get_batch"]

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "input.txt"
TRAIN_FRACTION = 0.9  # first 90% of the text trains, the last 10% validates


class CharDataset:
    """A text, its sorted character vocabulary, and the encoded train/val splits."""

    def __init__(self, text: str) -> None:
        if len(text) < 2:
            raise ValueError("the text needs at least two characters")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.itos = dict(enumerate(self.chars))
        data = torch.tensor(self.encode(text), dtype=torch.long)  # [N]
        n_train = int(TRAIN_FRACTION * len(data))
        self.splits = {"train": data[:n_train], "val": data[n_train:]}

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TEXT) -> CharDataset:
        return cls(Path(path).read_text(encoding="utf-8"))

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] for i in ids)

    def get_batch(
        self, split: str, batch_size: int, block_size: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """``batch_size`` random windows of ``block_size`` characters from ``split`` ("train" or "val").

        The same generator state gives the same batch. Returns ``{"idx": [B, T], "targets": [B, T]}`` with
        ``targets[:, t] == next character after idx[:, t]``.
        """
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.splits[split]
        if len(data) <= block_size:
            raise ValueError(f"the {split} split has {len(data)} characters; block_size {block_size} is too long")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # [B]
        offsets = torch.arange(block_size)  # [T]
        windows = starts[:, None] + offsets[None, :]  # [B, T]
        return {"idx": data[windows], "targets": data[windows + 1]}


@functools.lru_cache(maxsize=1)
def default_dataset() -> CharDataset:
    """The shipped text, loaded once."""
    return CharDataset.load(DEFAULT_TEXT)


def encode(s: str) -> list[int]:
    return default_dataset().encode(s)


def decode(ids) -> str:
    return default_dataset().decode(ids)


def get_batch(split: str, batch_size: int, block_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return default_dataset().get_batch(split, batch_size, block_size, generator)
