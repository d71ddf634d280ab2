"""The long-running `kvctl collect`'s line per cycle names the nodes whose answers held values
rejected as impossible (`collect --once` and --json already did); before, it said "1 up"
and nothing of them. Against a stand-in agent answering a NaN GPU power and an energy past
BIGINT (see test_collector_impossible_values)."""

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
from tests.functional.test_collector_impossible_values import StandIn, _gpus

#: a hang guard, never a timing claim
GUARD_S = 60.0


def test_the_cycle_line_says_how_many_values_were_rejected_and_where(tmp_path: Path) -> None:
    agent = StandIn("n1")
    agent.answers["/v1/gpus"] = _gpus(math.nan, 1e300, 0.5, 100)
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    db = open_db(url, auto_upgrade=True)
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
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
            agent.close()
    said = " ".join(line.split())
    assert said.startswith("scrape 1 up, 2 value(s) rejected: n1 · "), said
    assert "1e+300" not in said and "nan" not in said.lower(), said
