"""A Hugging Face GPT-2 (causal language model) on the shipped text, character by character.

``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (no download): its blocks are
``transformer.h``, and its output head is the input embedding (one tied ``Parameter``).
"""

from __future__ import annotations

import torch

NAME = "Hugging Face GPT-2"
LOSS_REDUCTION = "mean"  # every example predicts every position: the loss is a mean over examples


def build(vocab_size: int, args) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(ds, split: str, n: int, args, generator: torch.Generator) -> dict:
    """``n`` windows of text: ``input_ids`` and ``labels`` (the same ids: the model shifts them), ``[n, T]``."""
    ids = ds.get_batch(split, n, args.block_size, generator)["idx"]
    return {"input_ids": ids, "labels": ids}
