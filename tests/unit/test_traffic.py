"""The link between nodes given to the planner (``--link-rate``, ``--link-latency``) and what a plan sends over
each link per step (``planning.traffic``): charged and counted exactly as the formulas say."""

from __future__ import annotations

import pytest

from tests.profiles import make_profile
from varuna_core.errors import ConfigError
from varuna_core.ir.topology import Topology
from varuna_core.ir.units import parse_rate, parse_seconds
from varuna_core.planning.planner import PlanRequest, link_layout, make_plan, plan_for, shared_link_syncs
from varuna_core.planning.traffic import link_loads

pytestmark = pytest.mark.timeout(60)

PROFILE = make_profile([0.001, 0.003, 0.003, 0.002])
RATE = 50e6 / 8  # 50 Mbit/s in bytes/s


@pytest.mark.parametrize(("text", "want"), [("50mbit", RATE), ("1gbit", 1.25e8), ("200Mbit/s", 2.5e7),
                                            ("100MB/s", 1e8), ("2GiB/s", 2 * 2**30), (" 3 kbit ", 375.0)])
def test_rates_read_as_bytes_per_second(text, want) -> None:
    assert parse_rate(text) == want


@pytest.mark.parametrize("text", ["", "fast", "50", "50Mb/s", "50kb/s", "-1mbit", "0gbit", "nanmbit", "1e300gbit",
                                  "50 mbit per s"])
def test_a_bad_rate_is_refused(text) -> None:
    with pytest.raises(ConfigError):
        parse_rate(text)


@pytest.mark.parametrize(("text", "want"), [("200us", 2e-4), ("1.5ms", 1.5e-3), ("2s", 2.0), ("0", 0.0),
                                            ("3µs", 3e-6)])
def test_durations(text, want) -> None:
    assert parse_seconds(text) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("text", ["", "-1ms", "5m", "1e400", "soon", "1 hour"])
def test_a_bad_duration_is_refused(text) -> None:
    with pytest.raises(ConfigError):
        parse_seconds(text)


def test_messages_and_all_reduces_between_nodes_are_charged_at_the_given_link() -> None:
    """pp=2 × dp=2 on two nodes of two (ranks 0,1 on node 0: a replica's stages share a node; each stage's
    replicas are on both nodes): the activations stay inside a node, at the profile's fit; the all-reduces cross,
    a ring of 2 at the link's rate and latency, and both stages' rings go through each node's link at once, so
    each is charged with the other's bytes up to its own (processor sharing)."""
    req = PlanRequest(gpus=4, batch_size=16, gpus_per_node=2, pp=2, dp=2, microbatch_sizes=(2,),
                      schedules=("1f1b",), shard_optimizer=False, link_rate=RATE, link_latency=1e-3)
    layout = {"pp": 2, "dp": 2, "microbatch_size": 2, "schedule": "1f1b", "placement": "pipeline"}
    plan = plan_for(PROFILE, req, **layout)
    same = plan_for(PROFILE, PlanRequest(**{**req.__dict__, "link_rate": None, "link_latency": None}), **layout)
    assert plan.stage_to_rank_map == "0,2;1,3;"
    assert [st.send_activation for st in plan.stages] == [st.send_activation for st in same.stages]
    alone = [st.grad_bytes * 2 * (2 - 1) / 2 / RATE for st in plan.stages]  # each rank sends half of it twice
    for st, x in zip(plan.stages, alone, strict=True):  # all-reduce of 2: 2 steps of latency
        want = 2 * 1e-3 + sum(min(other, x) for other in alone)
        assert st.allreduce == pytest.approx(want, rel=1e-9)
    assert max(st.allreduce for st in plan.stages) == pytest.approx(2e-3 + sum(alone), rel=1e-9)  # the link bound
    assert (plan.link_rate, plan.link_latency) == (RATE, 1e-3)


def test_a_pipeline_across_nodes_sends_its_activations_at_the_link_rate() -> None:
    plan = make_plan(PROFILE, PlanRequest(gpus=4, batch_size=16, gpus_per_node=2, pp=4, microbatch_sizes=(2,),
                                          schedules=("1f1b",), link_rate=RATE))
    inter = plan.stages[1]  # stage 1 (node 0) sends to stage 2 (node 1)
    latency = next(c.fit.latency for c in PROFILE.comm if c.op == "p2p")  # the profile's, none given
    assert inter.send_activation == pytest.approx(latency + inter.activation_bytes / RATE, rel=1e-9)
    assert plan.stages[0].send_activation < inter.send_activation  # inside node 0: the profile's fit
    loads = {load.what: load for load in link_loads(plan)}
    assert [loads[f"stage {s} → {s + 1}"].inter for s in range(3)] == [False, True, False]
    mb = plan.num_microbatches
    assert loads["stage 1 → 2"].bytes_per_step == mb * inter.activation_bytes
    assert loads["stage 1 → 2"].seconds == pytest.approx(mb * inter.activation_bytes / RATE)
    assert loads["stage 0 → 1"].seconds is None


