"""A Hugging Face T5 (encoder–decoder) on the shipped text, character by character: denoising.

``transformers.T5ForConditionalGeneration`` built from a ``T5Config`` (no download). ``cutpoints="auto"``
finds two block stacks, ``encoder.block`` and ``decoder.block``, and cuts inside both. The encoder's output
(read by every decoder block's cross-attention) and the position biases the first block of each stack
computes for the others skip over the cuts: the stages in between carry them (see "What auto mode handles"
in the README). The input and output embeddings share one tied ``Parameter``.
"""

from __future__ import annotations

import torch

NAME = "Hugging Face T5 (denoising)"
# T5's loss is a plain mean over the micro-batch's label positions; every example has block_size of them, so
# that mean is a mean over examples and micro-batches weigh by their examples.
LOSS_REDUCTION = "mean"
NOISE = 0.15  # fraction of each example's characters replaced by the mask token


def build(vocab_size: int, args) -> torch.nn.Module:
    """Token ids: the characters, then the mask token (``vocab_size``) and the decoder's start token."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab_size + 2, d_model=args.n_embd, d_kv=args.n_embd // 4, d_ff=4 * args.n_embd,
                      num_layers=args.n_layer, num_decoder_layers=args.n_layer, num_heads=4,
                      relative_attention_num_buckets=16, dropout_rate=0.0, pad_token_id=vocab_size + 1,
                      decoder_start_token_id=vocab_size + 1, eos_token_id=vocab_size + 1)
    return T5ForConditionalGeneration(config)


def batch(ds, split: str, n: int, args, generator: torch.Generator) -> dict:
    """``n`` windows of text with the same number of characters masked (``input_ids``, ``attention_mask``) and
    the clean text to restore (``labels``), ``[n, T]`` each."""
    ids = ds.get_batch(split, n, args.block_size, generator)["idx"]
    k = max(1, round(NOISE * args.block_size))
    chosen = torch.rand(ids.shape, generator=generator).argsort(dim=1)[:, :k]  # [n, k] positions per example
    noisy = ids.scatter(1, chosen, ds.vocab_size)
    return {"input_ids": noisy, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
