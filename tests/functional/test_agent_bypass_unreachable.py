"""The agent's ``bypass_unreachable`` setting (config file or KVCTL_BYPASS_UNREACHABLE) reaches
its store: off by default (an engine with a prefix cache of its own, vLLM's, may ask the agent
for a chain's deep chunks only), on where the operator says every lookup starts at a chain's
first chunk."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.agent.config import load_settings
from kvctl.agent.runtime import AgentRuntime

CHUNK = 64 << 10


@pytest.mark.parametrize(
    ("env", "turned_away"), [({}, False), ({"KVCTL_BYPASS_UNREACHABLE": "yes"}, True)]
)
def test_the_setting_decides_whether_a_chain_past_the_tiers_is_stored(
    tmp_path: Path, env: dict[str, str], turned_away: bool
) -> None:
    flags = {"data_dir": str(tmp_path), "cpu": str(4 * CHUNK), "disk": 0, "shm": False}
    settings = load_settings(flags=flags, env=env).settings
    assert settings.bypass_unreachable is turned_away
    runtime = AgentRuntime.open(settings)
    try:
        store = runtime.store
        parent = None
        where = []
        for depth in range(6):  # room for 4 chunks in all
            k = depth.to_bytes(16, "little")
            where.append(store.put(k, bytes(CHUNK), tenant="t", parent=parent, depth=depth))
            parent = k
        assert where[:4] == ["cpu"] * 4
        assert where[4:] == ([None, None] if turned_away else ["cpu", "cpu"])
        assert store.stats.bypassed_puts == (2 if turned_away else 0)
    finally:
        runtime.close()
