"""A removed node's history stays in the totals of the windows that hold its samples, on a real
SQLite and PostgreSQL: `kvctl fleet rm node`, a DC removed with its nodes, `kvctl fleet import
--prune`. Its samples are keyed by its id (no foreign key, ids never reused), and the read model
counts them under its DC's name, listed as removed; live views list only the inventory's nodes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection, Engine

from kvctl.db.analytics.counts import Counts
from kvctl.db.analytics.inventory import inventory
from kvctl.db.analytics.links import link_figures
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.recorded import recorded, removed_in
from kvctl.db.analytics.summary import fleet_summary
from kvctl.db.analytics.windows import Window, sampled_between, window_for
from kvctl.db.fleetfile import import_fleet
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import (
    REMOVAL_MARGIN_MS,
    InventoryError,
    add_node,
    list_nodes,
    remove_dc,
    remove_node,
)
from kvctl.db.models import RemovedNode, raw_table
from kvctl.db.rollup import MINUTE_MS, rollup_all
from tests.functional.dashboard_history import ASSUME, NOW, T, _cache, fill_history
from tests.functional.waiting import wait_until

WINDOW = window_for("1h", NOW)
#: the window totals a removal must leave as they were
FIGURES = (
    "lookups",
    "hits",
    "reuse_hits",
    "sharing_hits",
    "lookup_tokens",
    "hit_tokens",
    "evictions",
    "samples",
    "up_samples",
    "energy_j",
    "energy_nodes",
    "prompt_tokens",
    "ttft_count",
    "gpu_seconds_saved",
    "it_joules_saved",
    "facility_joules_saved",
    "carbon_g_saved",
)


def figures(c: Counts) -> dict[str, Any]:
    return {f: pytest.approx(getattr(c, f)) for f in FIGURES}


def totals(conn: Connection) -> tuple[Counts, dict[str, Counts]]:
    ov = overview(conn, WINDOW, ASSUME)
    return ov.fleet, ov.dcs


def recorded_rows(conn: Connection) -> tuple[dict[str, Any], list[tuple[str, bool, int]]]:
    """`kvctl status --window`'s figures for the whole fleet: the fleet's row, and each node
    listed as (name, removed, lookups)."""
    nodes = list_nodes(conn)
    rec = recorded(conn, WINDOW, nodes, removed_in(conn, WINDOW, everyone=True))
    doc = rec.as_dict()
    listed = [(n["node"], n["removed"], n["lookups"]) for n in doc["nodes"]]
    return doc["total"], listed


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_a_removed_nodes_samples_stay_in_the_window_totals(db: Engine, rolled_up: bool) -> None:
    fill_history(db)
    if rolled_up:  # the same whether the window reads raw samples or rollups
        rollup_all(db.begin, NOW)
    with db.connect() as conn:
        fleet, dcs = totals(conn)
        links = overview(conn, WINDOW, ASSUME).links
        summary = fleet_summary(conn, WINDOW.start_ms, WINDOW.end_ms)
        status_total, _ = recorded_rows(conn)
    assert fleet.lookups == 190 and fleet.energy_j == pytest.approx(3.6e6)  # fra-a's among them

    with db.begin() as conn:
        remove_node(conn, "fra-a")  # the node with NVML energy and engine metrics
    with db.connect() as conn:
        fleet_after, dcs_after = totals(conn)
        ov = overview(conn, WINDOW, ASSUME)
        summary_after = fleet_summary(conn, WINDOW.start_ms, WINDOW.end_ms)
        status_after, listed = recorded_rows(conn)
        # the fitted window still sees its last scrape (only fra-a was scraped at T + 30 min)
        assert sampled_between(conn, T + 30 * MINUTE_MS, T + 31 * MINUTE_MS)

    assert figures(fleet_after) == figures(fleet)
    assert figures(dcs_after["fra"]) == figures(dcs["fra"])
    assert (dcs_after["fra"].nodes, dcs_after["fra"].removed_nodes) == (1, 1)
    assert [(n.name, n.label) for n in ov.inventory.removed] == [("fra-a", "fra-a (removed)")]
    assert [n.name for n in ov.inventory.nodes] == ["ams-a", "fra-b"]  # live: current only
    # its link probes (fra-a <-> ams-a) still count in the DC pair's figures
    assert ov.links == links and (links[0].probes, links[0].ok_probes) == (3, 2)
    # the benches' SQL summary
    assert (summary_after.total.lookups, summary_after.total.hits) == (190, 100)
    assert summary_after.total.energy_j == pytest.approx(summary.total.energy_j)
    assert [(d.dc, d.nodes, d.lookups) for d in summary_after.dcs] == [
        ("ams", 1, 40),
        ("fra", 1, 150),
    ]
    # `kvctl status --window`: the same totals, the node listed as removed
    assert status_after == status_total | {"nodes": 2}
    assert ("fra-a", True, 100) in listed and ("fra-b", False, 50) in listed


def test_a_removed_dcs_nodes_stay_in_the_fleet_totals(db: Engine) -> None:
    fill_history(db)
    with db.connect() as conn:
        fleet, dcs = totals(conn)
    with db.begin() as conn:
        remove_dc(conn, "fra", with_nodes=True)
    with db.connect() as conn:
        fleet_after, dcs_after = totals(conn)
        summary = fleet_summary(conn, WINDOW.start_ms, WINDOW.end_ms)
        _, listed = recorded_rows(conn)
        rec = recorded(conn, WINDOW, list_nodes(conn), removed_in(conn, WINDOW, everyone=True))

    assert figures(fleet_after) == figures(fleet)
    # the DC's row, marked removed, with its figures: carbon and PUE as the DC had them
    assert list(dcs_after) == ["ams", "fra (removed)"]
    assert figures(dcs_after["fra (removed)"]) == figures(dcs["fra"])
    assert dcs_after["fra (removed)"].carbon_g_saved > 0
    assert [(d.dc, d.lookups) for d in summary.dcs] == [("ams", 40), ("fra (removed)", 150)]
    assert summary.total.lookups == 190
    assert sorted(listed) == [("ams-a", False, 40), ("fra-a", True, 100), ("fra-b", True, 50)]
    assert list(rec.dcs) == ["ams", "fra (removed)"]


def test_a_node_added_again_under_its_name_starts_afresh(db: Engine) -> None:
    ids = fill_history(db)
    with db.begin() as conn:
        remove_node(conn, "fra-a")
        new_id = add_node(conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1")
        insert_rows(
            conn,
            raw_table("cache_sample"),
            [_cache(new_id, "all", T + 35 * MINUTE_MS, lookups=7, lookup_tokens=7, hits=3)],
        )
    assert new_id != ids["fra-a"]
    with db.connect() as conn:
        fleet, dcs = totals(conn)
        _, listed = recorded_rows(conn)
        removed = conn.execute(select(RemovedNode.id, RemovedNode.name)).all()
    assert removed == [(ids["fra-a"], "fra-a")]
    assert (fleet.lookups, fleet.hits) == (190 + 7, 100 + 3)
    assert (dcs["fra"].nodes, dcs["fra"].removed_nodes) == (2, 1)
    # the new node has only its own samples; the old ones stay with the removed record
    assert ("fra-a", False, 7) in listed and ("fra-a", True, 100) in listed


def test_import_prune_keeps_the_pruned_nodes_history(db: Engine) -> None:
    fill_history(db)
    with db.connect() as conn:
        fleet, _ = totals(conn)
    doc = {
        "dcs": [{"name": "ams"}],
        "nodes": [
            {"name": "ams-a", "dc": "ams", "agent_url": "http://127.0.0.1:3", "gpu_model": "L4"}
        ],
    }
    with db.begin() as conn:
        import_fleet(conn, doc, prune=True)
    with db.connect() as conn:
        fleet_after, dcs_after = totals(conn)
        assert [n.name for n in list_nodes(conn)] == ["ams-a"]
    assert list(dcs_after) == ["ams", "fra (removed)"]
    assert figures(fleet_after) == figures(fleet)


def test_removed_nodes_before_the_window_are_not_listed(db: Engine) -> None:
    """A node removed before a window began has no samples in it: not listed, not counted."""
    fill_history(db)
    with db.begin() as conn:
        remove_node(conn, "fra-b")
    later = window_for("1h", NOW + 400 * 24 * 60 * MINUTE_MS)  # nothing recorded in it
    with db.connect() as conn:
        ov = overview(conn, later, ASSUME)
    assert ov.inventory.removed == [] and list(ov.dcs) == ["ams", "fra"]
    assert ov.fleet.removed_nodes == 0


def test_a_database_from_before_removed_nodes_upgrades_in_place(empty_db_url: str) -> None:
    from kvctl.db import migrate
    from kvctl.db.engine import create_db_engine, resolve_url
    from kvctl.db.inventory import add_dc

    engine = create_db_engine(resolve_url(empty_db_url))
    migrate.upgrade(engine, "0011")
    with engine.begin() as conn:
        add_dc(conn, "fra", carbon_g_per_kwh=400.0, pue=1.5)
        add_node(conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1", gpu_model="L4")
    migrate.upgrade(engine)
    with engine.begin() as conn:
        node = remove_node(conn, "fra-a")
    with engine.connect() as conn:
        row = conn.execute(select(RemovedNode)).one()
    engine.dispose()
    assert (row.id, row.name, row.dc, row.gpu_model) == (node.id, "fra-a", "fra", "L4")
    assert (row.dc_carbon_g_per_kwh, row.dc_pue) == (400.0, 1.5)


# --- one rule on every surface (review of the change): late rows, link probes ----------------
#: when fra-a is removed: just after its last scrape of the shared history
REMOVED_MS = T + 31 * MINUTE_MS


def _scraped_after_removal(conn: Connection, node_id: int, ts_ms: int, lookups: int) -> None:
    """A scrape of the removed node, stamped ``ts_ms``, as a collector's kept rows arrive."""
    cache = _cache(node_id, "all", ts_ms, lookups=lookups, lookup_tokens=lookups, hits=1)
    insert_rows(conn, raw_table("cache_sample"), [cache])
    node = {"node_id": node_id, "ts_ms": ts_ms, "up": True, "scrape_seconds": 0.01}
    insert_rows(conn, raw_table("node_sample"), [node])


