"""The routing decision (kvctl.router.score) on hand-built indexes and topologies."""

from __future__ import annotations

import math

import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent
from kvctl.index.model import EmbeddedIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.score import Costs, decide, held_prefix, local_prefix, score_nodes
from kvctl.router.topology import DcLink, Node, Topology

CHUNK_TOKENS = 256
#: Llama-3.1-8B's KV: 131,072 bytes per token
CHUNK_BYTES = CHUNK_TOKENS * 131_072
#: 10k tokens/s, no attention term: easy arithmetic
PREFILL = PrefillModel(1e-4, 0.0, "configured: test")


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) + bytes(14) for i in range(n)]


def stored(ks: list[bytes], *, tier: str = "cpu", tenant: str = "t", isolated: bool = False):
    return [ChunkEvent("stored", k, tier, tenant, isolated, CHUNK_BYTES, CHUNK_TOKENS) for k in ks]


def two_dcs(km: float = 80.0) -> Topology:
    return Topology.build(
        [Node("a1", "fra"), Node("a2", "fra"), Node("b1", "ams"), Node("b2", "ams")],
        {("fra", "ams"): DcLink.fiber(km)},
    )


def test_a_request_goes_to_the_node_holding_its_prefix() -> None:
    index, ks = EmbeddedIndex(), keys(8)
    index.apply("b2", stored(ks))
    d = decide(
        index.holders(ks, tenant="t"),
        tokens=8 * CHUNK_TOKENS,
        chunk_tokens=CHUNK_TOKENS,
        topology=two_dcs(),
        costs=Costs(PREFILL),
    )
    assert d is not None and d.node == "b2"
    assert d.chosen.local_chunks == 8 and d.chosen.pulled_chunks == 0
    assert d.chosen.prefill_s == 0.0
    # every other node pulls the chain from b2, and pays for it
    others = {s.node: s for s in d.scores[1:]}
    assert others["a1"].pulled_chunks == 8 and others["a1"].fetch_s > d.chosen.fetch_s


def test_a_far_dc_is_not_chosen_when_recomputing_is_cheaper() -> None:
    # one short chunk held only 2,000 km away: the request's round trip there (20 ms) costs
    # more than recomputing 64 tokens at home (6.4 ms)
    index, ks = EmbeddedIndex(), keys(1)
    index.apply("b1", [ChunkEvent("stored", ks[0], "gpu", "t", False, 64 * 131_072, 64)])
    topo = two_dcs(km=2000)
    d = decide(
        index.holders(ks, tenant="t"),
        tokens=64,
        chunk_tokens=64,
        topology=topo,
        costs=Costs(PREFILL),
        origin_dc="fra",
    )
    assert d is not None and d.dc == "fra"
    assert d.chosen.prefill_s == pytest.approx(64 * 1e-4)
    # with a long prefix the holder wins despite the distance
    long_keys = keys(40, seed=1)
    index.apply("b1", stored(long_keys, tier="gpu"))
    d = decide(
        index.holders(long_keys, tenant="t"),
        tokens=40 * CHUNK_TOKENS,
        chunk_tokens=CHUNK_TOKENS,
        topology=topo,
        costs=Costs(PREFILL),
        origin_dc="fra",
    )
    assert d is not None and d.node == "b1"


def test_a_node_near_a_holder_pulls_rather_than_recomputes() -> None:
    index, ks = EmbeddedIndex(), keys(16)
    index.apply("a1", stored(ks))
    scores = {
        s.node: s
        for s in score_nodes(
            index.holders(ks, tenant="t"),
            tokens=16 * CHUNK_TOKENS,
            chunk_tokens=CHUNK_TOKENS,
            topology=two_dcs(),
            costs=Costs(PREFILL),
        )
    }
    a2 = scores["a2"]
    assert a2.pulled_chunks == 16 and a2.pulled_bytes == 16 * CHUNK_BYTES
    assert [p.as_dict()["from"] for p in a2.pulls] == ["a1"]
    assert a2.ttft_s < 16 * CHUNK_TOKENS * 1e-4  # cheaper than a full prefill
    assert "a1/cpu" in a2.links


def test_queued_work_moves_the_request_to_an_idle_node() -> None:
    index, ks = EmbeddedIndex(), keys(4)
    index.apply("a1", stored(ks))
    holdings = index.holders(ks, tenant="t")
    common = {"tokens": 4 * CHUNK_TOKENS, "chunk_tokens": CHUNK_TOKENS, "topology": two_dcs()}
    assert decide(holdings, costs=Costs(PREFILL), **common).node == "a1"  # type: ignore[union-attr]
    busy = decide(holdings, costs=Costs(PREFILL), queue_s={"a1": 5.0}, **common)
    assert busy is not None and busy.node != "a1" and busy.chosen.queue_s == 0.0


