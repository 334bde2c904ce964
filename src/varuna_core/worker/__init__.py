"""Floor L3 — the worker side of a launched job: heartbeats, preemption notices, on-demand checkpoints.

Supervision receives callables and plain values from the facade and returns decisions; it never sees the
``Varuna`` object. Imports: L0–L2, this floor and the wire protocol in ``launch.heartbeat``.
"""
