"""The read-only commands (collect, status, the fleet's lookups) under failure: an agent that
refuses the token is up, not down, in the collectors' report and history as in `kvctl status`;
a hung agent (it takes the connection and says nothing) is "not answering", not down; a Ctrl-C
while a hung agent is asked ends the command at once with one line, where it waited out
--timeout in silence."""

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

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, Node, NodeSample
from tests.functional.agents import closed_port, running_agent

runner = CliRunner()
#: a hang guard, never a timing claim
GUARD_S = 60.0
#: the --timeout the commands get where a hung agent is asked: far beyond any hang guard's
#: share, so only the fix ends a wait early
LONG_TIMEOUT_S = 300


def _cli(db: str, *args: str, code: int = 0) -> str:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    result = runner.invoke(app, [*args, "--db", db], env={**env, "COLUMNS": "1000"})
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, result.output
    return result.stdout


class _Hung:
    """A loopback stand-in for a hung agent: it takes each request and answers none until
    ``release`` is set; ``asked`` is set when a request arrives."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        hung = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _hang(self) -> None:
                hung.asked.set()
                hung.release.wait(GUARD_S * 2)

            do_GET = do_POST = _hang

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextmanager
def _hung_agent() -> Iterator[_Hung]:
    hung = _Hung()
    threading.Thread(target=hung.server.serve_forever, daemon=True).start()
    try:
        yield hung
    finally:
        hung.release.set()
        hung.server.shutdown()
        hung.server.server_close()


def _fleet(tmp_path: Path, nodes: dict[str, str]) -> str:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    _cli(db, "fleet", "add-dc", "fra")
    for name, url in nodes.items():
        _cli(db, "fleet", "add-node", name, "--dc", "fra", "--agent-url", url)
    return db


def test_collect_reports_an_agent_refusing_the_token_as_up_not_down(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    with running_agent(tmp_path / "locked", "--cpu", "8MiB", token="not-yours") as locked:
        db = _fleet(tmp_path, {"locked": locked.state.control_url, "gone": dead})
        args = ("collect", "--once", "--no-links", "--metrics-listen", "off")
        report = json.loads(_cli(db, *args, "--json", code=1))["scrape"]  # gone is down
        table = " ".join(_cli(db, *args, code=1).replace("│", " ").split())
    assert report["up"] == [] and list(report["down"]) == ["gone"], report
    assert list(report["token_refused"]) == ["locked"], report
    assert "KVCTL_TOKEN" in report["token_refused"]["locked"]
    assert "locked token refused" in table and "locked down" not in table, table
    assert "gone down" in table, table
    engine = open_db(db)
    try:
        with engine.connect() as conn:
            ids = dict(conn.execute(select(Node.name, Node.id)).all())
            samples = conn.execute(select(NodeSample)).all()
            cache = conn.execute(select(CacheSample.node_id)).scalars().all()
    finally:
        engine.dispose()
    refused = [s for s in samples if s.node_id == ids["locked"]]
    # it answered: up, as status shows it, with why it could not be read; no figures made up
    assert [s.up for s in refused] == [True, True]
    assert all("token" in (s.error or "") and s.scrape_seconds is not None for s in refused)
    assert [s.up for s in samples if s.node_id == ids["gone"]] == [False, False]
    assert cache == []


def test_status_tells_a_hung_agent_from_one_that_is_down(tmp_path: Path) -> None:
    with _hung_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url, "gone": f"http://127.0.0.1:{closed_port()}"})
        status = json.loads(_cli(db, "status", "--timeout", "1", "--json"))
        table = " ".join(_cli(db, "status", "--timeout", "1").replace("│", " ").split())
    nodes = {n["node"]: n for n in status["nodes"]}
    assert nodes["hung"]["up"] is False and nodes["hung"]["state"] == "not answering", nodes
    assert "said nothing for 1 s" in nodes["hung"]["error"], nodes
    assert nodes["gone"]["up"] is False and nodes["gone"]["state"] == "down", nodes
    assert "hung fra not answering" in table and "gone fra down" in table, table
    assert "hung down" not in table and "hung not answering:" in table, table
    assert status["total"]["up"] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--timeout", str(LONG_TIMEOUT_S)],
        ["lookup", "--all", "--key", "3f2a9c0d1e4b5a697887766554433221"],
        ["doctor", "--timeout", str(LONG_TIMEOUT_S)],
    ],
    ids=["status", "lookup", "doctor"],
)
def test_ctrl_c_while_a_hung_agent_is_asked_ends_a_read_only_command(
    tmp_path: Path, args: list[str]
) -> None:
    """Nothing a read-only command asks needs auditing: a Ctrl-C ends it with one line, where
    it waited in silence for the hung agent's --timeout (here far beyond the hang guard)."""
    if args[0] == "lookup":
        args = [*args, "--timeout", str(LONG_TIMEOUT_S)]
    with _hung_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url})
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", *args, "--db", db],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert hung.asked.wait(GUARD_S)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join(err.decode().split())
    assert proc.returncode == 130, said
    assert said == "interrupted", said


def test_ctrl_c_during_collect_once_says_nothing_was_recorded(tmp_path: Path) -> None:
    """A Ctrl-C ends collect --once at once with one line (the scrapes under way are not
    waited for; see test_collect_once_ctrl_c.py), where it exited 130 in silence."""
    with _hung_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url})
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "collect", "--once", "--no-links",
             "--metrics-listen", "off", "--db", db],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert hung.asked.wait(GUARD_S)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join(err.decode().split())
    assert proc.returncode == 130, said
    assert said == "interrupted: nothing recorded, the scrapes under way dropped", said
