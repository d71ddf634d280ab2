"""A lookup with a fleet index probes only the peers the index names (and the pool), counts
entries that outlived their chunks and never serves them, falls back to probing every peer when
the index fails (and then leaves the failed index alone for its backoff), and keeps isolated
tenants' chunks to their tenants.

Each peer is a real ``TieredStore`` answering the way an agent's data plane does (its probe is
the store's locate and entries, its fetch the store's export), counting the probes it gets; the
index is a real ``EmbeddedIndex`` fed by the peers' own store events (what a router's follower
does), or a real ``IndexClient`` at a port nothing listens on."""

from __future__ import annotations

import hashlib
import http.server
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.config import ConfigError, describe, load_settings
from kvctl.agent.metrics import AgentMetrics
from kvctl.agent.settings import AgentSettings
from kvctl.index.events import ChunkEvent, from_agent_event
from kvctl.index.model import EmbeddedIndex, Holding
from kvctl.index.remote import IndexClient
from kvctl.ports import free_loopback_port
from kvctl.remote.breaker import Breaker
from kvctl.remote.federation import PEER_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.pool import PoolChunk, PoolUsage, RemotePool, visible_to
from kvctl.store.errors import KeyNotFound, TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from tests.hostile_servers import Hostile, handler_class, send_json, trickle
from tests.not_an_agent import serving

CHUNK_BYTES = 256
CHUNK_TOKENS = 16


def key(space: str, i: int) -> bytes:
    return hashlib.blake2b(f"{space}:{i}".encode(), digest_size=16).digest()