def test_isolated_chunks_of_another_tenant_are_not_routed_on() -> None:
    index, ks = EmbeddedIndex(), keys(8)
    index.apply("b1", stored(ks, tenant="secret", isolated=True))
    assert held_prefix(index.holders(ks, tenant="other")) == 0
    assert held_prefix(index.holders(ks, tenant="secret")) == 8
    d = decide(
        index.holders(ks, tenant="other"),
        tokens=8 * CHUNK_TOKENS,
        chunk_tokens=CHUNK_TOKENS,
        topology=two_dcs(),
        costs=Costs(PREFILL),
    )
    assert d is not None and d.indexed_chunks == 0 and d.chosen.fetched_chunks == 0


def test_down_nodes_pool_agents_and_unlinked_dcs_are_not_chosen() -> None:
    topo = Topology.build(
        [Node("a1", "fra"), Node("pool", "fra", serves=False), Node("c1", "nyc")],
        {},
    )
    index, ks = EmbeddedIndex(), keys(4)
    index.apply("pool", stored(ks))
    holdings = index.holders(ks, tenant="t")
    scores = score_nodes(
        holdings,
        tokens=1024,
        chunk_tokens=CHUNK_TOKENS,
        topology=topo,
        costs=Costs(PREFILL),
        origin_dc="fra",
    )
    # the pool serves nothing; nyc has no link from fra
    assert [s.node for s in scores] == ["a1"]
    assert scores[0].pulled_chunks == 4  # it pulls from the pool in its own DC
    assert (
        decide(
            holdings,
            tokens=1024,
            chunk_tokens=CHUNK_TOKENS,
            topology=topo,
            costs=Costs(PREFILL),
            up=set(),
        )
        is None
    )


def test_carbon_weight_prefers_the_cleaner_dc_when_asked() -> None:
    topo = Topology.build(
        [Node("dirty", "x", carbon_g_per_kwh=800.0), Node("clean", "y", carbon_g_per_kwh=20.0)],
        {("x", "y"): DcLink.fiber(10)},
    )
    index, ks = EmbeddedIndex(), keys(2)
    common = {
        "tokens": 20_000,
        "chunk_tokens": CHUNK_TOKENS,
        "topology": topo,
        "origin_dc": "x",
    }
    holdings = index.holders(ks, tenant="t")
    plain = decide(holdings, costs=Costs(PREFILL), **common)
    assert plain is not None and plain.node == "dirty"  # the request's own DC: no round trip
    weighted = decide(holdings, costs=Costs(PREFILL, carbon_s_per_g=10.0), **common)
    assert weighted is not None and weighted.node == "clean"
    assert weighted.chosen.carbon_g is not None and weighted.chosen.carbon_g > 0


def test_prefix_helpers_and_bad_input() -> None:
    index, ks = EmbeddedIndex(), keys(3)
    index.apply("a1", stored(ks[:2]))
    index.apply("a2", stored(ks[1:]))
    holdings = index.holders(ks, tenant="t")
    assert held_prefix(holdings) == 3
    assert local_prefix(holdings, "a1") == 2 and local_prefix(holdings, "a2") == 0
    with pytest.raises(InvalidArgument):
        score_nodes(holdings, tokens=10, chunk_tokens=0, topology=two_dcs(), costs=Costs(PREFILL))
    with pytest.raises(InvalidArgument):
        DcLink(-1.0, 1e9, "configured")
    with pytest.raises(InvalidArgument):
        Topology.build([Node("a", "x"), Node("a", "y")])
    with pytest.raises(InvalidArgument):
        ChunkEvent("stored", b"short", "cpu")


@pytest.mark.parametrize(
    "figure",
    [
        {"host_to_device_bytes_per_s": math.inf},
        {"host_to_device_bytes_per_s": 0.0},
        {"host_to_device_bytes_per_s": -1e9},
        {"host_to_device_bytes_per_s": math.nan},
        {"disk_read_bytes_per_s": math.inf},
        {"prefill_watts": math.inf},
        {"carbon_s_per_g": math.inf},
    ],
)
def test_costs_refuse_figures_no_decision_can_use(figure: dict[str, float]) -> None:
    # `router serve --host-to-device-gbps inf` started, then answered every route 400 "device
    # bandwidth must be finite" (the caller blamed for the router's setting); an infinite
    # carbon weight made scores inf or NaN. The router must refuse them when it is built.
    with pytest.raises(InvalidArgument):
        Costs(PREFILL, **figure)  # type: ignore[arg-type]


