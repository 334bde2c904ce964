"""Floor L3 — the worker side of a launched job, inside ``Varuna(...)``.

``supervision`` (resume, periodic and on-demand checkpoints, the stop decision; it receives plain values and
callables from the facade and returns decisions, never seeing the ``Varuna`` object), ``beacon`` (heartbeats to
the launcher, in the format of ``launch.protocol``), ``excepthook`` (one line instead of a traceback for a
VarunaError). Imports: L0–L2, this floor and ``launch.protocol``.
"""
