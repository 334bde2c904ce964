"""The reference of the parity tests: one plain process, no library, that adds floating-point numbers in the order
a pipeline adds them, so that a pipelined run must equal it **bit for bit** on any machine.

A pipelined step computes exactly the ops of one process (the same kernels, the same precision, the same rounding
of every op), but it *sums* in another order than a naive full-batch step:

* each replica's gradient is accumulated micro-batch by micro-batch (``g0 + g1 + g2``), not computed from one
  full-batch backward;
* a tied weight held by two stages gets one gradient per copy, summed after the pipeline (``g_emb + g_head``),
  where autograd sums the two uses inside every micro-batch's backward;
* the replicas' gradients (and losses) are summed after their pipelines (``replica0 + replica1``).

Floating-point addition is not associative, so a naive reference differs from the pipeline in the last bit of
some gradient, and an optimizer such as Adam (``m / sqrt(v)`` normalises tiny gradients to steps of ``lr``)
amplifies that over the steps: on the example GPT, fp32, 20 AdamW steps, parameters differ by 7e-4 relative; in
bf16 autocast, where a last-bit change of a weight flips its bf16 rounding, by 1.5e-2; in fp16 by 0.36. A
tolerance on that gap is a tolerance on one machine's trajectory. This reference does the same sums in the same
order instead (micro-batches per replica, tied copies as separate parameters summed once per step, replicas
summed after), so the comparison is ``torch.equal`` in every precision, schedule and partition: anything else is
a defect.

Buffers a forward writes (BatchNorm statistics, counters) change as in one process: once per micro-batch, in
micro-batch order. With replicas, each replica's forwards start from the step's buffers and see only its own
micro-batches; after the step every replica takes replica 0's (as DDP with ``broadcast_buffers=True``). The
reference does exactly that: per replica it starts from the step's buffers, and ends the step with replica 0's.

Exactness holds when every sum of the pipeline has at most two non-zero terms per element (two copies of a tied
weight, two replicas): ``a + b == b + a`` in IEEE arithmetic, whatever order the collective uses. With more terms
the collective's own order has to be mirrored: the copies of a tied weight are added in the order of gloo's ring
all-reduce (:func:`ring_sum`); replicas are added in one order, so tests with more than two replicas state their
tolerance and why.

A module that the forward calls at several depths (one layer's weights reused, as ALBERT's) is a tied weight too:
each stage calling it holds a copy, autograd adds the uses of the stage's calls within its backward, and the
copies are summed after the pipeline. ``reused`` names such a module and ``Layout.calls`` the stage of each of its
calls; the reference gives every stage its own copy of the module's parameters, used by that stage's calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["Layout", "train_reference", "replica_shares", "untie", "ring_sum"]

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Layout:
    """How a pipelined run adds: ``batch`` examples per step over ``dp`` replicas of ``pp`` stages, in
    micro-batches of ``chunk``. The tied weights of the models here join the first and the last segment, so
    their copies sit on different stages exactly when ``pp > 1``."""

    batch: int
    chunk: int
    dp: int = 1
    pp: int = 1
    calls: tuple[int, ...] = ()  # the stage of each call of train_reference's ``reused`` module in one forward


def replica_shares(batch: int, dp: int) -> list[int]:
    """Examples per replica: consecutive slices of the global batch, the first ``batch % dp`` one larger."""
    base, extra = divmod(batch, dp)
    return [base + (1 if r < extra else 0) for r in range(dp)]


def _microbatches(n: int, chunk: int) -> list[int]:
    full, rest = divmod(n, chunk)
    return [chunk] * full + ([rest] if rest else [])


def untie(model: nn.Module, ties: Sequence[Sequence[str]]) -> list[list[nn.Parameter]]:
    """Give every name of each tie but the first its own copy of the tied parameter (same values); returns each
    tie's copies in stage order. The reference then decides where their gradients add up."""
    copies = []
    for names in ties:
        first = model.get_parameter(names[0])
        group = [first]
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if owner.get_parameter(attr) is not first:
                raise ValueError(f"{name} is not tied to {names[0]}")
            copy = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
            setattr(owner, attr, copy)
            group.append(copy)
        copies.append(group)
    return copies


