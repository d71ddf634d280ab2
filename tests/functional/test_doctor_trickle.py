"""`kvctl doctor` is bounded against an agent whose answers trickle (each read within
--timeout, the whole answer minutes long): it asks each agent four times (two clock samples,
info, GPUs), and waited for every trickle in full, so one such node held the whole report for
ten minutes and more with --timeout 1. Now the node fails within a deadline of its calls."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import _cli
from tests.functional.test_fleet_status_trickle import _Trickle
from tests.not_an_agent import serving

runner = CliRunner()


def test_doctor_fails_a_trickling_agent_within_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCTL_TOKEN", "KVCTL_DB_URL", "KVCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with serving(_Trickle) as url:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", url)
        t0 = time.monotonic()
        out = runner.invoke(app, ["doctor", "--db", db, "--timeout", "1", "--json"])
        took_s = time.monotonic() - t0
    # the deadline is 8 s here; a bound far below the trickle's minutes
    assert took_s < 60, (took_s, out.output)
    rows = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert rows["agent slow"]["status"] == "fail", rows["agent slow"]
    assert "within" in rows["agent slow"]["detail"], rows["agent slow"]
    # a slow agent, not a wrong URL: it is not said to answer unlike an agent
    assert "like a kvctl agent" not in rows["agent slow"]["detail"], rows["agent slow"]
    assert "hung or overloaded" in rows["agent slow"]["fix"], rows["agent slow"]
