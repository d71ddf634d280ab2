"""`kvctl doctor` warns about an agent data directory that group or others can read, with the
`chmod 700` that fixes it: this machine's agent, and fleet agents on this machine (loopback) or
that report their directory's mode."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvctl import __version__
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.doctor import (
    OK,
    SKIP,
    WARN,
    AgentProbe,
    Check,
    check_local_data_dir,
    classify_agent,
    classify_data_dir_mode,
    run_checks,
)

GiB = 1 << 30


def _dir(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / f"data-{mode:o}"
    path.mkdir()
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize(
    ("mode", "status"),
    [(0o700, OK), (0o750, WARN), (0o755, WARN), (0o711, WARN), (0o777, WARN), (0o500, OK)],
)
def test_mode_classification(mode: int, status: str) -> None:
    check = classify_data_dir_mode("data dir (local agent)", "/var/lib/kvctl", mode)
    assert check.status == status
    assert check.values == {"path": "/var/lib/kvctl", "mode": f"{mode:04o}"}
    if status == WARN:
        assert check.fix == "chmod 700 /var/lib/kvctl" and f"{mode:04o}" in check.detail
    else:
        assert check.fix is None


def test_unknown_mode_is_skipped() -> None:
    check = classify_data_dir_mode("data dir n", "/d", None)
    assert check.status == SKIP and check.fix is None


def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path | None) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for name in ("KVCTL_CONFIG", "KVCTL_DATA_DIR", "KVCTL_NAME"):
        monkeypatch.delenv(name, raising=False)
    if data_dir is not None:
        config = tmp_path / "agent.toml"
        config.write_text(f'[agent]\nname = "n1"\ndata_dir = "{data_dir}"\n')
        monkeypatch.setenv("KVCTL_CONFIG", str(config))


def test_local_agent_data_dir_readable_by_others_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _dir(tmp_path, 0o755)
    _env(tmp_path, monkeypatch, data)
    (check,) = check_local_data_dir()
    assert check.name == "data dir (local agent)" and check.status == WARN
    assert check.fix == f"chmod 700 {data}"

    os.chmod(data, 0o700)
    (check,) = check_local_data_dir()
    assert check.status == OK and check.fix is None


def test_local_default_data_dir_is_checked_without_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(tmp_path, monkeypatch, None)
    monkeypatch.setenv("KVCTL_NAME", "n2")
    assert check_local_data_dir() == []  # not created yet: the agent will make it 0700
    default = tmp_path / "state" / "kvctl" / "n2"
    default.mkdir(parents=True)
    os.chmod(default, 0o755)
    (check,) = check_local_data_dir()
    assert check.status == WARN and check.fix == f"chmod 700 {default}"


def test_run_checks_reports_the_local_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _dir(tmp_path, 0o750)
    _env(tmp_path, monkeypatch, data)
    checks = {c.name: c for c in run_checks(f"sqlite:///{tmp_path / 'none.db'}")}
    assert checks["data dir (local agent)"].status == WARN
    rows = {c.name for c in run_checks(f"sqlite:///{tmp_path / 'n.db'}", local_config=False)}
    assert "data dir (local agent)" not in rows


def _probe(data_dir: dict[str, Any]) -> AgentProbe:
    return AgentProbe(
        health={"status": "ok", "name": "node-a", "time_s": 1000.0},
        sent_s=999.99,
        received_s=1000.01,
        info={"name": "node-a", "version": __version__, "data_dir": data_dir},
        gpus={"nvml": {"available": True, "driver_version": "550", "device_count": 1}},
    )


def _rows(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_agent_on_this_machine_with_a_readable_data_dir_warns(tmp_path: Path) -> None:
    data = _dir(tmp_path, 0o755)
    node = NodeInfo(1, "node-a", "fra", "http://127.0.0.1:7070", "H100", None)
    reading = {"path": str(data), "free_bytes": 50 * GiB, "total_bytes": 100 * GiB}
    row = _rows(classify_agent(node, _probe(reading)))["data dir node-a"]
    assert row.status == WARN and row.fix == f"chmod 700 {data} on node-a"
    assert row.values["mode"] == "0755"


def test_agent_elsewhere_is_judged_by_the_mode_it_reports_or_not_at_all() -> None:
    node = NodeInfo(1, "node-a", "fra", "http://10.0.0.7:7070", "H100", None)
    reading: dict[str, Any] = {"path": "/var/lib/kvctl", "free_bytes": 1, "total_bytes": 2}
    assert "data dir node-a" not in _rows(classify_agent(node, _probe(reading)))
    row = _rows(classify_agent(node, _probe({**reading, "mode": 0o755})))["data dir node-a"]
    assert row.status == WARN and row.fix == "chmod 700 /var/lib/kvctl on node-a"
    row = _rows(classify_agent(node, _probe({**reading, "mode": 0o700})))["data dir node-a"]
    assert row.status == OK
