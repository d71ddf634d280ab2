"""The PromQL name lexer the deploy/ tests rely on: metrics and labels found, nothing else
taken for a metric, and an unknown function refused."""

from __future__ import annotations

import pytest

from tests.promql_names import names, variable_names


def test_metrics_and_labels_of_a_ratio() -> None:
    found = names(
        'sum by (dc, instance) (rate(kvctl_hits_total{tier="cpu", kind=~"re.*"}[5m]))\n'
        "  / ignoring (kind) group_left ()\n"
        "(sum by (dc) (rate(kvctl_lookup_chunks_total[$__rate_interval] offset 1h)) > 0)"
    )
    assert found.metrics == {"kvctl_hits_total", "kvctl_lookup_chunks_total"}
    assert found.labels == {"dc", "instance", "tier", "kind"}


def test_recording_rule_names_keywords_numbers_and_strings() -> None:
    found = names(
        "dc_instance:kvctl_hit_ratio:rate5m < 0.5 * (dc_instance:kvctl_hit_ratio:rate5m offset 1h)"
        ' and on (dc) up{job="kvctl", note="not_a_metric{x}"} == bool 1e3'
        " unless histogram_quantile(0.99, sum without (op) (x_bucket))"
    )
    assert found.metrics == {"dc_instance:kvctl_hit_ratio:rate5m", "up", "x_bucket"}
    assert found.labels == {"dc", "job", "note", "op"}


def test_an_unknown_function_is_refused() -> None:
    with pytest.raises(ValueError, match="rat_e"):
        names("sum(rat_e(kvctl_hits_total[5m]))")


def test_grafana_label_values_query() -> None:
    found = variable_names('label_values(kvctl_build_info{dc=~"$dc"}, instance)')
    assert found.metrics == {"kvctl_build_info"}
    assert found.labels == {"dc", "instance"}
