"""examples/gpt/train.py with one slow rank (a worker on a slow machine): after every transformer block's forward,
rank ``SLOW_RANK`` sleeps ``SLOWER`` times what the block took, so its compute is a multiple of its peer's whatever
the machine's speed or load (a fixed delay is many times the compute on an idle machine and a fraction of it on
one loaded core). The blocks' forwards (recompute included) are about a quarter of a stage's compute; backward,
embedding and head are the rest. 20 made the rank only 4-6x its peer with four busy loops sharing the 2 cores (one
report 3.8x), and a CI run missed the straggler; 50 makes it 10x to 28x its peer under the same load (seen)."""

import os
import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))

import model  # noqa: E402

SLOWER = 50

if os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
    forward = model.Block.forward

    def slow_forward(self, *args, **kwargs):
        started = time.perf_counter()
        out = forward(self, *args, **kwargs)
        time.sleep(SLOWER * (time.perf_counter() - started))
        return out

    model.Block.forward = slow_forward

sys.argv = [str(EXAMPLE / "train.py"), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE / "train.py"), run_name="__main__")