def test_the_all_reduce_bytes_of_a_ring() -> None:
    plan = make_plan(PROFILE, PlanRequest(gpus=4, batch_size=16, gpus_per_node=4, pp=1, dp=4, microbatch_sizes=(2,)))
    (load,) = link_loads(plan)
    assert load.what == "stage 0 all-reduce" and not load.inter and load.seconds is None
    assert load.bytes_per_step == round(plan.stages[0].grad_bytes * 2 * 3 / 4)
    assert plan.stages[0].grad_bytes == sum(seg.grad_bytes for seg in PROFILE.segments)


@pytest.mark.parametrize(("x", "pp", "dp", "per_node", "want"), [
    ([1.0, 3.0], 2, 2, 2, [2.0, 4.0]),  # both rings cross both nodes: the smaller ends after twice itself
    ([1.0, 1.0, 1.0, 1.0], 4, 2, 4, [4.0] * 4),  # a replica a node: four rings through each link
    ([1.0, 2.0], 2, 4, 4, [2.0, 3.0]),  # two replicas a node: still one ring crossing per stage and node
    ([1.0, 2.0, 3.0, 4.0], 4, 2, 1, [1.0, 2.0, 3.0, 4.0]),  # one rank a node: no link shared
    ([1.0, 2.0], 2, 2, 4, [1.0, 2.0]),  # one node: loopback, nothing crosses
    ([5.0], 1, 4, 2, [5.0]),  # one stage: its ring alone
])
def test_rings_that_cross_a_node_together_share_its_link(x, pp, dp, per_node, want) -> None:
    """``shared_link_syncs`` over transfers alone ``x`` (latency 0.5 each, never shared): processor sharing of
    each node's link among the stages' rings that cross it."""
    got = shared_link_syncs([(0.5, t) for t in x], link_layout("pipeline", pp, dp, per_node))
    assert got == pytest.approx([0.5 + w for w in want], rel=1e-12)


@pytest.mark.parametrize("rate", [RATE, RATE / 50])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "dp", "per_node"), [(2, 2, 2), (4, 2, 4), (2, 4, 4), (3, 2, 2), (6, 1, 4),
                                                    (1, 8, 4), (2, 4, 2), (2, 1, 1)])
def test_no_prediction_beats_the_bytes_its_busiest_link_must_carry(pp, dp, per_node, schedule, rate) -> None:
    """The planner's step, for every layout of 8 devices over nodes at 50 Mbit/s, is at least the time the busiest
    node's link takes to carry what crosses it: a ring's ``2(d-1)/d`` of the gradient out of the node for every
    stage whose replicas are on several nodes, and the activations of a boundary between nodes (the bound a
    measured step respected in every run of ``benchmarks/plan_regret.py``; its predictions were below it in 63 of
    264 configurations when each ring was charged as if it had the link alone). GPipe sends every forward's
    activation back to back: messages in flight at once share the link too."""
    profile = make_profile([0.001, 0.003, 0.003, 0.002, 0.002, 0.001])  # at 1 Mbit/s the messages outweigh these
    req = PlanRequest(gpus=pp * dp, batch_size=16, gpus_per_node=per_node, microbatch_sizes=(2,),
                      schedules=(schedule,), shard_optimizer=False, link_rate=rate, link_latency=0.0)
    for placement in ("pipeline", "stage"):
        plan = plan_for(profile, req, pp=pp, dp=dp, microbatch_size=2, schedule=schedule, placement=placement)
        ranks = Topology.parse(plan.stage_to_rank_map).stage_ranks
        node_of = {rank: i for i, on in enumerate(plan.nodes) for rank in on}
        out = [0.0] * len(plan.nodes)
        for s, st in enumerate(plan.stages):
            nodes = {node_of[r] for r in ranks[s]}
            if len(nodes) > 1:
                for n in nodes:
                    out[n] += st.grad_bytes * 2 * (dp - 1) / dp
            if s < pp - 1:
                for a, b in zip(ranks[s], ranks[s + 1], strict=True):
                    if node_of[a] != node_of[b]:
                        out[node_of[a]] += plan.num_microbatches * st.activation_bytes
        bound = max(out) / rate
        assert plan.prediction is not None and plan.prediction.step_time >= bound * (1 - 1e-9), (placement, bound)
    bound = max(out) / RATE
    assert plan.prediction is not None and plan.prediction.step_time >= bound * (1 - 1e-9), (bound, plan.prediction)


