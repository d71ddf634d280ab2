"""The routing policies the bench compares: round-robin, session affinity, prefix-only, cost."""

from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.model import Holding
from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
from kvctl.remote.fetchplan import PrefillRate
from kvctl.router.policies import (
    POLICIES,
    CostPolicy,
    PrefixOnly,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    local_prefixes,
    make_policy,
)
from kvctl.router.score import Costs
from kvctl.router.topology import DcLink, Node, Topology

CHUNK_TOKENS = 512
CHUNK_BYTES = CHUNK_TOKENS * 131072  # llama-3.1-8b's KV bytes per token


def _costs() -> Costs:
    inputs = ModeledInputs(model_profile("llama-3.1-8b"), gpu_profile("h100"))
    return Costs(prefill=PrefillRate.modeled(inputs).as_model())


def _fleet() -> Topology:
    nodes = [Node(f"{dc}{i}", dc) for dc in ("a", "b") for i in (1, 2, 3)]
    return Topology.build(nodes, {("a", "b"): DcLink.fiber(500)})


def _held(*nodes: str) -> list[Holding]:
    return [Holding(n, "cpu", CHUNK_BYTES, CHUNK_TOKENS) for n in nodes]


def _request(holdings: list[list[Holding]], **kw: object) -> RouteRequest:
    chunks = max(1, len(holdings))
    return RouteRequest(holdings, chunks * CHUNK_TOKENS, CHUNK_TOKENS, **kw)  # type: ignore[arg-type]


def test_round_robin_deals_the_origin_dcs_nodes_in_turn_and_skips_down_ones() -> None:
    rr = RoundRobin(_fleet())
    picks = [rr.choose(_request([], origin_dc="a")) for _ in range(6)]
    assert picks == ["a1", "a2", "a3", "a1", "a2", "a3"]
    down = [
        rr.choose(_request([], origin_dc="a", up=frozenset({"a1", "a3", "b1"}))) for _ in (1, 2)
    ]
    assert set(down) == {"a1", "a3"}


def test_round_robin_uses_the_whole_fleet_when_the_origin_dc_has_no_node_up() -> None:
    rr = RoundRobin(_fleet())
    picks = {rr.choose(_request([], origin_dc="a", up=frozenset({"b2", "b3"}))) for _ in range(4)}
    assert picks == {"b2", "b3"}


def test_session_affinity_is_stable_and_only_a_down_nodes_sessions_move() -> None:
    topo = _fleet()
    aff = SessionAffinity(topo)
    sessions = [f"conv-{i}" for i in range(60)]
    first = {s: aff.choose(_request([], session=s, origin_dc="a")) for s in sessions}
    # the same answer again, and from a second instance (no process-seeded hash)
    again = {
        s: SessionAffinity(topo).choose(_request([], session=s, origin_dc="a")) for s in sessions
    }
    assert first == again
    assert set(first.values()) == {"a1", "a2", "a3"}  # spread over the DC's nodes
    up = frozenset({"a1", "a3", "b1", "b2", "b3"})
    moved = {s: aff.choose(_request([], session=s, origin_dc="a", up=up)) for s in sessions}
    for s in sessions:
        if first[s] != "a2":
            assert moved[s] == first[s]
        else:
            assert moved[s] in {"a1", "a3"}


def test_session_affinity_falls_back_to_the_tenant() -> None:
    aff = SessionAffinity(_fleet())
    by_tenant = {aff.choose(_request([], tenant="t7", origin_dc="b")) for _ in range(5)}
    assert len(by_tenant) == 1
    assert by_tenant.pop() in {"b1", "b2", "b3"}


def test_prefix_only_picks_the_longest_local_prefix_anywhere() -> None:
    po = PrefixOnly(_fleet())
    holdings = [_held("a2", "b3"), _held("a2", "b3"), _held("b3"), _held("a1")]
    assert po.choose(_request(holdings, origin_dc="a")) == "b3"
    # the others' holdings do not count: a1 holds chunk 3 only, not a prefix
    assert local_prefixes(holdings, ["a1", "a2", "b3"]) == {"a1": 0, "a2": 2, "b3": 3}


def test_prefix_only_counts_a_nodes_engine_cache_as_its_own() -> None:
    holdings = [_held("a1#vllm", "b1"), _held("a1#vllm", "b1"), _held("a1#vllm")]
    assert PrefixOnly(_fleet()).choose(_request(holdings)) == "a1"


def test_prefix_only_breaks_ties_by_queue_then_name() -> None:
    po = PrefixOnly(_fleet())
    holdings = [_held("a2", "b1")]
    assert po.choose(_request(holdings)) == "a2"
    assert po.choose(_request(holdings, queue_s={"a2": 1.0})) == "b1"
    assert po.choose(_request([], queue_s={"a1": 0.5})) == "a2"


def test_down_nodes_are_never_chosen() -> None:
    topo = _fleet()
    holdings = [_held("a1"), _held("a1")]
    up = frozenset({"a2", "b1"})
    for name in POLICIES:
        policy = make_policy(name, topo, _costs())
        for _ in range(4):
            assert policy.choose(_request(holdings, origin_dc="a", up=up, session="s")) in up
    for name in POLICIES:
        assert make_policy(name, topo, _costs()).choose(_request([], up=frozenset())) is None


def test_cost_avoids_a_far_dc_when_recomputing_is_cheaper() -> None:
    # b is 20,000 km away: its round trip (0.2 s) costs more than recomputing one chunk
    topo = Topology.build([Node("a1", "a"), Node("b1", "b")], {("a", "b"): DcLink.fiber(20_000)})
    holdings = [_held("b1")]
    request = _request(holdings, origin_dc="a")
    assert PrefixOnly(topo).choose(request) == "b1"
    decision = CostPolicy(topo, _costs()).decide(request, explain=True)
    assert decision is not None and decision.node == "a1"
    assert decision.chosen.pulled_chunks == 0  # not worth pulling either
    assert decision.chosen.ttft_s < decision.scores[1].ttft_s
    assert CostPolicy(topo, _costs()).choose(request) == "a1"


def test_cost_goes_to_a_near_holder_of_a_long_prefix() -> None:
    holdings = [_held("b2")] * 40
    assert CostPolicy(_fleet(), _costs()).choose(_request(holdings, origin_dc="a")) == "b2"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="choose from"):
        make_policy("random", _fleet(), _costs())
