"""The planner's memory model: the peak bytes of one pipeline stage on one device.

A stage that runs segments ``[a, b)`` with ``M`` micro-batches per step needs

    (static + graphs · saved + inputs · input + outputs · output + pending · weight) · (1 + headroom)

* ``static``: parameters, gradients (the runtime's flat buckets) and optimizer state of its segments;
* ``saved``: the activations autograd saves for one micro-batch over its segments (not counting views of
  parameters, which are static), kept for each of the ``graphs`` micro-batches whose graph the schedule keeps
  alive at once;
* ``input``: one micro-batch's activation at the stage's first cut. ``inputs`` counts the buffers of that size:
  receives posted and not consumed (the window ``act_recvs``, see [Note: receive window] in
  :mod:`varuna_core.ir.inflight`), consumed ones stashed between a micro-batch's ``F`` and ``B`` (``held``), and
  the gradients sent back and not yet waited for (at most the previous stage's gradient window, which is
  ``act_recvs``: [Note: unwaited sends]). A micro-batch's buffer is in one of these states at a time, so
  ``inputs = min(M, 2 · act_recvs + held)``;
* ``output``: one micro-batch's value at the stage's last cut. ``outputs`` counts the buffers of that size: the
  posted gradient receives (the window ``grad_recvs``), the values sent and not yet waited for (at most the next
  stage's activation window, which is ``grad_recvs``), and the outputs of the live graphs: a recompute's output
  is a new tensor (``+ graphs``), a forward's is the value it sent (``min(M, grad_recvs + graphs)``);
* ``weight``: under a schedule that splits the backward (``zb``, ``varuna-zb``), what one micro-batch keeps from its
  ``B``, which frees its graph, to its ``W``: the inputs and output gradients of the split modules, which the
  weights' gradients need (the profile's ``weight_bytes``, the :class:`~varuna_core.model.split.WeightGrads`'
  ``nbytes`` after ``B``), kept for each of the ``pending`` micro-batches between their ``B`` and their ``W`` at once
  (:func:`varuna_core.ir.inflight.pending_weights`). A micro-batch is in that state only after its ``B`` released
  its graph and its stashed input, which the terms above count until then; ``pending`` is 0 without a split;
* ``headroom``: the fraction kept free (allocator fragmentation, CUDA context, the transient tensors of one
  forward or backward, which the profile does not measure).

``held`` and ``graphs`` are the schedule's in-flight counts (:func:`varuna_core.ir.inflight.inflight`, by name
through :func:`varuna_core.planning.simulate.inflight_counts`), ``pending`` its peak of micro-batches waiting for
their ``W`` (by name through :func:`varuna_core.ir.inflight.pending_weights_named`), ``act_recvs`` and
``grad_recvs`` the windows :func:`varuna_core.ir.inflight.receive_windows` derives from them (the function the
runtime's :func:`~varuna_core.ir.inflight.posted_receives` uses). The planner evaluates this for every stage it
tries, on prefix sums of the segment numbers. Pure Python, no torch.

Before the runtime bounded its unwaited sends, it kept every value it sent until the step ended, and a stage's
memory grew by ``M · (input + output)`` with the number of micro-batches (``benchmarks/memory_model.py`` measured
it); now it grows with ``M`` only where the schedule holds ``M`` micro-batches at once (``gpipe``).
"""

from __future__ import annotations

__all__ = ["stage_bytes"]


def stage_bytes(*, static: float, saved: float, input_bytes: float, output_bytes: float, held: int, graphs: int,
                act_recvs: int, grad_recvs: int, headroom: float, microbatches: int | None = None,
                recompute: bool = False, pending: int = 0, weight_bytes: float = 0.0) -> float:
    """Predicted peak bytes of one stage (see the module docstring for the terms); ``microbatches``: ``M``, or
    ``None`` for no bound on the buffers per micro-batch; ``recompute``: the stage recomputes before each
    backward (its graphs' outputs are not the values it sent); ``pending``: micro-batches between their ``B`` and
    their ``W`` at once, each keeping ``weight_bytes`` (a schedule that splits the backward)."""
    bound = float("inf") if microbatches is None else microbatches
    inputs = min(bound, 2 * act_recvs + held)
    forwarded = min(bound, grad_recvs) + graphs if recompute else min(bound, grad_recvs + graphs)
    total = (static + graphs * saved + inputs * input_bytes + (grad_recvs + forwarded) * output_bytes
             + pending * weight_bytes)
    return total * (1.0 + headroom)
