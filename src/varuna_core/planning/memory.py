"""The planner's memory model: the peak bytes of one pipeline stage on one device.

A stage that runs segments ``[a, b)`` needs

    (static + graphs · saved + held · input + act_recvs · input + grad_recvs · output) · (1 + headroom)

* ``static``: parameters, gradients and optimizer state of its segments;
* ``saved``: the activations autograd saves for one micro-batch over its segments, kept for each of the
  ``graphs`` micro-batches whose graph the schedule keeps alive at once;
* ``input``: one micro-batch's activation at the stage's first cut, stashed for each of the ``held``
  micro-batches between their ``F`` and ``B``;
* ``act_recvs · input + grad_recvs · output``: the receive buffers the runtime keeps posted and not yet
  consumed (activations in at the first cut, gradients in at the last), at most its receive window per
  direction (:func:`varuna_core.ir.inflight.posted_receives`, see [Note: receive window] there), not one per
  micro-batch of the step: ``held(s-1)`` and ``held(s)`` for stage ``s`` (0 on the first, resp. last, stage);
  a consumed activation buffer becomes the stashed input counted in ``held · input``;
* ``headroom``: the fraction kept free (allocator fragmentation, CUDA context).

``held`` and ``graphs`` are the schedule's in-flight counts (:func:`varuna_core.ir.inflight.inflight`, by name
through :func:`varuna_core.planning.simulate.inflight_counts`), ``act_recvs`` and ``grad_recvs`` the windows
:func:`varuna_core.ir.inflight.receive_windows` derives from them (the function the runtime's
:func:`~varuna_core.ir.inflight.posted_receives` uses). The planner evaluates this for every stage it
tries, on prefix sums of the segment numbers. Pure Python, no torch.
"""

from __future__ import annotations

__all__ = ["stage_bytes"]


def stage_bytes(*, static: float, saved: float, input_bytes: float, output_bytes: float, held: int, graphs: int,
                act_recvs: int, grad_recvs: int, headroom: float) -> float:
    """Predicted peak bytes of one stage (see the module docstring for the terms)."""
    total = static + graphs * saved + (held + act_recvs) * input_bytes + grad_recvs * output_bytes
    return total * (1.0 + headroom)
