"""Agent metrics: store figures match the store's own counters, names follow the conventions,
label cardinality stays bounded, and each agent has its own registry."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvctl import __version__
from kvctl.agent.metrics import LATENCY_BUCKETS, MAX_ROUTES, OTHER, AgentMetrics
from kvctl.store.keys import Namespace
from kvctl.store.stats import EVICTION_REASONS
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.conftest import chain, put_chain

CHUNK = 100

STORE_COUNTERS = {
    "kvctl_lookups",
    "kvctl_lookup_chunks",
    "kvctl_lookup_tokens",
    "kvctl_hits",
    "kvctl_hit_tokens",
    "kvctl_puts",
    "kvctl_tier_written_bytes",
    "kvctl_tier_read_bytes",
    "kvctl_promotions",
    "kvctl_demotions",
    "kvctl_tier_filesystem_full",
    "kvctl_tier_unreadable_on_open",
    "kvctl_evictions",
    "kvctl_drops",
    "kvctl_demotion_failures",
    "kvctl_admission_refused",
    "kvctl_bypassed_puts",
    "kvctl_unreachable_puts",
    "kvctl_spilled_puts",
    "kvctl_rerouted_puts",
    "kvctl_corrupt_chunks",
}
STORE_GAUGES = {
    "kvctl_tier_capacity_bytes",
    "kvctl_tier_used_bytes",
    "kvctl_tier_pinned_bytes",
    "kvctl_tier_items",
    "kvctl_shm_leases",
    "kvctl_policy_queued_accesses",
}


class Scrape:
    """One parsed exposition, with lookups by sample name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: list[Sample] = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0]

    def labelsets(self, name: str) -> list[dict[str, str]]:
        return [s.labels for s in self.samples if s.name == name]


def scrape(metrics: AgentMetrics) -> Scrape:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return Scrape(body.decode())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    # room for 3 chunks in cpu, so a 4th put evicts (demotes) by capacity
    s = TieredStore(
        [CpuTier(3 * CHUNK), DiskTier(tmp_path / "disk", 100 * CHUNK)],
        eviction="lru",  # plain LRU keeps the hand-counted victims obvious
        chunk_tokens=4,
    )
    yield s
    s.close()


@pytest.fixture
def busy(store: TieredStore, ns: Namespace) -> dict[str, Any]:
    """Drive the store through reuse and sharing hits, demotions, a promotion and evictions."""
    a = chain(ns, 3, seed=1)
    put_chain(store, a, CHUNK, tenant="a")
    store.lookup(a, tenant="a")  # 3 reuse hits in cpu
    store.lookup(a, tenant="b")  # 3 sharing hits in cpu
    store.lookup(a[:2], tenant="b")  # 2 more sharing hits
    store.lookup(chain(ns, 2, seed=9), tenant="a")  # 2 misses
    b = chain(ns, 2, seed=2)
    put_chain(store, b, CHUNK, tenant="b")  # 2 capacity evictions from cpu, demoted to disk
    demoted = [k for k in a if store.entry(k).tier == "disk"]
    assert len(demoted) == 2
    store.get(demoted[0], tenant="a")  # promoted back to cpu: one more capacity eviction
    store.evict([demoted[1]])  # explicit, from disk
    return {"a": a, "b": b}


