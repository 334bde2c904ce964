"""The planner's memory model: the peak bytes of one pipeline stage on one device.

A stage that runs segments ``[a, b)`` needs

    (static + graphs · saved + held · input + num_mb · (input + output)) · (1 + headroom)

* ``static``: parameters, gradients and optimizer state of its segments;
* ``saved``: the activations autograd saves for one micro-batch over its segments, kept for each of the
  ``graphs`` micro-batches whose graph the schedule keeps alive at once;
* ``input``: one micro-batch's activation at the stage's first cut, stashed for each of the ``held``
  micro-batches between their ``F`` and ``B``;
* ``num_mb · (input + output)``: the receive buffers the runtime posts for every micro-batch of the step
  (activations in at the first cut, gradients in at the last);
* ``headroom``: the fraction kept free (allocator fragmentation, CUDA context).

``held`` and ``graphs`` are the schedule's in-flight counts (:func:`varuna_core.ir.inflight.inflight`, by name
through :func:`varuna_core.planning.simulate.inflight_counts`). The planner evaluates this for every stage it
tries, on prefix sums of the segment numbers. Pure Python, no torch.
"""

from __future__ import annotations

__all__ = ["stage_bytes"]


def stage_bytes(*, static: float, saved: float, input_bytes: float, output_bytes: float, held: int, graphs: int,
                num_mb: int, headroom: float) -> float:
    """Predicted peak bytes of one stage (see the module docstring for the terms)."""
    total = static + graphs * saved + held * input_bytes + num_mb * (input_bytes + output_bytes)
    return total * (1.0 + headroom)
