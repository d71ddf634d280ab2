"""Every metric and label that deploy/prometheus/kvctl-rules.yml and the Grafana dashboard read
exists on a real agent's /metrics, so renaming a metric breaks this test rather than an
operator's alert. The agent has a pool and a peer (both unreachable: their breakers and
counters are exported all the same) and serves data-plane and control-API requests first, so
the series created on first use are there too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy_queries import (
    DCGM_LABELS,
    DCGM_SERIES,
    PROMETHEUS_SERIES,
    TARGET_LABELS,
    Names,
    dashboard,
    dashboard_names,
    panel_queries,
    records,
    rule_names,
)
from tests.functional.agents import closed_port, key, payload, running_agent


class Exported:
    def __init__(self, text: str) -> None:
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        self.metrics = {s.name for s in samples}
        self.labels = {label for s in samples for label in s.labels}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    data_dir: Path = tmp_path_factory.mktemp("agent")
    args = ["--disk", "0", "--cpu", "16MiB"]
    args += [
        "--pool",
        f"kvctl://127.0.0.1:{closed_port()}",
        "--peer",
        f"p1=127.0.0.1:{closed_port()}",
    ]
    with running_agent(data_dir, *args) as agent:
        keys = [key(i, 41) for i in range(3)]
        with agent.data("tcp") as c:
            c.put_many([(k, payload(k, 1024)) for k in keys[:2]], tenant="a")
            c.lookup(keys, tenant="b")
            assert bytes(c.get(keys[0], tenant="a")) == payload(keys[0], 1024)
        agent.control().stats()
        text = httpx.get(f"{agent.state.control_url}/metrics", timeout=10).text
    yield Exported(text)


def _unknown(used: Names, exported: Exported, *, also: frozenset[str] = frozenset()) -> list[str]:
    known_records = records()
    missing = []
    for name in sorted(used.metrics):
        if ":" in name:
            if name not in known_records:
                missing.append(f"{name} (no such recording rule)")
        elif name not in exported.metrics | PROMETHEUS_SERIES | also:
            missing.append(name)
    return missing


def test_rules_read_only_exported_metrics_and_labels(exported: Exported) -> None:
    used = rule_names()
    assert not _unknown(used, exported), _unknown(used, exported)
    assert used.labels <= exported.labels | TARGET_LABELS, used.labels - exported.labels


def test_dashboard_reads_only_exported_metrics_and_labels(exported: Exported) -> None:
    used = dashboard_names()
    assert not _unknown(used, exported, also=DCGM_SERIES), _unknown(
        used, exported, also=DCGM_SERIES
    )
    known_labels = exported.labels | TARGET_LABELS | DCGM_LABELS
    assert used.labels <= known_labels, used.labels - known_labels


def test_dashboard_legends_name_known_labels(exported: Exported) -> None:
    board = dashboard()
    known = exported.labels | TARGET_LABELS | DCGM_LABELS
    legends = [
        t["legendFormat"]
        for top in board["panels"]
        for p in [top, *top.get("panels", [])]
        for t in p.get("targets", [])
    ]
    assert len(legends) == len(panel_queries(board))
    used = {name for legend in legends for name in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)}
    assert used and used <= known, used - known


def test_a_renamed_metric_would_be_caught(exported: Exported) -> None:
    """The check above is not vacuous: a misspelt metric or recording rule is reported."""
    used = Names({"kvctl_hit_total", "dc:kvctl_hit_ratios:rate5m", "kvctl_hits_total"}, set())
    assert _unknown(used, exported) == [
        "dc:kvctl_hit_ratios:rate5m (no such recording rule)",
        "kvctl_hit_total",
    ]