def test_store_counters_match_store_stats(store: TieredStore, busy: dict[str, Any]) -> None:
    m = scrape(AgentMetrics(store))
    st = store.stats
    # figures the scenario caused, checked by hand
    assert m.value("kvctl_hits_total", tier="cpu", kind="reuse") == 3
    assert m.value("kvctl_hits_total", tier="cpu", kind="sharing") == 5
    assert m.value("kvctl_hits_total", tier="disk", kind="sharing") == 0
    assert m.value("kvctl_lookups_total") == 4
    assert m.value("kvctl_lookup_chunks_total") == 3 + 3 + 2 + 2
    assert m.value("kvctl_puts_total", tier="cpu") == 5
    assert m.value("kvctl_evictions_total", tier="cpu", reason="capacity") == 3
    assert m.value("kvctl_evictions_total", tier="disk", reason="explicit") == 1
    assert m.value("kvctl_demotions_total", tier="disk") == 3
    assert m.value("kvctl_promotions_total", tier="cpu") == 1
    assert m.value("kvctl_drops_total") == 1
    # and everything against the store's own counters
    assert m.value("kvctl_lookups_total") == st.lookups
    assert m.value("kvctl_lookup_chunks_total") == st.lookup_chunks
    assert m.value("kvctl_lookup_tokens_total") == st.lookup_tokens
    assert m.value("kvctl_drops_total") == st.drops
    assert m.value("kvctl_demotion_failures_total") == st.demotion_failures
    assert m.value("kvctl_admission_refused_total") == st.admission_refused
    assert m.value("kvctl_bypassed_puts_total") == st.bypassed_puts
    assert m.value("kvctl_unreachable_puts_total") == st.unreachable_puts
    assert m.value("kvctl_spilled_puts_total") == store.spilled_puts
    assert m.value("kvctl_rerouted_puts_total") == store.rerouted_puts
    assert m.value("kvctl_corrupt_chunks_total") == st.corrupt_dropped
    for tier, ts in st.tiers.items():
        assert m.value("kvctl_hits_total", tier=tier, kind="reuse") == ts.reuse_hits
        assert m.value("kvctl_hits_total", tier=tier, kind="sharing") == ts.sharing_hits
        assert m.value("kvctl_hit_tokens_total", tier=tier) == ts.hit_tokens
        assert m.value("kvctl_puts_total", tier=tier) == ts.puts
        assert m.value("kvctl_tier_written_bytes_total", tier=tier) == ts.bytes_written
        assert m.value("kvctl_tier_read_bytes_total", tier=tier) == ts.bytes_read
        assert m.value("kvctl_promotions_total", tier=tier) == ts.promotions
        assert m.value("kvctl_demotions_total", tier=tier) == ts.demotions
        for reason in EVICTION_REASONS:  # every reason present, zero included
            want = ts.evictions.get(reason, 0)
            assert m.value("kvctl_evictions_total", tier=tier, reason=reason) == want
    # hit chunks summed over tiers and kinds is the store's total: nothing double-booked
    total_hits = sum(s.value for s in m.samples if s.name == "kvctl_hits_total")
    assert total_hits == st.hit_chunks == 8


def test_gauges_match_usage(store: TieredStore, busy: dict[str, Any]) -> None:
    store.pin([busy["b"][0]])
    m = scrape(AgentMetrics(store))
    usage = store.usage()
    assert set(usage) == {"cpu", "disk"}
    for tier, u in usage.items():
        assert m.value("kvctl_tier_capacity_bytes", tier=tier) == u["capacity_bytes"]
        assert m.value("kvctl_tier_used_bytes", tier=tier) == u["used_bytes"]
        assert m.value("kvctl_tier_pinned_bytes", tier=tier) == u["pinned_bytes"]
        assert m.value("kvctl_tier_items", tier=tier) == u["chunks"]
    assert m.value("kvctl_tier_capacity_bytes", tier="cpu") == 3 * CHUNK
    assert m.value("kvctl_tier_used_bytes", tier="cpu") == 3 * CHUNK
    assert m.value("kvctl_tier_pinned_bytes", tier="cpu") == CHUNK
    assert m.value("kvctl_tier_items", tier="disk") == 1
    assert m.value("kvctl_shm_leases") == 0
    assert m.value("kvctl_policy_queued_accesses") == 0  # this store replays inline


def test_metrics_follow_later_changes(store: TieredStore, ns: Namespace) -> None:
    metrics = AgentMetrics(store)
    assert scrape(metrics).value("kvctl_lookups_total") == 0
    store.lookup(chain(ns, 2), tenant="a")
    assert scrape(metrics).value("kvctl_lookups_total") == 1


def test_bypassed_puts_count_and_say_the_unreachable_rule(ns: Namespace) -> None:
    """An operator reading kvctl_bypassed_puts must learn it counts the chunks turned away as
    deeper than the tiers hold (``bypass_unreachable``), not only the policy's declines."""
    store = TieredStore([CpuTier(3 * CHUNK)], eviction="lru", bypass_unreachable=True)
    try:
        keys = chain(ns, 5, seed=3)
        for depth, (k, parent) in enumerate(zip(keys, [None, *keys], strict=False)):
            store.put(k, bytes(CHUNK), parent=parent, depth=depth)  # room for 3: 2 turned away
        m = scrape(AgentMetrics(store))
        assert m.value("kvctl_bypassed_puts_total") == 2
        assert m.value("kvctl_unreachable_puts_total") == 2  # the rule's own, apart
        assert "bypass_unreachable" in m.families["kvctl_bypassed_puts"].documentation
    finally:
        store.close()


