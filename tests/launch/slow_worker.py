"""examples/gpt/train.py with one slow rank (a worker on a slow machine): rank ``SLOW_RANK`` spends 30 ms more
in every transformer block's forward (several times its whole compute)."""

import os
import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))

import model  # noqa: E402

if os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
    forward = model.Block.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(0.03)
        return forward(self, *args, **kwargs)

    model.Block.forward = slow_forward

sys.argv = [str(EXAMPLE / "train.py"), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE / "train.py"), run_name="__main__")
