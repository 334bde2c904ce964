"""The gradient sync overlapped with the stage's last backward, bucket by bucket (as torch DDP's buckets).

Each tied weight's gradient is summed over its stages, then the stage's gradients over its replicas (see
:mod:`varuna_core.pipeline.reduce`). Both start while the stage's last backward still runs, instead of after the
pipeline: the executor says when gradients become final ([Note: final gradients] in
:mod:`varuna_core.pipeline.executor`), each parameter's ``post_accumulate_grad`` hook says when its last
accumulation happened, and the collectives are posted from there, asynchronously; :meth:`OverlappedSync.finish`,
after the pipeline, posts whatever is left and waits for all of it (bounded waits, named as before).

*Order.* Collectives over one process group must be posted in one order on all of its ranks, whatever the timing
(gloo and NCCL match them by their sequence on the group). So the tied weights' sums are posted in the order of
``groups.ties`` (the same on every copy), each once its gradient is final and those before it are posted; and the
buckets in one fixed order (the same on every replica), each once its parameters are final, the sums of the tied
weights among them have completed (the order of summation stays: over the tie, then over the replicas) and the
buckets before it are posted. The fixed order is the reverse of the buffer's (gradients become final from the last
layer to the first), with the buckets that hold a tied weight at the end: a tie's sum completes only when its
other stages are done too, and every bucket after it in the order would wait for it. Nothing here waits for a
peer before the pipeline is over (a stage waiting there for a tie's sum could deadlock with the stage whose
gradient it waits for): a tie's sum is polled (``is_completed``).

*A parameter that gets no gradient* (unused in the last micro-batch, or in the whole step) is never seen by its
hook in the last backward: it is final when the executor says the last final action ended, and ``finish`` posts
what is still left in any case, so no bucket waits for it.

[Note: bucket boundaries] The buckets are the same ranges as the sync after the pipeline uses
(:meth:`~varuna_core.pipeline.grads.GradBuffer.buckets`: consecutive ``bucket_bytes`` of each flat buffer from its
start); only the time and order of posting differ. This matters beyond ``dp = 2`` (where a sum of two is exact in
any order): gloo's ring all-reduce cuts a tensor into one chunk per rank and adds each chunk around the ring from
another rank, so an element's sum ``(a + b) + c`` or ``(b + c) + a`` depends on where the tensor's chunk
boundaries fall, i.e. on the bucket's start and length. Measured (gloo, 3 ranks, 100,000 random fp32 of mixed
magnitudes): summed whole or in buckets of 7,777 elements, 19,764 elements differ in their last bits; summed in
the same buckets posted in reverse order, all at once, none does. Same buckets, same contents: the same sums, bit
for bit (``tests/dist/test_overlap.py`` compares every gradient at ``dp = 3``). Each bucket's collective is
independent of the others', so posting them in another order or at other times changes no bit.

*Hooks* never touch ``.grad`` (a view of the flat buffer, which the split backward's ``W`` adds into too); they
note that the parameter is final and post what became ready. An error in posting is kept and raised after the
action (not through autograd).

A sharded optimizer's reduce-scatter (:mod:`varuna_core.pipeline.shard`) still runs in :meth:`finish`: its ring
buckets take a slice of every replica's range of the buffer at once, each range spans the buffer, so a bucket is
complete only when nearly every gradient is final; and it is a ring of blocking exchanges with additions between
them, which would need a thread to progress during the backward. Only the tied weights' sums overlap there.

``VARUNA_OVERLAP_SYNC=0`` puts the whole sync after the pipeline (:class:`~varuna_core.pipeline.reduce.GradSync`),
for comparison and debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..errors import InternalError
from ..model.stage import TieSet
from .grads import Bucket, BucketReduction, GradBuffer, post_tie_sum, tie_tag
from .p2p import wait_all

__all__ = ["OverlappedSync"]


class OverlappedSync:
    """Posts the tied weights' sums and the data-parallel buckets as the stage's gradients become final.

    Args:
        grad_buffer: the stage's gradients.
        ties: ``(tie, its group, this stage's copy)`` per tied weight, in the order of ``groups.ties``.
        dp: the stage's data-parallel group, or ``None`` (no replicas, or a sharded optimizer's reduce-scatter
            after the pipeline instead).
        timeout, describe: bounded waits, ``describe(what)`` naming this rank and stage.
    """

    def __init__(self, grad_buffer: GradBuffer, ties: list[tuple[TieSet, Any, nn.Parameter]], dp: Any, *,
                 timeout: float, describe: Callable[[str], str]) -> None:
        self.grad_buffer, self.dp, self.timeout, self.describe = grad_buffer, dp, timeout, describe
        params = grad_buffer.params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._ties = [(tie, group, self._index[id(p)]) for tie, group, p in ties if id(p) in self._index]
        tie_of = {i: t for t, (_, _, i) in enumerate(self._ties)}
        self._buckets: list[tuple[Bucket, list[int]]] = []  # in the posting order, with the ties each waits for
        if dp is not None:
            # reverse buffer order (a parameter spread over several buckets: its last range first), ties last
            order = sorted(grad_buffer.buckets(),
                           key=lambda b: (any(i in tie_of for i in b.params), -min(b.params), -b.start))
            self._buckets = [(b, [tie_of[i] for i in b.params if i in tie_of]) for b in order]
        self._of: dict[int, list[int]] = {}  # parameter index -> the buckets (positions in the order) holding it
        for k, (bucket, _) in enumerate(self._buckets):
            for i in bucket.params:
                self._of.setdefault(i, []).append(k)
        # only the parameters a tie sum or a bucket waits for: a hook is a Python call per parameter per backward
        # (at dp = 1 with a tied weight, the others' hooks cost every backward of the step for nothing)
        watched = sorted({i for _, _, i in self._ties} | set(self._of))
        self._hooks = [params[i].register_post_accumulate_grad_hook(self._accumulated) for i in watched]
        self.posted_early = 0  # collectives (tie sums and buckets) the last step posted before its pipeline ended
        self._reset()

    @property
    def active(self) -> bool:
        """Whether there is anything to sync (replicas or tied weights)."""
        return bool(self._hooks)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _reset(self) -> None:
        n = len(self.grad_buffer.params)
        self._armed = False
        self._pending: frozenset[int] = frozenset()
        self._final = [False] * n
        self._missing = [len(b.params) for b, _ in self._buckets]  # per bucket: parameters not final yet
        self._tie_works: list[Any] = []  # posted tie sums, in order
        self._reductions: list[BucketReduction] = []  # posted buckets, in order
        self._error: BaseException | None = None

    def begin(self) -> OverlappedSync:
        """A new step: nothing is final or posted (what a failed step left posted is dropped)."""
        self._reset()
        return self

    # -- told by the executor ([Note: final gradients]) and by the hooks --------------------------------------

    def final_action(self, pending: frozenset[int]) -> None:
        self._raise()
        self._armed, self._pending = True, pending

    def final_action_done(self, pending: frozenset[int]) -> None:
        self._armed = False
        for p, i in self._index.items():
            if p not in pending:
                self._mark(i)
        self._post()
        self._raise()

    def _accumulated(self, param: torch.Tensor) -> None:
        """``param``'s post-accumulate hook: in a final action, the last accumulation unless a ``W`` is pending."""
        if not self._armed or id(param) in self._pending or self._error is not None:
            return
        i = self._index.get(id(param))
        if i is not None and not self._final[i]:
            self._mark(i)
            try:
                self._post()
            except Exception as exc:  # noqa: BLE001 - raised after the action, not through autograd
                self._error = exc

    def _mark(self, i: int) -> None:
        if not self._final[i]:
            self._final[i] = True
            for k in self._of.get(i, ()):
                self._missing[k] -= 1

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- posting --------------------------------------------------------------------------------------------

    def _post(self, ties_waited: bool = False) -> None:
        """Post every tie sum and bucket that is ready and whose predecessors in the order are posted
        (``ties_waited``: the tie sums posted have been waited for; under NCCL a wait orders the streams without
        the sum having completed yet, so ``is_completed`` may still say no)."""
        while len(self._tie_works) < len(self._ties):
            _, group, i = self._ties[len(self._tie_works)]
            if not self._final[i]:
                break
            grad = self.grad_buffer.params[i].grad
            assert grad is not None  # attached before the step
            self._tie_works.append(post_tie_sum(grad, group, tie_tag(self._ties[len(self._tie_works)][0].canonical)))
        while len(self._reductions) < len(self._buckets):
            k = len(self._reductions)
            bucket, ties = self._buckets[k]
            summed = all(t < len(self._tie_works) and (ties_waited or self._tie_works[t].is_completed()) for t in ties)
            if self._missing[k] or not summed:
                break
            self._reductions.append(self.grad_buffer.launch(bucket, self.dp))

    def finish(self) -> None:
        """After the pipeline: every gradient is final; post what is left (the tie sums waited for first), and wait
        for everything."""
        self._armed = False
        self._raise()
        self.posted_early = len(self._tie_works) + len(self._reductions)
        for i in range(len(self._final)):
            self._mark(i)
        self._post()  # every tie sum is posted now
        for (tie, _, _), work in zip(self._ties, self._tie_works, strict=True):
            what = f"summing gradients of tied weight {tie.canonical!r}"
            wait_all([work], timeout=self.timeout, peer=None,
                     describe=lambda: self.describe(what))  # noqa: B023 - called (on a failure) before the next tie
        self._post(ties_waited=True)
        if len(self._tie_works) < len(self._ties) or len(self._reductions) < len(self._buckets):
            raise InternalError(f"{self.describe('gradient sync')}: {len(self._ties) - len(self._tie_works)} tie sums "
                                f"and {len(self._buckets) - len(self._reductions)} buckets left unposted after the "
                                "pipeline")
        for reduction in self._reductions:
            reduction.wait(timeout=self.timeout, describe=lambda: self.describe("data-parallel all-reduce"))
        self._reset()
