"""Tiny Hugging Face models built from configs (no downloads) and their batches, for the auto-cut tests.

Each ``build(name, dropout)`` returns a 4-block model with its own loss (``labels`` in the batch); GPT-2 and
BERT tie their output head to the input embedding, Llama does not. ALBERT (``n_layer`` layers, 6 by default) calls
its one layer group at every depth (no block stack: ``cutpoints="auto"`` cuts between the group's calls) and ties
its head to the embedding. The encoder–decoders (``SEQ2SEQ``: T5 and
BART, ``...ForConditionalGeneration``) have 3 encoder and 3 decoder blocks and translate 12 tokens into 8
(the reversed first 8, padding at the end of the second example's source). ``batch(name, n, seed)`` gives ``n``
examples of 12 tokens: GPT-2 predicts every position; Llama a different number per example, normalised by the
batch's count (``loss_reduction="sum"``); BERT 3 masked positions per example, with padding at the end of the
second example (so the attention mask is a real tensor). ``PATTERNED``: ModernBERT (masked LM, batches as BERT's)
and Gemma 3 (causal LM, as GPT-2's), whose layers take one of two attention masks by a layer-type pattern.
"""

from __future__ import annotations

import torch

VOCAB, SEQ = 61, 12
NAMES = ("gpt2", "bert", "llama")
ALBERT_TIES = (("albert.embeddings.word_embeddings.weight", "predictions.decoder.weight"),)
ALBERT_REUSED = "albert.encoder.albert_layer_groups.0"  # its one layer group, called at every depth
SEQ2SEQ = ("t5", "bart")
PATTERNED = ("modernbert", "gemma3")  # layers of two attention types, in a pattern: see [Note: loop-carried]
TARGET = 8


def build(name: str, dropout: float = 0.0, n_layer: int | None = None, auto: bool = False) -> torch.nn.Module:
    """The model ``name``; ``auto``: with ``cutpoints="auto"``'s cuts applied (as ``Varuna`` applies them)."""
    model = _build(name, dropout, n_layer)
    if auto:
        from varuna_core.model.autocut import apply_auto_cutpoints

        apply_auto_cutpoints(model)
    return model


def _build(name: str, dropout: float, n_layer: int | None) -> torch.nn.Module:
    import transformers as tf

    if name == "albert":
        cfg = tf.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_attention_heads=4,
                              intermediate_size=64, num_hidden_layers=n_layer or 6, num_hidden_groups=1,
                              max_position_embeddings=SEQ, pad_token_id=0, hidden_dropout_prob=dropout,
                              attention_probs_dropout_prob=dropout, classifier_dropout_prob=dropout)
        return tf.AlbertForMaskedLM(cfg)
    n_layer = n_layer or 4
    if name == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
                          num_heads=4, relative_attention_num_buckets=8, dropout_rate=dropout,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return tf.T5ForConditionalGeneration(cfg)
    if name == "bart":
        cfg = tf.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                            max_position_embeddings=SEQ, dropout=dropout, attention_dropout=dropout,
                            activation_dropout=dropout, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                            decoder_start_token_id=1, forced_eos_token_id=None)
        return tf.BartForConditionalGeneration(cfg)

    if name == "modernbert":  # its default layout at 4 layers: full, sliding, sliding, full (global every 3rd)
        cfg = tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                                  num_attention_heads=4, global_attn_every_n_layers=3, local_attention=4,
                                  max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                  cls_token_id=0, sep_token_id=0, embedding_dropout=dropout,
                                  attention_dropout=dropout, mlp_dropout=dropout)
        cfg._attn_implementation = "eager"
        return tf.ModernBertForMaskedLM(cfg)
    if name == "gemma3":  # sliding, full, full, sliding: the pattern of Gemma 3's 5:1 layout at 7 layers and more
        types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
        cfg = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                  layer_types=(types * n_layer)[:n_layer], max_position_embeddings=SEQ,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0, attention_dropout=dropout)
        cfg._attn_implementation = "eager"
        return tf.Gemma3ForCausalLM(cfg)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                            attn_pdrop=dropout)
        return tf.GPT2LMHeadModel(cfg)
    if name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=n_layer, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                            vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        return tf.BertForMaskedLM(cfg)
    if name == "rwkv":  # outside training it keeps a recurrent state (use_cache): another computation
        cfg = tf.RwkvConfig(vocab_size=VOCAB, context_length=SEQ, hidden_size=32, num_hidden_layers=n_layer,
                            attention_hidden_size=32, intermediate_size=64)
        return tf.RwkvForCausalLM(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=n_layer, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, attention_dropout=dropout)
        return tf.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}")


def batch(name: str, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    if name in SEQ2SEQ:  # every example has TARGET labels, so a micro-batch's mean is a mean over examples
        attention = torch.ones_like(ids)
        if n > 1:
            attention[1, -4:] = 0
        return {"input_ids": ids, "attention_mask": attention, "labels": ids[:, :TARGET].flip(1).clone()}
    if name in ("gpt2", "gemma3", "rwkv"):
        return {"input_ids": ids, "labels": ids.clone()}
    if name == "llama":
        # positions left out of the loss, a different number per example: the loss is a mean over the batch's
        # positions (Hugging Face's num_items_in_batch), with Varuna(loss_reduction="sum")
        labels = ids.clone()
        labels[torch.rand(n, SEQ, generator=g) < 0.3] = -100
        return {"input_ids": ids, "labels": labels, "num_items_in_batch": int((labels[:, 1:] != -100).sum())}
    # BERT's (and ALBERT's) masked-LM loss is a plain mean over the micro-batch's predicted positions, so every example
    # predicts the same number of them (3) and the mean over positions is a mean over examples
    attention = torch.ones_like(ids)
    if n > 1:
        attention[1, -3:] = 0
    labels = torch.full_like(ids, -100)
    masked = ids.clone()
    for row in range(n):
        chosen = torch.randperm(SEQ - 3, generator=g)[:3]
        labels[row, chosen] = ids[row, chosen]
        masked[row, chosen] = VOCAB - 1  # the [MASK] token of this toy vocabulary
    return {"input_ids": masked, "attention_mask": attention, "labels": labels}
