"""Debian's prometheus package binaries (promtool, prometheus) for the deploy/ tests: absent
outside CI the tests skip with the install hint; with CI=true they fail."""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL_HINT = "apt-get install prometheus"


def prometheus_binary(name: str) -> str:
    """The path of ``name`` (``promtool`` or ``prometheus``) on PATH or in /usr/bin."""
    path = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if path is None:
        why = f"{name} not found: {INSTALL_HINT}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path
