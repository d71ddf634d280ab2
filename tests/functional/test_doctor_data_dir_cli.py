"""`kvctl doctor` end to end on a real agent whose data directory others can read: a warning
row with the `chmod 700` that fixes it, for the fleet's agent and for this machine's config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db import migrate
from kvctl.db.inventory import add_dc, add_node
from tests.functional.agents import running_agent


def test_doctor_warns_about_a_data_dir_group_and_others_can_read(
    tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCTL_TOKEN", "KVCTL_DB_URL"):
        monkeypatch.delenv(name, raising=False)
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    os.chmod(data_dir, 0o755)
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nname = "node-a"\ndata_dir = "{data_dir}"\n')
    monkeypatch.setenv("KVCTL_CONFIG", str(config))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    with running_agent(data_dir, "--name", "node-a", "--dc", "fra") as agent:
        engine = migrate.open_db(sqlite_url)
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_node(conn, "node-a", dc="fra", agent_url=agent.state.control_url)
        engine.dispose()
        result = CliRunner().invoke(app, ["doctor", "--db", sqlite_url, "--json"])
        text = CliRunner().invoke(app, ["doctor", "--db", sqlite_url]).stdout
    out = json.loads(result.stdout)
    rows = {c["name"]: c for c in out["checks"]}
    fleet = rows["data dir node-a"]
    assert fleet["status"] == "warn" and fleet["values"]["mode"] == "0755"
    assert fleet["fix"] == f"chmod 700 {data_dir} on node-a"
    local = rows["data dir (local agent)"]
    assert local["status"] == "warn" and local["fix"] == f"chmod 700 {data_dir}"
    assert result.exit_code == 0  # a warning, not a failure
    assert f"chmod 700 {data_dir}" in " ".join(text.split())
