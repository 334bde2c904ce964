"""examples/gpt/train.py whose rank ``CRASH_RANK`` dies of SIGABRT as it leaves after its on-demand checkpoint (the
checkpointed exit, 75), as a worker can in gloo's or the interpreter's teardown once its work is saved."""

import os
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))
sys.argv = [str(EXAMPLE / "train.py"), *sys.argv[1:]]
try:
    runpy.run_path(str(EXAMPLE / "train.py"), run_name="__main__")
except SystemExit as exc:
    if exc.code == 75 and os.environ.get("RANK") == os.environ.get("CRASH_RANK"):
        sys.stdout.flush()
        os.abort()
    raise
