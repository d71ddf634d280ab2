"""Ctrl-C during a control command (pin, evict... on several nodes): the command says at once
that it waits for the agents already asked, and each of those acts all the same, so its answer
is audited too. Before, the command went silent for up to --timeout and the answers that came
in after the Ctrl-C were never written to the audit trail: an agent pinned or evicted chunks
that `kvctl audit` never showed."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()
KEY = "3f2a9c0d1e4b5a697887766554433221"
DONE = json.dumps({"done": 1, "skipped_pinned": 0, "missing": 0, "failed": 0}).encode()
#: a hang guard, never a timing claim
GUARD_S = 60.0


class _Agent:
    """A loopback stand-in for an agent that answers a pin once ``release`` is set; ``asked``
    is set when its pin arrives."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                agent.asked.set()
                agent.release.wait(GUARD_S)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(DONE)))
                self.end_headers()
                self.wfile.write(DONE)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextmanager
def _agents(n: int) -> Iterator[list[_Agent]]:
    agents = [_Agent() for _ in range(n)]
    for a in agents:
        threading.Thread(target=a.server.serve_forever, daemon=True).start()
    try:
        yield agents
    finally:
        for a in agents:
            a.release.set()
            a.server.shutdown()
            a.server.server_close()


def _cli(db: str, *args: str) -> str:
    result = runner.invoke(app, [*args, "--db", db], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    return result.output


def test_ctrl_c_during_a_pin_waits_aloud_and_audits_what_the_agents_did(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with _agents(2) as (fast, slow):
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "fast", "--dc", "fra", "--agent-url", fast.url)
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", slow.url)
        fast.release.set()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "pin", "--all", "--yes", "--key", KEY,
             "--timeout", "30", "--db", db],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert fast.asked.wait(GUARD_S) and slow.asked.wait(GUARD_S)
            proc.send_signal(signal.SIGINT)
            assert proc.stderr is not None
            first = proc.stderr.readline().decode()  # at once, while slow still holds its pin
            slow.release.set()  # slow pins after the Ctrl-C
            _, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join((first + err.decode()).split())
    assert first.startswith("interrupted: waiting up to 30 s for the agents already asked"), said
    assert proc.returncode == 130, said
    assert "interrupted: 2 of 2 node(s) ended: done on fast, slow;" in said, said
    assert "failed" not in said and "Traceback" not in said
    audit = json.loads(_cli(db, "audit", "--action", "pin", "--json"))
    assert sorted((row["target"], row["ok"]) for row in audit) == [("fast", True), ("slow", True)]


def test_ctrl_c_does_not_call_a_node_that_failed_answered(tmp_path: Path) -> None:
    """A node whose call failed (here: nothing listens) was counted among those that
    "answered", as was one that timed out: the operator read that it had acted."""
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with _agents(1) as (slow,):
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", slow.url)
        _cli(db, "fleet", "add-node", "gone", "--dc", "fra", "--agent-url", "http://127.0.0.1:1")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "pin", "--all", "--yes", "--key", KEY,
             "--timeout", "30", "--db", db],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert slow.asked.wait(GUARD_S)
            proc.send_signal(signal.SIGINT)
            assert proc.stderr is not None
            first = proc.stderr.readline().decode()
            slow.release.set()
            _, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join((first + err.decode()).split())
    assert proc.returncode == 130, said
    assert "interrupted: 2 of 2 node(s) ended: done on slow; failed on gone;" in said, said
    assert "answered" not in said.split("interrupted: 2 of 2")[1]
