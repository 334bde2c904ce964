"""Floor L2 — checkpoints, knowing nothing of ``Varuna``.

``layout`` (torch-free: step directories, ``RUN``, ``COMPLETE``, the one ``latest``), ``manifest`` (torch-free),
raw file ``io``, the DCP ``storage``, ``state`` (the plain ``CheckpointState`` the facade fills), ``saveload``
(save and load that state) and the offline
``tools`` behind ``varuna ckpt``. Imports: L0, L1 and this floor; the launcher imports ``layout`` without torch.
"""
