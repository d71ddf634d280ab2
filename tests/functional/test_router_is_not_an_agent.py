"""A node's agent URL that is the router's (port 9480 for 7070, at 3 a.m.): `kvctl agent status
--url` failed as "a bug in kvctl" (KeyError: 'lookups'), and `kvctl doctor` called the router an
agent that is up ("ok ... version N/A"). Each says it is the router, not an agent."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import closed_port
from tests.functional.routers import RunningRouter, running_router

runner = CliRunner()


def _run(*args: str) -> Any:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    return runner.invoke(app, list(args), env=clean | {"COLUMNS": "1000"})


@pytest.fixture(scope="module")
def router() -> Iterator[RunningRouter]:
    away = f"x=http://127.0.0.1:{closed_port()}@fra"
    with running_router(["--agent", away], token="") as running:
        yield running


def test_agent_status_at_the_routers_url_says_it_is_the_router(router: RunningRouter) -> None:
    out = _run("agent", "status", "--url", router.url)
    report = json.loads(_run("agent", "status", "--url", router.url, "--json").stdout)
    said = " ".join(out.output.split())
    assert out.exit_code == 1, said
    assert said.startswith("not an agent:"), said
    assert f"{router.url} is a kvctl router, not an agent" in said
    assert "did not expect" not in said and "KeyError" not in said
    assert report["up"] is False and "is a kvctl router" in report["error"]


def test_doctor_does_not_call_the_router_an_agent_that_is_up(
    router: RunningRouter, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    assert _run("fleet", "add-dc", "fra", "--db", db).exit_code == 0
    add = ["fleet", "add-node", "rt", "--dc", "fra", "--agent-url", router.url, "--db", db]
    assert _run(*add).exit_code == 0
    report = json.loads(_run("doctor", "--db", db, "--json").stdout)
    check = next(c for c in report["checks"] if c["name"] == "agent rt")
    assert check["status"] == "fail", check
    assert "is a kvctl router, not an agent" in check["detail"], check