class _CallCopies:
    """One copy of a module's parameters per stage that calls it: a pre-hook on the module puts in the copy of the
    stage of its current call (``calls``, set per step), counted from the start of each forward of the model. The
    copies are registered under the model (so ``parameters()`` lists them) until :meth:`close`."""

    HOLDER = "_reference_copies"

    def __init__(self, model: nn.Module, name: str, stages: int) -> None:
        module = model.get_submodule(name)
        self.slots = [(owner, attr) for owner in module.modules() for attr, p in owner._parameters.items()
                      if p is not None]
        first = [owner._parameters[attr] for owner, attr in self.slots]
        self.copies = [first] + [[nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in first]
                                 for _ in range(stages - 1)]
        self.model = model
        model.add_module(self.HOLDER, nn.ParameterList([p for copy in self.copies[1:] for p in copy]))
        self.calls: tuple[int, ...] = ()
        self.count = 0
        self.handles = [model.register_forward_pre_hook(self._start), module.register_forward_pre_hook(self._call)]

    def groups(self) -> list[list[nn.Parameter]]:
        """Each parameter's copies in stage order, as :func:`untie` returns a tie's."""
        return [[copy[i] for copy in self.copies] for i in range(len(self.slots))]

    def _start(self, model, args) -> None:
        self.count = 0

    def _call(self, module, args) -> None:
        stage = self.calls[self.count] if self.calls else 0
        self.count += 1
        for (owner, attr), p in zip(self.slots, self.copies[stage], strict=True):
            owner._parameters[attr] = p

    def close(self) -> None:
        """The plain model again: its own names, holding the first copy (the copies are equal after every step)."""
        for handle in self.handles:
            handle.remove()
        for (owner, attr), p in zip(self.slots, self.copies[0], strict=True):
            owner._parameters[attr] = p
        if hasattr(self.model, self.HOLDER):
            delattr(self.model, self.HOLDER)


def _narrow(inputs: dict, dims: dict, start: int, n: int) -> dict:
    return {k: v.narrow(dims.get(k, 0), start, n) if isinstance(v, torch.Tensor) and dims.get(k, 0) is not None
            else v for k, v in inputs.items()}


