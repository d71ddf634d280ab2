"""kvctl_time_seconds: the agent's clock read at each scrape (not at start), so Prometheus can
compare it with the scrape's timestamp and alert on clock skew (deploy/prometheus)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.agent.metrics import AgentMetrics
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier


@pytest.fixture
def store() -> Iterator[TieredStore]:
    s = TieredStore([CpuTier(1 << 20)], chunk_tokens=4)
    yield s
    s.close()


def clock_value(metrics: AgentMetrics) -> float:
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    family = families["kvctl_time_seconds"]
    assert family.type == "gauge"
    [sample] = family.samples
    assert sample.labels == {}
    return float(sample.value)


def test_clock_is_read_at_every_scrape(store: TieredStore) -> None:
    readings = iter([1000.5, 1007.25])
    metrics = AgentMetrics(store, started_s=1.0, clock=lambda: next(readings))
    assert clock_value(metrics) == 1000.5
    assert clock_value(metrics) == 1007.25


def test_default_clock_is_the_wall_clock(store: TieredStore) -> None:
    metrics = AgentMetrics(store, started_s=1.0)
    before_s = time.time()
    value_s = clock_value(metrics)
    after_s = time.time()
    assert before_s <= value_s <= after_s
