"""A control action is bounded against an agent whose answer trickles (each read within
--timeout, the whole answer minutes long): the node fails, audited as failed, and the command
ends, instead of holding every other node's report and the audit of the action for as long
as the trickle lasts."""

from __future__ import annotations

import http.server
import json
import time
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import DONE, KEY, _cli
from tests.functional.test_fleet_status_trickle import _Trickle
from tests.not_an_agent import answering_url, send, serving

runner = CliRunner()


def test_a_trickling_agent_fails_the_pin_within_its_deadline(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with serving(_Trickle) as slow, answering_url(200, DONE, "application/json") as good:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", slow)
        _cli(db, "fleet", "add-node", "good", "--dc", "fra", "--agent-url", good)
        t0 = time.monotonic()
        args = ["pin", "--all", "--yes", "--key", KEY, "--timeout", "1", "--db", db, "--json"]
        out = runner.invoke(app, args, env={"KVCTL_TOKEN": None})
        took_s = time.monotonic() - t0
    # the deadline is 4 s here; a bound far below the trickle's minutes
    assert took_s < 30, (took_s, out.output)
    assert out.exit_code == 1, out.output
    assert json.loads(out.stdout)["failed"] == ["slow"]
    trail = {r["target"]: r for r in json.loads(_cli(db, "audit", "--action", "pin", "--json"))}
    assert trail["good"]["ok"] is True
    assert trail["slow"]["ok"] is False and "within" in trail["slow"]["result"], trail["slow"]


def test_a_ctrl_c_waits_for_a_trickling_agent_no_longer_than_its_deadline(tmp_path: Path) -> None:
    """After a first Ctrl-C the command waits for the nodes already asked, so their answers
    are audited: that wait had no bound, and one trickling agent held it (kvctl pin --timeout
    1 still ran 40 s after the Ctrl-C, its deadline 4 s). Now it ends at the deadline, the
    trickling node audited as unanswered and the good one as it answered."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    slow_asked, good_asked = threading.Event(), threading.Event()

    class SlowAsked(_Trickle):
        def do_POST(self) -> None:
            slow_asked.set()
            self._answer()

    class GoodAsked(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            good_asked.set()
            send(self, DONE)

        def log_message(self, *args: Any) -> None:
            pass

    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with serving(SlowAsked) as slow, serving(GoodAsked) as good:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", slow)
        _cli(db, "fleet", "add-node", "good", "--dc", "fra", "--agent-url", good)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        args = ["pin", "--all", "--yes", "--key", KEY, "--timeout", "1", "--db", db]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", *args], env=env, stderr=subprocess.PIPE, text=True
        )
        try:
            # both asked (the deadline is 4 s), the slow one trickling: a fixed 2 s was not
            # always enough for the command to start on a loaded machine, and a Ctrl-C before
            # it asks anyone leaves no node to audit
            assert slow_asked.wait(60) and good_asked.wait(60)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=60)
            took_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    # the trickle lasts about 170 s; the deadline ends the wait at most 4 s after the Ctrl-C
    assert took_s < 30, (took_s, err[-2000:])
    assert proc.returncode != 0, err[-2000:]
    trail = {r["target"]: r for r in json.loads(_cli(db, "audit", "--action", "pin", "--json"))}
    assert trail["good"]["ok"] is True, trail
    assert trail["slow"]["ok"] is False, trail
