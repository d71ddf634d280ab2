"""`kvctl doctor` with a pool agent (`--role pool`) in the inventory: its "fleet inventory" row
said "1 DC(s), 2 node(s)" and every row was ok, as if both served requests, though a pool agent
runs no engine (it answers other agents' pulls) while `kvctl replay` and a router send requests
to every node of the inventory. The row now says how many of them serve, and warns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import Agent, closed_port, fra_fleet, node_and_pool_agents


@pytest.fixture(scope="module")
def node_and_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    with node_and_pool_agents(tmp_path_factory.mktemp("doctor-pool")) as agents:
        yield agents


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVCTL_TOKEN", "KVCTL_DB_URL", "KVCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def _fleet(tmp_path: Path, nodes: dict[str, str]) -> str:
    return fra_fleet(tmp_path, nodes)


def _doctor(*args: str) -> tuple[int, dict[str, dict[str, Any]], str]:
    runner = CliRunner()
    result = runner.invoke(app, ["doctor", "--timeout", "5", "--json", *args])
    rows = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    text = runner.invoke(app, ["doctor", "--timeout", "5", *args], env={"COLUMNS": "1000"})
    return result.exit_code, rows, text.stdout


def test_a_pool_agent_in_the_inventory_is_not_counted_as_serving(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent]
) -> None:
    node, pool = node_and_pool
    db = _fleet(tmp_path, {"node-a": node.state.control_url, "pool-1": pool.state.control_url})
    code, rows, text = _doctor("--db", db)
    inventory = rows["fleet inventory"]
    assert inventory["detail"].startswith("1 DC(s), 2 node(s), 1 serving requests"), inventory
    assert "pool-1" in inventory["detail"]
    assert inventory["status"] == "warn" and "kvctl fleet rm node pool-1" in inventory["fix"]
    # replay's reason to keep it out, not a router's: a router routes a pool agent nothing
    assert inventory["fix"].startswith("`kvctl replay` sends requests to every node")
    assert "a router routes none to a pool agent" in inventory["fix"]
    assert inventory["values"]["serving"] == 1
    assert inventory["values"]["pool_agents"] == ["pool-1"]
    assert "pool agent" in rows["agent pool-1"]["detail"]
    assert rows["agent pool-1"]["values"]["role"] == "pool"
    assert rows["agent node-a"]["values"]["role"] == "node"
    assert code == 0  # a warning, not a failure
    assert "2 node(s), 1 serving requests" in text


def test_a_fleet_of_serving_nodes_reads_as_before(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent]
) -> None:
    node, _pool = node_and_pool
    db = _fleet(tmp_path, {"node-a": node.state.control_url})
    code, rows, _text = _doctor("--db", db)
    assert rows["fleet inventory"]["detail"] == "1 DC(s), 1 node(s)"
    assert rows["fleet inventory"]["status"] == "ok" and code == 0


def test_with_nodes_not_asked_or_not_answering_the_serving_count_is_at_most(
    tmp_path: Path, node_and_pool: tuple[Agent, Agent]
) -> None:
    # a node that did not answer, or one left out by --node, may be a pool agent too
    node, pool = node_and_pool
    away = f"http://127.0.0.1:{closed_port()}"
    db = _fleet(
        tmp_path,
        {"node-a": node.state.control_url, "pool-1": pool.state.control_url, "node-b": away},
    )
    _code, rows, _text = _doctor("--db", db)
    assert rows["fleet inventory"]["detail"].startswith("1 DC(s), 3 node(s), at most 2 serving")
    _code, rows, _text = _doctor("--db", db, "--node", "pool-1")
    assert rows["fleet inventory"]["detail"].startswith("1 DC(s), 3 node(s), at most 2 serving")
    _code, rows, _text = _doctor("--db", db, "--node", "node-a")
    assert rows["fleet inventory"]["detail"] == "1 DC(s), 3 node(s)"
