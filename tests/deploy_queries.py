"""The PromQL that deploy/ holds: the rules file's records and alerts, and the Grafana
dashboard's panel and variable queries (read from the checked-in JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.promql_names import Names, names, variable_names

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "kvctl-rules.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "kvctl-agents.json"
GENERATOR = GRAFANA_DIR / "generate.py"

#: labels the scrape adds to every series (the agents never export them)
TARGET_LABELS = frozenset({"job", "instance", "dc"})
#: series Prometheus itself writes for every target
PROMETHEUS_SERIES = frozenset({"up"})
#: NVIDIA DCGM exporter's series and labels the dashboard reads beside kvctl's
DCGM_SERIES = frozenset({"DCGM_FI_DEV_POWER_USAGE"})
DCGM_LABELS = frozenset({"gpu", "UUID", "Hostname"})


@dataclass(frozen=True)
class Rule:
    group: str
    name: str  # the record's or the alert's name
    expr: str
    raw: dict[str, Any]

    @property
    def is_alert(self) -> bool:
        return "alert" in self.raw


def rules() -> list[Rule]:
    doc = yaml.safe_load(RULES.read_text())
    return [
        Rule(g["name"], r.get("record") or r["alert"], r["expr"], r)
        for g in doc["groups"]
        for r in g["rules"]
    ]


def records() -> set[str]:
    return {r.name for r in rules() if not r.is_alert}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, rows' nested panels included."""
    out: list[tuple[str, str]] = []
    for panel in board["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))
    return out


def variable_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    return [(v["name"], v["query"]) for v in board["templating"]["list"] if v["type"] == "query"]


def rule_names() -> Names:
    found = Names()
    for r in rules():
        found.add(names(r.expr))
    return found


def dashboard_names() -> Names:
    board = dashboard()
    found = Names()
    for _, expr in panel_queries(board):
        found.add(names(expr))
    for _, query in variable_queries(board):
        found.add(variable_names(query))
    return found
