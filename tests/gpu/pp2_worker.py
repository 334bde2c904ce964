"""One rank of a two-rank ToyLM run on the one GPU of the machine (both ranks on the same device), started by
``test_two_ranks.py`` with torchrun's environment.

    python -m tests.gpu.pp2_worker BACKEND DEVICE OUT_DIR [MAP [WIRE]]

``MAP``: the stage-to-rank map, ``0;1`` (pp=2, the default) or ``0,1`` (pp=1 x dp=2: each rank steps its half of the
global batch, the replicas' gradients summed over the group while the last backward runs). ``WIRE``: ``Varuna``'s
``wire_dtype`` (``bf16``, ``fp16``; default none).

``BACKEND`` ``nccl``: the library's default (``device=-1``, every rank's ``LOCAL_RANK`` 0), which must refuse;
``gloo``: the script joins a gloo group itself before ``Varuna(...)``, and the ranks then share the GPU. As a
training script does, it lets a ``VarunaError`` propagate (the library reports it in one line and exits with its
code); results (losses, parameters and buffers by name) go to ``OUT_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna

STEPS, BATCH, CHUNK = 3, 8, 2
PARTITION = [(0, 2), (2, 5)]  # ToyLM's 5 segments on 2 stages: the boundary is cuts.1 (what the wire test rounds)


def main(backend: str, device: str, out: Path, stage_map: str = "0;1", wire: str | None = None) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if backend == "gloo":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    vm = Varuna(ToyLM(), stage_map, batch(2, 99), batch_size=BATCH, chunk_size=CHUNK, shared_weights=SHARED,
                device=-1 if backend == "nccl" else device, timeout=30, schedule="1f1b", wire_dtype=wire,
                partition=PARTITION if ";" in stage_map else None)
    replicas = stage_map.count(",") + 1
    share = slice(rank * BATCH // replicas, (rank + 1) * BATCH // replicas) if replicas > 1 else slice(None)
    opt = torch.optim.SGD(list(vm.parameters()), lr=0.05, momentum=0.9)
    vm.set_optimizer(opt)
    losses = []
    for step in range(STEPS):
        loss, _ = vm.step({k: v[share] for k, v in batch(BATCH, step).items()})
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    state = {n: t.detach().cpu() for n, t in [*vm.named_parameters(), *vm.named_buffers()]}
    torch.save({"losses": losses, "state": state, "device": str(vm.device), "backend": dist.get_backend()},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:6])
