"""A router reading the fleet inventory gave every node serves=True, so a pool agent (`kvctl
agent start --role pool`) listed there was routed requests, though it runs no engine. The router
now asks each agent its role (/v1/info) when it reads the inventory: a pool agent stays in the
topology but serves nothing, logged once with why; an agent that does not answer serves until a
reread hears from it. Real agents, as tests/functional/test_doctor_pool_agent.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.cli.router import FleetSource, inventory_reader, load_fleet
from tests.functional.agents import Agent, closed_port, fra_fleet, node_and_pool_agents


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
    node, pool = node_and_pool
    gone = f"http://127.0.0.1:{closed_port()}"
    url = _fleet(
        tmp_path, {"node-a": node.state.control_url, "pool-1": pool.state.control_url, "gone": gone}
    )
    caplog.set_level(logging.WARNING, logger="kvctl.router.inventory")
    topology, urls = load_fleet(FleetSource(db=url))
    assert urls == {
        "node-a": node.state.control_url,
        "pool-1": pool.state.control_url,
        "gone": gone,
    }
    serves = {name: n.serves for name, n in topology.nodes.items()}
    # an agent that does not answer is not known to be a pool agent: it serves (marked down)
    assert serves == {"node-a": True, "pool-1": False, "gone": True}
    # a reread (every 30 s) keeps it out of routing, and does not log it again
    _name, read = inventory_reader(FleetSource(db=url))
    assert read is not None
    topology, _urls = read()
    assert not topology.nodes["pool-1"].serves and topology.nodes["node-a"].serves
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
