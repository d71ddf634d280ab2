"""`kvctl doctor` end to end: real agents on loopback (one healthy, one with a token), a node
whose agent is down, one whose agent is starting, real SQLite and PostgreSQL databases
(current, behind, unreachable)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from kvctl.agent_starting import STARTING_PREFIX
from kvctl.cli.main import app
from kvctl.db import migrate
from kvctl.db.engine import create_db_engine, resolve_url
from kvctl.db.inventory import add_dc, add_node
from tests.functional.agents import Agent, closed_port, running_agent
from tests.starting_agent import starting_url

TOKEN = "doctor-test-token"


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    with running_agent(tmp_path_factory.mktemp("a"), "--name", "node-a", "--dc", "fra") as a:
        yield a


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent with a token that calls itself by a name the inventory does not use."""
    data_dir = tmp_path_factory.mktemp("t")
    with running_agent(data_dir, "--name", "gpu-17", "--dc", "fra", token=TOKEN) as a:
        yield a


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the doctor reads the token, the database and this machine's agent config from the
    # environment: the developer's own must not leak in
    for name in ("KVCTL_TOKEN", "KVCTL_DB_URL", "KVCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def _url(db: Engine) -> str:
    return db.url.render_as_string(hide_password=False)


def _register(db: Engine, nodes: dict[str, str]) -> None:
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        for name, url in nodes.items():
            add_node(conn, name, dc="fra", agent_url=url)


def _doctor(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(app, ["doctor", *args], env=env)
    # never a traceback: the only exception is typer's exit
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result


def _json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    result = _doctor(*args, "--json", env=env)
    return result.exit_code, json.loads(result.stdout)


def _rows(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in out["checks"]}


def test_down_agent_fails_with_a_fix(db: Engine, healthy: Agent) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    _register(db, {"node-a": healthy.state.control_url, "node-b": down})

    result = _doctor("--db", _url(db))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    a_row = next(ln for ln in lines if "agent node-a" in ln)
    b_row = next(ln for ln in lines if "agent node-b" in ln)
    assert " ok " in a_row and " fail " in b_row
    fixes = result.stdout[result.stdout.index("Fixes:") :]
    assert "agent node-b: start the agent on node-b (`kvctl agent start`)" in fixes
    assert "kvctl fleet ls" in fixes
    assert "1 fail" in result.stdout

    code, out = _json("--db", _url(db))
    assert code == 1
    assert set(out) == {"checks", "summary"}
    assert out["summary"] == {
        s: sum(c["status"] == s for c in out["checks"]) for s in ("ok", "warn", "fail", "skip")
    }
    for check in out["checks"]:
        assert set(check) == {"name", "status", "detail", "fix", "values"}
        assert check["status"] in ("ok", "warn", "fail", "skip")
        assert (check["fix"] is None) == (check["status"] in ("ok", "skip"))
    rows = _rows(out)
    assert rows["database"]["status"] == "ok" and rows["database schema"]["status"] == "ok"
    assert rows["fleet inventory"]["values"] == {"dcs": 2, "nodes": 2}
    assert rows["agent node-b"]["status"] == "fail" and down in rows["agent node-b"]["detail"]
    # only the agent row for a node that did not answer: the rest would repeat the cause
    assert not {"clock node-b", "nvml node-b", "disk node-b"} & set(rows)
    assert rows["agent node-a"]["status"] == "ok"
    assert rows["agent node-a"]["values"]["name"] == "node-a"
    clock = rows["clock node-a"]
    assert clock["status"] == "ok" and abs(clock["values"]["skew_s"]) < 1.0
    assert 0 <= clock["values"]["rtt_s"] < 1.0
    # no GPU here: a warning with the agent's hint, not a failure (ok on a GPU host)
    assert rows["nvml node-a"]["status"] in ("ok", "warn")
    assert rows["nvml (local)"]["status"] in ("ok", "warn")
    disk = rows["disk node-a"]
    assert disk["values"]["path"] == str(healthy.data_dir)
    assert disk["values"]["total_bytes"] > 0
    if db.dialect.name == "sqlite":
        assert "disk (local db)" in rows
    else:
        assert "disk (local db)" not in rows


def test_starting_agent_fails_as_starting_not_down(db: Engine, healthy: Agent) -> None:
    with starting_url() as starting:
        _register(db, {"node-a": healthy.state.control_url, "node-s": starting})
        result = _doctor("--db", _url(db))
        code, out = _json("--db", _url(db))
    # not serving yet: a failing check (exit 1), worded as starting, never as down
    assert result.exit_code == 1 and code == 1
    text = " ".join(result.stdout.split())
    fixes = text[text.index("Fixes:") :]
    assert "agent node-s: node-s's agent is opening its tiers" in fixes, fixes
    assert "run `kvctl doctor` again shortly" in fixes and "kvctl agent start" not in fixes
    agent = _rows(out)["agent node-s"]
    assert agent["status"] == "fail" and agent["detail"].startswith(STARTING_PREFIX)
    assert starting in agent["detail"] and "unreachable" not in agent["detail"]
    assert not {"clock node-s", "nvml node-s", "disk node-s"} & set(_rows(out))
    assert _rows(out)["agent node-a"]["status"] == "ok"


def test_healthy_fleet_exits_0_and_selection_narrows_it(db: Engine, healthy: Agent) -> None:
    _register(db, {"node-a": healthy.state.control_url})
    result = _doctor("--db", _url(db), "--timeout", "5")
    assert result.exit_code == 0, result.stdout
    assert "agent node-a" in result.stdout and "0 fail" in result.stdout

    with db.begin() as conn:
        add_node(conn, "node-b", dc="ams", agent_url=f"http://127.0.0.1:{closed_port()}")
    code, out = _json("--db", _url(db), "--node", "node-a")
    assert code == 0 and "agent node-a" in _rows(out) and "agent node-b" not in _rows(out)
    code, out = _json("--db", _url(db), "--dc", "ams")
    assert code == 1 and "agent node-b" in _rows(out) and "agent node-a" not in _rows(out)

    code, out = _json("--db", _url(db), "--node", "ghost")
    agents = _rows(out)["agents"]
    assert code == 1 and agents["status"] == "fail" and "ghost" in agents["detail"]
    assert "kvctl fleet ls" in agents["fix"]


def test_refused_token_and_wrong_name(sqlite_url: str, guarded: Agent) -> None:
    engine = migrate.open_db(sqlite_url)
    try:
        _register(engine, {"node-t": guarded.state.control_url})
    finally:
        engine.dispose()

    code, out = _json("--db", sqlite_url)
    agent = _rows(out)["agent node-t"]
    assert code == 1 and agent["status"] == "fail"
    assert "KVCTL_TOKEN" in agent["fix"]

    code, out = _json("--db", sqlite_url, env={"KVCTL_TOKEN": TOKEN})
    rows = _rows(out)
    agent = rows["agent node-t"]
    # the agent answers as gpu-17: the inventory points node-t at another machine's agent
    assert code == 0 and agent["status"] == "warn" and "'gpu-17'" in agent["detail"]
    assert "--name node-t" in agent["fix"]
    assert rows["clock node-t"]["status"] == "ok"


def test_unreachable_database_fails_with_a_fix() -> None:
    bad = "postgresql://nobody@127.0.0.1:1/x"
    result = _doctor("--db", bad)
    assert result.exit_code == 1
    row = next(ln for ln in result.stdout.splitlines() if "database" in ln)
    assert " fail " in row
    assert "start PostgreSQL at 127.0.0.1:1" in result.stdout
    assert "KVCTL_DB_URL" in result.stdout

    code, out = _json("--db", bad)
    rows = _rows(out)
    assert code == 1 and rows["database"]["status"] == "fail"
    assert "pg_isready" in rows["database"]["fix"]
    assert rows["agents"]["status"] == "skip"


def test_schema_behind_head_is_reported_not_upgraded(empty_db_url: str) -> None:
    engine = create_db_engine(resolve_url(empty_db_url))
    try:
        migrate.upgrade(engine, "0001")
        code, out = _json("--db", empty_db_url)
        schema = _rows(out)["database schema"]
        assert schema["values"] == {"current": "0001", "head": migrate.head_revision()}
        assert "kvctl db upgrade" in schema["fix"]
        if engine.dialect.name == "sqlite":
            # SQLite upgrades itself on first use: a warning
            assert schema["status"] == "warn" and "upgrades itself" in schema["detail"]
            assert code == 0
        else:
            assert schema["status"] == "fail" and code == 1
        # the inventory of revision 0001 is still read
        assert _rows(out)["fleet inventory"]["values"] == {"dcs": 0, "nodes": 0}
        assert migrate.current_revision(engine) == "0001"  # the doctor only looks
    finally:
        engine.dispose()
