"""The remote sources' circuit breakers and call counters on ``/metrics``: one state set to 1 per
source, the counters those of ``Source.status``, and sources labelled by name and tier only."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.agent.metrics import BREAKER_STATES, SourceCollector
from tests.unit.test_source_breaker import FakeClock, make_source, no_bytes


def _fail() -> None:
    raise ConnectionError("pool is away")


def _registry(statuses: Callable[[], Iterable[Mapping[str, Any]]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SourceCollector(statuses))
    return registry


def _samples(metrics: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("kvctl_remote_source")
        for s in family.samples
    }


def test_breaker_state_and_counters_follow_the_source() -> None:
    clock = FakeClock()
    source = make_source(clock)
    metrics = _registry(lambda: [source.status()])

    def state_of() -> str:
        samples = _samples(metrics)
        on = [
            st
            for st in BREAKER_STATES
            if samples[
                (
                    "kvctl_remote_source_breaker_state",
                    (("source", "pool"), ("state", st), ("tier", source.tier)),
                )
            ]
            == 1.0
        ]
        assert len(on) == 1, on  # exactly one state is current
        return on[0]

    assert state_of() == "closed"
    assert source.call("get", _fail, moved_bytes=no_bytes) is None
    assert state_of() == "open"
    assert source.call("get", _fail, moved_bytes=no_bytes) is None  # skipped: breaker open
    labels = (("source", "pool"), ("tier", source.tier))
    samples = _samples(metrics)
    assert samples[("kvctl_remote_source_errors_total", labels)] == 1
    assert samples[("kvctl_remote_source_skipped_total", labels)] == 1
    assert samples[("kvctl_remote_source_breaker_opens_total", labels)] == 1
    clock.advance(source.status()["breaker"]["retry_in_s"] + 0.01)
    assert source.call("get", lambda: b"ok", moved_bytes=no_bytes) == b"ok"  # the probe
    assert state_of() == "closed"
    assert _samples(metrics)[("kvctl_remote_source_breaker_probes_total", labels)] == 1


def test_no_sources_no_samples() -> None:
    metrics = _registry(list)
    assert not [k for k in _samples(metrics) if k[0] != "kvctl_remote_source_breaker_state"]


def test_late_answers_and_overdue_pulls_are_exported() -> None:
    """Answers past the lookup's wait open the breaker (``breaker_late_opens``, among
    ``breaker_opens``); the source's ``late`` probes and ``overdue`` pulls are counters too."""
    clock = FakeClock()
    source = make_source(clock)
    status: dict[str, Any] = {}
    metrics = _registry(lambda: [{**source.status(), **status}])
    for _ in range(3):  # due at once: every answer is late
        assert source.call("probe", lambda: b"ok", moved_bytes=no_bytes, answer_within_s=0.0)
    labels = (("source", "pool"), ("tier", source.tier))
    samples = _samples(metrics)
    assert samples[("kvctl_remote_source_breaker_late_opens_total", labels)] == 1
    assert samples[("kvctl_remote_source_breaker_opens_total", labels)] == 1
    assert samples[("kvctl_remote_source_late_total", labels)] == 0
    status.update(late=4, overdue=2)
    samples = _samples(metrics)
    assert samples[("kvctl_remote_source_late_total", labels)] == 4
    assert samples[("kvctl_remote_source_overdue_total", labels)] == 2
