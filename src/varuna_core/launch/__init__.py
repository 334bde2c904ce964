"""Floor L3 — the launcher (``varuna launch``): no torch at module level.

Heartbeat wire protocol, hosts, SSH, the node agent, one attempt, the manager that restarts and morphs, the
straggler monitor. Imports: L0–L2 modules that are torch-free at import (``planning``, ``checkpoint.layout``)
and this floor.
"""
