"""A lost replica stops nobody: the survivors' side of a regroup (DESIGN.md §3.8, "sudden loss").

When a host dies that held only whole data-parallel replicas (every stage keeps a replica elsewhere), the workers
that are left need no new process and no state from anywhere: each already holds its stage's parameters and
optimizer state, equal on every replica. What they lose is the step in flight and their process group. So:

1. **Abort.** A collective with a peer that is gone fails on the survivors that talk to it, before its deadline
   (:func:`peer_lost`); each of them leaves the process group at once,
   which closes its connections, so that the survivors waiting on *it* fail too, within milliseconds. Nothing of
   the step is kept: the gradients are zeroed, the loss scale and the buffers the forward writes are put back as
   they were before the step (the optimizer is stepped by the script after ``step()`` returns: never half done).
2. **Agree.** Each survivor reports the step it was at (``regroup_asked`` in its heartbeat) and waits for the
   launcher's decision, a :class:`~varuna_core.launch.protocol.Regroup` signed with the job's token that node 0's
   agent puts in the job's store: the new rank of every old rank (None for one whose replica lost a stage: it
   leaves, exit code :data:`EXIT_LEFT`), the new stage-to-rank map (same stages, fewer replicas) and the store
   prefix of the new process group.
3. **Rebuild and redo.** Each survivor joins the new process group, rebuilds its groups, pipeline executor and
   batch layout for the new replica set, and redoes the step: the replicas that are left take over the lost
   replicas' micro-batches (the global batch and the data order stay the same), so the run goes on exactly as a
   restart onto that layout would, but without a process started or a byte moved. Taking the lost micro-batches
   needs the global batch: the inputs must be the share :meth:`Varuna.replica_slice` made of it, which remembers
   it (:func:`global_views`); a script that slices its own batches gets the restart path instead.

Anything that does not fit (no launcher, one replica, a decision that does not come, survivors at different
steps, a rank whose stage would change) re-raises the collective's error: the process exits and the launcher
recovers the job as before (from the snapshots, or the store).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..env import WorkerEnv
from ..errors import EXIT_LEFT, CommTimeoutError, HandoverError
from ..launch.protocol import Regroup, decode_regroup, regroup_key

__all__ = ["EXIT_LEFT", "Regrouper", "global_views", "peer_lost"]  # EXIT_LEFT: from errors, for the workers' use

log = logging.getLogger(__name__)

WAIT = 60.0  # seconds a survivor waits for the launcher's decision before it gives up (and exits)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer is gone: a wait whose connection failed before its deadline (told apart from a
    timeout by the clock, :func:`~varuna_core.pipeline.p2p.wait_all`), not the model or the data being wrong."""
    return isinstance(exc, CommTimeoutError) and exc.peer_lost


def global_views(inputs: Mapping[str, Any], sliced: tuple[Mapping[str, Any], Mapping[str, Any]] | None
                 ) -> Mapping[str, Any] | None:
    """The global batch that this replica's ``inputs`` are a share of: ``sliced`` is the last ``(global batch,
    share)`` that ``replica_slice`` made, and ``inputs`` must hold that share's very tensors (not copies: a copy
    does not say where it came from). None otherwise."""
    if sliced is None:
        return None
    whole, share = sliced
    if set(inputs) != set(share):
        return None
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value is not share[name]:
            return None
    return whole


@dataclass
class Regrouper:
    """Waits for the launcher's regroup decisions and joins the new process groups (one per worker).

    Args:
        told: what the launcher told this worker (job token, attempt).
        master: ``(address, port)`` of the job's store (node 0's agent hosts it).
        timeout: the process groups' timeout (seconds).
    """

    told: WorkerEnv
    master: tuple[str, int]
    timeout: float
    number: int = 0  # regroups of this attempt so far

    @classmethod
    def launched(cls, told: WorkerEnv, timeout: float) -> Regrouper | None:
        """This worker's regrouper when the launcher regroups (``VARUNA_REGROUP``, with the job's token, the
        attempt and the job's store known); None otherwise: a lost peer then ends the worker, as it always did."""
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not told.regroup or not told.job_token or told.attempt is None or not address or not port.isdigit():
            return None
        return cls(told, (address, int(port)), timeout)

    def wait(self, step: int, deadline: float = WAIT) -> Regroup:
        """The launcher's next decision, for this worker's attempt, to redo ``step``.

        Raises:
            HandoverError: none came within ``deadline`` seconds, or one that is not signed, not the next one of
                this attempt, or for another step (the survivors are not all at one step).
        """
        import torch.distributed as dist

        self.number += 1
        key = regroup_key(self.number)
        try:
            store = dist.TCPStore(self.master[0], self.master[1], is_master=False,
                                  timeout=datetime.timedelta(seconds=deadline))
            store.wait([key])
            text = store.get(key)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistStoreError is a RuntimeError
            raise HandoverError(f"no regroup decision from the launcher within {deadline:g} s ({exc})".splitlines()[0],
                                hint="the job restarts from its snapshots or checkpoints instead") from None
        try:
            regroup = decode_regroup(text, self.told.job_token or "", self.told.attempt or 0, self.number)
        except ValueError as exc:
            raise HandoverError(f"refused the regroup message: {exc}") from None
        if regroup.step != step:
            raise HandoverError(f"the regroup redoes step {regroup.step}, but this worker was at step {step}",
                                hint="the job restarts from its snapshots or checkpoints instead")
        return regroup

    def join(self, regroup: Regroup, rank: int, backend: str) -> None:
        """Join the regroup's process group as ``rank`` (the job's store, under the regroup's key prefix)."""
        import torch.distributed as dist

        world = sum(r is not None for r in regroup.ranks)
        timeout = datetime.timedelta(seconds=max(self.timeout, 60))
        store = dist.TCPStore(self.master[0], self.master[1], is_master=False, timeout=timeout)
        started = time.perf_counter()
        dist.init_process_group(backend, store=dist.PrefixStore(regroup.prefix, store), rank=rank, world_size=world,
                                timeout=timeout)
        if backend == "gloo":
            dist.barrier()  # every pair connected before anyone goes on (see ensure_process_group)
        log.info("rank %d joined the regrouped process group of %d ranks in %.2f s", rank, world,
                 time.perf_counter() - started)
