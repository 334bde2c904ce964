"""Worker for ``tests/dist/test_exit.py``: a script that keeps its model and optimizer in module globals (as
scripts without a ``main()`` do), makes the default process group itself after importing varuna, and trains a
few steps of a 2-stage pipeline with a tied weight (so a sub-group exists). Its first ``atexit`` handler runs
last, when only the interpreter's teardown is left: it records the threads alive then, and those alive once the
default process group was made. A thread of a process group still running in the teardown may need the GIL of
an interpreter being torn down and end the process with SIGABRT after a successful run. argv: OUT_DIR."""

import atexit
import json
import os
import sys
from pathlib import Path

OUT = Path(sys.argv[1])


def threads() -> list[str]:
    return sorted((Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task"))


atexit.register(lambda: (OUT / f"exit{os.environ['RANK']}.json").write_text(json.dumps(threads())))  # runs last

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.models import SHARED, ToyLM, batch  # noqa: E402
from varuna import Varuna  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
dist.init_process_group("gloo")
(OUT / f"start{os.environ['RANK']}.json").write_text(json.dumps(threads()))
model = Varuna(ToyLM(), "0;1", batch(2), 8, 2, shared_weights=SHARED, timeout=30)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model.set_optimizer(optimizer)
for step in range(3):
    loss, overflow = model.step(batch(8, seed=100 + step))
    optimizer.step()
    optimizer.zero_grad()
