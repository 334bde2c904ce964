"""The launcher's side of a regroup: which workers go on, as which ranks, when a host is lost without notice
(DESIGN.md §3.8, "a lost replica stops nobody"; the workers' side is :mod:`varuna_core.worker.regroup`).

A host lost during training takes its workers with it. When every stage keeps at least one whole data-parallel
replica elsewhere (a replica whose every stage's worker is alive), the job needs no new process and no state
from anywhere: the workers of the whole replicas that are left go on as a pipeline of the same depth and fewer
replicas, the global batch and the data order unchanged. A worker whose replica lost a stage has nothing to do in
it and leaves. :func:`plan_regroup` decides this from the stage-to-rank map alone; the attempt waits until every
surviving worker has said at which step it lost its peer (they all must be at the same one), then sends the
decision, signed, through node 0's agent, which keeps the job's store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.topology import Topology
from ..planning.artifacts import Plan

__all__ = ["REGROUP_WAIT", "RegroupPlan", "plan_regroup", "regrouped_plan"]

# seconds the launcher waits for every surviving worker to say at which step it lost its peer (they fail within
# milliseconds of each other when the lost host's connections reset; one that says nothing is blocked on a peer
# that vanished without a word, and the job is recovered as before)
REGROUP_WAIT = 10.0


@dataclass(frozen=True)
class RegroupPlan:
    """How the survivors go on: ``ranks[r]`` is the new rank of current rank ``r`` (None: lost, or leaves),
    placed by ``stage_to_rank_map`` (``dp`` replicas of the same ``pp`` stages)."""

    ranks: list[int | None]
    stage_to_rank_map: str
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return sum(r is not None for r in self.ranks)

    def leaving(self, lost: set[int]) -> list[int]:
        """The current ranks that are alive but leave (their replica lost a stage)."""
        return [r for r, new in enumerate(self.ranks) if new is None and r not in lost]


def plan_regroup(stage_to_rank_map: str, world: int, lost: set[int]) -> RegroupPlan | None:
    """The regroup of the job placed by ``stage_to_rank_map`` over ``world`` ranks once the ranks ``lost`` are
    gone, or None when no whole replica is left (or nothing was lost). The new ranks keep the order of the old
    ones, and each stage's replicas theirs."""
    topology = Topology.parse(stage_to_rank_map, world)
    lost = {r for r in lost if 0 <= r < world}
    if not lost:
        return None
    whole = [q for q in range(topology.dp) if all(topology.rank(s, q) not in lost for s in range(topology.pp))]
    if not whole:
        return None
    kept = sorted(topology.rank(s, q) for q in whole for s in range(topology.pp))
    new = {old: i for i, old in enumerate(kept)}
    layout = ";".join(",".join(str(new[topology.rank(s, q)]) for q in whole) for s in range(topology.pp))
    return RegroupPlan([new.get(r) for r in range(world)], layout, topology.pp, len(whole))


def regrouped_plan(plan: Plan, regroup: RegroupPlan, nodes: list[list[int]], why: str) -> Plan:
    """``plan`` as the survivors run it after ``regroup``: the same stages, partition, micro-batch size and
    schedule over ``regroup.dp`` replicas placed by its map, with ``nodes`` the new ranks of each host that is
    left (a valid plan: what a replay of the run uses for the steps after the regroup). The prediction stays the
    original layout's, and the assumptions say so; the alternatives, made for more devices, are dropped."""
    replica = math.ceil(plan.batch_size / regroup.dp)
    note = f"regrouped from pp={plan.pp} × dp={plan.dp} ({why}); the prediction is that layout's"
    return Plan.model_validate({
        **plan.model_dump(), "dp": regroup.dp, "gpus": regroup.pp * regroup.dp,
        "stage_to_rank_map": regroup.stage_to_rank_map, "nodes": [ranks for ranks in nodes if ranks],
        "num_microbatches": math.ceil(replica / plan.microbatch_size), "alternatives": [],
        "assumptions": [*plan.assumptions, note]})
