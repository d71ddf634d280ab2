"""`kvctl collect --json` (the loop) writes JSON lines, as its --help says: one report a line,
written out as its cycle ends. It wrote each report indented over many lines, and into stdout's
buffer: piped to a script, nothing came until 8 KiB of reports had piled up (none in 8 s at
--interval 1)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.agents import running_agent

pytestmark = pytest.mark.slow


def test_the_loop_writes_each_report_as_one_line_as_it_ends(
    sqlite_url: str, tmp_path: Path
) -> None:
    db = open_db(sqlite_url)
    with running_agent(tmp_path / "a1", "--name", "n1") as a1:
        with db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
        db.dispose()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env["KVCTL_DB_URL"] = sqlite_url
        # one cycle, then an hour's sleep: its reports must come out during that sleep
        argv = ["collect", "--interval", "3600", "--no-links", "--metrics-listen", "off"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", *argv, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        try:
            # bounds on a hang, not timings under test: the loop sleeps an hour meanwhile
            first, second = lines.get(timeout=120), lines.get(timeout=120)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    scrape, upkeep = json.loads(first), json.loads(second)
    assert scrape["kind"] == "scrape" and scrape["up"] == ["n1"] and scrape["written"]
    assert upkeep["kind"] == "maintenance"
    assert proc.returncode == 0
