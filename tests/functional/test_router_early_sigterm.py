"""A real `kvctl router serve` stopped by SIGTERM as soon as it says where it serves: it exits 0,
as a supervisor that stops a router it just started (a rolling restart cancelled) expects."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.functional.agents import closed_port
from tests.functional.routers import cli_env

#: starts tried: the signal lands at a slightly different point of each start
TRIES = 5
#: a stopping router exits well within this (a hang guard, not a timing claim)
EXIT_S = 15.0


def test_a_sigterm_right_after_the_serving_line_stops_the_router() -> None:
    # The line is printed once the followers started, before uvicorn takes SIGTERM over; till
    # then a no-op handler stood in for it and swallowed the signal: the router served on (10
    # of 15 starts). Its handler now tells uvicorn to stop, before and after it serves.
    argv = [sys.executable, "-m", "kvctl", "router", "serve", "--listen", "127.0.0.1:0"]
    argv += ["--agent", f"a1=http://127.0.0.1:{closed_port()}@fra"]
    for attempt in range(TRIES):
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env()
        )
        try:
            assert proc.stdout is not None
            output = []
            for line in proc.stdout:
                output.append(line)
                if "serving at" in line:
                    break
            assert "serving at" in "".join(output), "".join(output)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(EXIT_S)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"start {attempt + 1}: still serving {EXIT_S}s after SIGTERM"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