def test_a_node_name_with_the_engine_separator_is_refused() -> None:
    # "#" ends a node's name in the index (NODE#ENGINE is an engine's own cache, owned by
    # NODE): a node named "rack#1" holding a whole prefix was credited with none of it (its
    # copies read as rack's engine cache), and its requests went elsewhere to recompute
    with pytest.raises(InvalidArgument, match="#"):
        Topology.build([Node("rack#1", "fra"), Node("other", "fra")])


def test_the_decision_explains_itself() -> None:
    index, ks = EmbeddedIndex(), keys(2)
    index.apply("a1", stored(ks))
    d = decide(
        index.holders(ks, tenant="t"),
        tokens=600,
        chunk_tokens=CHUNK_TOKENS,
        topology=two_dcs(),
        costs=Costs(PREFILL),
    )
    assert d is not None
    plain, explained = d.as_dict(), d.as_dict(explain=True)
    assert "scores" not in plain and plain["node"] == "a1"
    assert explained["scores"][0]["node"] == "a1"  # type: ignore[index]
    assert explained["prefill"]["basis"] == "configured: test"  # type: ignore[index]
    a2 = next(s for s in explained["scores"] if s["node"] == "a2")  # type: ignore[union-attr]
    assert a2["links"]["a1/cpu"]["source"] == "configured"


def test_an_engines_own_cache_counts_for_its_node_only() -> None:
    from kvctl.index.model import engine_index_name, owner

    index, ks = EmbeddedIndex(), keys(6)
    engine = engine_index_name("b1")
    assert owner(engine) == "b1" and owner("b1") == "b1"
    index.apply(engine, stored(ks, tier="gpu"))
    # the agent on b1 resyncing its own (empty) holding leaves the engine's entries alone
    index.replace("b1", [])
    scores = {
        s.node: s
        for s in score_nodes(
            index.holders(ks, tenant="t"),
            tokens=6 * CHUNK_TOKENS,
            chunk_tokens=CHUNK_TOKENS,
            topology=two_dcs(),
            costs=Costs(PREFILL),
        )
    }
    assert scores["b1"].local_chunks == 6 and scores["b1"].prefill_s == 0.0
    # nobody else can pull from an engine's GPU memory: they recompute
    assert scores["a1"].pulled_chunks == 0 and scores["a1"].fetched_chunks == 0
    assert min(scores.values(), key=lambda s: s.score_s).node == "b1"


def test_pruning_plans_fewer_nodes_and_picks_the_same_one() -> None:
    # 12 nodes in 3 DCs; chains held in different places with different queues: the pruned
    # decision must always equal the full one
    import random

    rng = random.Random(7)
    nodes = [Node(f"n{i}", f"dc{i % 3}") for i in range(12)]
    topo = Topology.build(
        nodes,
        {
            ("dc0", "dc1"): DcLink.fiber(100),
            ("dc0", "dc2"): DcLink.fiber(1500),
            ("dc1", "dc2"): DcLink.fiber(1500),
        },
    )
    index = EmbeddedIndex()
    planned_fewer = 0
    for trial in range(40):
        ks = keys(rng.randint(1, 60), seed=trial)
        for node in rng.sample(nodes, rng.randint(0, 3)):
            cut = rng.randint(1, len(ks))
            index.apply(node.name, stored(ks[:cut], tier=rng.choice(["gpu", "cpu", "disk"])))
        common = {
            "tokens": len(ks) * CHUNK_TOKENS + rng.randint(0, 255),
            "chunk_tokens": CHUNK_TOKENS,
            "topology": topo,
            "costs": Costs(PREFILL, host_to_device_bytes_per_s=50e9),
            "origin_dc": rng.choice(["dc0", "dc1", "dc2", None]),
            "queue_s": {n.name: rng.choice([0.0, 0.0, 0.05, 1.0]) for n in nodes},
        }
        holdings = index.holders(ks, tenant="t")
        full = decide(holdings, explain=True, **common)  # type: ignore[arg-type]
        pruned = decide(holdings, **common)  # type: ignore[arg-type]
        assert full is not None and pruned is not None
        assert (pruned.node, pruned.chosen.score_s) == (full.node, full.chosen.score_s)
        assert len(full.scores) == 12
        planned_fewer += len(pruned.scores) < len(full.scores)
    assert planned_fewer > 20
