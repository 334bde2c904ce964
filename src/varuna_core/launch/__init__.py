"""Floor L3 — the launcher (``varuna launch``): no torch at module level.

``options`` (what the launch is asked to do, and the defaults the CLI shows), ``protocol`` (the node agent's
spec, commands and events as pydantic models, and the heartbeat datagrams), ``heartbeat`` (the manager's
listener), ``hosts``, ``ssh``, ``agent`` (the node agent), ``attempt`` (one attempt), ``manager`` (restarts and
morphs), ``exclusion`` (hosts left out while they do not answer), ``stragglers``. Imports: L0–L2 modules that
are torch-free at import (``planning``, ``checkpoint.layout``) and this floor; never ``worker`` (the worker's
beacon imports ``protocol``, not the reverse).
"""
