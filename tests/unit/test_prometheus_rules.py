"""deploy/prometheus: the rules file passes ``promtool check rules``, its unit tests pass
``promtool test rules``, and those tests cover every recording rule and every alert, firing
and not firing. Whether the metric names exist on a real agent's /metrics is checked in
tests/functional/test_deploy_metric_names.py."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy_queries import RULE_TESTS, RULES, rules
from tests.prometheus_tools import prometheus_binary


@pytest.fixture(scope="module")
def promtool() -> str:
    return prometheus_binary("promtool")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert RULE_TESTS, "no promtool tests in deploy/prometheus/tests"
    out = run(promtool, "test", "rules", *map(str, RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_TESTS), out.stdout


def _tests() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../kvctl-rules.yml"], path
        cases.extend(doc["tests"])
    return cases


def test_every_recording_rule_has_expected_samples() -> None:
    tested = {
        t["expr"]
        for case in _tests()
        for t in case.get("promql_expr_test", [])
        if t.get("exp_samples")
    }
    missing = {r.name for r in rules() if not r.is_alert} - tested
    assert not missing, f"recording rules without a promtool test: {sorted(missing)}"


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _tests():
        for t in case.get("alert_rule_test", []):
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    alerts = {r.name for r in rules() if r.is_alert}
    assert not alerts - firing, f"alerts never tested firing: {sorted(alerts - firing)}"
    assert not alerts - quiet, f"alerts never tested quiet: {sorted(alerts - quiet)}"


def test_alerts_say_what_why_and_what_to_do() -> None:
    for r in rules():
        if not r.is_alert:
            continue
        annotations = r.raw.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{r.name}: no {key} annotation"
        assert "kvctl" in annotations["runbook"], f"{r.name}: the runbook names no command"
        assert r.raw.get("labels", {}).get("severity") in ("critical", "warning"), r.name


def test_recording_rules_keep_the_labels_their_names_say() -> None:
    """A record is named for the labels it keeps (``dc_instance_kind:`` keeps dc, instance and
    kind), dc first: DC and host are target labels, so every figure is per DC or per node."""
    for r in rules():
        if r.is_alert:
            continue
        kept = r.name.split(":")[0].split("_")
        assert kept[0] == "dc", r.name
        assert f"by ({', '.join(kept)}" in r.expr, (r.name, r.expr)
