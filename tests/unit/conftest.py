"""Fixtures several unit test modules share."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.runtime import AgentRuntime
from tests.unit.test_agent_api import _runtime, _settings


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[AgentRuntime]:
    """An agent runtime over a small cpu + disk store (test_agent_api's settings); a module
    that needs another one defines its own."""
    rt = _runtime(_settings(tmp_path), tmp_path)
    yield rt
    rt.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair (a client's end, a stand-in agent's end); a test that hangs on
    it fails after 20 s instead."""
    a, b = socket.socketpair()
    a.settimeout(20)
    b.settimeout(20)
    yield a, b
    a.close()
    b.close()
