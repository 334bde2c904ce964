"""The Hugging Face T5 example as a ``ModelSpec``: ``varuna profile examples/hf_t5/spec.py:spec``."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import model  # noqa: E402
from hf_common import model_spec  # noqa: E402

spec = model_spec(model, "examples/hf_t5")