def _lookups(conn: Connection, win: Window) -> dict[str, object]:
    everyone = removed_in(conn, win, everyone=True)
    return {
        "dashboard": overview(conn, win, ASSUME).fleet.lookups,
        "status --window": recorded(conn, win, list_nodes(conn), everyone).fleet.lookups,
        "bench summary": fleet_summary(conn, win.start_ms, win.end_ms).total.lookups,
        "window fitting sees a scrape": sampled_between(conn, win.start_ms, win.end_ms),
    }


def test_a_removed_nodes_late_rows_count_alike_everywhere(db: Engine) -> None:
    """The dashboard, `kvctl status --window`, the benches' SQL summary and the window fitting
    count a removed node's rows stamped after its removal by one rule (REMOVAL_MARGIN_MS): a
    collector cut off from the database keeps scraping the nodes it last read and writes
    those rows on its return."""
    ids = fill_history(db)
    within = REMOVED_MS + 30 * MINUTE_MS  # a collector cycle late: counted
    past = REMOVED_MS + REMOVAL_MARGIN_MS + 60 * MINUTE_MS  # kept through an outage: not
    with db.begin() as conn:
        remove_node(conn, "fra-a")
        conn.execute(update(RemovedNode).values(removed_ms=REMOVED_MS))
        _scraped_after_removal(conn, ids["fra-a"], within, 70)
        _scraped_after_removal(conn, ids["fra-a"], past, 80)
    near = Window("1h", within - 10 * MINUTE_MS, within + 10 * MINUTE_MS, MINUTE_MS)
    far = Window("1h", past - 10 * MINUTE_MS, past + 10 * MINUTE_MS, MINUTE_MS)
    with db.connect() as conn:
        near_figures, far_figures = _lookups(conn, near), _lookups(conn, far)
    assert near_figures == dict.fromkeys(near_figures, 70) | {"window fitting sees a scrape": True}
    # before: the bench summary 80, and the window fitted to a scrape its pages left out
    assert far_figures == dict.fromkeys(far_figures, 0) | {"window fitting sees a scrape": False}


