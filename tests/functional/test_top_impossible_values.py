"""`kvctl top` reading agents that answer figures that cannot be true (NaN, Infinity, as
Python's json reads them): the collectors' checks (kvctl.db.sample_checks) apply, so the field
is N/A, the node stays up with its other figures, the DC and fleet sums skip it, and --json
never prints NaN or Infinity. Before, a NaN counter marked the node DOWN ("not an agent's
stats (ValueError: cannot convert float NaN to integer)") and a NaN GPU power made the DC and
fleet power NaN, which strict JSON parsers refuse.

The agents are the collectors' tests' stand-ins (a loopback HTTP server answering what the
test sets): a real agent never says NaN, and one on another host, buggy, old or hostile, can.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from textual.pilot import Pilot
from typer.testing import CliRunner

from kvctl.cli.main import app as cli
from kvctl.db.inventory import NodeInfo
from kvctl.tui.app import create_app
from kvctl.tui.model import Poll, Reading, RouterReading, Sampler
from kvctl.tui.sources import AgentSource
from tests.functional.test_collector_impossible_values import StandIn, _gpus, _stats
from tests.functional.test_top import cell, drive, until
from tests.unit.test_top_routing import router_stats

runner = CliRunner()


def _strict(text: str) -> Any:
    """``text`` as a strict JSON parser reads it: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_top_json_keeps_a_node_up_with_its_impossible_fields_unknown(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    n1, n2 = stand_ins
    bad = _stats(0, 0, 0.0)
    bad["stats"]["drops"] = math.nan
    bad["usage"]["cpu"]["used_bytes"] = math.inf
    n2.answers["/v1/stats"] = bad
    n2.answers["/v1/gpus"] = _gpus(math.nan, 1000.0, 0.5, 1 << 30)
    args = ["top", "--agent", n1.url, "--agent", n2.url, "--json", "--interval", "0.2"]
    out = runner.invoke(cli, args)
    assert out.exit_code == 0, out.output
    doc = _strict(out.stdout)
    rows = {r["node"]: r for r in doc["nodes"]}
    good, odd = rows["n1"], rows["n2"]
    assert (odd["up"], odd["state"], odd["error"]) == (True, "up", None), odd
    assert odd["rejected"] == {
        "stats.drops": "not finite",
        "usage.cpu.used_bytes": "not finite",
        "gpus[0].power_w": "not finite",
    }
    assert good["rejected"] == {}
    # each impossible field N/A, every other figure kept
    assert odd["evictions_per_s"] is None and good["evictions_per_s"] == 0.0
    assert odd["lookups_per_s"] == 0.0 and odd["io_bytes_per_s"] == 0.0
    # its cpu gauges rejected: null, as a tier without any; the hits cpu served since the
    # agent started stand beside them
    cpu = odd["tiers"]["cpu"]
    assert cpu["used_bytes"] is None and cpu["occupancy_ratio"] is None, cpu
    assert cpu["evictions_per_s"] is None and cpu["sharing_hits"] is not None, cpu
    assert odd["tiers"]["disk"]["capacity_bytes"] == 1 << 33
    assert odd["gpu_power_w"] is None and "gpus[0].power_w (not finite)" in odd["gpu_note"]
    assert odd["uptime_s"] is not None
    # the sums skip what is unknown: n1's figures, not NaN
    for whole in (doc["total"], *doc["dcs"]):
        assert whole["up"] == 2
        assert whole["gpu_power_w"] == 300.0
        assert whole["evictions_per_s"] == 0.0
        assert whole["tiers"]["cpu"]["used_bytes"] == 4096
        assert whole["tiers"]["disk"]["capacity_bytes"] == 2 << 33


def _node(name: str, i: int) -> NodeInfo:
    return NodeInfo(i, name, "fra", f"http://127.0.0.1:{7000 + i}", "", None)


def _poll(ts_s: float, *readings: Reading) -> Poll:
    return Poll(ts_s, list(readings), None, 0.01)


def test_a_counter_unknown_for_a_poll_counts_whole_at_the_next() -> None:
    """The collectors' rule: a rejected counter keeps its last known value, so its increase
    is counted at the next answer that reads it, and the window's counts stay exact."""
    a, b = _node("a", 1), _node("b", 2)
    nan_lookups = _stats(0, 50, 0.0)
    nan_lookups["stats"]["lookup_chunks"] = math.nan
    # the lookups' tokens read (60 chunks' worth): only the chunks' count is rejected, not 50
    # hits' tokens over none looked up (named impossible, as the database's window has them)
    nan_lookups["stats"]["lookup_tokens"] = 60 * 256
    s = Sampler()
    s.update(_poll(0.0, Reading(a, _stats(0, 0, 0.0)), Reading(b, _stats(0, 0, 0.0))))
    view = s.update(_poll(2.0, Reading(a, nan_lookups), Reading(b, _stats(100, 10, 0.0))))
    row = view.row("a")
    assert row is not None and row.up and row.rejected == {"stats.lookup_chunks": "not finite"}
    figures = _strict(json.dumps(view.as_dict()))
    ra = next(r for r in figures["nodes"] if r["node"] == "a")
    assert ra["lookups"] is None and ra["hit_ratio"] is None and ra["lookups_per_s"] is None
    assert ra["hits"] == 50 and ra["evictions_per_s"] == 0.0
    # the fleet's ratio is over b alone: never a's hits over b's lookups
    assert view.total.recent.hit_ratio == pytest.approx(0.1)
    assert view.total.lookups_per_s == pytest.approx(50.0)
    view = s.update(_poll(4.0, Reading(a, _stats(100, 80, 0.0)), Reading(b, _stats(200, 20, 0.0))))
    recent = view.row("a").recent  # type: ignore[union-attr]
    assert (recent.lookups, recent.hits, recent.seconds) == (100, 80, 4.0)
    assert recent.hit_ratio == pytest.approx(0.8) and recent.lookups_per_s == pytest.approx(25.0)
    assert view.total.recent.hit_ratio == pytest.approx(100 / 300)


def test_a_counter_unknown_from_the_first_poll_is_a_baseline_when_read() -> None:
    """Read for the first time at the second poll, a counter's whole value is not an increase
    of that poll (a spike of every lookup since the agent started): N/A until the next."""
    a = _node("a", 1)
    nan_lookups = _stats(0, 0, 0.0)
    nan_lookups["stats"]["lookup_chunks"] = math.nan
    s = Sampler()
    s.update(_poll(0.0, Reading(a, nan_lookups)))
    recent = s.update(_poll(2.0, Reading(a, _stats(5000, 0, 0.0)))).rows[0].recent
    assert recent.lookups_per_s is None and recent.hit_ratio is None
    recent = s.update(_poll(4.0, Reading(a, _stats(5100, 50, 0.0)))).rows[0].recent
    assert recent.lookups == 100 and recent.hits == 50


def test_a_router_counting_infinity_is_not_read_as_a_count() -> None:
    """The router's counters get the same check: Infinity made every increase NaN (inf - inf),
    printed as NaN in --json; the routing figures are now N/A with why."""
    counts = router_stats({"a": (3, 1)})
    counts["decisions"] = math.inf
    s = Sampler()
    view = s.update(Poll(0.0, [], None, 0.01, RouterReading("http://r", counts)))
    assert view.routing is not None and not view.routing.up
    assert "not a count: inf" in (view.routing.error or "")
    _strict(json.dumps(view.as_dict()))


def test_the_live_view_shows_an_impossible_figure_as_na(stand_ins: tuple[StandIn, StandIn]) -> None:
    """In the table: n2's hit ratio, over a NaN lookup counter, is N/A (not "idle" like n1,
    which had no lookups), and its state says it answered values that were rejected."""
    n1, n2 = stand_ins
    bad = _stats(0, 0, 0.0)
    bad["stats"]["lookup_chunks"] = math.nan
    n2.answers["/v1/stats"] = bad
    # a poll waits 60% of the interval: 0.3 s left 0.18 s, which a loaded run overran (NO ANSWER)
    app = create_app(AgentSource([n1.url, n2.url]), readonly=True, interval_s=2.5)

    async def script(pilot: Pilot[None]) -> None:
        await until(pilot, lambda: app.refreshes >= 2, "two polls")
        assert cell(app, "node:n1", "state") == "up"
        assert cell(app, "node:n2", "state") == "up 1 rejected"
        assert cell(app, "node:n1", "hit") == "idle"
        assert cell(app, "node:n2", "hit") == "N/A"
        assert cell(app, "node:n2", "evictions") != "N/A"  # its other figures stay

    drive(app, script)


def test_top_json_rejects_impossible_read_counts(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """Read counts that cannot be true (test_status_impossible_values.BAD_READS) are rejected by
    name, as `kvctl status` and the collector reject them: the node up with its other figures,
    its reads null, the totals the sound node's alone."""
    from tests.functional.test_status_impossible_values import BAD_READS, READS, _inventory

    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    n1.answers["/v1/stats"] = {
        **_stats(100, 40, 0.0),
        "dataplane": {"read_chunks": 30, "read_missing_chunks": 3},
    }
    for dataplane, rejected in BAD_READS:
        n2.answers["/v1/stats"] = {**_stats(50, 20, 0.0), "dataplane": dataplane}
        out = runner.invoke(cli, ["top", "--db", sqlite_url, "--json", "--interval", "0.2"])
        assert out.exit_code == 0, (dataplane, out.output)
        view = _strict(out.stdout)
        node = next(r for r in view["nodes"] if r["node"] == "n2")
        assert node["state"] == "up" and rejected.items() <= node["rejected"].items(), node
        assert [node[k] for k in READS] == [None, None, None], dataplane
        assert node["tiers"]["cpu"]["sharing_hits"] == 20, dataplane  # the rest stands
        assert [view["total"][k] for k in READS] == [30, 3, 0.1], dataplane
