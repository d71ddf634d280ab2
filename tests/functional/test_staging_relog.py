"""Staging segments that keep failing are said again while they do, not only at the first
failure of a row. Found in review: the SDK logged only a row's first failure, and a row resets
only when a segment attaches, so a shortage that came back hours later (no segment attached
between) was never said again. The client's back-off clock is moved by hand (its
``_monotonic_s`` seam): no wall-clock waits."""

from __future__ import annotations

import errno
import itertools
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvctl.client as client_module
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import key, payload
from tests.functional.inprocess_node import InProcessNode

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd seals are Linux")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="relog", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    n = InProcessNode(tmp_path, settings, [CpuTier(16 << 20, shared=True)])
    try:
        yield n
    finally:
        n.close()


def test_a_staging_shortage_that_lasts_is_logged_again_every_ten_minutes(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_memory(size: int) -> tuple[int, object]:
        raise OSError(errno.ENOMEM, "Cannot allocate memory (injected)")

    monkeypatch.setattr(client_module, "_sealed_segment", no_memory)
    now_s = [1000.0]
    said_at_s: list[float] = []  # the clock at each line
    with (
        DataClient.connect(node.unix) as c,
        caplog.at_level(logging.WARNING, logger="kvctl.client"),
    ):
        assert c.shm
        c._monotonic_s = lambda: now_s[0]
        for round_ in range(30):
            before = len(caplog.records)
            k = key(round_, 95)
            assert c.put(k, payload(k, 8192), tenant="t") == "cpu"  # over the socket
            assert c._staging is None and c._staging_failures == round_ + 1
            said = [r.getMessage() for r in caplog.records[before:]]
            said = [m for m in said if "staging segment" in m]
            assert len(said) <= 1, said
            if said:
                said_at_s.append(now_s[0])
                assert "Cannot allocate memory" in said[0] and "LimitAS=" in said[0], said
                if len(said_at_s) > 1:
                    assert f"{round_ + 1} failures in a row" in said[0], said
            now_s[0] = c._staging_retry_at_s  # the back-off ran out
    # the first at once, then once each 600 s the failures lasted, not each try
    assert said_at_s[0] == 1000.0, said_at_s
    assert len(said_at_s) >= 3, said_at_s
    gaps_s = [b - a for a, b in itertools.pairwise(said_at_s)]
    assert all(600.0 <= gap < 600.0 + client_module.STAGING_RETRY_MAX_SECONDS for gap in gaps_s)


def test_a_shortage_back_hours_later_is_said_again_though_no_segment_attached_between(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_memory(size: int) -> tuple[int, object]:
        raise OSError(errno.ENOMEM, "Cannot allocate memory (injected)")

    monkeypatch.setattr(client_module, "_sealed_segment", no_memory)
    now_s = [1000.0]
    with (
        DataClient.connect(node.unix) as c,
        caplog.at_level(logging.WARNING, logger="kvctl.client"),
    ):
        c._monotonic_s = lambda: now_s[0]
        for round_, at_s in enumerate((1000.0, 1000.0 + 3 * 3600.0)):
            now_s[0] = at_s
            k = key(round_, 96)
            assert c.put(k, payload(k, 8192), tenant="t") == "cpu"
    said = [r.getMessage() for r in caplog.records if "staging segment" in r.getMessage()]
    assert len(said) == 2, said
    assert "2 failures in a row" in said[1] and "LimitAS=" in said[1], said
