"""The example GPT as a ``ModelSpec``: ``varuna profile examples/gpt/spec.py:spec``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import CharDataset
from model import GPT, SHARED_WEIGHTS, GPTConfig

from varuna_core import ModelSpec, meta_init

BLOCK_SIZE = 64
_data = CharDataset.load()
CONFIG = GPTConfig(vocab_size=_data.vocab_size, block_size=BLOCK_SIZE, n_layer=4, n_head=4, n_embd=64)


def build() -> GPT:
    """The GPT with its parameters on the meta device: profiling allocates one segment at a time."""
    with meta_init():
        return GPT(CONFIG)


def batch(n: int) -> dict:
    """``n`` training examples: ``idx`` and ``targets``, each ``[n, BLOCK_SIZE]`` token ids."""
    return _data.get_batch("train", n, BLOCK_SIZE, torch.Generator().manual_seed(n))


spec = ModelSpec(build=build, batch=batch, shared_weights=SHARED_WEIGHTS, name="examples/gpt", init=GPT.init_module)
