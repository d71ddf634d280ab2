"""Polling for what a real process does in its own time (an index catching up, a feed
connecting): one helper for the functional tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = 0.05
) -> None:
    """Call ``check`` every ``interval_s`` until it is true; fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval_s)
