"""GPT-2 XL-shaped ``ModelSpec``\\ s of the example GPT, to measure one real transformer layer on a GPU.

The emulated cluster's models (:mod:`devtools.emumodels`) sleep for a layer's forward, input gradient and weights'
gradient. These specs are where those times are measured: the example GPT (``examples/gpt/model.py``) at GPT-2 XL's
width (hidden 1600, 25 heads, GPT-2's vocabulary of 50 257, biases as GPT-2 has them) with two blocks, so that
segment 1 of the profile is exactly one block (segment 0 is the embeddings, segment 2 the last block with the final
LayerNorm, the head and the loss)::

    varuna profile devtools/gpt2xl.py:xl   --device cuda --precision bf16 --microbatch-sizes 1,2,4,8 -o xl.json
    varuna profile devtools/gpt2xl.py:long --device cuda --precision bf16 --microbatch-sizes 1,2,4 -o long.json

``xl`` runs sequences of 1024 tokens (GPT-2's context), ``long`` of 4096. The batches are random token ids
(``[n, seq]`` int64, seeded by ``n``): a layer's time does not depend on the values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from model import GPT, SHARED_WEIGHTS, GPTConfig

from varuna_core import ModelSpec, meta_init

__all__ = ["VOCAB", "HIDDEN", "HEADS", "config", "xl", "long"]

VOCAB, HIDDEN, HEADS = 50257, 1600, 25  # GPT-2 XL (Radford et al. 2019)


def config(seq: int) -> GPTConfig:
    """Two GPT-2 XL blocks over sequences of ``seq`` tokens."""
    return GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=2, n_head=HEADS, n_embd=HIDDEN)


def _spec(seq: int, name: str) -> ModelSpec:
    cfg = config(seq)

    def build() -> GPT:
        with meta_init():
            return GPT(cfg)

    def batch(n: int) -> dict:
        g = torch.Generator().manual_seed(n)
        idx = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
        return {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}

    return ModelSpec(build=build, batch=batch, shared_weights=SHARED_WEIGHTS, name=name, init=GPT.init_module)


xl = _spec(1024, "gpt2-xl-layer-s1024")
long = _spec(4096, "gpt2-xl-layer-s4096")
