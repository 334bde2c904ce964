"""Floor L1 — choosing a configuration, without torch (``varuna plan`` starts fast and runs anywhere).

``artifacts`` (the ``Profile`` and ``Plan``), ``memory`` (the one memory model), ``simulate`` (the simulator; the
C++ or the Python one is chosen there and only there), ``planner`` and ``timeline``. Imports: L0 and this
floor; never torch at module level.
"""
