"""A router reading the fleet inventory gave every node serves=True, so a pool agent (`kvctl
agent start --role pool`) listed there was routed requests, though it runs no engine; one named
by --agent too. The router's followers read each agent's role (/v1/info) once per agent start,
for the inventory's nodes and --agent flags alike: a pool agent stays in the topology but serves
nothing, logged once with why; an agent not heard from is not known to be one (and not up).
Reading the inventory asks the agents nothing. Real agents, as
tests/functional/test_doctor_pool_agent.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvctl.cli.router import FleetSource, inventory_reader, load_fleet
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.ports import free_loopback_port
from kvctl.router.score import Costs
from kvctl.router.service import KeySpace, Router
from tests.functional.agents import (
    Agent,
    closed_port,
    fra_fleet,
    node_and_pool_agents,
    running_agent,
)
from tests.unit.test_router_service import PREFILL


@pytest.fixture(scope="module")
def node_and_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    with node_and_pool_agents(tmp_path_factory.mktemp("router-pool")) as agents:
        yield agents


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCTL_TOKEN", raising=False)


def _fleet(tmp_path: Path, nodes: dict[str, str]) -> str:
    return fra_fleet(tmp_path, nodes, check_agent=False)


def test_a_pool_agent_in_the_inventory_serves_no_request(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent], caplog: pytest.LogCaptureFixture
) -> None:
    """The inventory has no role: the router's followers read each agent's role once per agent
    start and the router routes no request to a pool agent, kept as a node (its chunks, its
    DC's links). Reading the inventory, at start and at each reread (every 30 s), asked every
    agent its /v1/info again and logged a pool agent a second time, under another logger: one
    rule now, the followers', and a reread asks the agents nothing."""
    node, pool = node_and_pool
    gone = f"http://127.0.0.1:{closed_port()}"
    url = _fleet(
        tmp_path, {"node-a": node.state.control_url, "pool-1": pool.state.control_url, "gone": gone}
    )
    caplog.set_level(logging.WARNING)
    asked = {a.state.control_url: _info_requests(a) for a in (node, pool)}
    topology, urls = load_fleet(FleetSource(db=url))
    assert urls == {
        "node-a": node.state.control_url,
        "pool-1": pool.state.control_url,
        "gone": gone,
    }
    assert all(n.serves for n in topology.nodes.values())  # the inventory says no role
    index = EmbeddedIndex()
    followers = Followers(index, {name: (u, None) for name, u in urls.items()})
    keyspace = KeySpace.of_model("llama-3.1-8b")
    router = Router(index, topology, Costs(PREFILL), keyspace=keyspace, followers=followers)
    _name, read = inventory_reader(FleetSource(db=url))
    assert read is not None
    try:
        for _ in range(3):
            followers.poll_all()
        roles = {s["node"]: s["role"] for s in followers.status()}
        # an agent that does not answer is not known to be a pool agent (and is not up)
        assert roles == {"node-a": "node", "pool-1": "pool", "gone": None}
        for _ in range(2):
            decision = router.route([b"\x01" * 16], tenant="acme", explain=True)
            assert [s.node for s in decision.scores] == ["node-a"]
        # a reread keeps it out of routing, asking the agents nothing
        reread, _urls = read()
        router.set_topology(reread)
        decision = router.route([b"\x01" * 16], tenant="acme", explain=True)
        assert [s.node for s in decision.scores] == ["node-a"]
        assert not router.topology.nodes["pool-1"].serves
        assert router.topology.nodes["node-a"].serves
        for agent in (node, pool):  # the followers' read alone, once per agent start
            assert _info_requests(agent) - asked[agent.state.control_url] == 1
    finally:
        followers.close()
    lines = [r.getMessage() for r in caplog.records if "pool-1" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"pool-1 ({pool.state.control_url}) is a pool agent (it reports role 'pool')" in lines[0]
    assert "no request is routed to it" in lines[0] and "kvctl fleet rm node pool-1" in lines[0]


def test_without_a_pool_agent_every_node_serves(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent]
) -> None:
    node, _pool = node_and_pool
    url = _fleet(tmp_path, {"node-a": node.state.control_url})
    topology, _urls = load_fleet(FleetSource(db=url))
    assert [n.serves for n in topology.nodes.values()] == [True]


def _info_requests(agent: Agent) -> float:
    """The /v1/info requests ``agent`` answered (its own counter)."""
    metrics = httpx.get(f"{agent.state.control_url}/metrics", timeout=10).text
    for line in metrics.splitlines():
        info = 'route="/v1/info"' in line and 'status="200"' in line
        if line.startswith("kvctl_http_requests_total{") and info:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_pool_agent_given_by_agent_flags_serves_no_request_and_is_asked_once(
    node_and_pool: tuple[Agent, Agent], caplog: pytest.LogCaptureFixture
) -> None:
    """`kvctl router serve --agent` nodes were never asked their role: a pool agent given so
    was routed requests (only the inventory's nodes were asked, each at every reread, every
    30 s). The router's followers read each agent's role from its /v1/info once per agent
    start (its event stream), for the nodes of --agent flags and of the inventory alike, and
    the router routes none to a pool agent; it stays a node (a source of chunks)."""
    node, pool = node_and_pool
    topology, urls = load_fleet(
        FleetSource(
            agents=[f"node-a={node.state.control_url}@fra", f"pool-1={pool.state.control_url}@fra"]
        )
    )
    assert all(n.serves for n in topology.nodes.values())  # flags say nothing of a role
    index = EmbeddedIndex()
    followers = Followers(index, {name: (url, None) for name, url in urls.items()})
    keyspace = KeySpace.of_model("llama-3.1-8b")
    router = Router(index, topology, Costs(PREFILL), keyspace=keyspace, followers=followers)
    asked = {a.state.control_url: _info_requests(a) for a in (node, pool)}
    caplog.set_level(logging.WARNING, logger="kvctl.index.follower")
    try:
        for _ in range(3):
            followers.poll_all()
        assert {s["node"]: s["role"] for s in followers.status()} == {
            "node-a": "node",
            "pool-1": "pool",
        }
        for policy in ("cost", "round-robin"):
            for _ in range(2):
                decision = router.route([b"\x01" * 16], tenant="acme", policy=policy, explain=True)
                assert decision.node == "node-a"
                assert [s.node for s in decision.scores] == ["node-a"]
        assert "pool-1" in router.topology.nodes  # kept: its chunks can still be pulled
        for _ in range(3):
            followers.poll_all()
        # once per agent start, not at every poll (nor at an inventory's every reread)
        for agent in (node, pool):
            url = agent.state.control_url
            assert _info_requests(agent) - asked[url] == 1, url
    finally:
        followers.close()
    lines = [r.getMessage() for r in caplog.records if "pool-1" in r.getMessage()]
    assert len(lines) == 1 and "is a pool agent" in lines[0], lines


def test_an_agent_restarted_as_a_pool_agent_is_asked_its_role_again(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent]
) -> None:
    """The role is read once per agent start: an agent restarted at the same URL with another
    role (`kvctl agent start --role pool` where a node agent ran) starts a new event stream,
    and its role is read again, so the router stops routing to it."""
    node, _pool = node_and_pool
    listen = ["--listen", f"127.0.0.1:{free_loopback_port()}", "--name", "n1", "--dc", "fra"]
    small = ("--cpu", "1MiB", "--disk", "2MiB")
    index = EmbeddedIndex()
    with running_agent(tmp_path / "first", *listen, *small) as first:
        url = first.state.control_url
        topology, urls = load_fleet(
            FleetSource(agents=[f"node-a={node.state.control_url}@fra", f"n1={url}@fra"])
        )
        followers = Followers(index, {name: (u, None) for name, u in urls.items()})
        keyspace = KeySpace.of_model("llama-3.1-8b")
        router = Router(index, topology, Costs(PREFILL), keyspace=keyspace, followers=followers)
        followers.poll_all()
        assert {s["node"]: s["role"] for s in followers.status()}["n1"] == "node"
        scored = router.route([b"\x01" * 16], tenant="acme", explain=True).scores
        assert sorted(s.node for s in scored) == ["n1", "node-a"]
    try:
        followers.poll_all()  # refused: marked down
        with running_agent(tmp_path / "second", *listen, *small, "--role", "pool") as second:
            assert second.state.control_url == url
            roles: dict[str, object] = {}
            for _ in range(50):  # until a poll hears the new stream (each poll waits for it)
                followers.poll_all()
                roles = {s["node"]: s["role"] for s in followers.status()}
                if roles["n1"] == "pool":
                    break
            assert roles == {"node-a": "node", "n1": "pool"}
            scored = router.route([b"\x01" * 16], tenant="acme", explain=True).scores
            assert [s.node for s in scored] == ["node-a"]
    finally:
        followers.close()


