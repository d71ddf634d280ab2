"""deploy/grafana: the checked-in dashboard JSON is what generate.py builds, and it is a
well-formed dashboard (unique panel ids, every panel on the selected data source with queries,
panels inside the 24-column grid and not overlapping, the datasource/dc/instance variables).
Its metric names are checked against a real agent in tests/functional/test_deploy_metric_names.py,
its queries against a real Prometheus in tests/functional/test_prometheus_scrape.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_queries import DASHBOARD, GENERATOR, dashboard, panel_queries

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=120
    )


def test_checked_in_json_is_what_generate_builds() -> None:
    out = generate("--check")
    assert out.returncode == 0, out.stderr


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "kvctl-agents.json"
    stale.write_text(DASHBOARD.read_text().replace("Hit ratio by DC", "Hit ratio per DC"))
    out = generate("--check", "--output", str(stale))
    assert out.returncode == 1
    assert "differs from what generate.py generates" in out.stderr


def test_generate_writes_the_file(tmp_path: Path) -> None:
    fresh = tmp_path / "out.json"
    out = generate("--output", str(fresh))
    assert out.returncode == 0, out.stderr
    assert fresh.read_text() == DASHBOARD.read_text()


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return dashboard()


def _all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for top in board["panels"] for p in [top, *top.get("panels", [])]]


def test_panel_ids_are_unique(board: dict[str, Any]) -> None:
    ids = [p["id"] for p in _all_panels(board)]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))


def test_every_panel_queries_the_selected_data_source(board: dict[str, Any]) -> None:
    for p in _all_panels(board):
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        targets = p["targets"]
        assert targets, p["title"]
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert t["expr"].strip(), p["title"]
        assert p["title"] and p.get("description"), p["id"]


def test_panels_fit_the_grid_without_overlapping(board: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = p["title"]


def test_variables_pick_data_source_dc_and_node(board: dict[str, Any]) -> None:
    by_name = {v["name"]: v for v in board["templating"]["list"]}
    assert set(by_name) == {"datasource", "dc", "instance"}
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    for name in ("dc", "instance"):
        v = by_name[name]
        assert v["type"] == "query" and v["datasource"] == DATASOURCE
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert re.fullmatch(rf"label_values\(.*, {name}\)", v["query"]), v["query"]
    assert "$dc" in by_name["instance"]["query"]  # nodes of the selected DCs only


def test_kvctl_queries_follow_the_selection(board: dict[str, Any]) -> None:
    """Every query on kvctl's own series filters by the selected DCs; the GPU (DCGM) series
    come from another exporter whose instance is not the agent's, so they follow the DC only."""
    for title, expr in panel_queries(board):
        assert 'dc=~"$dc"' in expr, (title, expr)
        if "DCGM_" not in expr and not expr.startswith("dc:"):
            assert 'instance=~"$instance"' in expr, (title, expr)


def test_json_is_stable_text() -> None:
    text = DASHBOARD.read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
