"""Worker for ``tests/dist/test_receives.py``: trains ``ToyLM`` under ``Varuna`` with many micro-batches per
schedule and saves, per step, the runtime's peak of posted and unconsumed receives (``runtime.max_posted``) and
of sent values not yet waited for (``runtime.max_unwaited``), the IR's counts for this stage, the losses and the
final parameters."""

from __future__ import annotations

import torch

from tests.dist.worker import main, make_optimizer
from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna
from varuna_core.ir.inflight import posted_receives, unwaited_sends
from varuna_core.ir.schedule import generate


def run_one(run: dict, spec: dict) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    vm = Varuna(model, spec["map"], batch(2, 0), batch_size=run["batch"], chunk_size=run["chunk"],
                shared_weights=SHARED, schedule=run["schedule"], timeout=spec.get("timeout", 60), seed=1234)
    opt = make_optimizer(run["optimizer"], vm.parameters())
    vm.set_optimizer(opt)
    num_mb = -(-run["batch"] // run["chunk"])
    sched = generate(run["schedule"], vm.topology.pp, num_mb)
    want, want_sends = posted_receives(sched)[vm.stage], unwaited_sends(sched)[vm.stage]
    losses, peaks, unwaited = [], [], []
    for step in range(run["steps"]):
        loss, overflow = vm.step(vm.replica_slice(batch(run["batch"], seed=100 + step)))
        assert not overflow
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        peaks.append(list(vm.executor.max_posted))
        unwaited.append(list(vm.executor.max_unwaited))
    vm.evaluate(batch(run["batch"], seed=999))
    return {"losses": torch.tensor(losses, dtype=torch.float64), "peaks": torch.tensor(peaks),
            "want": torch.tensor(want), "eval_peak": torch.tensor(vm.executor.max_posted),
            "unwaited": torch.tensor(unwaited), "want_sends": torch.tensor(want_sends),
            "eval_unwaited": torch.tensor(vm.executor.max_unwaited),
            "params": {n: p.detach().clone() for n, p in vm.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in vm.named_buffers()}, "stage": vm.stage}


if __name__ == "__main__":
    main(run_one)