def test_the_fleet_pages_link_figures_are_the_links_pages(db: Engine) -> None:
    """A removed node whose last probe falls in the window after its last scrape: its probe
    counts on both pages (the fleet page left it out with the node's empty row)."""
    ids = fill_history(db)
    win = Window("1h", T, T + 20 * MINUTE_MS, MINUTE_MS)
    with db.begin() as conn:
        c = add_node(conn, "fra-c", dc="fra", agent_url="http://127.0.0.1:9")
        scrape = {"node_id": c, "ts_ms": T - MINUTE_MS, "up": True, "scrape_seconds": 0.01}
        insert_rows(conn, raw_table("node_sample"), [scrape])
        probe = {"src_node_id": c, "dst_node_id": ids["ams-a"], "ts_ms": T + 3 * MINUTE_MS,
                 "rtt_s": 0.5, "bandwidth_bytes_per_s": 1e9, "loss_ratio": 0.0,
                 "probe_bytes": 1, "ok": True}  # fmt: skip
        insert_rows(conn, raw_table("link_sample"), [probe])
        remove_node(conn, "fra-c")
    with db.connect() as conn:
        fleet_page = overview(conn, win, ASSUME)
        links_page = link_figures(
            conn, win.start_ms, win.end_ms, inventory(conn, removed_since_ms=win.start_ms)
        )
    assert [n.name for n in fleet_page.inventory.removed] == []  # no figures: not listed
    assert [(lk.dc_a, lk.dc_b, lk.probes, lk.ok_probes) for lk in links_page] == [
        ("ams", "fra", 4, 3)
    ]
    assert fleet_page.links == links_page


