"""Floor L2 — checkpoints, knowing nothing of ``Varuna``.

``layout`` (torch-free: step directories, ``RUN``, ``COMPLETE``, latest), ``manifest``, raw file ``io``, the
DCP ``storage``, ``saveload`` (save and load a plain ``CheckpointState`` the facade fills) and the offline
``tools`` behind ``varuna ckpt``. Imports: L0, L1 and this floor; the launcher imports ``layout`` without torch.
"""
