"""Debian's prometheus package binaries (promtool, prometheus) for the deploy/ tests: absent
outside CI the tests skip with the install hint; with CI=true they fail."""

from __future__ import annotations

from tests.tools import required_tool

INSTALL_HINT = "apt-get install prometheus"


def prometheus_binary(name: str) -> str:
    """The path of ``name`` (``promtool`` or ``prometheus``) on PATH or in /usr/bin."""
    return required_tool(name, INSTALL_HINT, also_in="/usr/bin")