def ring_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum gloo's ring all-reduce computes over ``terms`` (one per rank of the group, in rank order), in its
    order: the tensor is split into ``2k`` segments for ``k`` ranks (gloo's minimum; its maximum segment size splits
    only tensors far larger than these tests'), rank ``a`` owns segments ``2a`` and ``2a + 1``, and each segment
    travels the ring down from rank ``a - 1``, every rank adding its own term to what it received, so rank ``a``'s
    term is added last: ``x[a] + (x[a-2] + x[a-1])`` for three ranks. Checked against ``dist.all_reduce`` on gloo
    for 3 and 4 ranks and tensors of 1 to 3 million elements."""
    k = len(terms)
    if k == 1:
        return terms[0].clone()
    flat = [t.reshape(-1) for t in terms]
    n, size = flat[0].numel(), flat[0].element_size()
    segments = 2 * k
    segment_bytes = _ceil_div(_ceil_div(n * size, segments), size) * size  # whole elements
    owner = torch.arange(n, device=flat[0].device) * size // segment_bytes // (segments // k)
    out = torch.empty_like(flat[0])
    for a in range(k):
        mine = owner == a
        value = flat[(a - 1) % k][mine]
        for d in range(2, k + 1):
            value = flat[(a - d) % k][mine] + value
        out[mine] = value
    return out.reshape(terms[0].shape)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _loss_of(output) -> torch.Tensor:
    """The loss in a model's output: the output itself, its ``loss`` (a Hugging Face output), or its first entry."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else output[0]


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """``a + b``, where ``None`` is a gradient not computed yet (zero: the pipeline's buffers start at zero)."""
    if a is None or b is None:
        return b if a is None else a
    return a + b


def train_reference(model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    steps: int, batch_at: Callable[[int], dict], layout: Layout | Sequence[Layout], *,
                    ties: Sequence[Sequence[str]] = (), precision: str = "fp32", loss_scale: float | None = None,
                    loss_reduction: str = "mean", batch_dims: dict | None = None, clip: float | None = None,
                    norms: list[float] | None = None, reused: str | None = None,
                    buffers: dict[str, torch.Tensor] | None = None, device: str | torch.device = "cpu",
                    reduce_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Train ``model`` for ``steps`` steps of ``batch_at(step)`` (a global batch, a dict of tensors) as a pipeline
    with ``layout`` adds (one layout, or one per step: a run resumed under another layout). ``ties`` names the
    model's tied weights (``("emb.weight", "head.weight")``). Returns the losses (float64 ``[steps]``, each the
    global batch's loss as the pipeline reports it) and the final parameters under every name the plain model
    has (tied names included). ``reused``: a module the forward calls at several depths, whose calls each
    layout places on stages (``Layout.calls``; see the module's docstring).

    ``device``: where the model already is; each batch is moved there, and every sum is done there (the GPU
    tests compare a CUDA pipeline with this on CUDA). ``reduce_dtype``: the replicas' gradients are summed in it
    and cast back, as ``Varuna(..., reduce_dtype=...)`` all-reduces them.
    ``precision`` ``bf16``/``fp16`` runs each forward under ``torch.autocast`` of that device; fp16 multiplies each
    micro-batch's weighted loss by ``loss_scale`` and unscales the summed gradients with torch's AMP kernel, as
    the pipeline does (an overflow here is an error: the tests choose a scale that does not overflow).
    ``clip`` clips by the global gradient norm (each tied weight counted once) as ``model.step(...,
    clip_grad_max_norm=clip)`` does; each step's norm before clipping is appended to ``norms``. The pipeline sums
    the squared norm over its ranks in the collective's order (float64), so with several ranks the clipping
    factor may differ from this one in its last bit: tests that clip state a tolerance. ``buffers``, if given,
    receives the final buffers under every name the plain model has (see the module's docstring for replicas).
    Runs on one thread, as the workers do.
    """
    layouts = [layout] * steps if isinstance(layout, Layout) else list(layout)
    if len(layouts) != steps:
        raise ValueError(f"{len(layouts)} layouts for {steps} steps")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every worker runs: a kernel may split a reduction by thread count
    try:
        call_copies = None
        if reused is not None:
            call_copies = _CallCopies(model, reused, max(max(layout.calls, default=0) for layout in layouts) + 1)
        try:
            losses, params = _train(model, make_optimizer, batch_at, layouts, ties, precision, loss_scale,
                                    loss_reduction, batch_dims or {}, clip, norms if norms is not None else [],
                                    call_copies, torch.device(device), reduce_dtype)
        finally:
            if call_copies is not None:
                call_copies.close()
        if buffers is not None:
            buffers.update({n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)})
        return losses, params
    finally:
        torch.set_num_threads(threads)


def _train(model, make_optimizer, batch_at, layouts, ties, precision, loss_scale, loss_reduction, dims, clip, norms,
           call_copies, device, reduce_dtype=None):
    copies = untie(model, ties) + (call_copies.groups() if call_copies is not None else [])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params)
    losses = []
    for step, layout in enumerate(layouts):
        if call_copies is not None:
            call_copies.calls = layout.calls
        full = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch_at(step).items()}
        replica_grads, replica_losses, start = [], [], 0
        at_step = [b.detach().clone() for b in model.buffers()]
        for replica, share in enumerate(replica_shares(layout.batch, layout.dp)):
            if replica > 0:  # each replica starts the step from the step's buffers
                with torch.no_grad():
                    for b, value in zip(model.buffers(), at_step, strict=True):  # the forward may replace one
                        b.copy_(value)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            acc: list[torch.Tensor | None] = [None] * len(params)
            for n in _microbatches(share, layout.chunk):
                weight = n / layout.batch if loss_reduction == "mean" else 1.0
                with (torch.autocast(device.type, dtype=_AUTOCAST[precision]) if precision in _AUTOCAST
                      else contextlib.nullcontext()):
                    loss = _loss_of(model(**_narrow(full, dims, start, n)))
                start += n
                loss_sum += loss.detach().reshape(()).double() * weight
                root = loss.float() * weight
                if precision == "fp16":
                    root = root * torch.tensor([float(loss_scale)], device=device)
                root.sum().backward()
                if layout.pp == 1:  # one stage holds one tied weight: autograd adds its uses within the backward
                    for group in copies:
                        merged = None
                        for p in group:
                            merged = _add(merged, p.grad)
                        for p in group:
                            p.grad = merged
                for i, p in enumerate(params):  # the stage's gradient buffer accumulates the micro-batches
                    acc[i] = _add(acc[i], p.grad)
                    p.grad = None
            if layout.pp > 1:  # the tie all-reduce after the pipeline: every copy gets the copies' sum
                index = {id(p): i for i, p in enumerate(params)}
                for group in copies:
                    held = [acc[index[id(p)]] for p in group if acc[index[id(p)]] is not None]
                    total = ring_sum(held) if held else None
                    for p in group:
                        acc[index[id(p)]] = total
            replica_grads.append(acc)
            replica_losses.append(loss_sum)
            if replica == 0:
                after_first = [b.detach().clone() for b in model.buffers()]
        with torch.no_grad():  # replica 0's buffers win (broadcast after the step)
            for b, value in zip(model.buffers(), after_first, strict=True):
                b.copy_(value)
        for i, p in enumerate(params):  # the data-parallel all-reduce
            grad = None
            for grads in replica_grads:
                term = grads[i]
                grad = _add(grad, term.to(reduce_dtype) if term is not None and reduce_dtype is not None else term)
            p.grad = torch.zeros_like(p) if grad is None else grad.to(p.dtype, copy=True)
        if precision == "fp16":
            found_inf = torch.zeros(1, device=device)
            inv_scale = torch.tensor([float(loss_scale)], device=device).double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found_inf, inv_scale)
            if found_inf.item():
                raise AssertionError(f"the reference overflowed at step {step} with loss scale {loss_scale}")
        counted = [p for p in params if not any(p is q for group in copies for q in group[1:])]
        norm = float(torch.stack(torch._foreach_norm([p.grad for p in counted])).double().pow(2).sum()) ** 0.5
        norms.append(norm)
        if clip is not None:
            torch._foreach_mul_([p.grad for p in params], min(clip / (norm + 1e-6), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        total = replica_losses[0]
        for other in replica_losses[1:]:
            total = total + other
        losses.append(float(total))
    for group in copies:
        for p in group[1:]:
            if not torch.equal(p, group[0]):
                raise AssertionError("the copies of a tied weight diverged in the reference")
    if call_copies is not None:
        call_copies.close()
    params_out = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return torch.tensor(losses, dtype=torch.float64), params_out
