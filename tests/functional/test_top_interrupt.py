"""`kvctl top --json` and Ctrl-C: as the other read-only commands (status, lookup, doctor), one
line "interrupted" on stderr and exit 130; before, it exited 130 in silence. Against a
loopback stand-in for a hung agent, with a --timeout far beyond the hang guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.functional.test_cli_failures_readonly import GUARD_S, LONG_TIMEOUT_S, _hung_agent


def test_ctrl_c_during_top_json_says_interrupted() -> None:
    """As the other read-only commands: one line, exit 130, where it exited in silence."""
    with _hung_agent() as hung:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "top", "--json", "--agent", hung.url,
             "--timeout", str(LONG_TIMEOUT_S)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert hung.asked.wait(GUARD_S)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = " ".join(err.decode().split())
    assert proc.returncode == 130, said
    assert said == "interrupted" and out == b"", said
