"""What a plan sends over each link in one step: the bytes between neighbouring stages and in each stage's
data-parallel all-reduce, and whether they cross nodes (``varuna plan`` and ``plan show`` print it).

On a slow network the step is often the link's: 50 Mbit/s moves 6 MB a second, so a plan's bytes per step and
the link each crosses say at once what the step cannot beat. Bytes are per step, as a rank sends them:

* between stage ``s`` and ``s + 1``: every micro-batch's activation forward (``activation_bytes``, in the plan's
  wire dtype if it has one), and the same bytes of gradient back (the gradient of each floating-point value that
  crossed; integer masks and ids have none, so this slightly overstates a cut that carries them);
* a stage's all-reduce over its ``dp`` replicas: a ring, each rank sending (and receiving) ``2 (dp - 1) / dp`` of
  the stage's gradient bytes (``grad_bytes``; with a sharded optimizer the same bytes, as reduce-scatter and
  all-gather).

Where the plan knows the rate of the link between nodes (``varuna plan --link-rate``), the time those bytes take
on it alone is given too: a lower bound on the step when they do not overlap compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.topology import Topology
from .artifacts import Plan

__all__ = ["LinkLoad", "link_loads"]


@dataclass(frozen=True)
class LinkLoad:
    """One flow of a step: ``what`` (``"stage 0 → 1"``, ``"stage 1 all-reduce"``), the bytes each rank sends per
    step in each direction, whether it crosses nodes (for some replica), and its time at the plan's link rate
    when it does and the rate is known (else None)."""

    what: str
    bytes_per_step: int
    inter: bool
    seconds: float | None


def link_loads(plan: Plan) -> list[LinkLoad]:
    """Every flow of one step of ``plan`` (none for a layout given by hand, whose stages are not known)."""
    if not plan.stages:
        return []
    topology = Topology.parse(plan.stage_to_rank_map, plan.pp * plan.dp)
    node_of = {rank: i for i, ranks in enumerate(plan.nodes) for rank in ranks}

    def crosses(a: int, b: int) -> bool:
        return node_of.get(a, -1) != node_of.get(b, -1)

    def at_rate(nbytes: float, inter: bool) -> float | None:
        if not inter or plan.link_rate is None:
            return None
        return nbytes / plan.link_rate

    loads: list[LinkLoad] = []
    replicas = [topology.replica_ranks(r) for r in range(plan.dp)]
    for st in plan.stages[:-1]:
        s = st.stage
        nbytes = plan.num_microbatches * st.activation_bytes
        inter = any(crosses(ranks[s], ranks[s + 1]) for ranks in replicas)
        loads.append(LinkLoad(f"stage {s} → {s + 1}", nbytes, inter, at_rate(nbytes, inter)))
    if plan.dp > 1:
        for st in plan.stages:
            group = [ranks[st.stage] for ranks in replicas]
            inter = any(crosses(group[0], rank) for rank in group[1:])
            nbytes = round(st.grad_bytes * 2 * (plan.dp - 1) / plan.dp)
            loads.append(LinkLoad(f"stage {st.stage} all-reduce", nbytes, inter, at_rate(nbytes, inter)))
    return loads
