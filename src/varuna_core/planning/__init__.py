"""Floor L1 — choosing a configuration, without torch (``varuna plan`` starts fast and runs anywhere).

The ``Profile`` and ``Plan`` artifacts, the one memory model, the simulator (native or Python, chosen in
``simulate``), the planner and timelines. Imports: L0 and this floor; never torch at module level.
"""
