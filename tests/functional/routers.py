"""A real `kvctl router serve` process for functional tests: on a free loopback port, found
from the first line it prints, stopped with SIGTERM at the end (and its exit code checked)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
import pytest

#: lines of a starting router's merged output read for its URL before giving up
MAX_LINES_BEFORE_URL = 200


def cli_env() -> dict[str, str]:
    """This environment without KVCTL_* settings, wide enough that no line wraps."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["COLUMNS"] = "300"
    return env


@dataclass
class RunningRouter:
    url: str
    #: a client of the router's API, with its bearer token
    http: httpx.Client
    proc: subprocess.Popen[str]
    #: its output up to the line with its URL (log lines may come first)
    early: str = ""


@contextlib.contextmanager
def running_router(
    args: Sequence[str], *, token: str, env: dict[str, str] | None = None
) -> Iterator[RunningRouter]:
    """`kvctl router serve --listen 127.0.0.1:0 ARGS` (ARGS give its --token-file with
    ``token``; ``env`` adds to its environment); its output is read for the URL only."""
    argv = [sys.executable, "-m", "kvctl", "router", "serve", "--listen", "127.0.0.1:0", *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**cli_env(), **(env or {})},
    )
    try:
        assert proc.stdout is not None
        # stderr is merged in: a log line (a follower's first poll) may come before the URL,
        # which is stdout's first line; they are kept for the test (``early``)
        early: list[str] = []
        url = None
        while url is None and len(early) < MAX_LINES_BEFORE_URL:
            line = proc.stdout.readline()
            if not line:  # it exited
                break
            early.append(line)
            if found := re.search(r"serving at (http://[0-9.]+:[0-9]+)", line):
                url = found.group(1)
        if url is None:
            proc.kill()  # so that reading the rest of its output ends
            pytest.fail(f"the router did not start: {''.join(early)}{proc.stdout.read()[-3000:]}")
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as http:
            yield RunningRouter(url, http, proc, "".join(early))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, f"the router exited {code} on SIGTERM"
