"""Floor L2 — measuring a model and the network for the planner (``varuna profile``).

Imports: L0, L1 and this floor; workers are started with ``varuna_core.util.procs``.
"""
