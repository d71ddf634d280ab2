"""A second Ctrl-C while a control command waits for the agents already asked: the command
stops at once, and the audit trail still has a row for every node it asked, the one that had
not answered marked failed with its outcome unknown. Before, the second Ctrl-C ended the wait
with nothing written for that node: an agent could pin or evict chunks that `kvctl audit`
never showed, not even as an attempt."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.functional.test_cli_failures_interrupt import GUARD_S, KEY, _agents, _cli

#: seconds before pressing Ctrl-C again, should the command still run: far longer than the
#: audit writes take even on a loaded machine, and than the ~0.3 s it takes to stop (so a
#: press does not land on its way out)
REPRESS_S = 15.0


def test_a_second_ctrl_c_stops_the_wait_and_audits_the_unanswered_node(tmp_path: Path) -> None:
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
            first = proc.stderr.readline().decode()  # the first Ctrl-C was taken: it waits
            # slow still holds its pin: stop now. Pressed again while the command still runs:
            # one landing while the first Ctrl-C's handler still prints is taken with it. Not
            # sooner: two presses FORCE_AFTER_SECONDS apart while the audit writes run force a
            # stop that skips them (a fresh-clone CI run pressing every 3.5 s lost both rows)
            deadline = time.monotonic() + GUARD_S
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(REPRESS_S)
            _, err = proc.communicate(timeout=GUARD_S)  # slow is never released
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join((first + err.decode()).split())
    assert first.startswith("interrupted: waiting up to 30 s"), said
    assert proc.returncode == 130, said
    assert "Traceback" not in said, said
    audit = {
        row["target"]: row for row in json.loads(_cli(db, "audit", "--action", "pin", "--json"))
    }
    assert sorted(audit) == ["fast", "slow"], said
    # fast answered at once, but its answer may still be on the way when the second Ctrl-C
    # lands: then it too is recorded as not known, never missing
    assert audit["fast"]["ok"] is True or "unknown" in audit["fast"]["result"], audit["fast"]
    assert audit["slow"]["ok"] is False and "unknown" in audit["slow"]["result"], audit["slow"]
