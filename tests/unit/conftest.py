"""Fixtures several unit test modules share."""

from __future__ import annotations

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