class _PollLandsBetween(Followers):
    """Followers whose first poll of a newly added agent lands while a request reads the
    roles: ``pool_nodes`` answers as before the poll, which then runs (a poll thread's, there)."""

    polls_inside = 0

    def pool_nodes(self) -> frozenset[str]:
        before = super().pool_nodes()
        if self.polls_inside == 0:
            self.polls_inside += 1
            self.poll_all()
        return before


def test_a_pool_agent_first_heard_from_during_a_request_is_not_scored(
    node_and_pool: tuple[Agent, Agent],
) -> None:
    """A request read the pool agents, then the nodes that are up: a follower's first poll of a
    pool agent between the two (its role read, then it called up) had it scored, up and not yet
    known to be a pool agent. The nodes that are up are read first: one called up after has its
    role read already, and one not up is not scored."""
    node, pool = node_and_pool
    topology, urls = load_fleet(
        FleetSource(
            agents=[f"node-a={node.state.control_url}@fra", f"pool-1={pool.state.control_url}@fra"]
        )
    )
    index = EmbeddedIndex()
    followers = _PollLandsBetween(index, {"node-a": (urls["node-a"], None)})
    keyspace = KeySpace.of_model("llama-3.1-8b")
    router = Router(index, topology, Costs(PREFILL), keyspace=keyspace, followers=followers)
    try:
        followers.polls_inside = 1  # node-a's first poll is not the one under test
        followers.poll_all()
        followers.add("pool-1", urls["pool-1"])  # not heard from yet: not up
        followers.polls_inside = 0
        decision = router.route([b"\x01" * 16], tenant="acme", explain=True)
        assert followers.polls_inside == 1  # the poll ran inside the request
        assert [s.node for s in decision.scores] == ["node-a"]
        assert {s["node"]: s["role"] for s in followers.status()}["pool-1"] == "pool"
        decision = router.route([b"\x01" * 16], tenant="acme", explain=True)
        assert [s.node for s in decision.scores] == ["node-a"]
    finally:
        followers.close()
