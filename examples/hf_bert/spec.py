"""The Hugging Face BERT example as a ``ModelSpec``: ``varuna profile examples/hf_bert/spec.py:spec``."""

import sys
from argparse import Namespace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import model  # noqa: E402
from hf_common import CharDataset  # noqa: E402

from varuna_core import ModelSpec  # noqa: E402

ARGS = Namespace(block_size=64, n_embd=64, n_layer=4)
_data = CharDataset.load()


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return model.build(_data.vocab_size, ARGS)


spec = ModelSpec(build=build, batch=lambda n: model.batch(_data, "train", n, ARGS, torch.Generator().manual_seed(n)),
                 cutpoints="auto", name="examples/hf_bert")
