"""The long-running `kvctl collect`'s line per cycle names the nodes whose answers held values
rejected as impossible (`collect --once` and --json already did); before, it said "1 up"
and nothing of them. Against a stand-in agent answering a NaN GPU power and an energy past
BIGINT (see test_collector_impossible_values). It names the nodes still starting (their tiers
opening) too, apart from those down."""

from __future__ import annotations

import math
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.agents import closed_port
from tests.functional.test_collector_impossible_values import StandIn, _gpus
from tests.starting_agent import starting_url

#: a hang guard, never a timing claim
GUARD_S = 60.0


def _first_cycle_line(tmp_path: Path, nodes: dict[str, str]) -> str:
    """The first scrape line of `kvctl collect` over ``nodes`` (name -> agent URL), its
    whitespace collapsed."""
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    db = open_db(url, auto_upgrade=True)
    with db.begin() as conn:
        add_dc(conn, "fra")
        for name, agent_url in nodes.items():
            add_node(conn, name, dc="fra", agent_url=agent_url)
    db.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["PYTHONUNBUFFERED"] = "1"  # each cycle's line as it is printed
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "collect", "--interval", "0.5", "--no-links",
         "--metrics-listen", "off", "--db", url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
        text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
    try:
        line = ""
        while not line.startswith("scrape"):
            line = lines.get(timeout=GUARD_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return " ".join(line.split())


def test_the_cycle_line_says_how_many_values_were_rejected_and_where(tmp_path: Path) -> None:
    agent = StandIn("n1")
    agent.answers["/v1/gpus"] = _gpus(math.nan, 1e300, 0.5, 100)
    try:
        said = _first_cycle_line(tmp_path, {"n1": agent.url})
    finally:
        agent.close()
    assert said.startswith("scrape 1 up, 2 value(s) rejected: n1 · "), said
    assert "1e+300" not in said and "nan" not in said.lower(), said


def test_the_cycle_line_says_how_many_nodes_are_starting(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    with starting_url() as url:
        said = _first_cycle_line(tmp_path, {"warming": url, "gone": dead})
    assert said.startswith("scrape 0 up, 1 down: gone, 1 starting: warming · "), said
