"""Floor L2 — running a schedule across processes (``torch.distributed``).

Point-to-point transfers, gradient buckets, micro-batching and the executor of one schedule per step, with
tracing as an observer. Imports: L0, L1 and this floor; never the ``Varuna`` facade.
"""
