"""`kvctl status` and `kvctl lookup` are bounded by --timeout even against an agent whose answer
trickles: the HTTP client's timeout bounds each read, not the whole answer, so a node sending
a byte every half second (swapping, a broken proxy) held the whole command for as long as it
trickled, a minute and more with --timeout 1, every other node's figures waiting on it."""

from __future__ import annotations

import http.server
import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import KEY, _cli
from tests.not_an_agent import serving

runner = CliRunner()
#: the whole answer at this pace takes minutes: far past any --timeout
BODY = b'{"stats": {}, "usage": {}, "pad": "' + b"x" * 300 + b'"}'


class _Trickle(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        try:
            for byte in BODY:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:  # the client gave up: what the test wants
            pass

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("command", [["status"], ["lookup", "--key", KEY]])
def test_a_trickling_agent_fails_within_the_timeout(tmp_path: Path, command: list[str]) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with serving(_Trickle) as url:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", url)
        t0 = time.monotonic()
        args = [*command, "--node", "slow", "--timeout", "1", "--db", db, "--json"]
        out = runner.invoke(app, args, env={"KVCTL_TOKEN": None})
        took_s = time.monotonic() - t0
    # a bound far above the few seconds it takes, far below the minutes of the trickle
    assert took_s < 30, (took_s, out.output)
    (node,) = json.loads(out.stdout)["nodes"]
    assert node["error"] and "within" in node["error"], node
