"""`kvctl doctor --json` stays valid JSON whatever an agent answers: an agent (or something
in its place) whose readings carry NaN or Infinity (Python's json reads them) had them copied
into the rows' ``values``, and the report came out with bare NaN, which is not JSON (jq, Go,
JavaScript refuse the whole document)."""

from __future__ import annotations

import http.server
import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import _cli
from tests.not_an_agent import send, serving

runner = CliRunner()


def _answers() -> dict[str, bytes]:
    return {
        "/v1/health": json.dumps({"name": "odd", "time_s": time.time()}).encode(),
        "/v1/info": b'{"version": NaN, "data_dir": {"path": "/srv/kv", "free_bytes": NaN,'
        b' "total_bytes": Infinity, "mode": 448}, "dataplane": {"shm": true,'
        b' "shm_huge_page_bytes": NaN, "shmem_huge_pages": "never"}}',
        "/v1/gpus": b'{"nvml": {"available": false, "device_count": NaN, "error": NaN}}',
    }


class _Odd(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = _answers().get(self.path.split("?")[0], b"{}")
        send(self, body)

    def log_message(self, *args: Any) -> None:
        pass


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_doctor_json_is_json_when_an_agent_answers_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCTL_TOKEN", "KVCTL_DB_URL", "KVCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with serving(_Odd) as url:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "odd", "--dc", "fra", "--agent-url", url)
        out = runner.invoke(app, ["doctor", "--db", db, "--node", "odd", "--json"])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.output
    doc = _strict(out.stdout)
    rows = {c["name"]: c for c in doc["checks"]}
    assert rows["disk odd"]["status"] == "skip"  # unreadable, so N/A: not a number to judge
    assert rows["disk odd"]["values"]["free_bytes"] is None