def test_two_removals_of_one_node_at_once_record_it_once(pg_url: str) -> None:
    """On PostgreSQL two `kvctl fleet rm node` of the same node at once: the second waits on
    the first's lock, then finds the node gone and says so (an InventoryError), where it hit a
    raw unique violation on the removed record (the node recorded twice)."""
    from kvctl.db.migrate import open_db

    engine = open_db(pg_url, auto_upgrade=True)
    try:
        ids = fill_history(engine)
        outcome: list[BaseException | None] = []
        with engine.connect() as first:
            first.begin()
            remove_node(first, "fra-a")  # recorded and deleted, not committed yet

            def second() -> None:
                try:
                    with engine.begin() as conn:
                        remove_node(conn, "fra-a")
                    outcome.append(None)
                except BaseException as exc:  # what the test checks
                    outcome.append(exc)

            thread = threading.Thread(target=second)
            thread.start()
            wait_until(
                "the second removal to wait on the first's lock",
                lambda: _waiting_on_a_lock(engine),
            )
            first.commit()
        thread.join(30)
        assert not thread.is_alive()
        (exc,) = outcome
        assert isinstance(exc, InventoryError), exc
        assert "removed by another command meanwhile" in str(exc)
        with engine.connect() as conn:
            removed = conn.execute(select(RemovedNode.id)).scalars().all()
        assert removed == [ids["fra-a"]]
    finally:
        engine.dispose()


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        waiting = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(waiting)
