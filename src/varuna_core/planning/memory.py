"""The planner's memory model: the peak bytes of one pipeline stage on one device.

A stage that runs segments ``[a, b)`` with ``M`` micro-batches per step needs

    (static + graphs · saved + inputs · input + outputs · output) · (1 + headroom)

* ``static``: parameters, gradients (the runtime's flat buckets) and optimizer state of its segments;
* ``saved``: the activations autograd saves for one micro-batch over its segments (not counting views of
  parameters, which are static), kept for each of the ``graphs`` micro-batches whose graph the schedule keeps
  alive at once;
* ``input``: one micro-batch's activation at the stage's first cut. ``inputs`` counts the buffers of that size:
  receives posted and not consumed (the window ``act_recvs``, see [Note: receive window] in
  :mod:`varuna_core.ir.inflight`), consumed ones stashed between a micro-batch's ``F`` and ``B`` (``held``), and
  the gradients sent back and still kept (``kept_sends``, [Note: kept sends]). A micro-batch's buffer is in one
  of these states at a time, so ``inputs = min(M, act_recvs + held + kept_sends)``;
* ``output``: one micro-batch's value at the stage's last cut. ``outputs`` counts the buffers of that size: the
  posted gradient receives (the window ``grad_recvs``), the values sent and still kept (``kept_sends``), and the
  outputs of the live graphs: a recompute's output is a new tensor (``+ graphs``), a forward's is the value it
  sent (``min(M, kept_sends + graphs)``);
* ``headroom``: the fraction kept free (allocator fragmentation, CUDA context, the transient tensors of one
  forward or backward, which the profile does not measure).

``held`` and ``graphs`` are the schedule's in-flight counts (:func:`varuna_core.ir.inflight.inflight`, by name
through :func:`varuna_core.planning.simulate.inflight_counts`), ``act_recvs`` and ``grad_recvs`` the windows
:func:`varuna_core.ir.inflight.receive_windows` derives from them (the function the runtime's
:func:`~varuna_core.ir.inflight.posted_receives` uses). The planner evaluates this for every stage it
tries, on prefix sums of the segment numbers. Pure Python, no torch.

[Note: kept sends]
The runtime posts a send as soon as a value exists and waits for its sends only when the step's actions are
done (``PipelineRuntime._finish`` in :mod:`varuna_core.pipeline.executor`); a send's work handle holds its
tensor, so every activation a stage sends (``M`` outputs) and every gradient it sends back (``M`` inputs' worth)
stays allocated until the step ends. The peak comes late in the step: at a stage's last backward every
micro-batch has been forwarded and all but one sent its gradient back, so then ``inputs = M`` and
``outputs = M + (gradient receives still posted)``; under ``1f1b`` the last forward comes with the most graphs,
under ``gpipe`` every forward. So the planner passes ``kept_sends = M``, and a stage's memory grows with the
number of micro-batches by ``M · (input + output)`` (``benchmarks/memory_model.py`` measures it). A runtime
that released a send once it completed would pass its bound instead.
"""

from __future__ import annotations

__all__ = ["stage_bytes"]


def stage_bytes(*, static: float, saved: float, input_bytes: float, output_bytes: float, held: int, graphs: int,
                act_recvs: int, grad_recvs: int, headroom: float, microbatches: int | None = None,
                kept_sends: int = 0, recompute: bool = False) -> float:
    """Predicted peak bytes of one stage (see the module docstring for the terms); ``microbatches``: ``M``, or
    ``None`` for no bound on the buffers per micro-batch; ``recompute``: the stage recomputes before each
    backward (its graphs' outputs are not the values it sent)."""
    bound = float("inf") if microbatches is None else microbatches
    inputs = min(bound, act_recvs + held + kept_sends)
    forwarded = min(bound, kept_sends) + graphs if recompute else min(bound, kept_sends + graphs)
    total = static + graphs * saved + inputs * input_bytes + (grad_recvs + forwarded) * output_bytes
    return total * (1.0 + headroom)
