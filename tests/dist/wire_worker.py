"""Worker for ``tests/dist/test_wire.py``: trains a test model under ``Varuna(..., wire_dtype=...)`` and records what
crossed the cuts.

Run options beyond the usual (model, schedule, optimizer, batch, chunk, steps, partition, precision,
init_loss_scale): ``wire`` (passed as ``wire_dtype=``; absent: the keyword is not passed at all), ``reduce`` (passed
as ``reduce_dtype=``), ``record`` (keep every message this rank sent, its kind, dtypes and values, the dtypes of
what arrived, after the cast back, and of the gradients handed to autograd), ``blow`` ``{rank, step, direction,
factor}`` (on that rank at that step, or at ``"eval"`` in the evaluation, multiply the activation leaving its
stage, or the gradient of the activation entering it, by ``factor``: an out-of-range value made on purpose; the
activation's gradient is left alone), ``evaluate`` (examples of an evaluation after training). A ``VarunaError``
of a run is recorded as its ``error`` and the next run goes on.
"""

from __future__ import annotations

import torch

from tests import models
from tests.dist.worker import main, make_optimizer
from tests.models import SHARED, batch
from varuna_core import Varuna
from varuna_core.errors import VarunaError
from varuna_core.pipeline import p2p

_LOG: list | None = None  # the current run's record, when it records


def _recording() -> None:
    """Wrap the functions a stage sends and receives with, and autograd's entry point, to record into ``_LOG``."""
    send, arrived, backward = p2p.send, p2p.Pending.arrived, torch.autograd.backward

    def recorded_send(tensors, *, dst, mb, kind, group):
        if _LOG is not None:
            _LOG.append({"sent": kind, "mb": mb, "dtypes": [str(t.dtype) for t in tensors],
                         "values": [t.detach().clone() for t in tensors]})
        return send(tensors, dst=dst, mb=mb, kind=kind, group=group)

    def recorded_arrived(self):
        tensors = arrived(self)
        if _LOG is not None:
            _LOG.append({"arrived": self.what, "dtypes": [str(t.dtype) for t in tensors]})
        return tensors

    def recorded_backward(tensors, grad_tensors=None, *args, **kwargs):
        if _LOG is not None and grad_tensors is not None:
            _LOG.append({"backward": [str(g.dtype) for g in grad_tensors]})
        return backward(tensors, grad_tensors, *args, **kwargs)

    p2p.send, p2p.Pending.arrived, torch.autograd.backward = recorded_send, recorded_arrived, recorded_backward


def _blow(vm: Varuna, model: torch.nn.Module, spec: dict) -> list:
    """Hooks that make this stage's outgoing activation (its last block's output) or the gradient of its incoming
    one (its first block's input) ``spec["factor"]`` times larger: the activation's value only, not its gradient."""
    owned = [b for b in model.blocks if next(b.parameters()).device.type != "meta"]
    factor = float(spec["factor"])
    if spec["direction"] == "activation":
        def louder(module, args, output):
            return output + output.detach() * (factor - 1.0)

        return [owned[-1].register_forward_hook(louder)]

    def louder_gradient(module, args):
        if args[0].requires_grad:
            args[0].register_hook(lambda g: g * factor)

    return [owned[0].register_forward_pre_hook(louder_gradient)]


def run_one(run: dict, spec: dict) -> dict:
    global _LOG
    torch.manual_seed(0)
    model = getattr(models, run.get("model", "ToyLM"))()
    wire = {"wire_dtype": run["wire"]} if "wire" in run else {}
    if "reduce" in run:
        wire["reduce_dtype"] = run["reduce"]
    vm = Varuna(model, spec["map"], batch(2, 0), batch_size=run["batch"], chunk_size=run["chunk"],
                shared_weights=SHARED, schedule=run["schedule"], partition=run.get("partition"),
                precision=run.get("precision"), timeout=spec.get("timeout", 60), seed=1234, **wire)
    opt = make_optimizer(run["optimizer"], vm.parameters())
    vm.set_optimizer(opt, init_loss_scale=run.get("init_loss_scale", 2**20))
    log: list = []
    _LOG = log if run.get("record") else None
    out: dict = {"stage": vm.stage, "wire_dtype": vm.wire_dtype}
    losses, overflows, scales, counts = [], [], [], []
    blow = run.get("blow") if run.get("blow", {}).get("rank") == vm.rank else None
    try:
        for step in range(run["steps"]):
            hooks = _blow(vm, model, blow) if blow is not None and blow["step"] == step else []
            scales.append(vm.get_loss_scale())
            try:
                loss, overflow = vm.step(vm.replica_slice(batch(run["batch"], seed=100 + step)))
            finally:
                for hook in hooks:
                    hook.remove()
            counts.append(vm.executor.wire_overflows.tolist() if vm.executor.wire_overflows is not None else None)
            if not overflow:
                opt.step()
            opt.zero_grad()
            losses.append(loss)
            overflows.append(overflow)
        scales.append(vm.get_loss_scale())
        if run.get("evaluate"):
            hooks = _blow(vm, model, blow) if blow is not None and blow["step"] == "eval" else []
            out["eval"] = vm.evaluate(batch(run["evaluate"], seed=999))
            for hook in hooks:
                hook.remove()
    except VarunaError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["error_counts"] = vm.executor.wire_overflows.tolist() if vm.executor.wire_overflows is not None else None
    finally:
        _LOG = None
    out.update({"losses": torch.tensor(losses, dtype=torch.float64), "overflows": torch.tensor(overflows),
                "scales": torch.tensor(scales, dtype=torch.float64), "counts": counts, "log": log,
                "params": {n: p.detach().clone() for n, p in vm.named_parameters()}})
    return out


if __name__ == "__main__":
    _recording()  # here, not at import: the tests' forkserver imports this module for every worker it forks
    main(run_one)
