"""Real agents A, B and C, A with B and C as peers and a fleet index configured: A's lookups
probe only the peer the index names (counted by the peers' own data-plane metrics), count an
entry that outlived its chunk and serve nothing for it, and fall back to probing every peer
when the index is unreachable (a router stopped, or a URL nothing answers on)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.index.remote import IndexClient
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import Node, Topology
from kvctl.store.keys import parents_of
from tests.functional.agents import Agent, closed_port, key, metric, payload, running_agent
from tests.functional.waiting import wait_until as wait_for

CHUNK_BYTES = 64 << 10
SMALL = ["--disk", "0", "--cpu", "64MiB"]


def fetch_requests(agent: Agent) -> float:
    """FETCH requests the agent's data plane served (a peer's probe is one, payload-less)."""
    total = 0.0
    for family in text_string_to_metric_families(agent.control().metrics_text()):
        if family.name != "kvctl_dataplane_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("op") == "fetch":
                total += sample.value
    return total


def index_status(agent: Agent) -> dict[str, Any]:
    status = agent.control()._request("GET", "/v1/remote")["index"]
    assert status is not None, "the agent reports no index"
    return dict(status)


def put_chain(agent: Agent, keys: list[bytes], tenant: str) -> None:
    with agent.data() as d:
        outs = d.put_many(
            [(k, payload(k, CHUNK_BYTES)) for k in keys],
            tenant=tenant,
            parents=parents_of(keys),
            tokens=256,
        )
    assert {o.status for o in outs} == {"stored"}


@contextlib.contextmanager
def start_with_index(
    data_dir: Path, name: str, index_url: str, peers: dict[str, Agent]
) -> Iterator[Agent]:
    # the index is set in the agent's config file, as an operator would (the test harness
    # gives each agent its own XDG config home); a generous timeout, so that a slow first
    # answer on a loaded machine is not taken for a failed index
    config = data_dir / "xdg" / "kvctl" / "agent.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[agent]\nindex_url = "{index_url}"\nindex_timeout_seconds = 10\n')
    args = ["--name", name, *SMALL]
    for peer_name, peer in peers.items():
        # fetch what a peer holds, whatever the loopback link measures: the test is about
        # whom a lookup asks, not about the cost model
        args += [
            "--peer",
            f"{peer_name}={peer.state.data_tcp}",
            "--link",
            f"{peer_name}:override=fetch",
        ]
    with running_agent(data_dir, *args) as agent:
        yield agent


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    with (
        running_agent(tmp_path / "b", "--name", "b", *SMALL) as b,
        running_agent(tmp_path / "c", "--name", "c", *SMALL) as c,
    ):
        yield {"b": b, "c": c}


def test_an_unreachable_index_leaves_a_lookup_to_probe_every_peer(
    tmp_path: Path, peers: dict[str, Agent]
) -> None:
    keys = [key(i, space=61) for i in range(4)]
    put_chain(peers["b"], keys, tenant="t1")
    url = f"http://127.0.0.1:{closed_port()}"
    with start_with_index(tmp_path / "a", "a", url, peers) as a:
        remote = a.control().info()["remote"]
        assert remote is not None and remote["index"] == url
        before = {n: fetch_requests(p) for n, p in peers.items()}
        with a.data() as d:
            res = d.lookup(keys, tenant="t1")
            assert res.matched_chunks == len(keys)
            assert set(res.locations) == {"peer"}
            got = d.get_many(keys, tenant="t1")
        assert [bytes(g or b"") for g in got] == [payload(k, CHUNK_BYTES) for k in keys]
        after = {n: fetch_requests(p) for n, p in peers.items()}
        assert after["c"] > before["c"]  # c, which holds nothing, was probed too
        idx = index_status(a)
        assert idx["fallbacks"] >= 1 and idx["errors"] >= 1 and idx["queries"] == 0
        assert "did not answer" in idx["last_error"]
        assert metric(a, "kvctl_index_fallbacks_total") >= 1
        assert metric(a, "kvctl_index_configured") == 1


def test_a_router_index_narrows_the_probes_to_the_holder(
    tmp_path: Path, peers: dict[str, Agent]
) -> None:
    index = EmbeddedIndex()
    followers = Followers(
        index, {name: (p.state.control_url, None) for name, p in peers.items()}, poll_s=0.05
    )
    router = Router(
        index,
        Topology.build([Node(n, "local") for n in ("a", "b", "c")]),
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
        followers=followers,
    )
    server = RouterServer(router, listen="127.0.0.1:0")
    server.start()
    try:
        keys = [key(i, space=62) for i in range(4)]
        put_chain(peers["c"], keys, tenant="t1")
        probe = IndexClient(server.url)
        wait_for(
            "the router's index to place the chain on c",
            lambda: all([h.node for h in row] == ["c"] for row in probe.holders(keys, tenant="t1")),
        )
        with start_with_index(tmp_path / "a", "a", server.url, peers) as a:
            before = {n: fetch_requests(p) for n, p in peers.items()}
            with a.data() as d:
                res = d.lookup(keys, tenant="t1")
                assert res.matched_chunks == len(keys)
                got = d.get_many(keys, tenant="t1")
            assert [bytes(g or b"") for g in got] == [payload(k, CHUNK_BYTES) for k in keys]
            after = {n: fetch_requests(p) for n, p in peers.items()}
            assert after["b"] == before["b"]  # b holds nothing: never asked
            assert after["c"] >= before["c"] + 2  # the probe, then the pull
            idx = index_status(a)
            assert idx["queries"] >= 1 and idx["peer_probes_saved"] >= 1
            assert idx["fallbacks"] == 0 and idx["errors"] == 0
            assert metric(a, "kvctl_index_queries_total") >= 1

            # a stale entry: c drops a chain the index placed on it, after the router stopped
            # hearing from c (a follower that lags)
            stale = [key(i, space=63) for i in range(3)]
            put_chain(peers["c"], stale, tenant="t1")
            wait_for(
                "the router's index to place the second chain on c",
                lambda: all(
                    [h.node for h in row] == ["c"] for row in probe.holders(stale, tenant="t1")
                ),
            )
            followers.stop()
            peers["c"].control().evict(stale)
            with a.data() as d:
                assert d.lookup(stale, tenant="t1").matched_chunks == 0
                # each probe that finds an entry stale counts it (a lookup's, then a locate's)
                assert index_status(a)["stale_chunks"] == len(stale)
                assert d.exists(stale, tenant="t1") == [None] * len(stale)
                assert d.get_many(stale, tenant="t1") == [None] * len(stale)
            assert index_status(a)["stale_chunks"] >= 2 * len(stale)

            # the router goes away: every peer is probed again, and the hits still come
            server.stop()
            again = [key(i, space=64) for i in range(2)]
            put_chain(peers["b"], again, tenant="t1")
            with a.data() as d:
                assert d.lookup(again, tenant="t1").matched_chunks == len(again)
            idx = index_status(a)
            assert idx["fallbacks"] >= 1 and idx["errors"] >= 1
    finally:
        server.stop()
