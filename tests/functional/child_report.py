"""A child Python that reports in JSON: for tests that make the client's own process short of
something for real (RLIMIT_AS, descriptors), which must not be the test runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child_report(code: str, *args: str, timeout_s: float = 120) -> tuple[dict[str, Any], str]:
    """Run ``code`` with ``args`` from the repository root; (the JSON object its last line of
    stdout printed, its stderr). It must exit 0."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr
