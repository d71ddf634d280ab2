"""`kvctl route --explain` and `kvctl router status` print the router's names (nodes, DCs) and
reasons, which are not kvctl's markup: a DC named "ams[/x]" was a MarkupError traceback
instead of the decision, and "[bold]" vanished from a name. A stand-in router answers with
such names."""

from __future__ import annotations

import http.server
import json
import os
from typing import Any

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.not_an_agent import serving

runner = CliRunner()
KEY = "3f2a9c0d1e4b5a697887766554433221"
#: a node and DCs named like markup: a closing tag with no opening one, and a style
NODE, AMS, FRA = "gpu[/]1", "ams[/x]", "fra[bold]"
LINK = {"rtt_s": 0.02, "bandwidth_bytes_per_s": 1e9}
SCORE = {
    "node": NODE,
    "dc": FRA,
    "local_chunks": 1,
    "fetched_chunks": 2,
    "fetched_tokens": 512,
    "pulled_chunks": 1,
    "pulled_bytes": 1024,
    "origin_s": 0.001,
    "fetch_s": 0.002,
    "prefill_s": 0.003,
    "queue_s": 0.0,
    "carbon_g": None,
    "ttft_s": 0.006,
    "score_s": 0.006,
    "pulls": [
        {"first": 1, "chunks": 1, "from": f"{AMS}/gpu[/]2", "tier": "cpu", "size_bytes": 1024}
    ],
    "plan_reason": "fetch [/plan]",
    "links": {f"{AMS} -> {FRA}": {**LINK, "rtt_basis": "measured [/m]"}},
}
DECISION = {
    **{k: v for k, v in SCORE.items() if k != "links"},
    "chunks": 2,
    "tokens": 512,
    "indexed_chunks": 2,
    "decision_id": 1,
    "full_prefill_ttft_s": 0.01,
    "policy": "cost",
    "scores": [SCORE],
    "prefill": {"tokens_per_s": 10000.0, "basis": "modeled [/p]"},
    "dc_links": [{"dcs": [AMS, FRA], **LINK, "basis": "distance [/d]"}],
    "intra_dc": {**LINK, "basis": "configured"},
}
INDEX = {"kind": "redis", "nodes": {NODE: 3}, "followers": []}
STATS = {
    "nodes": {NODE: {"decisions": 1, "to_holder": 1, "queue_s": 0.0}},
    "decisions": 1,
    "to_holder": 1,
    "no_node": 0,
    "indexed_chunks": 2,
    "requested_chunks": 2,
    "fetched_tokens": 512,
    "recomputed_tokens": 0,
    "decision_s": {"p50": 0.001, "p99": 0.002},
    "links": [{"from_dc": AMS, "to_dc": FRA, "chunks": 1, "bytes": 1024}],
}


class _Router(http.server.BaseHTTPRequestHandler):
    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(INDEX if self.path == "/v1/index" else STATS)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(DECISION)

    def log_message(self, *args: Any) -> None:
        pass


def _run(*args: str) -> str:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    with serving(_Router) as url:
        result = runner.invoke(app, [*args, "--router", url], env={**clean, "COLUMNS": "1000"})
    assert "Traceback" not in result.output and "MarkupError" not in result.output, result.output
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_route_explain_shows_the_routers_names_as_they_are() -> None:
    out = _run("route", "--key", KEY, "--explain")
    assert f"route to {NODE} (dc {FRA})" in out and "plan: fetch [/plan]" in out, out
    assert f"DC link {AMS} - {FRA}: rtt" in out and "(distance [/d])" in out, out
    assert f"{NODE} via {AMS} -> {FRA}: rtt" in out and "(measured [/m])" in out, out


def test_router_status_shows_the_dcs_of_its_pulls_as_they_are() -> None:
    out = _run("router", "status")
    assert f"pulled {AMS} -> {FRA}: 1 chunks" in out, out
