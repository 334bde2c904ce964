"""Floor L1 — the user's model: torch, but no ``torch.distributed``.

``CutPoint`` markers and automatic cut points, structure discovery by a dry run (what crosses each cut, its
cache), slicing into a ``StageSlice`` with tied weights (``meta_ops``: the memo of ops on its placeholders),
payload packing, RNG streams, autocast precision, ``ModelSpec``, and the split backward (``split``: B computes
input gradients, W the weights'). Imports: L0 (``errors``, ``env``, ``util``, ``ir``) and this floor.
"""
