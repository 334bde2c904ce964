"""Floor L2 — running a schedule across processes (``torch.distributed``).

``config`` (the facade's arguments checked and resolved, with the plan), ``groups`` (process group, device,
data-parallel and tied-weight groups, the agreed seed and run id), ``microbatch``, ``p2p`` (point-to-point
transfers), ``executor`` (one schedule per step, in small steps), ``tracing`` (observers of the executor, the
Chrome trace among them), ``grads`` (gradient buckets), ``reduce`` (after the pipeline: gradient sync, the
step's one all-reduce of loss, norm and overflow, clipping), ``validate`` (the sliced pipeline against the
unsliced model). Imports: L0, L1 and this floor; never the facade.
"""