def test_one_snapshot_per_scrape(store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def snapshot() -> dict[str, Any]:
        calls.append(1)
        return {
            "stats": store.stats.as_dict(),
            "usage": store.usage(),
            "leases": 3,
            "queued_accesses": 5,
            "policies": {"cpu": {"policy": "lineage-adaptive", "leader": "lru", "switches": 2}},
        }

    monkeypatch.setattr(store, "snapshot", snapshot, raising=False)
    metrics = AgentMetrics(store)
    assert calls == []  # registering does not read the store
    m = scrape(metrics)
    assert calls == [1]
    assert m.value("kvctl_shm_leases") == 3
    assert m.value("kvctl_policy_queued_accesses") == 5
    assert m.value("kvctl_policy_switches_total", tier="cpu") == 2


def test_names_units_and_labels_follow_conventions(
    store: TieredStore, busy: dict[str, Any]
) -> None:
    metrics = AgentMetrics(store)
    metrics.observe_dataplane("get", "tcp", 0.001, ok=True, bytes_out=CHUNK)
    metrics.observe_http("GET", "/v1/stats", 200, 0.002)
    m = scrape(metrics)
    assert "_total_total" not in m.text
    types = {name: f.type for name, f in m.families.items()}
    for name in STORE_COUNTERS | {
        "kvctl_dataplane_requests",
        "kvctl_dataplane_bytes",
        "kvctl_http_requests",
    }:
        assert types.get(name) == "counter", name
        # counter samples are exposed as <name>_total (plus the library's <name>_created)
        assert {s.name for s in m.families[name].samples} <= {f"{name}_total", f"{name}_created"}
        assert any(s.name == f"{name}_total" for s in m.families[name].samples)
    for name in STORE_GAUGES | {"kvctl_start_time_seconds", "kvctl_dataplane_connections"}:
        assert types.get(name) == "gauge", name
    for name in ("kvctl_dataplane_request_duration_seconds", "kvctl_http_request_duration_seconds"):
        assert types.get(name) == "histogram", name
    for s in m.samples:
        assert s.name.startswith("kvctl_"), s.name
        assert not {"key", "request", "tenant", "dc", "host"} & set(s.labels), s
    assert not any(
        name.endswith("_ratio") for name in m.families
    )  # ratios are derived, not exported


def test_build_info_and_start_time(store: TieredStore) -> None:
    m = scrape(AgentMetrics(store, started_s=1234.5))
    assert m.value("kvctl_build_info", version=__version__, python=platform.python_version()) == 1
    assert m.value("kvctl_start_time_seconds") == 1234.5
    # serving: 0 (its starting responder answers scrapes with 1 while the tiers open)
    assert m.value("kvctl_agent_starting") == 0


def test_dataplane_histogram_counters_and_connections(store: TieredStore) -> None:
    metrics = AgentMetrics(store)
    metrics.observe_dataplane("get", "tcp", 2e-5, ok=True, bytes_out=CHUNK)
    metrics.observe_dataplane("get", "tcp", 0.003, ok=True, bytes_out=CHUNK)
    metrics.observe_dataplane("get", "tcp", 20.0, ok=False)
    metrics.observe_dataplane("put", "unix", 0.0004, ok=True, bytes_in=3 * CHUNK)
    metrics.connection_opened("tcp")
    metrics.connection_opened("tcp")
    metrics.connection_opened("unix")
    metrics.connection_closed("tcp")
    m = scrape(metrics)

    def req(op: str, tr: str, outcome: str) -> float:
        return m.value("kvctl_dataplane_requests_total", op=op, transport=tr, outcome=outcome)

    assert req("get", "tcp", "ok") == 2
    assert req("get", "tcp", "error") == 1
    assert req("put", "unix", "ok") == 1
    h = "kvctl_dataplane_request_duration_seconds"
    assert m.value(f"{h}_count", op="get", transport="tcp") == 3
    assert m.value(f"{h}_sum", op="get", transport="tcp") == pytest.approx(20.00302)
    assert m.value(f"{h}_bucket", op="get", transport="tcp", le="2.5e-05") == 1
    assert m.value(f"{h}_bucket", op="get", transport="tcp", le="0.005") == 2
    assert m.value(f"{h}_bucket", op="get", transport="tcp", le="10.0") == 2
    assert m.value(f"{h}_bucket", op="get", transport="tcp", le="+Inf") == 3
    assert m.value(f"{h}_count", op="put", transport="unix") == 1
    les = [s.labels["le"] for s in m.samples if s.name == f"{h}_bucket" and s.labels["op"] == "put"]
    assert len(les) == len(LATENCY_BUCKETS) + 1
    assert float(les[0]) == 1e-5 and float(les[-2]) == 10.0
    b = "kvctl_dataplane_bytes_total"
    assert m.value(b, transport="tcp", direction="out") == 2 * CHUNK
    assert m.value(b, transport="tcp", direction="in") == 0
    assert m.value(b, transport="unix", direction="in") == 3 * CHUNK
    assert m.value("kvctl_dataplane_connections", transport="tcp") == 1
    assert m.value("kvctl_dataplane_connections", transport="unix") == 1


def test_bad_observations_never_raise(store: TieredStore) -> None:
    metrics = AgentMetrics(store)
    metrics.observe_dataplane("get", "tcp", -1.0, ok=True, bytes_in=-5, bytes_out=-5)
    m = scrape(metrics)
    assert m.value("kvctl_dataplane_request_duration_seconds_sum", op="get", transport="tcp") == 0
    assert m.value("kvctl_dataplane_bytes_total", transport="tcp", direction="in") == 0


def test_http_requests_and_unknown_route_collapse(store: TieredStore) -> None:
    metrics = AgentMetrics(store, routes=["/v1/lookup", "/v1/chunks/{key}", "/metrics"])
    metrics.observe_http("POST", "/v1/lookup", 200, 0.001)
    metrics.observe_http("POST", "/v1/lookup", 400, 0.001)
    metrics.observe_http("GET", "/v1/chunks/{key}", 404, 0.001)
    metrics.observe_http("GET", "/v1/chunks/00ff00ff00ff00ff", 404, 0.001)  # a raw path
    metrics.observe_http("GET", "/wp-admin/login.php", 404, 0.001)
    metrics.observe_http("BREW", "/metrics", 405, 0.001)
    m = scrape(metrics)
    r = "kvctl_http_requests_total"
    assert m.value(r, method="POST", route="/v1/lookup", status="200") == 1
    assert m.value(r, method="POST", route="/v1/lookup", status="400") == 1
    assert m.value(r, method="GET", route="/v1/chunks/{key}", status="404") == 1
    assert m.value(r, method="GET", route=OTHER, status="404") == 2
    assert m.value(r, method=OTHER, route="/metrics", status="405") == 1
    routes = {ls["route"] for ls in m.labelsets(r)}
    assert routes == {"/v1/lookup", "/v1/chunks/{key}", "/metrics", OTHER}
    h = "kvctl_http_request_duration_seconds_count"
    assert m.value(h, method="GET", route=OTHER) == 2


def test_allow_routes_after_construction(store: TieredStore) -> None:
    metrics = AgentMetrics(store)
    metrics.allow_routes(["/v1/stats"])
    metrics.observe_http("GET", "/v1/stats", 200, 0.001)
    metrics.observe_http("GET", "/nope", 404, 0.001)
    m = scrape(metrics)
    assert {ls["route"] for ls in m.labelsets("kvctl_http_requests_total")} == {"/v1/stats", OTHER}


def test_label_values_are_capped_without_an_allowlist(store: TieredStore) -> None:
    metrics = AgentMetrics(store)
    for i in range(MAX_ROUTES + 50):
        metrics.observe_http("GET", f"/r{i}", 200, 0.001)
    for i in range(100):
        metrics.observe_dataplane(f"op{i}", f"t{i}", 0.001, ok=True)
    m = scrape(metrics)
    routes = {ls["route"] for ls in m.labelsets("kvctl_http_requests_total")}
    assert len(routes) == MAX_ROUTES + 1 and OTHER in routes
    assert m.value("kvctl_http_requests_total", method="GET", route=OTHER, status="200") == 50
    labelsets = m.labelsets("kvctl_dataplane_requests_total")
    assert len({ls["op"] for ls in labelsets}) <= 33
    assert len({ls["transport"] for ls in labelsets}) <= 9
    assert sum(m.value("kvctl_dataplane_requests_total", **ls) for ls in labelsets) == 100


def test_each_agent_has_its_own_registry(store: TieredStore, ns: Namespace) -> None:
    one, two = AgentMetrics(store), AgentMetrics(store)  # no duplicate-timeseries error
    assert one.registry is not two.registry and one.registry is not REGISTRY
    one.observe_dataplane("get", "tcp", 0.001, ok=True)
    assert scrape(two).labelsets("kvctl_dataplane_requests_total") == []
    assert REGISTRY.get_sample_value("kvctl_lookups_total") is None


def test_openmetrics_when_asked(store: TieredStore) -> None:
    metrics = AgentMetrics(store)
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert text.rstrip().endswith("# EOF")
    assert "kvctl_lookups_total 0" in text
    assert "_total_total" not in text
