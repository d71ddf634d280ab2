"""The router as a library (kvctl.router.service: Router, KeySpace; kvctl.router.load) and its
HTTP app (kvctl.router.app) over an EmbeddedIndex fed directly."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvctl.agent.runtime import AgentRuntime
from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.index.remote import MAX_KEYS
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import create_app
from kvctl.router.load import LoadTally
from kvctl.router.score import Costs
from kvctl.router.service import KeySpace, NoNodeAvailable, Router
from kvctl.router.topology import DcLink, Node, Topology
from tests.functional.agents import closed_port

CHUNK_TOKENS = 256
#: Llama-3.1-8B's KV: 131,072 bytes per token
CHUNK_BYTES = CHUNK_TOKENS * 131_072
#: 10k tokens/s, no attention term: easy arithmetic
PREFILL = PrefillModel(1e-4, 0.0, "configured: test")
TOKEN = "s3cret-router-token"


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i % 256, i // 256]) + bytes(13) for i in range(n)]


def stored(
    ks: list[bytes], *, tier: str = "cpu", tenant: str = "t", isolated: bool = False
) -> list[ChunkEvent]:
    return [ChunkEvent("stored", k, tier, tenant, isolated, CHUNK_BYTES, CHUNK_TOKENS) for k in ks]


def fleet(km: float = 80.0, *, pool: bool = False) -> Topology:
    nodes = [Node("a1", "fra"), Node("a2", "fra"), Node("b1", "ams"), Node("b2", "ams")]
    if pool:
        nodes.append(Node("p1", "ams", serves=False))
    return Topology.build(nodes, {("fra", "ams"): DcLink.fiber(km)})


def make_router(index: EmbeddedIndex, topology: Topology | None = None, **kw: object) -> Router:
    return Router(
        index,
        topology or fleet(),
        Costs(PREFILL),
        keyspace=KeySpace.of_model("llama-3.1-8b", isolated_tenants=["secret"]),
        **kw,  # type: ignore[arg-type]
    )


# --- LoadTally -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_load_tally_drains_at_wall_clock_rate_and_forgets_idle_nodes() -> None:
    clock = FakeClock()
    load = LoadTally(clock)
    load.add("a1", 2.0)
    load.add("b1", 0.5)
    clock.now_s += 1.0
    load.add("a1", 1.0)  # 1 s left + 1 s more
    assert load.queue_s() == {"a1": pytest.approx(2.0)}  # b1 drained and forgotten
    clock.now_s += 1.5
    assert load.queue_s() == {"a1": pytest.approx(0.5)}
    clock.now_s += 10
    assert load.queue_s() == {}
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument):
            load.add("a1", bad)


# --- KeySpace: the same keys an agent computes -----------------------------------------------


def test_key_space_computes_the_agents_keys_for_shared_and_isolated_tenants(
    runtime: AgentRuntime,
) -> None:
    s = runtime.settings
    space = KeySpace.of_model(
        s.models[0].id, chunk_tokens=s.chunk_tokens, isolated_tenants=s.isolated_tenants
    )
    assert "secret" in s.isolated_tenants
    for tenant in ("", "acme", "secret"):
        assert space.namespace(tenant).root == runtime.namespace(None, tenant).root
    toks = list(range(3 * s.chunk_tokens + 1))
    shared, isolated = space.keys(toks, "acme"), space.keys(toks, "secret")
    assert len(shared) == 3  # the partial tail has no key
    assert shared == space.keys(toks, "other")  # shared tenants share keys
    assert not set(shared) & set(isolated)  # an isolated tenant's keys are its own


# --- Router ----------------------------------------------------------------------------------


def test_route_goes_to_the_holder_and_counts_the_decision() -> None:
    index, ks = EmbeddedIndex(), keys(8)
    index.apply("b2", stored(ks))
    router = make_router(index)
    d = router.route(ks, tenant="t")
    assert d.node == "b2" and d.chosen.local_chunks == 8 and d.indexed_chunks == 8
    s = router.stats()
    assert s["decisions"] == 1 and s["to_holder"] == 1 and s["no_node"] == 0
    assert s["nodes"]["b2"]["decisions"] == 1 and s["nodes"]["b2"]["to_holder"] == 1
    assert s["nodes"]["a1"]["decisions"] == 0  # every node of the topology is listed
    assert s["requested_chunks"] == 8 and s["indexed_chunks"] == 8 and s["local_chunks"] == 8
    assert s["tokens"] == 8 * CHUNK_TOKENS and s["recomputed_tokens"] == 0
    assert s["policies"] == {"cost": 1}
    assert s["decision_s"]["samples"] == 1 and s["decision_s"]["p99"] is not None
    assert s["latency"]["count"] == 1


def test_pulls_are_counted_per_dc_link_and_recompute_in_tokens() -> None:
    # the chain is held only by a pool node (it serves no engine): whoever serves pulls it
    index, ks = EmbeddedIndex(), keys(6)
    index.apply("p1", stored(ks))
    router = make_router(index, fleet(pool=True))
    d = router.route(ks, tenant="t", tokens=6 * CHUNK_TOKENS + 100, origin_dc="fra")
    assert d.node != "p1" and d.chosen.pulled_chunks > 0
    s = router.stats()
    assert s["to_holder"] == 0
    assert s["links"] == [
        {
            "from_dc": "ams",
            "to_dc": d.dc,
            "chunks": d.chosen.pulled_chunks,
            "bytes": d.chosen.pulled_bytes,
        }
    ]
    assert s["pulled_bytes"] == d.chosen.pulled_bytes
    assert s["recomputed_tokens"] == 6 * CHUNK_TOKENS + 100 - d.chosen.fetched_tokens
    assert s["recomputed_tokens"] >= 100  # the partial tail is always prefilled


def test_the_modeled_queue_spreads_requests_that_cost_alike() -> None:
    # nothing is cached: every node costs the same, so the queue decides
    router = make_router(EmbeddedIndex())
    chosen = [router.route(keys(4, seed=i), tenant="t").node for i in range(4)]
    assert sorted(chosen) == ["a1", "a2", "b1", "b2"]
    queue = router.load.queue_s()
    assert set(queue) == {"a1", "a2", "b1", "b2"}
    assert router.stats()["nodes"]["a1"]["queue_s"] > 0


def test_route_tokens_finds_what_an_agent_stored_and_isolation_holds() -> None:
    index = EmbeddedIndex()
    router = make_router(index)
    toks = list(range(4 * CHUNK_TOKENS))
    index.apply("a2", stored(router.keys_for(toks, tenant="acme"), tenant="acme"))
    secret_keys = router.keys_for(toks, tenant="secret")
    index.apply("b1", stored(secret_keys, tenant="secret", isolated=True))
    assert router.route_tokens(toks, tenant="someone").node == "a2"  # shared namespace
    assert router.route_tokens(toks, tenant="secret").node == "b1"
    # another tenant naming the isolated keys directly learns nothing of them
    d = router.route(secret_keys, tenant="acme")
    assert d.indexed_chunks == 0 and d.chosen.local_chunks == 0
    assert router.holders(secret_keys, tenant="acme") == [[] for _ in secret_keys]


def test_a_token_request_whose_chain_passes_the_key_limit_is_routed_on_all_of_it() -> None:
    # 16-token chunks (vLLM's block size): a 80,000-token prompt, under MAX_TOKENS, is a chain
    # of 5,000 keys. The router computed them itself, yet answered 400 "5,000 keys in one
    # request; the limit is 4,096", a limit on keys the caller never sent.
    index = EmbeddedIndex()
    router = Router(
        index, fleet(), Costs(PREFILL), keyspace=KeySpace.of_model("llama-3.1-8b", chunk_tokens=16)
    )
    toks = [7] * (5000 * 16)
    chain = router.keys_for(toks, tenant="t")
    assert len(chain) == 5000 > MAX_KEYS
    index.apply("b1", [ChunkEvent("stored", k, "cpu", "t", False, 16 * 131_072, 16) for k in chain])
    with TestClient(create_app(router)) as c:
        r = c.post("/v1/route", json={"tokens": toks, "tenant": "t"})
    assert r.status_code == 200, r.text
    body = r.json()
    # the whole chain, past the first lookup's 4,096 keys, is held and planned
    assert body["node"] == "b1" and body["chunks"] == 5000
    assert body["indexed_chunks"] == 5000 and body["local_chunks"] == 5000
    # keys the caller sends are still held to the limit
    with pytest.raises(InvalidArgument, match="limit"):
        router.route(chain, tenant="t")


def test_baseline_policies_pick_their_node_and_show_its_modeled_plan() -> None:
    index, ks = EmbeddedIndex(), keys(8)
    index.apply("b2", stored(ks))
    router = make_router(index)
    turns = [router.route(ks, tenant="t", policy="round-robin").node for _ in range(4)]
    assert sorted(turns) == ["a1", "a2", "b1", "b2"]
    d = router.route(ks, tenant="t", policy="round-robin")
    assert d.chosen.node == d.node and d.chosen in d.scores
    assert router.route(ks, tenant="t", policy="prefix-only").node == "b2"
    assert router.stats()["policies"] == {"prefix-only": 1, "round-robin": 5}
    with pytest.raises(InvalidArgument, match="unknown policy"):
        router.route(ks, tenant="t", policy="random")


def test_inventory_rereads_while_requests_are_routed_never_fail_a_request() -> None:
    # A request scored the nodes of one topology, then asked round-robin of the next (swapped
    # in meanwhile by the reloader's thread), which dealt it "a0", new and first by name: no
    # score for it, so a fleet with every node up answered 503 "no serving node is up" (about
    # one request in ten while rereads kept changing the fleet).
    small = Topology.build([Node(f"n{i:03}", "fra") for i in range(300)])
    grown = Topology.build([Node("a0", "fra"), *small.nodes.values()])
    router = make_router(EmbeddedIndex(), small)
    stop = threading.Event()

    def reread() -> None:
        while not stop.is_set():
            router.set_topology(grown)
            router.set_topology(small)

    rereads = threading.Thread(target=reread)
    rereads.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            router.route(keys(1), tenant="t", policy="round-robin")
    finally:
        stop.set()
        rereads.join()
    assert router.stats()["no_node"] == 0


def test_bad_requests_and_no_node_are_clear_errors() -> None:
    index = EmbeddedIndex()
    # a node in a DC with no link to the origin cannot serve it
    topo = Topology.build([Node("a1", "fra"), Node("p1", "zrh", serves=False)])
    router = make_router(index, topo)
    with pytest.raises(NoNodeAvailable, match="zrh"):
        router.route(keys(2), tenant="t", origin_dc="zrh")
    assert router.stats()["no_node"] == 1
    with pytest.raises(InvalidArgument, match="unknown origin DC"):
        router.route(keys(2), tenant="t", origin_dc="nowhere")
    with pytest.raises(InvalidArgument, match="limit"):
        router.route(keys(MAX_KEYS + 1), tenant="t")
    with pytest.raises(InvalidArgument, match="tokens"):
        router.route(keys(2), tenant="t", tokens=-1)


def test_only_nodes_whose_follower_is_up_are_chosen() -> None:
    # real followers of agents that are not there: after a poll every node is down
    index = EmbeddedIndex()
    port = closed_port()
    followers = Followers(
        index, {n: (f"http://127.0.0.1:{port}", None) for n in ("a1", "a2", "b1", "b2")}
    )
    router = make_router(index, followers=followers)
    try:
        followers.poll_all()
        assert router.up_nodes() == frozenset()
        with pytest.raises(NoNodeAvailable, match="no node is up"):
            router.route(keys(2), tenant="t")
    finally:
        router.close()


# --- the HTTP app ----------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[TestClient, EmbeddedIndex, Router]]:
    index = EmbeddedIndex()
    router = make_router(index)
    with TestClient(create_app(router, token=TOKEN, max_body_bytes=1 << 20)) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c, index, router


def test_a_router_without_a_token_serves_only_requests_addressed_to_this_host() -> None:
    # what a web page whose domain points at 127.0.0.1 (DNS rebinding) would send: its domain
    router = make_router(EmbeddedIndex())
    try:
        with TestClient(create_app(router), base_url="http://127.0.0.1:7171") as c:
            assert c.get("/v1/health").status_code == 200
            refused = c.get("/v1/health", headers={"Host": "evil.example"})
            assert refused.status_code == 403, refused.text
            assert "evil.example" in refused.json()["detail"]
    finally:
        router.close()


def test_route_endpoint_answers_the_decision_with_an_id(served) -> None:  # type: ignore[no-untyped-def]
    c, index, _ = served
    ks = keys(8)
    index.apply("b2", stored(ks))
    r = c.post("/v1/route", json={"keys": [k.hex() for k in ks], "tenant": "t"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["node"] == "b2" and body["local_chunks"] == 8 and body["indexed_chunks"] == 8
    assert body["full_prefill_ttft_s"] == pytest.approx(8 * CHUNK_TOKENS * 1e-4)
    assert body["ttft_s"] < body["full_prefill_ttft_s"]
    assert "scores" not in body
    second = c.post(
        "/v1/route",
        json={"keys": [k.hex() for k in ks], "tenant": "t", "explain": True, "origin_dc": "fra"},
    ).json()
    assert second["decision_id"] != body["decision_id"]
    assert {s["node"] for s in second["scores"]} == {"a1", "a2", "b1", "b2"}
    far = next(s for s in second["scores"] if s["node"] == "a1")
    assert far["pulled_chunks"] > 0
    assert "b2/cpu" in far["links"]  # the pull's link, with its figures and their basis
    assert second["prefill"]["basis"] == "configured: test"


def test_route_by_tokens_uses_the_routers_key_space(served) -> None:  # type: ignore[no-untyped-def]
    c, index, router = served
    toks = list(range(2 * CHUNK_TOKENS + 10))
    index.apply("a2", stored(router.keys_for(toks, tenant="x"), tenant="x"))
    body = c.post("/v1/route", json={"tokens": toks, "tenant": "x"}).json()
    assert body["node"] == "a2" and body["tokens"] == len(toks) and body["chunks"] == 2


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"tenant": "t"}, 400, "exactly one of keys or tokens"),
        ({"keys": ["00" * 16], "tokens": [1], "tenant": "t"}, 400, "exactly one"),
        ({"keys": ["zz" * 16], "tenant": "t"}, 400, "keys[0]"),
        ({"keys": ["00" * 16], "origin_dc": "mars"}, 400, "unknown origin DC"),
        ({"keys": ["00" * 16], "policy": "dice"}, 400, "unknown policy"),
        ({"keys": ["00" * 16], "orign_dc": "fra"}, 422, "orign_dc"),
        ({"keys": ["00" * 16] * (MAX_KEYS + 1)}, 422, "keys"),
        ({"tokens": [-1]}, 422, "tokens"),
        ({"keys": ["00" * 16], "explain": "yes"}, 422, "explain"),
    ],
)
def test_bad_route_requests_are_4xx_naming_the_problem(served, body, status, says) -> None:  # type: ignore[no-untyped-def]
    c, _, _ = served
    r = c.post("/v1/route", json=body)
    assert r.status_code == status, r.text
    assert says in r.text


def test_a_long_policy_name_is_refused_without_being_echoed_whole(served) -> None:  # type: ignore[no-untyped-def]
    # every other string field has a max_length: an unknown policy of 700 KB came back whole
    # in the 400 (and in the message of every client that shows it)
    c, _, _ = served
    r = c.post("/v1/route", json={"keys": ["00" * 16], "policy": "x" * 700_000})
    assert r.status_code == 422 and "policy" in r.text
    assert len(r.content) < 2_000


def test_no_node_is_503(served) -> None:  # type: ignore[no-untyped-def]
    c, _, router = served
    router.topology = Topology.build([Node("p1", "fra", serves=False)])
    r = c.post("/v1/route", json={"keys": ["00" * 16]})
    assert r.status_code == 503 and "no serving node" in r.json()["detail"]


def test_every_endpoint_needs_the_token_when_set(served) -> None:  # type: ignore[no-untyped-def]
    c, _, _ = served
    for method, path in [
        ("GET", "/v1/health"),
        ("GET", "/v1/index"),
        ("GET", "/v1/stats"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("POST", "/v1/route"),
        ("POST", "/v1/index/holders"),
    ]:
        for auth in (None, "Bearer wrong", f"Basic {TOKEN}"):
            r = c.request(method, path, headers={"Authorization": auth or ""})
            assert r.status_code == 401, (method, path, auth)
    assert c.get("/v1/health").json()["status"] == "ok"


def test_the_schema_states_every_error_as_an_error_detail(served) -> None:  # type: ignore[no-untyped-def]
    # the agent's schema does the same (test_api_schema): one ErrorDetail, kvctl.http_errors'
    c, _, _ = served
    spec = c.get("/openapi.json").json()
    assert spec["components"]["schemas"]["ErrorDetail"]["required"] == ["detail"]
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            for code in ("401", "413"):  # the auth and body-limit middleware answer any request
                content = op["responses"][code]["content"]["application/json"]
                assert content["schema"]["$ref"] == "#/components/schemas/ErrorDetail", (
                    path,
                    method,
                )
    route = spec["paths"]["/v1/route"]["post"]["responses"]
    assert sorted(route) == ["200", "400", "401", "413", "422", "503"]
    assert route["503"]["description"].startswith("no node can serve the request")


def test_a_body_over_the_limit_is_413(served) -> None:  # type: ignore[no-untyped-def]
    c, _, _ = served
    r = c.post("/v1/route", json={"tokens": [123456789] * 120_000})  # about 1.2 MB
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_holders_and_index_answer_as_the_index_client_reads_them(served) -> None:  # type: ignore[no-untyped-def]
    c, index, _ = served
    ks = keys(3)
    index.apply("a1", stored(ks[:2], tier="gpu"))
    index.apply("b1", stored(ks[:1], tenant="secret", isolated=True))
    r = c.post("/v1/index/holders", json={"keys": [k.hex() for k in ks], "tenant": "t"})
    assert r.status_code == 200
    assert r.json() == {
        "holders": [
            [{"node": "a1", "tier": "gpu", "size_bytes": CHUNK_BYTES, "tokens": CHUNK_TOKENS}],
            [{"node": "a1", "tier": "gpu", "size_bytes": CHUNK_BYTES, "tokens": CHUNK_TOKENS}],
            [],
        ]
    }
    secret = c.post("/v1/index/holders", json={"keys": [ks[0].hex()], "tenant": "secret"}).json()
    assert [h["node"] for h in secret["holders"][0]] == ["a1", "b1"]
    got = c.get("/v1/index").json()
    assert got == {
        "kind": "embedded",
        "nodes": {"a1": 2, "b1": 1},
        "not_in_inventory": {},
        "malformed_entries": 0,
        "followers": [],
        "engines": [],
    }
    assert c.post("/v1/index/holders", json={"keys": ["0" * 31]}).status_code == 400


def test_a_tenant_name_is_bounded_in_bytes_as_an_agent_bounds_it(served) -> None:  # type: ignore[no-untyped-def]
    """256 characters of 4-byte UTF-8 passed the schema's max_length (characters) where every
    agent refuses a name past 256 bytes (``check_tenant``): the router answers 400 as they do."""
    c, _, _ = served
    key = keys(1)[0].hex()
    wide = "\U0001f600" * 100  # 100 characters, 400 bytes
    for path, body in (
        ("/v1/index/holders", {"keys": [key], "tenant": wide}),
        ("/v1/route", {"keys": [key], "tenant": wide}),
    ):
        r = c.post(path, json=body)
        assert r.status_code == 400 and "400 bytes in UTF-8" in r.json()["detail"], r.text
    assert (
        c.post("/v1/index/holders", json={"keys": [key], "tenant": "\u00e9" * 128}).status_code
        == 200
    )


def test_metrics_are_prometheus_text_without_keys_or_tenants(served) -> None:  # type: ignore[no-untyped-def]
    c, index, _ = served
    ks = keys(4)
    index.apply("b2", stored(ks, tenant="tenant-x"))
    c.post("/v1/route", json={"keys": [k.hex() for k in ks], "tenant": "tenant-x"})
    c.post("/v1/index/holders", json={"keys": [ks[0].hex()], "tenant": "tenant-x"})
    text = c.get("/metrics").text
    assert 'kvctl_router_decisions_total{node="b2"} 1.0' in text
    assert 'kvctl_router_decisions_to_holder_total{node="b2"} 1.0' in text
    assert "kvctl_router_decision_seconds_count 1.0" in text
    assert "kvctl_index_holders_keys_total 1.0" in text
    assert 'kvctl_index_entries{node="b2"} 4.0' in text
    assert "tenant-x" not in text and ks[0].hex() not in text


def test_stats_and_health(served) -> None:  # type: ignore[no-untyped-def]
    c, _, router = served
    c.post("/v1/route", json={"keys": [keys(1)[0].hex()]})
    stats = c.get("/v1/stats").json()
    assert stats["decisions"] == 1 and set(stats["nodes"]) == {"a1", "a2", "b1", "b2"}
    health = c.get("/v1/health").json()
    assert health["instance"] == router.instance and health["nodes"] == 4


@pytest.mark.parametrize("claimed", [2**62, CHUNK_TOKENS * 4], ids=["2**62", "four-chunks"])
def test_a_chunk_claiming_more_tokens_than_its_bytes_hold_counts_what_they_can(
    claimed: int,
) -> None:
    """An agent's events bound a chunk's tokens by an int64 only: a hostile or broken one that
    said its one chunk of a 4-chunk prompt held 2**62 tokens (or the whole prompt's) made the
    router take the whole prompt as fetched from it, nothing to prefill, and send every such
    request there (found by a review). A chunk counts at most what it can hold, as the remote
    tiers bound a peer's claim: chunk_tokens, or its bytes at MIN_KV_BYTES_PER_TOKEN."""
    ks = keys(4)
    index = EmbeddedIndex()
    # 512 bytes: 256 tokens at MIN_KV_BYTES_PER_TOKEN (2), the router's chunk_tokens
    index.apply("b1", [ChunkEvent("stored", ks[0], "cpu", "t", False, 512, claimed)])
    router = make_router(index)
    d = router.route(ks, tenant="t", tokens=4 * CHUNK_TOKENS)
    assert d.node == "b1" and d.chosen.fetched_chunks == 1
    assert d.chosen.fetched_tokens == CHUNK_TOKENS
    stats = router.stats()
    assert (stats["fetched_tokens"], stats["recomputed_tokens"]) == (256, 3 * CHUNK_TOKENS)


def test_a_chunk_larger_than_the_routers_whose_bytes_hold_its_tokens_counts_them_all() -> None:
    """An engine may chunk larger than the router (its own chunk_tokens): a chunk of 512
    tokens whose bytes hold them counts its 512, not the router's 256."""
    ks = keys(2)
    index = EmbeddedIndex()
    index.apply("b1", [ChunkEvent("stored", ks[0], "cpu", "t", False, 2 * CHUNK_BYTES, 512)])
    d = make_router(index).route(ks, tenant="t", tokens=4 * CHUNK_TOKENS)
    assert d.node == "b1" and d.chosen.fetched_tokens == 512


def test_a_prompt_routed_by_its_tokens_counts_no_chunk_past_chunk_tokens() -> None:
    """Routed by token ids, every key is the router's own, of chunk_tokens tokens: a holding
    that claims more (its bytes holding them: a hostile agent claims those too) counts
    chunk_tokens, not the 4,096 it says (found by a review)."""
    router = make_router(EmbeddedIndex())
    prompt = list(range(4 * CHUNK_TOKENS))
    ks = router.keys_for(prompt, tenant="t")
    router.index.apply("b1", [ChunkEvent("stored", ks[0], "cpu", "t", False, CHUNK_BYTES, 4096)])
    d = router.route_tokens(prompt, tenant="t")
    assert d.node == "b1" and d.chosen.fetched_tokens == CHUNK_TOKENS
    # by keys, a chunk's length is the caller's: its bytes bound it (they hold 4,096)
    assert router.route(ks, tenant="t", tokens=16 * CHUNK_TOKENS).chosen.fetched_tokens == 4096


def test_chunks_no_holder_claims_longer_than_chunk_tokens_are_not_bounded_one_holder_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """held_tokens (f69a72d) bounds a holding claiming more tokens than chunk_tokens; a chunk
    held by several nodes called it once per holder, for every chunk of every route, though
    almost every chunk claims chunk_tokens at most (then the bound is what they claim): a
    1,024-chunk prompt held by 256 nodes (a system prompt cached fleet-wide) made about 262k
    calls a route, some 25 ms (found by a review; the single holder's path skipped it
    already). Bounded one holder at a time only where a holder claims more."""
    from kvctl.router import score

    calls: list[int] = []

    def counted(h: object, chunk_tokens: int, *, exact: bool = False) -> int:
        calls.append(1)
        return held_tokens(h, chunk_tokens, exact=exact)  # type: ignore[arg-type]

    held_tokens = score.held_tokens
    monkeypatch.setattr(score, "held_tokens", counted)
    ks = keys(4)
    index = EmbeddedIndex()
    for node in ("a1", "a2", "b1"):
        index.apply(node, stored(ks[:3]))
    d = make_router(index).route(ks, tenant="t", tokens=4 * CHUNK_TOKENS)
    assert d.chosen.fetched_tokens == 3 * CHUNK_TOKENS
    assert calls == []
    # one holder of the second chunk claims more: that chunk's holders are bounded, and the
    # claim counts what its bytes hold (CHUNK_BYTES: far more than 512 tokens)
    index.apply("b2", [ChunkEvent("stored", ks[1], "cpu", "t", False, CHUNK_BYTES, 512)])
    d = make_router(index).route(ks, tenant="t", tokens=4 * CHUNK_TOKENS)
    assert d.chosen.fetched_tokens == 4 * CHUNK_TOKENS
    assert len(calls) == 4
