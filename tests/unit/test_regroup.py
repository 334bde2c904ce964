"""The pieces of a regroup (worker.regroup): the launcher's signed decision and what a worker refuses of it, the
global batch behind a replica's inputs, and what counts as a lost peer."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
import torch

from varuna_core.errors import CommTimeoutError
from varuna_core.launch.protocol import Regroup, decode_regroup, encode_regroup, regroup_key
from varuna_core.pipeline.config import replica_share
from varuna_core.worker.regroup import global_views, peer_lost

TOKEN = "regroup-token"


def _regroup(**fields) -> Regroup:
    return Regroup(**{"attempt": 2, "number": 1, "step": 7, "ranks": [None, None, 0, 1], "stage_to_rank_map": "0;1",
                      "prefix": "regroup-1/", **fields})


def test_a_decision_is_read_back_only_with_the_token_for_its_attempt_and_number() -> None:
    text = encode_regroup(_regroup(), TOKEN)
    assert decode_regroup(text, TOKEN, 2, 1) == _regroup()
    assert regroup_key(1) != regroup_key(2)
    with pytest.raises(ValueError, match="not signed with the job's token"):
        decode_regroup(text, "another-token", 2, 1)
    with pytest.raises(ValueError, match="not number 1 of this worker's attempt 3"):
        decode_regroup(text, TOKEN, 3, 1)
    with pytest.raises(ValueError, match="not number 2"):
        decode_regroup(text, TOKEN, 2, 2)
    outer = json.loads(text)
    outer["p"] = outer["p"].replace('"step":7', '"step":8')  # tampered: the signature no longer fits
    with pytest.raises(ValueError, match="not signed"):
        decode_regroup(json.dumps(outer), TOKEN, 2, 1)


@pytest.mark.parametrize("text", ["", "[", "[]", '{"p": 1, "mac": "x"}', "x" * (5 * 2**20), '{"p": "{}"}'])
def test_malformed_decisions_are_refused_in_one_line(text) -> None:
    with pytest.raises(ValueError) as info:
        decode_regroup(text, TOKEN, 2, 1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ranks", [[None, None], [0, 0], [1, 2], [0, 2], [-1, 0], [0, True]])
def test_the_new_ranks_are_0_to_n_minus_1_each_once(ranks) -> None:
    with pytest.raises(ValueError):
        _regroup(ranks=ranks)
    payload = _regroup().model_dump_json().replace('"ranks":[null,null,0,1]', f'"ranks":{json.dumps(ranks)}')
    with pytest.raises(ValueError, match="malformed"):  # a decision signed with the token is checked as well
        decode_regroup(_signed(payload), TOKEN, 2, 1)


def _signed(payload: str) -> str:
    mac = hmac.new(TOKEN.encode(), b"varuna-regroup\0" + payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac})


def test_the_global_batch_is_known_only_for_the_share_replica_slice_made() -> None:
    batch = {"idx": torch.arange(40).reshape(8, 5), "targets": torch.arange(40).reshape(8, 5) + 1, "flag": 3}
    dims = {"idx": 0, "targets": 0, "flag": None}
    mine = replica_share(batch, dims, 8, (4, 8))
    assert global_views(mine, (batch, mine)) is batch
    assert global_views(dict(mine), (batch, mine)) is batch  # the same tensors in another dict
    assert global_views(mine, None) is None
    copied = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
    assert global_views(copied, (batch, mine)) is None  # copies (moved, cast) say nothing of where they came from
    assert global_views({"idx": mine["idx"]}, (batch, mine)) is None
    other = replica_share(batch, dims, 8, (0, 4))
    assert global_views(other, (batch, mine)) is None


def test_only_a_connection_lost_before_its_deadline_counts_as_a_lost_peer() -> None:
    lost = CommTimeoutError("rank 0 waiting: the connection failed")
    lost.peer_lost = True
    assert peer_lost(lost)
    assert not peer_lost(CommTimeoutError("rank 0 waiting: no progress within 60s"))
    assert not peer_lost(RuntimeError("Connection closed by peer"))  # not through the pipeline's waits
    assert not peer_lost(ValueError("shapes do not match"))


def test_a_connection_found_failed_as_a_message_is_posted_is_a_lost_peer(monkeypatch) -> None:
    """gloo may report a peer's closed connection as a receive or send is posted, not only when it is waited for:
    the same error either way (the dist tests met it as a raw RuntimeError)."""
    from varuna_core.pipeline import p2p
    from varuna_core.pipeline.p2p import post_recv, send

    def closed(*args, **kwargs):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:31941")

    monkeypatch.setattr(p2p.dist, "irecv", closed)
    monkeypatch.setattr(p2p.dist, "isend", closed)
    monkeypatch.setattr(p2p, "staged_through_host", lambda device, group=None: False)
    monkeypatch.setattr(p2p, "_report_failure", lambda peer: peer)
    spec = type("Spec", (), {"shape_for": lambda self, n: (n, 2), "torch_dtype": torch.float32})()
    with pytest.raises(CommTimeoutError, match="rank 1 waiting for rank 0: the connection failed") as info:
        post_recv([spec], 3, src=0, mb=0, kind=0, device=torch.device("cpu"), group=None,
                  what="rank 1 waiting for rank 0")
    assert peer_lost(info.value)
    with pytest.raises(CommTimeoutError, match="sending micro-batch 2 to rank 1: the connection failed") as info:
        send([torch.zeros(2)], dst=1, mb=2, kind=0, group=None)
    assert peer_lost(info.value)


# ----------------------------------------------------------------------------------------------------------
# The launcher's side

@pytest.mark.parametrize(("layout", "world", "lost", "ranks", "new_map"), [
    ("0,2;1,3", 4, {2, 3}, [0, 1, None, None], "0;1"),  # a host held replica 1 whole
    ("0,2;1,3", 4, {1}, [None, None, 0, 1], "0;1"),  # replica 0 lost a stage: its stage-0 worker leaves
    ("0,2,4;1,3,5", 6, {4}, [0, 1, 2, 3, None, None], "0,2;1,3"),
    ("0,1;2,3", 4, {0}, [None, 0, None, 1], "0;1"),  # replicas numbered across the hosts
    ("0,3;1,4;2,5", 6, {4, 5}, [0, 1, 2, None, None, None], "0;1;2"),
])
def test_the_whole_replicas_left_go_on_renumbered_in_order(layout, world, lost, ranks, new_map) -> None:
    from varuna_core.launch.regroup import plan_regroup

    plan = plan_regroup(layout, world, lost)
    assert plan is not None and (plan.ranks, plan.stage_to_rank_map) == (ranks, new_map)
    assert plan.world == sum(r is not None for r in ranks) and plan.pp == layout.count(";") + 1
    assert sorted(plan.leaving(lost)) == sorted(r for r, new in enumerate(ranks) if new is None and r not in lost)


@pytest.mark.parametrize(("layout", "world", "lost"), [
    ("0;1", 2, {1}),  # one replica: nothing whole is left
    ("0,2;1,3", 4, {0, 3}),  # each replica lost a stage
    ("0,2;1,3", 4, set()),  # nothing lost
    ("0,2;1,3", 4, {7}),  # not a rank of the job
])
def test_no_regroup_without_a_whole_replica_left(layout, world, lost) -> None:
    from varuna_core.launch.regroup import plan_regroup

    assert plan_regroup(layout, world, lost) is None


def test_the_regrouped_plan_is_a_valid_plan_of_the_same_stages(tmp_path) -> None:
    from tests.profiles import make_profile
    from varuna_core.launch.regroup import plan_regroup, regrouped_plan
    from varuna_core.planning.artifacts import load_plan, save_plan
    from varuna_core.planning.planner import PlanRequest, plan_for

    profile = make_profile([1e-3] * 6, sizes=(1, 2, 4, 8))
    plan = plan_for(profile, PlanRequest(gpus=4, batch_size=32, gpus_per_node=2), pp=2, dp=2, microbatch_size=4,
                    schedule="varuna")
    regroup = plan_regroup(plan.stage_to_rank_map, 4, {2, 3})
    assert regroup is not None
    after = regrouped_plan(plan, regroup, [[0, 1], []], "host b lost at step 7")
    assert (after.pp, after.dp, after.gpus, after.nodes) == (2, 1, 2, [[0, 1]])
    assert (after.partition, after.microbatch_size, after.schedule) == (plan.partition, plan.microbatch_size,
                                                                        plan.schedule)
    assert after.num_microbatches == 8 and "host b lost at step 7" in after.assumptions[-1]
    save_plan(after, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml") == after
