"""Floor L0 — the pipeline's intermediate representation, pure Python (no torch anywhere).

Schedules (``Action``/``Schedule``, generators and validation), in-flight counts, the stage-to-rank map
(``Topology``), partitions of segments into stages and byte-size units. The simulator scores and the executor
runs the very same ``Schedule`` objects. Imports: ``varuna_core.errors`` and ``varuna_core.util`` only.
"""
