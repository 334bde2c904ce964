"""Worker for ``tests/dist/test_user_signal.py``: a script in the original's style with its own SIGUSR1 handler
(checkpoint, then exit), installed after ``Varuna(...)``. Rank 0 signals itself after step 2; every rank must run
the handler at the same step and exit 0 with a complete checkpoint. argv: OUT_DIR."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from tests.models import SHARED, ToyLM, batch
from varuna import Varuna


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Varuna(ToyLM(), "0;1", batch(2), 8, 2, shared_weights=SHARED, timeout=30)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_optimizer(optimizer)

    def handler(signum, frame):  # as the original's README: checkpoint, then exit
        model.checkpoint(str(out / "ckpt"), step=model.iteration)
        (out / f"handled{rank}").write_text(str(model.iteration))
        sys.exit(0)

    signal.signal(signal.SIGUSR1, handler)
    for step in range(10):
        loss, overflow = model.step(batch(8, seed=100 + step))
        if not overflow:
            optimizer.step()
        optimizer.zero_grad()
        if step == 1 and rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
    (out / f"finished{rank}").write_text("trained all steps: the handler never ran")


if __name__ == "__main__":
    main()
