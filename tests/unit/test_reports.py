"""What the agent reports has the shape ``kvctl.wire.reports`` declares: the store builds its
counters and usage as plain dicts, so these tests hold them to the wire's TypedDicts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.api import ProbeResponse
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.keys import KVLayout, Namespace, keys_for
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.reports import (
    AgentInfo,
    AgentStats,
    DataDir,
    DataPlaneAddresses,
    LinkProbe,
    ModelEntry,
    StoreCounters,
    TierCounters,
    TierEntry,
    TierUsage,
)


def keys_of(typed: Any) -> tuple[frozenset[str], frozenset[str]]:
    """A TypedDict's (required, optional) keys."""
    return typed.__required_keys__, typed.__optional_keys__


def assert_shape(value: Mapping[str, Any], typed: Any) -> None:
    required, optional = keys_of(typed)
    assert required <= set(value), f"{typed.__name__} lacks {sorted(required - set(value))}"
    assert set(value) <= required | optional, f"{typed.__name__}: {sorted(set(value) - required)}"


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[AgentRuntime]:
    settings = AgentSettings(name="r", data_dir=str(tmp_path))
    store = TieredStore([CpuTier(1 << 20), DiskTier(tmp_path / "disk", 4 << 20)])
    rt = AgentRuntime(settings, store)
    ns = Namespace("m", KVLayout(1, 1, 4, "float16"), "")
    keys = keys_for(list(range(64)), ns, 16)
    for k in keys:
        store.put(k, b"x" * 128, tokens=16)
    rt.lookup([*keys, b"\x00" * 16])
    try:
        yield rt
    finally:
        rt.close()


def test_stats_have_the_wire_shape(runtime: AgentRuntime) -> None:
    stats: AgentStats = runtime.stats()
    assert_shape(stats, AgentStats)
    assert_shape(stats["stats"], StoreCounters)
    assert stats["stats"]["tiers"] and stats["usage"]
    for counters in stats["stats"]["tiers"].values():
        assert_shape(counters, TierCounters)
    for usage in stats["usage"].values():
        assert_shape(usage, TierUsage)
    assert stats["hit_ratio"] == stats["stats"]["hit_ratio"] > 0


def test_info_has_the_wire_shape(runtime: AgentRuntime) -> None:
    info: AgentInfo = runtime.info()
    assert_shape(info, AgentInfo)
    assert [t["name"] for t in info["tiers"]] == ["cpu", "disk"]
    for tier in info["tiers"]:
        assert_shape(tier, TierEntry)
    for model in info["models"]:
        assert_shape(model, ModelEntry)
    assert_shape(info["dataplane"], DataPlaneAddresses)
    assert_shape(info["data_dir"], DataDir)


def test_the_probe_report_is_what_the_api_declares() -> None:
    assert set(ProbeResponse.model_fields) == set(keys_of(LinkProbe)[0])
