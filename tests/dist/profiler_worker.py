"""Worker for ``tests/dist/test_original_profiler.py``: every rank runs the original's profiling script.
argv: OUT_DIR."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.models import SHARED, ListCutLM, batch
from varuna import Profiler


def get_batch(size, device=None):
    return batch(size)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ListCutLM()
    profiler = Profiler(model, get_batch, device=-1, out_folder=out / "profiles", shared_weights=SHARED,
                        repeats=1, warmup=0)
    profiler.set_optimizer(torch.optim.AdamW(model.parameters()))
    result = profiler.profile_all([1, 2])
    (out / f"returned{profiler.rank}").write_text("profile" if result is not None else "none")


if __name__ == "__main__":
    main()
