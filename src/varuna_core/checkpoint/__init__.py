"""Floor L2 — checkpoints, knowing nothing of ``Varuna``.

``layout`` (torch-free: step directories, ``RUN``, ``COMPLETE``, the one ``latest``), ``manifest`` (torch-free),
``part`` (torch-free: the ``PART`` marker of a host's part of a checkpoint), raw file ``io``, the DCP ``storage``,
``state`` (the plain ``CheckpointState`` the facade fills), ``saveload`` (save and load that state), and the
offline ``tools`` and ``assemble`` (torch-free: one checkpoint from the hosts' parts) behind ``varuna ckpt``.
Imports: L0, L1 and this floor; the launcher imports ``layout`` without torch.
"""
