"""Outside programs the tests drive (Debian packages: prometheus, systemd, strace): absent
outside CI, a test skips with the install hint; with CI=true it fails, so CI never passes a
test by skipping it."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def unavailable(why: str) -> NoReturn:
    """Fail with ``why`` in CI, else skip with it."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def required_tool(name: str, install_hint: str, *, also_in: str | None = None) -> str:
    """The path of the program ``name`` on PATH (or in the directory ``also_in``)."""
    path = shutil.which(name) or (None if also_in is None else shutil.which(name, path=also_in))
    if path is None:
        unavailable(f"{name} not found: {install_hint}")
    return path