def test_a_stage_s_replicas_on_one_node_keep_its_all_reduce_there_and_share_the_link_for_messages() -> None:
    """The same request, searched: the planner places each stage's two replicas on one node (map ``0,1;2,3``),
    because at 50 Mbit/s the two stages' gradients crossing the link cost more than the activations. Both
    replicas' messages of the boundary go through node 0's link at once: each is charged twice its bytes; the
    all-reduces stay inside the nodes, at the profile's fit."""
    req = PlanRequest(gpus=4, batch_size=16, gpus_per_node=2, pp=2, dp=2, microbatch_sizes=(2,),
                      schedules=("1f1b",), shard_optimizer=False, link_rate=RATE, link_latency=1e-3)
    plan = make_plan(PROFILE, req)
    assert plan.stage_to_rank_map == "0,1;2,3;"
    assert any("50 Mbit/s each way, 1000 µs per message" in note for note in plan.assumptions)
    stage0 = plan.stages[0]
    assert stage0.send_activation == pytest.approx(1e-3 + 2 * stage0.activation_bytes / RATE, rel=1e-9)
    inside = plan_for(PROFILE, PlanRequest(**{**req.__dict__, "gpus_per_node": 4}), pp=2, dp=2, microbatch_size=2,
                      schedule="1f1b")  # one node: the same all-reduces over its loopback
    assert [st.allreduce for st in plan.stages] == [st.allreduce for st in inside.stages]
    pipeline = next(alt for alt in plan.alternatives if alt.placement == "pipeline" and alt.pp == 2)
    assert pipeline.step_time > plan.prediction.step_time


@pytest.mark.parametrize(("placement", "pp", "dp", "per_node", "sends", "crossing", "node_stages"), [
    ("pipeline", 2, 2, 2, (0,), (True, True), ((0, 1),)),
    ("stage", 2, 2, 2, (2,), (False, False), ()),
    ("pipeline", 4, 2, 2, (0, 1, 0), (True,) * 4, ((0, 1), (2, 3))),  # a replica over two nodes
    ("stage", 4, 2, 2, (2, 2, 2), (False,) * 4, ()),
    ("stage", 2, 4, 2, (2,), (True, True), ((0,), (1,))),  # a stage's four replicas over two nodes
    ("stage", 3, 2, 4, (0, 2), (False, False, False), ()),  # stages 0, 1 on node 0; stage 2 on node 1
    ("pipeline", 3, 2, 4, (1, 0), (False, True, True), ((1, 2),)),  # ranks 0..3 | 4, 5: stage 0's both on node 0
    ("pipeline", 2, 2, 4, (0,), (False, False), ()),  # one node
])
def test_what_crosses_the_links_under_each_placement(placement, pp, dp, per_node, sends, crossing,
                                                      node_stages) -> None:
    layout = link_layout(placement, pp, dp, per_node)
    assert (layout.sends, layout.crossing, layout.node_stages) == (sends, crossing, node_stages)
    topology = Topology.placed(placement, pp, dp)  # the same, counted rank by rank from the map
    node = [rank // per_node for rank in range(pp * dp)]
    for s in range(pp - 1):
        pairs = [(node[a], node[b]) for a, b in zip(topology.stage_ranks[s], topology.stage_ranks[s + 1],
                                                     strict=True) if node[a] != node[b]]
        most = max([0, *(sum(1 for p in pairs if p[0] == n) for n in set(node)),
                    *(sum(1 for p in pairs if p[1] == n) for n in set(node))])
        assert layout.sends[s] == most
    assert layout.crossing == tuple(len({node[r] for r in ranks}) > 1 for ranks in topology.stage_ranks)


def test_the_layouts_shortcuts_equal_counting_rank_by_rank() -> None:
    """link_layout counts what crosses per node and enumerates only the nodes that give distinct stage sets (a
    4096-device search builds hundreds of layouts); every small cluster shape agrees with counting from the map,
    rank by rank."""
    for placement in ("pipeline", "stage"):
        for pp in range(1, 9):
            for dp in range(1, 13):
                for per_node in (1, 2, 3, 4, 8):
                    if pp * dp <= per_node:
                        continue
                    layout = link_layout(placement, pp, dp, per_node)
                    topology = Topology.placed(placement, pp, dp)
                    node = [rank // per_node for rank in range(pp * dp)]
                    sends = []
                    for s in range(pp - 1):
                        pairs = [(node[a], node[b]) for a, b in zip(topology.stage_ranks[s],
                                                                    topology.stage_ranks[s + 1], strict=True)
                                 if node[a] != node[b]]
                        sends.append(max([0, *(sum(1 for p in pairs if p[0] == n) for n in set(node)),
                                          *(sum(1 for p in pairs if p[1] == n) for n in set(node))]))
                    crossing = tuple(len({node[r] for r in ranks}) > 1 for ranks in topology.stage_ranks)
                    stage_of = {r: s for s, ranks in enumerate(topology.stage_ranks) for r in ranks}
                    sets = {tuple(sorted({stage_of[r] for r in range(pp * dp) if node[r] == n and
                                          crossing[stage_of[r]]})) for n in set(node)} - {()}
                    shape = (placement, pp, dp, per_node)
                    assert layout.sends == tuple(sends), shape
                    assert layout.crossing == crossing, shape
                    assert layout.node_stages == tuple(sorted(sets)), shape
