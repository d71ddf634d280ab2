"""A small real filesystem for the tests of full disks: a tmpfs mounted for the block, so that
ENOSPC comes from the kernel, not from a mock. Skips where none can be mounted (no mount
command, not root, a sandbox that forbids it)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """``path`` (made here) with a tmpfs of ``size`` (``mount -o size=``: ``64k``, ``8m``)
    mounted on it for the block, unmounted after."""
    path.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("cannot mount a tmpfs here: no mount command")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, timeout=30)
