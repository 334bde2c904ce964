"""``examples/gpt/train.py``, except that the first worker started warm for a handover (``VARUNA_HANDOVER=wait``)
dies while warming up: ``warm_crash_worker.py MARKER TRAIN_ARGS...`` (the marker file says it happened). It trains
by ``devtools/paced_train.py``: TRAIN_ARGS begin with ``--pace SECONDS``."""

import os
import runpy
import sys
from pathlib import Path

marker = Path(sys.argv[1])
if os.environ.get("VARUNA_HANDOVER") == "wait" and not marker.exists():
    marker.touch()
    print("error: this worker dies while warming up (a test's fault)", flush=True)
    sys.exit(3)
sys.argv = ["devtools/paced_train.py", *sys.argv[2:]]
runpy.run_path("devtools/paced_train.py", run_name="__main__")