def payload(k: bytes) -> bytes:
    return (k * (CHUNK_BYTES // len(k) + 1))[:CHUNK_BYTES]


def new_store() -> TieredStore:
    return TieredStore([CpuTier(64 * CHUNK_BYTES)], chunk_tokens=CHUNK_TOKENS)


def put_chain(
    store: TieredStore,
    keys: Sequence[bytes],
    tenant: str,
    parents: Sequence[bytes | None] | None = None,
    **kw: Any,
) -> None:
    """Each key stored under its parent: ``parents[i]`` where given, else the key before it."""
    for parent, k in zip(parents or [None, *keys], keys, strict=False):
        store.put(k, payload(k), tokens=CHUNK_TOKENS, tenant=tenant, parent=parent, **kw)


class StorePeer(RemotePool):
    """A peer agent's answers from its store in this process (the data plane's FETCH: probe =
    the entries of what is cached here and visible to the tenant, fetch = their bytes)."""

    def __init__(self, name: str, store: TieredStore) -> None:
        self.address = f"in-process://{name}"
        self.store = store
        #: probe_many calls: what the index is there to save; get_many calls (pulls)
        self.probes = 0
        self.gets = 0

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        self.probes += 1
        with self.store.locked():
            where = self.store.locate(keys, tenant=tenant)
            return [
                None if t is None else self.store.entry(k).meta()
                for k, t in zip(keys, where, strict=True)
            ]

    def get_many(self, keys: Sequence[bytes], *, tenant: str) -> list[PoolChunk | None]:
        self.gets += 1
        out: list[PoolChunk | None] = []
        for k in keys:
            got = self.store.export(k)
            if got is None or not visible_to(got[0], tenant):
                out.append(None)
            else:
                out.append(PoolChunk(got[0], memoryview(got[1])))
        return out

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        raise TierUnavailable("a peer is only read from")

    def delete_many(self, keys: Sequence[bytes]) -> int:
        raise TierUnavailable("a peer is only read from")

    def usage(self) -> PoolUsage:
        raise TierUnavailable("a peer reports no pool usage")


class Fleet:
    """Node ``a`` with peers ``b``, ``c``, ``d``; the index follows the peers' store events."""

    def __init__(self, index: Any = None, *, breaker: Breaker | None = None) -> None:
        self.embedded = EmbeddedIndex()
        self.peers = {name: StorePeer(name, new_store()) for name in ("b", "c", "d")}
        self.unfollow = {
            name: peer.store.subscribe(self._follower(name)) for name, peer in self.peers.items()
        }
        self.a = RemoteTiers(
            new_store(),
            pool=None,
            peers=[
                # fetch whatever a peer holds: the test is about whom a lookup asks
                Source(name, PEER_TIER, peer, LinkEstimator(name, override="fetch"))
                for name, peer in self.peers.items()
            ],
            prefill=PrefillRate(1e4, "configured"),
            index=self.embedded if index is None else index,
            node_name="a",
            index_breaker=breaker,
        )

    def _follower(self, node: str) -> Any:
        def apply(event: dict[str, Any]) -> None:
            chunk = from_agent_event(event)
            if chunk is not None:
                self.embedded.apply(node, [chunk])

        return apply

    def probes(self) -> dict[str, int]:
        return {name: peer.probes for name, peer in self.peers.items()}

    def index(self) -> dict[str, Any]:
        status = self.a.index_status()
        assert status is not None
        return status

    def close(self) -> None:
        self.a.close()
        for peer in self.peers.values():
            peer.store.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def closed_port() -> int:
    return free_loopback_port()


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_only_the_peers_the_index_names_are_probed(fleet: Fleet) -> None:
    keys = [key("x", i) for i in range(4)]
    put_chain(fleet.peers["c"].store, keys, tenant="t1")
    res = fleet.a.lookup(keys, tenant="t2")
    assert res.matched_chunks == len(keys)
    assert set(res.locations) == {"peer"}
    assert fleet.probes() == {"b": 0, "c": 1, "d": 0}
    idx = fleet.index()
    assert idx["queries"] == 1 and idx["peer_probes_saved"] == 2
    assert idx["fallbacks"] == 0 and idx["errors"] == 0 and idx["stale_chunks"] == 0
    # the fill pulls the chunks from c, the holder the lookup chose, and asks no one else
    assert fleet.a.fill(keys, tenant="t2") == len(keys)
    assert {name: peer.gets for name, peer in fleet.peers.items()} == {"b": 0, "c": 1, "d": 0}
    assert [bytes(fleet.a.store.get(k, tenant="t2")) for k in keys] == [payload(k) for k in keys]


def test_a_chain_split_over_two_peers_probes_both_and_a_miss_probes_none(fleet: Fleet) -> None:
    keys = [key("split", i) for i in range(4)]
    put_chain(fleet.peers["b"].store, keys[:2], tenant="t1")
    # d holds the rest (chunks 2 and 3, whose parents are 1 and 2)
    put_chain(fleet.peers["d"].store, keys[2:], tenant="t1", parents=keys[1:3])
    assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
    assert fleet.probes() == {"b": 1, "c": 0, "d": 1}
    # no node holds these: nobody is asked
    assert fleet.a.lookup([key("nowhere", i) for i in range(3)], tenant="t1").matched_chunks == 0
    assert fleet.probes() == {"b": 1, "c": 0, "d": 1}
    assert fleet.index()["peer_probes_saved"] == 1 + 3


def test_holdings_of_this_node_and_of_unknown_nodes_probe_no_one(fleet: Fleet) -> None:
    keys = [key("elsewhere", i) for i in range(2)]
    stored = [ChunkEvent("stored", k, tier="cpu", tenant="t1") for k in keys]
    fleet.embedded.apply("a", stored)  # this node itself (its local prefix was looked at)
    fleet.embedded.apply("zz-not-a-peer", stored)  # e.g. a peer configured under another name
    assert fleet.a.lookup(keys, tenant="t1").matched_chunks == 0
    assert fleet.probes() == {"b": 0, "c": 0, "d": 0}
    assert fleet.index()["unknown_nodes"] == len(keys)


def test_a_stale_entry_is_counted_and_never_served(fleet: Fleet) -> None:
    keys = [key("stale", i) for i in range(4)]
    c = fleet.peers["c"].store
    put_chain(c, keys, tenant="t1")
    # c loses its last two chunks while the index does not hear of it (a lagging follower)
    fleet.unfollow["c"]()
    c.evict(keys[2:])
    res = fleet.a.lookup(keys, tenant="t1")
    assert res.matched_chunks == 2
    assert res.locations[2:] == (None, None)
    assert fleet.index()["stale_chunks"] == 2
    assert fleet.a.fill(keys, tenant="t1") == 2
    assert [bytes(fleet.a.store.get(k, tenant="t1")) for k in keys[:2]] == [
        payload(k) for k in keys[:2]
    ]
    for k in keys[2:]:
        with pytest.raises(KeyNotFound):
            fleet.a.store.get(k, tenant="t1")
    # the entry naming a chunk that moved to another peer: the peer that has it is not asked,
    # the one the index names is, and its miss is counted
    d = fleet.peers["d"].store
    fleet.unfollow["d"]()
    put_chain(d, keys[2:], tenant="t1")
    before = fleet.probes()
    assert fleet.a.lookup(keys[2:], tenant="t1").matched_chunks == 0
    after = fleet.probes()
    assert after["c"] == before["c"] + 1 and after["d"] == before["d"]
    assert fleet.index()["stale_chunks"] == 4


def test_an_unreachable_index_falls_back_to_every_peer_then_backs_off() -> None:
    clock = FakeClock()
    dead = IndexClient(f"http://127.0.0.1:{closed_port()}")
    fleet = Fleet(dead, breaker=Breaker(clock=clock))
    try:
        keys = [key("dead", i) for i in range(3)]
        put_chain(fleet.peers["d"].store, keys, tenant="t1")
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.probes() == {"b": 1, "c": 1, "d": 1}
        idx = fleet.index()
        assert (idx["errors"], idx["fallbacks"], idx["skipped"]) == (1, 1, 0)
        assert idx["up"] is False and idx["breaker"]["state"] == "open"
        assert "did not answer" in idx["last_error"]
        # in its backoff the index is not asked: the lookup costs it nothing
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        idx = fleet.index()
        assert (idx["errors"], idx["fallbacks"], idx["skipped"]) == (1, 2, 1)
        assert fleet.probes() == {"b": 2, "c": 2, "d": 2}
        # the backoff ran out: the link monitor's probe (not a lookup) finds it still down
        fleet.a._monitoring = True
        clock.now_s += idx["breaker"]["backoff_s"]
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.index()["errors"] == 1  # the lookup did not make the probe
        assert fleet.a.probe_index() is False
        idx = fleet.index()
        assert idx["errors"] == 2 and idx["breaker"]["probe_failures"] == 1
    finally:
        fleet.close()


class Reachable:
    """An index that can be taken away and given back (a router restarting): the real
    EmbeddedIndex, or a real IndexClient at a closed port."""

    def __init__(self, index: EmbeddedIndex) -> None:
        self.live = index
        self.dead = IndexClient(f"http://127.0.0.1:{closed_port()}")
        self.up = False

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        return (self.live if self.up else self.dead).holders(keys, tenant=tenant)

    def nodes(self) -> dict[str, int]:
        return (self.live if self.up else self.dead).nodes()


def test_an_index_that_comes_back_is_used_again_after_the_monitors_probe() -> None:
    clock = FakeClock()
    fleet = Fleet(breaker=Breaker(clock=clock))
    switch = Reachable(fleet.embedded)
    fleet.a.index = switch
    fleet.a._monitoring = True
    try:
        keys = [key("back", i) for i in range(2)]
        put_chain(fleet.peers["b"].store, keys, tenant="t1")
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.probes() == {"b": 1, "c": 1, "d": 1}
        switch.up = True
        assert fleet.a.probe_index() is None  # still backing off: no probe due
        clock.now_s += fleet.index()["breaker"]["backoff_s"]
        assert fleet.a.probe_index() is True
        assert fleet.index()["up"] is True
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.probes() == {"b": 2, "c": 1, "d": 1}
        idx = fleet.index()
        assert (idx["queries"], idx["errors"], idx["fallbacks"]) == (1, 1, 1)
    finally:
        fleet.close()


def test_an_answer_of_the_wrong_shape_is_an_index_error() -> None:
    class Short:
        def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
            return []  # one row short per key: not an answer to trust

        def nodes(self) -> dict[str, int]:
            return {}

    fleet = Fleet(Short())
    try:
        keys = [key("short", i) for i in range(2)]
        put_chain(fleet.peers["c"].store, keys, tenant="t1")
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.probes() == {"b": 1, "c": 1, "d": 1}
        idx = fleet.index()
        assert idx["errors"] == 1 and idx["fallbacks"] == 1
        assert "answered 0 rows for 2 keys" in idx["last_error"]
    finally:
        fleet.close()


def test_isolated_tenants_chunks_stay_theirs_through_the_index(fleet: Fleet) -> None:
    keys = [key("iso", i) for i in range(3)]
    put_chain(fleet.peers["c"].store, keys, tenant="acme", isolated=True)
    # another tenant learns of them from neither the index nor a peer
    assert fleet.a.lookup(keys, tenant="globex").matched_chunks == 0
    assert fleet.probes() == {"b": 0, "c": 0, "d": 0}
    assert fleet.a.locate(keys, tenant="globex") == [None] * len(keys)
    assert fleet.a.fill(keys, tenant="globex") == 0
    # their tenant does, through c only
    assert fleet.a.lookup(keys, tenant="acme").matched_chunks == len(keys)
    assert fleet.probes() == {"b": 0, "c": 1, "d": 0}
    # an isolated tenant on this node takes nothing another tenant stored under its keys,
    # though the index (which knows no node's isolation settings) names the holder
    planted = [key("planted", i) for i in range(2)]
    put_chain(fleet.peers["b"].store, planted, tenant="globex")
    fleet.a.store.set_isolated_tenants({"acme"})
    assert fleet.a.lookup(planted, tenant="acme").matched_chunks == 0
    assert fleet.probes()["b"] == 1
    assert fleet.index()["stale_chunks"] == 0  # b holds them: not stale, just not acme's
    assert fleet.a.lookup(planted, tenant="initech").matched_chunks == len(planted)


def test_without_an_index_every_peer_is_probed_and_nothing_is_counted() -> None:
    fleet = Fleet()
    fleet.a.index = None
    try:
        keys = [key("plain", i) for i in range(2)]
        put_chain(fleet.peers["b"].store, keys, tenant="t1")
        assert fleet.a.lookup(keys, tenant="t1").matched_chunks == len(keys)
        assert fleet.probes() == {"b": 1, "c": 1, "d": 1}
        assert fleet.a.status()["index"] is None
        assert fleet.a.describe()["index"] is None
    finally:
        fleet.close()


def test_the_index_counters_are_on_metrics(fleet: Fleet) -> None:
    keys = [key("metrics", i) for i in range(3)]
    put_chain(fleet.peers["c"].store, keys, tenant="t1")
    fleet.a.lookup(keys, tenant="t1")
    metrics = AgentMetrics(fleet.a.store)
    metrics.add_index(fleet.a.index_status)
    text = metrics.render()[0].decode()
    assert "kvctl_index_configured 1.0" in text
    assert "kvctl_index_queries_total 1.0" in text
    assert "kvctl_index_peer_probes_saved_total 2.0" in text
    assert 'kvctl_index_breaker_state{state="closed"} 1.0' in text
    for name in ("errors", "fallbacks", "skipped", "stale_chunks", "unknown_nodes"):
        assert f"kvctl_index_{name}_total 0.0" in text
    # an agent without an index exports the same names, at zero
    bare = AgentMetrics(fleet.a.store)
    bare.add_index(lambda: None)
    text = bare.render()[0].decode()
    assert "kvctl_index_configured 0.0" in text and "kvctl_index_fallbacks_total 0.0" in text


def _load(tmp_path: Path, **flags: object) -> AgentSettings:
    return load_settings(env={"XDG_CONFIG_HOME": str(tmp_path)}, flags=flags).settings


def test_the_index_settings_are_read_and_checked(tmp_path: Path) -> None:
    s = _load(
        tmp_path,
        index_url="http://10.0.0.9:7400/",
        index_token="secret",
        peers=["b=127.0.0.1:7071"],
    )
    assert (s.index_url, s.index_token, s.index_timeout_seconds) == (
        "http://10.0.0.9:7400",
        "secret",
        0.25,
    )
    assert _load(tmp_path, index_url="off").index_url == ""
    with pytest.raises(ConfigError, match="no peers are configured") as no_peers:
        _load(tmp_path, index_url="http://10.0.0.9:7400")
    assert no_peers.value.setting == "index_url"
    with pytest.raises(ConfigError, match="router's URL") as bad:
        _load(tmp_path, index_url="redis://user:pw@10.0.0.9", peers=["b=127.0.0.1:7071"])
    assert "pw" not in str(bad.value)  # a URL may carry a password: never echoed
    with pytest.raises(ConfigError, match="index_timeout_seconds"):
        _load(tmp_path, index_timeout_seconds="0")
    # the peer names the index's answers are matched against, and the token shown as ***
    loaded = load_settings(
        env={"XDG_CONFIG_HOME": str(tmp_path), "KVCTL_INDEX_URL": "http://r:7400"},
        flags={"peers": ["b=127.0.0.1:7071"], "index_token": "secret"},
    )
    rows = {r["setting"]: r for r in describe(loaded)}
    assert rows["index_url"] == {
        "setting": "index_url",
        "value": "http://r:7400",
        "source": "env:KVCTL_INDEX_URL",
    }
    assert rows["index_token"]["value"] == "***"


def test_an_index_trickling_its_holders_is_a_failure_and_its_probe_keeps_it_out() -> None:
    """A router answering ``/v1/index`` at once but trickling ``/v1/index/holders`` (a byte every
    50 ms for 4 s, then a valid answer): the lookup's holders call fails at its deadline (a
    failure for the breaker, the lookup probing every peer), and once the backoff runs out the
    link monitor's probe, the same holders call, fails too, so lookups keep leaving it alone.
    Before, the lookup took the answer after 4 s, and a probe of ``/v1/index`` let it back."""
    hostile = Hostile()

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        if path == "/v1/index":
            return send_json(handler, b'{"nodes": {"b": 0}}')
        return trickle(handler, b'{"holders": [[]]}')

    clock = FakeClock()
    with serving(handler_class(hostile, answer)) as url:
        fleet = Fleet(IndexClient(url), breaker=Breaker(clock=clock))
        fleet.a._monitoring = True
        try:
            keys = [key("trickle", 0)]
            put_chain(fleet.peers["c"].store, keys, tenant="t1")
            assert fleet.a.lookup(keys, tenant="t1").matched_chunks == 1
            assert fleet.probes() == {"b": 1, "c": 1, "d": 1}
            idx = fleet.index()
            assert (idx["errors"], idx["fallbacks"], idx["queries"]) == (1, 1, 0)
            assert "no whole answer within" in idx["last_error"]
            assert idx["up"] is False
            clock.now_s += idx["breaker"]["backoff_s"]
            assert fleet.a.probe_index() is False
            idx = fleet.index()
            assert idx["up"] is False and idx["errors"] == 2
            assert "probe: " in idx["last_error"] and "no whole answer" in idx["last_error"]
        finally:
            fleet.close()
    assert hostile.requests.get("/v1/index/holders") == 2
