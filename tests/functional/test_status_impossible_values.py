"""`kvctl status` reading agents that answer figures that cannot be true (NaN, Infinity, as
Python's json reads them): the collectors' checks (kvctl.db.sample_checks) apply, as in `kvctl
top`, so the field is unknown (null in --json, N/A in the table), the node stays up with its
other figures and its rejected fields named, and DC and fleet totals leave it out. Before, a
NaN counter marked the node down ("not an agent's stats (ValueError: cannot convert float NaN
to integer)") while `kvctl top` showed it up.

`kvctl status --window` shows the recorded scrapes answered without figures (unread).

The agents are the collectors' tests' stand-ins (a loopback HTTP server answering what the
test sets): a real agent never says NaN, and one on another host, buggy, old or hostile, can.
"""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from kvctl.cli.main import app as cli
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.fleet import status as fleet_status
from tests.functional.test_collector_impossible_values import StandIn, _stats
from tests.functional.test_top_impossible_values import _strict

runner = CliRunner()


def _inventory(url: str, n1: StandIn, n2: StandIn) -> None:
    engine = open_db(url, auto_upgrade=True)
    try:
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_dc(conn, "ams")
            add_node(conn, "n1", dc="fra", agent_url=n1.url)
            add_node(conn, "n2", dc="ams", agent_url=n2.url)
    finally:
        engine.dispose()


def _impossible() -> dict[str, Any]:
    """50 lookups, 20 hits (all sharing), with the lookups NaN, the drops -Infinity and the
    cpu tier's bytes in use Infinity."""
    bad = _stats(50, 20, 0.0)
    bad["stats"]["lookup_chunks"] = math.nan
    bad["stats"]["drops"] = -math.inf
    bad["usage"]["cpu"]["used_bytes"] = math.inf
    return bad


REJECTED = {
    "stats.lookup_chunks": "not finite",
    "stats.drops": "not finite",
    "usage.cpu.used_bytes": "not finite",
}


