"""``examples/gpt/train.py``, except that the first worker started warm for a handover (``VARUNA_HANDOVER=wait``)
dies right after it took its state, before its first step: ``take_crash_worker.py MARKER TRAIN_ARGS...`` (the
marker file says it happened). It trains by ``devtools/paced_train.py``: TRAIN_ARGS begin with ``--pace SECONDS``."""

import os
import runpy
import sys
from pathlib import Path

import varuna_core

marker = Path(sys.argv[1])
if os.environ.get("VARUNA_HANDOVER") == "wait":
    set_optimizer = varuna_core.Varuna.set_optimizer

    def taken_then_dead(self, *args, **kwargs):
        set_optimizer(self, *args, **kwargs)  # a warm worker takes its state here
        if not marker.exists():
            marker.touch()
            print("error: this worker dies after taking its state (a test's fault)", flush=True)
            os._exit(3)

    varuna_core.Varuna.set_optimizer = taken_then_dead
sys.argv = ["devtools/paced_train.py", *sys.argv[2:]]
runpy.run_path("devtools/paced_train.py", run_name="__main__")
