"""Worker process for the multi-process tests: trains ``tests.models.ToyLM`` under ``Varuna`` for each run of
a spec and saves losses and final parameters. Errors are written to ``rank<R>.err`` as ``Type: message``."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from tests import models
from tests.models import SHARED, batch
from varuna_core import Varuna
from varuna_core.errors import VarunaError


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def run_one(run: dict, spec: dict) -> dict:
    torch.manual_seed(run.get("seed", 0))
    model_cls = getattr(models, run.get("model", "ToyLM"))
    model = model_cls(n_layer=run.get("n_layer", 4), dropout=run.get("dropout", 0.0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vm = Varuna(model, spec["map"], batch(2), batch_size=run["batch"], chunk_size=run["chunk"],
                shared_weights=SHARED if run.get("declare_shared", True) else None,
                schedule=run["schedule"], partition=run.get("partition"), validate=run.get("validate", False),
                timeout=spec.get("timeout", 60))
    opt = make_optimizer(run["optimizer"], vm.parameters())
    vm.set_optimizer(opt)
    losses = []
    for step in range(run.get("steps", 3)):
        if run.get("stall_rank") == vm.rank:
            time.sleep(run["stall_seconds"])
        full = batch(run["batch"], seed=100 + step)
        if run.get("bad_seq") and step == run["bad_seq"]:
            full = {k: v[:, :-1] for k, v in full.items()}
        loss, overflow = vm.step(vm.replica_slice(full))
        if not overflow:
            opt.step()
        opt.zero_grad()
        losses.append(loss)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "params": {n: p.detach().clone() for n, p in vm.named_parameters()},
        "held_bytes": held, "stage_bytes": vm.parameter_bytes(), "full_bytes": full_bytes,
        "stage": vm.stage, "replica": vm.replica,
    }


def main() -> None:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = []
    try:
        for run in spec["runs"]:
            results.append(run_one(run, spec))
    except VarunaError as exc:
        (out_dir / f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    torch.save({"runs": results}, out_dir / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