def test_status_json_keeps_a_node_up_with_its_impossible_fields_unknown(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    n1.answers["/v1/stats"] = _stats(100, 40, 0.0)
    n2.answers["/v1/stats"] = _impossible()
    out = runner.invoke(cli, ["status", "--db", sqlite_url, "--json"])
    assert out.exit_code == 0, out.output
    doc = _strict(out.stdout)  # never NaN or Infinity
    rows = {r["node"]: r for r in doc["nodes"]}
    good, odd = rows["n1"], rows["n2"]
    assert (odd["up"], odd["state"], odd["error"]) == (True, "up", None), odd
    assert odd["rejected"] == REJECTED and good["rejected"] == {}
    # each impossible figure null, and every ratio over it; the rest kept
    assert odd["lookups"] is None
    assert all(odd[r] is None for r in ("hit_ratio", "reuse_hit_ratio", "sharing_hit_ratio"))
    assert (odd["hits"], odd["reuse_hits"], odd["sharing_hits"]) == (20, 0, 20)
    assert (odd["reuse_share_of_hits"], odd["sharing_share_of_hits"]) == (0.0, 1.0)
    # its cpu tier's usage rejected: no occupancy, as a tier that reports none; the hits it
    # served stand, their ratios over the unknown lookups null
    cpu, disk = odd["tiers"]["cpu"], odd["tiers"]["disk"]
    assert (cpu["used_bytes"], cpu["capacity_bytes"], cpu["occupancy_ratio"]) == (None,) * 3
    assert (cpu["hits"], cpu["sharing_hits"], cpu["sharing_hit_ratio"]) == (20, 20, None)
    assert disk["capacity_bytes"] == 1 << 33
    assert odd["uptime_s"] is not None
    assert (good["lookups"], good["hit_ratio"]) == (100, 0.4)
    # ams has only n2: its counts are unknown, not 0 lookups; its known tier is summed
    dcs = {d["dc"]: d for d in doc["dcs"]}
    assert dcs["ams"]["up"] == 1 and dcs["ams"]["lookups"] is None
    assert dcs["ams"]["hit_ratio"] is None and "cpu" not in dcs["ams"]["tiers"]
    # the fleet's figures are n1's: never n2's hits over n1's lookups
    total = doc["total"]
    assert (total["up"], total["nodes"]) == (2, 2)
    assert (total["lookups"], total["hits"], total["hit_ratio"]) == (100, 40, 0.4)
    assert total["tiers"]["cpu"]["used_bytes"] == 4096
    assert total["tiers"]["disk"]["capacity_bytes"] == 2 << 33


def test_status_table_shows_an_impossible_figure_as_na_and_names_it(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    n1.answers["/v1/stats"] = _stats(100, 40, 0.0)
    n2.answers["/v1/stats"] = _impossible()
    out = runner.invoke(cli, ["status", "--db", sqlite_url], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert "nan" not in text.lower() and "inf" not in text.lower(), text
    assert "not an agent's stats" not in text and "down" not in text, text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("│ n2"))
    # up, its hit ratio N/A (its lookups unknown), its split over known hits shown
    assert " up " in row and "N/A" in row and "0.0% / 100.0%" in row, row
    assert "disk 0.0%" in row and "cpu" not in row, row
    fleet = next(line for line in lines if "fleet" in line)
    assert "2/2" in fleet and "40.0%" in fleet, fleet
    said = " ".join(line for line in lines if line.startswith("n2 "))
    assert "3 value(s) rejected as impossible" in said, text
    for where in REJECTED:
        assert f"{where} (not finite)" in said, text


def test_status_window_shows_the_unread_scrapes(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """A scrape whose figures were all rejected (no ``stats`` object) is recorded up without
    figures: `unread_samples` in --json, the 'unread' column in the table."""
    n1, n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
        add_node(conn, "n2", dc="fra", agent_url=n2.url)
    url = db.url.render_as_string(hide_password=False)
    now = [time.time() - 120]  # within the window `--window` takes back from now
    collector = Collector(db, CollectorConfig(interval_s=10.0), clock=lambda: now[0])
    try:
        for i, lookups in enumerate((10, 20, 30, 40)):
            n1.answers["/v1/stats"] = _stats(lookups, 4, 0.0)
            n2.answers["/v1/stats"] = {**_stats(lookups, 4, 0.0), "stats": None}
            if i == 0:
                n2.answers["/v1/stats"] = _stats(lookups, 4, 0.0)
            collector.collect_once()
            now[0] += 10.0
    finally:
        collector.close()
    window = ["--window", "7d"]
    out = runner.invoke(cli, ["status", "--db", url, *window, "--json"])
    assert out.exit_code == 0, out.output
    doc = _strict(out.stdout)
    unread = {r["node"]: r["unread_samples"] for r in doc["nodes"]}
    assert unread["n1"] == 0 and unread["n2"] > 0, unread
    table = runner.invoke(cli, ["status", "--db", url, *window], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    header = next(line for line in lines if "scrapes up" in line)
    assert "unread" in header, table.stdout
    cells = [c.strip() for c in next(line for line in lines if line.startswith("│ n2")).split("│")]
    assert cells[4] == str(unread["n2"]), cells  # node, dc, scrapes up, unread


def test_a_dc_whose_only_answer_refused_the_token_has_unknown_counts() -> None:
    """As `kvctl top` sums: a DC's counts are over the nodes whose counts were read, so a DC
    with only a node refusing the token says null, not 0 lookups (idle)."""
    dc = fleet_status.DcStatus("ams")
    dc.add(fleet_status.NodeStatus("c", "ams", "http://c", True, "401", auth_refused=True))
    doc = dc.as_dict()
    assert doc["up"] == 1 and doc["lookups"] is None and doc["hit_ratio"] is None


#: an agent's read counts that cannot be true, and what each is rejected as
BAD_READS = [
    ({"read_chunks": "6", "read_missing_chunks": 2}, {"dataplane.read_chunks": "not a number"}),
    ({"read_chunks": 6, "read_missing_chunks": -2}, {"dataplane.read_missing_chunks": "negative"}),
    ({"read_chunks": True, "read_missing_chunks": 0}, {"dataplane.read_chunks": "not a number"}),
    ({"read_chunks": math.nan, "read_missing_chunks": 0}, {"dataplane.read_chunks": "not finite"}),
    ({"read_chunks": [6], "read_missing_chunks": 2}, {"dataplane.read_chunks": "not a number"}),
    (
        {"read_chunks": 2, "read_missing_chunks": 6},
        {"dataplane.read_missing_chunks": "more than dataplane.read_chunks"},
    ),
    ("not an object", {"dataplane": "not an object"}),
]


def test_live_status_rejects_impossible_read_counts(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """Read counts that cannot be true (a string, a list, a bool, negative, NaN, more missing
    than read, a dataplane that is not an object) are rejected by name, as the collector
    rejects them: the node stays up with its other figures, its reads null (N/A), the totals
    the sound node's alone, and the table says so (test_top_impossible_values.py: top)."""
    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    n1.answers["/v1/stats"] = {**_stats(100, 40, 0.0), "dataplane": {"read_chunks": 30}}
    n1.answers["/v1/stats"]["dataplane"]["read_missing_chunks"] = 3
    for dataplane, rejected in BAD_READS:
        n2.answers["/v1/stats"] = {**_stats(50, 20, 0.0), "dataplane": dataplane}
        out = runner.invoke(cli, ["status", "--db", sqlite_url, "--json"])
        assert out.exit_code == 0, (dataplane, out.output)
        doc = _strict(out.stdout)
        rows = {r["node"]: r for r in doc["nodes"]}
        odd = rows["n2"]
        assert (odd["state"], odd["rejected"]) == ("up", rejected), dataplane
        assert [odd[k] for k in READS] == [None, None, None], dataplane
        assert (odd["lookups"], odd["hits"]) == (50, 20), dataplane  # the rest stands
        assert [rows["n1"][k] for k in READS] == [30, 3, 0.1]
        for total in (doc["total"], next(d for d in doc["dcs"] if d["dc"] == "fra")):
            assert [total[k] for k in READS] == [30, 3, 0.1], dataplane
        ams = next(d for d in doc["dcs"] if d["dc"] == "ams")
        assert [ams[k] for k in READS] == [None, None, None], dataplane

        table = runner.invoke(cli, ["status", "--db", sqlite_url], env={"COLUMNS": "200"})
        assert table.exit_code == 0, (dataplane, table.output)
        lines = table.stdout.splitlines()
        row = next(line for line in lines if line.startswith("│ n2"))
        assert " up " in row and "N/A" in row, row
        said = " ".join(line for line in lines if line.startswith("n2 "))
        assert "rejected as impossible" in said and next(iter(rejected)) in said, table.stdout


READS = ("read_chunks", "read_missing_chunks", "read_missing_ratio")
