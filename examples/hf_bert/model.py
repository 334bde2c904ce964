"""A Hugging Face BERT (masked language model) on the shipped text, character by character.

``transformers.BertForMaskedLM`` built from a ``BertConfig`` (no download): its blocks are
``bert.encoder.layer``, and its prediction head's decoder is the word embedding (one tied ``Parameter``).
"""

from __future__ import annotations

import torch

NAME = "Hugging Face BERT (masked LM)"
# BertForMaskedLM's loss is a plain mean over the micro-batch's masked positions. Every example masks the same
# number of them, so that mean is a mean over examples, and micro-batches weigh by their examples.
LOSS_REDUCTION = "mean"
MASKED = 0.15  # fraction of each example's positions to predict


def build(vocab_size: int, args) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size + 1, hidden_size=args.n_embd, num_hidden_layers=args.n_layer,
                        num_attention_heads=4, intermediate_size=4 * args.n_embd,
                        max_position_embeddings=args.block_size, pad_token_id=0)
    return BertForMaskedLM(config)


def batch(ds, split: str, n: int, args, generator: torch.Generator) -> dict:
    """``n`` windows of text with the same number of positions replaced by the mask token (id ``vocab_size``):
    ``input_ids``, ``attention_mask`` and ``labels`` (-100 where nothing is predicted), ``[n, T]`` each."""
    ids = ds.get_batch(split, n, args.block_size, generator)["idx"]
    k = max(1, round(MASKED * args.block_size))
    chosen = torch.rand(ids.shape, generator=generator).argsort(dim=1)[:, :k]  # [n, k] positions per example
    labels = torch.full_like(ids, -100).scatter(1, chosen, ids.gather(1, chosen))
    masked = ids.scatter(1, chosen, ds.vocab_size)
    return {"input_ids": masked, "attention_mask": torch.ones_like(ids), "labels": labels}
