"""`kvctl top`'s view model: counters to recent rates and ratios, restarts, down nodes, DC
totals, sorting with missing values last, the filter language, grouping, and the gauges."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvctl.agent_starting import STARTING_DETAIL
from kvctl.db.inventory import NodeInfo
from kvctl.tui.model import (
    GpuPower,
    Level,
    Poll,
    Reading,
    Sampler,
    Thresholds,
    arrange,
    bar,
    matches,
    sort_rows,
    sparkline,
)
from kvctl.tui.sources import gpu_power


def node(name: str, dc: str = "fra", i: int = 1) -> NodeInfo:
    return NodeInfo(i, name, dc, f"http://127.0.0.1:{7000 + i}", "", None)


def stats(
    *,
    lookups: int = 0,
    hits: int = 0,
    reuse: int = 0,
    sharing: int = 0,
    drops: int = 0,
    read: int = 0,
    written: int = 0,
    cpu_evictions: int = 0,
    used: int = 0,
    capacity: int = 1000,
    started_s: float = 100.0,
) -> dict[str, Any]:
    """The shape of an agent's ``/v1/stats`` with one cpu tier."""
    tier = {
        "hits": hits,
        "hit_tokens": 0,
        "reuse_hits": reuse,
        "sharing_hits": sharing,
        "puts": 0,
        "bytes_written": written,
        "bytes_read": read,
        "promotions": 0,
        "demotions": 0,
        "evictions": {"capacity": cpu_evictions, "resize": 0, "flush": 0},
    }
    return {
        "stats": {
            "lookup_chunks": lookups,
            "lookup_tokens": 0,
            "hit_chunks": hits,
            "hit_tokens": 0,
            "reuse_hits": reuse,
            "sharing_hits": sharing,
            "drops": drops,
            "tiers": {"cpu": tier},
        },
        "usage": {
            "cpu": {"used_bytes": used, "capacity_bytes": capacity, "pinned_bytes": 0, "chunks": 3}
        },
        "started_s": started_s,
    }


def poll(ts_s: float, *readings: Reading, rtt: Any = None) -> Poll:
    return Poll(ts_s, list(readings), rtt, 0.01)


def test_rates_and_ratios_over_the_window() -> None:
    a = node("a")
    s = Sampler(window_polls=2)
    first = s.update(poll(1000.0, Reading(a, stats(lookups=50, hits=10, used=500))))
    row = first.rows[0]
    # the first poll is a baseline: counts that happened before it are not attributed
    assert row.up and row.recent.seconds == 0 and row.recent.hit_ratio is None
    assert row.lifetime_hit_ratio == pytest.approx(0.2)
    assert row.tiers["cpu"].occupancy_ratio == pytest.approx(0.5)
    assert row.uptime_s == pytest.approx(900.0)

    s.update(
        poll(
            1002.0,
            Reading(
                a,
                stats(lookups=150, hits=70, reuse=40, sharing=20, drops=4, read=3000, written=1000),
            ),
        )
    )
    view = s.update(
        poll(
            1004.0,
            Reading(
                a,
                stats(
                    lookups=250,
                    hits=90,
                    reuse=50,
                    sharing=30,
                    drops=10,
                    read=5000,
                    written=3000,
                    cpu_evictions=6,
                ),
            ),
        )
    )
    r = view.rows[0].recent
    # two polls of 2 s: 200 lookups, 80 hits, 10 drops, 5000 read + 3000 written
    assert r.seconds == pytest.approx(4.0)
    assert r.hit_ratio == pytest.approx(80 / 200)
    assert r.reuse_share_of_hits == pytest.approx(50 / 80)
    assert r.sharing_share_of_hits == pytest.approx(30 / 80)
    assert r.evictions_per_s == pytest.approx(10 / 4)
    assert r.io_bytes_per_s == pytest.approx(8000 / 4)
    assert r.lookups_per_s == pytest.approx(50.0)
    assert view.rows[0].tiers["cpu"].evictions_per_s == pytest.approx(6 / 4)
    # per-poll hit ratios: none for the baseline, then 60/100 and 20/100
    assert view.rows[0].hit_history == [None, pytest.approx(0.6), pytest.approx(0.2)]

    # the window slides: a third step drops the first
    view = s.update(poll(1006.0, Reading(a, stats(lookups=250, hits=90, started_s=100.0))))
    assert view.rows[0].recent.lookups == 100 and view.rows[0].recent.hits == 20
    assert view.rows[0].hit_history[-1] is None  # no lookups in the last poll


def test_an_agent_restart_counts_from_zero_not_negative() -> None:
    a = node("a")
    s = Sampler()
    s.update(poll(10.0, Reading(a, stats(lookups=1000, hits=900, started_s=1.0))))
    view = s.update(poll(12.0, Reading(a, stats(lookups=40, hits=10, started_s=11.0))))
    r = view.rows[0].recent
    assert r.lookups == 40 and r.hits == 10
    assert r.hit_ratio == pytest.approx(0.25)


def test_a_gap_restarts_the_window_and_dc_rates_are_summed_node_rates() -> None:
    a, b = node("a", i=1), node("b", i=2)
    s = Sampler(max_gap_s=3.0)
    s.update(poll(0.0, Reading(a, stats()), Reading(b, stats())))
    s.update(poll(2.0, Reading(a, stats(drops=20)), Reading(b, stats(drops=4))))
    s.update(poll(4.0, Reading(a, stats(drops=40)), Reading(b, None, "timed out")))
    # b is back: its 4 s step across the gap restarts its window instead of being averaged in
    view = s.update(poll(6.0, Reading(a, stats(drops=60)), Reading(b, stats(drops=100))))
    assert view.row("a").recent.seconds == 6.0  # type: ignore[union-attr]
    assert view.row("b").recent.seconds == 0.0  # type: ignore[union-attr]
    view = s.update(poll(8.0, Reading(a, stats(drops=70)), Reading(b, stats(drops=106))))
    ra, rb = view.row("a").recent, view.row("b").recent  # type: ignore[union-attr]
    assert ra.evictions_per_s == pytest.approx(70 / 8)
    assert rb.evictions_per_s == pytest.approx(6 / 2)
    # the DC's rate is the sum of its nodes' rates, not its counts over the longest window
    assert view.total.evictions_per_s == pytest.approx(70 / 8 + 6 / 2)


def test_an_answer_that_is_not_stats_marks_only_that_node_down() -> None:
    a, b = node("a", i=1), node("b", i=2)
    view = Sampler().update(poll(0.0, Reading(a, {"hello": "html"}), Reading(b, stats())))
    assert not view.row("a").up and "not an agent's stats" in (view.row("a").error or "")  # type: ignore[union-attr]
    assert view.row("b").up  # type: ignore[union-attr]


def test_a_down_node_stays_with_its_error_and_how_long() -> None:
    a, b = node("a", i=1), node("b", i=2)
    s = Sampler()
    s.update(poll(10.0, Reading(a, stats()), Reading(b, stats())))
    s.update(poll(12.0, Reading(a, stats()), Reading(b, None, "connection refused")))
    view = s.update(poll(15.0, Reading(a, stats()), Reading(b, None, "connection refused")))
    down = view.row("b")
    assert down is not None and not down.up
    # down since this view last saw it answer (10.0), not since the first poll that found it down
    assert down.error == "connection refused" and down.down_for_s == pytest.approx(5.0)
    assert down.last_seen_ms == 10_000
    assert view.total.nodes == 2 and view.total.up == 1
    # back up: the down clock resets
    view = s.update(poll(17.0, Reading(a, stats()), Reading(b, stats())))
    assert view.row("b").up and view.row("b").down_for_s is None  # type: ignore[union-attr]


def test_dc_totals_fold_only_nodes_that_answered() -> None:
    s = Sampler()
    a, b, c = node("a", "fra", 1), node("b", "fra", 2), node("c", "ams", 3)
    gpu = GpuPower(300.0, 1)
    s.update(
        poll(
            0.0,
            Reading(a, stats(used=100), gpu=gpu),
            Reading(b, stats(used=300)),
            Reading(c, None, "down"),
        )
    )
    view = s.update(
        poll(
            2.0,
            Reading(a, stats(lookups=10, hits=5, used=100)),
            Reading(b, stats(lookups=30, hits=5, used=300)),
            Reading(c, None, "down"),
        )
    )
    fra = next(d for d in view.dcs if d.dc == "fra")
    ams = next(d for d in view.dcs if d.dc == "ams")
    assert (fra.nodes, fra.up, ams.nodes, ams.up) == (2, 2, 1, 0)
    assert fra.recent.hit_ratio == pytest.approx(10 / 40)
    assert fra.tiers["cpu"].occupancy_ratio == pytest.approx(400 / 2000)
    # a's GPU reading is kept between the polls that ask for GPUs
    assert fra.power_w == pytest.approx(300.0) and ams.power_w is None
    assert view.total.recent.lookups == 40


def test_rtt_is_per_other_dc_from_the_nodes_dc() -> None:
    rtt = {
        ("fra", "ams"): 0.003,
        ("ams", "fra"): 0.003,
        ("fra", "fra"): 0.0001,
        ("fra", "lon"): None,
    }
    view = Sampler().update(poll(0.0, Reading(node("a", "fra"), stats()), rtt=rtt))
    row = view.rows[0]
    assert row.rtt_s == {"ams": 0.003, "lon": None} and row.max_rtt_s == 0.003
    assert view.has_links
    assert not Sampler().update(poll(0.0, Reading(node("a"), stats()))).has_links


def _view(*rows: tuple[str, str, float | None, bool]):  # type: ignore[no-untyped-def]
    """A view whose nodes have the given (name, dc, hit ratio, up)."""
    s = Sampler()
    readings0, readings1 = [], []
    for i, (name, dc, hit, up) in enumerate(rows):
        n = node(name, dc, i + 1)
        readings0.append(Reading(n, stats()) if up else Reading(n, None, "down"))
        lookups = 0 if hit is None else 100
        st = stats(lookups=lookups, hits=round((hit or 0) * lookups))
        readings1.append(Reading(n, st) if up else Reading(n, None, "down"))
    s.update(poll(0.0, *readings0))
    return s.update(poll(2.0, *readings1))


def test_sorting_puts_missing_values_last_in_both_directions() -> None:
    view = _view(
        ("a", "fra", 0.5, True),
        ("b", "ams", None, True),
        ("c", "fra", 0.9, True),
        ("d", "ams", 0.1, False),
        ("e", "lon", 0.1, True),
    )
    up = [r.name for r in sort_rows(view.rows, "hit")]
    down = [r.name for r in sort_rows(view.rows, "hit", reverse=True)]
    assert up == ["e", "a", "c", "b", "d"]
    assert down == ["c", "a", "e", "b", "d"]
    assert [r.name for r in sort_rows(view.rows, "dc")] == ["b", "d", "a", "c", "e"]
    assert [r.name for r in sort_rows(view.rows, "state")][:1] == ["d"]
    assert [r.name for r in sort_rows(view.rows, "tier:cpu")][-1] == "d"
    with pytest.raises(ValueError, match="cannot sort"):
        sort_rows(view.rows, "nope")


def test_filter_words_fields_states_and_negation() -> None:
    view = _view(("gpu-a1", "fra", 0.5, True), ("gpu-b1", "ams", 0.5, False))
    a, b = view.rows
    assert matches(a, "fra") and not matches(b, "fra")
    assert matches(a, "gpu a1") and matches(a, "GPU-A1") and not matches(a, "gpu b1")
    assert matches(b, "down") and not matches(a, "down") and matches(a, "up")
    assert matches(a, "dc:fra") and not matches(a, "dc:fr")
    assert matches(a, "node:gpu-a1") and not matches(b, "node:gpu-a1")
    assert matches(a, "!ams") and not matches(b, "!ams")
    assert matches(a, "") and matches(a, "!")


def test_arrange_filters_sorts_and_groups_with_dc_headers() -> None:
    view = _view(
        ("a", "fra", 0.5, True),
        ("b", "ams", 0.2, True),
        ("c", "fra", 0.9, True),
        ("d", "ams", 0.1, False),
    )
    flat = arrange(view, sort="hit", reverse=True)
    assert [ln.row.name for ln in flat if ln.row] == ["c", "a", "b", "d"]
    grouped = arrange(view, sort="hit", reverse=True, group=True)
    shape = [(ln.dc.dc, ln.dc.up, ln.dc.nodes) if ln.dc else ln.row.name for ln in grouped]  # type: ignore[union-attr]
    assert shape == [("ams", 1, 2), "b", "d", ("fra", 2, 2), "c", "a"]
    filtered = arrange(view, query="fra", group=True)
    assert [(ln.dc.dc, ln.dc.nodes) if ln.dc else ln.row.name for ln in filtered] == [  # type: ignore[union-attr]
        ("fra", 2),
        "a",
        "c",
    ]
    assert arrange(view, query="nothing-matches") == []


def test_thresholds_levels() -> None:
    t = Thresholds()
    assert t.occupancy(None) is Level.NONE and t.occupancy(0.5) is Level.NONE
    assert t.occupancy(0.85) is Level.WARN and t.occupancy(0.95) is Level.CRIT
    assert t.hit(0.05) is Level.WARN and t.hit(0.3) is Level.NONE and t.hit(0.5) is Level.GOOD
    assert t.rtt(0.0005) is Level.GOOD and t.rtt(0.003) is Level.WARN
    assert t.rtt(0.01) is Level.CRIT and t.rtt(None) is Level.NONE


def test_gauges() -> None:
    assert bar(0.56, 8) == "████▌░░░"
    assert bar(0.0, 4) == "░░░░" and bar(1.0, 4) == "████" and bar(None, 3) == "   "
    assert bar(1.7, 2) == "██"  # clamped
    assert sparkline([0.0, 0.5, 1.0, None], 6) == "  ▁▅█ "
    assert sparkline([1.0] * 20, 5) == "█████"


def test_gpu_power_sums_gpus_or_says_why_not() -> None:
    off = gpu_power({"nvml": {"available": False, "error": "NVML Shared Library Not Found"}})
    assert off.power_w is None and "NVML Shared Library Not Found" in (off.note or "")
    two = gpu_power({"nvml": {"available": True}, "gpus": [{"power_w": 300.5}, {"power_w": 120.0}]})
    assert two == GpuPower(420.5, 2)
    unread = gpu_power({"nvml": {"available": True}, "gpus": [{"power_w": None}]})
    assert unread.power_w is None and unread.gpus == 1 and unread.note == "no power reading"


def test_view_as_dict_is_json_ready() -> None:
    import json

    view = _view(("a", "fra", 0.5, True), ("b", "ams", None, False))
    data = json.loads(json.dumps(view.as_dict()))
    assert [n["node"] for n in data["nodes"]] == ["a", "b"]
    assert data["nodes"][0]["hit_ratio"] == pytest.approx(0.5)
    assert data["nodes"][1]["up"] is False and data["total"]["up"] == 1


def test_view_json_stamps_ts_ms_like_status_and_collect() -> None:
    view = Sampler().update(poll(1_790_000_000.1234, Reading(node("a"), stats())))
    data = view.as_dict()
    assert "ts_s" not in data
    assert data["ts_ms"] == 1_790_000_000_123 and isinstance(data["ts_ms"], int)


def test_rtt_says_its_basis_in_the_row_json_and_cell() -> None:
    from kvctl.tui.cells import Cells, Palette
    from kvctl.tui.sources import rtt_basis_word

    rtt = {("fra", "ams"): 0.003, ("ams", "fra"): 0.003, ("fra", "lon"): 0.001}
    rtt |= {("lon", "fra"): 0.001}
    basis = {("fra", "ams"): "emulated", ("ams", "fra"): "emulated", ("fra", "lon"): "measured"}
    p = Poll(0.0, [Reading(node("a", "fra"), stats())], rtt, 0.01, rtt_basis=basis)
    row = Sampler().update(p).rows[0]
    assert row.rtt_basis == {"ams": "emulated", "lon": "measured"}
    assert row.worst_link_basis == "emulated"
    assert row.as_dict()["rtt_basis"] == {"ams": "emulated", "lon": "measured"}
    cells = Cells(Palette(), Thresholds())
    assert cells.rtt(row, True).plain == "ams 3.0ms emu"
    row.rtt_basis["ams"] = "measured"
    assert cells.rtt(row, True).plain == "ams 3.0ms"
    # a link's probes by basis, in one word
    assert rtt_basis_word({"measured": 3}) == "measured"
    assert rtt_basis_word({"emulated": 2}) == "emulated"
    assert rtt_basis_word({"emulated": 2, "measured": 1}) == "mixed"


def test_down_for_counts_from_the_collectors_last_scrape() -> None:
    a = node("a")
    s = Sampler()
    # top opens on a node the collectors last reached 47 s ago
    view = s.update(poll(100.0, Reading(a, None, "refused", last_seen_s=53.0)))
    row = view.row("a")
    assert row is not None and row.down_for_s == pytest.approx(47.0)
    assert row.last_seen_ms == 53_000 and row.as_dict()["last_seen_ms"] == 53_000
    view = s.update(poll(102.0, Reading(a, None, "refused", last_seen_s=53.0)))
    assert view.rows[0].down_for_s == pytest.approx(49.0)
    # never reached by anyone: since the first poll that found it down, said as a lower bound
    from kvctl.tui.cells import Cells, Palette

    s = Sampler()
    s.update(poll(100.0, Reading(a, None, "refused")))
    row = s.update(poll(103.0, Reading(a, None, "refused"))).rows[0]
    assert row.down_for_s == pytest.approx(3.0) and row.last_seen_ms is None
    assert Cells(Palette(), Thresholds()).state(row).plain.startswith("DOWN ≥")


def test_sorting_by_state_puts_the_nodes_most_in_need_of_a_look_first() -> None:
    # before: by up alone, then name, a starting or token-refusing node sorted among the down
    # ones (the names here are in the opposite order to the states')
    names = ("a-up", "b-starting", "c-refused", "d-silent", "e-down")
    nodes = {n: node(n, "fra", i + 1) for i, n in enumerate(names)}
    view = Sampler().update(
        poll(
            0.0,
            Reading(nodes["a-up"], stats()),
            Reading(nodes["b-starting"], None, "starting", starting=True),
            Reading(nodes["c-refused"], None, "401", auth_refused=True),
            Reading(nodes["d-silent"], None, "no answer", silent=True),
            Reading(nodes["e-down"], None, "refused"),
        )
    )
    rows = sort_rows(view.rows, "state")
    assert [r.name for r in rows] == ["e-down", "d-silent", "c-refused", "b-starting", "a-up"]
    assert [r.state for r in rows] == ["down", "not answering", "token refused", "starting", "up"]


def test_a_starting_node_is_up_without_figures_and_not_summed() -> None:
    """An agent opening its tiers answers "starting": up (a restart would only start it over),
    its figures N/A, counted up in its DC as one refusing the token is, and never taken for a
    node with figures in the DC's sums."""
    from kvctl.tui.cells import Cells, Palette

    s_fra, a, s_ams = node("s1", "fra", 1), node("a", "fra", 2), node("s2", "ams", 3)
    said = f"{STARTING_DETAIL} ({s_fra.agent_url})"
    nan_lookups = stats(lookups=10, hits=5)
    nan_lookups["stats"]["lookup_chunks"] = math.nan  # a's hit counts unknown this poll
    s = Sampler()
    s.update(poll(0.0, Reading(s_fra, None, said, starting=True), Reading(a, stats())))
    view = s.update(
        poll(
            2.0,
            Reading(s_fra, None, said, starting=True),
            Reading(a, nan_lookups),
            Reading(s_ams, None, said, starting=True),
        )
    )
    row = view.row("s1")
    assert row is not None and row.starting and not row.auth_refused and not row.up
    assert (row.state, row.answered, row.error) == ("starting", True, said)
    assert row.down_for_s is None and row.last_seen_ms == 2000
    cell = Cells(Palette(), Thresholds()).state(row)
    assert cell.plain == "up, starting" and cell.style == Palette().style(Level.WARN)
    assert matches(row, "up") and matches(row, "starting") and not matches(row, "down")
    data = view.as_dict()
    nodes = {n["node"]: n for n in data["nodes"]}
    shown = nodes["s1"]
    assert (shown["up"], shown["starting"], shown["auth_refused"]) == (True, True, False)
    assert shown["state"] == "starting" and shown["lookups"] is None
    assert (nodes["a"]["starting"], nodes["a"]["state"]) == (False, "up")
    dcs = {d["dc"]: d for d in data["dcs"]}
    # a DC whose only node is starting has nothing read: unknown, not 0 lookups
    assert (dcs["ams"]["up"], dcs["ams"]["starting"], dcs["ams"]["lookups"]) == (1, 1, None)
    # the starting node (first in fra) does not make a the second node with figures: a's
    # unknown hit counts stay unknown for fra, not 0 lookups
    assert (dcs["fra"]["up"], dcs["fra"]["starting"]) == (2, 1)
    assert dcs["fra"]["lookups"] is None and dcs["fra"]["hit_ratio"] is None
    total = data["total"]
    assert (total["up"], total["starting"], total["auth_refused"]) == (3, 2, 0)
    # open: up with its figures, no longer starting
    row = s.update(poll(4.0, Reading(s_fra, stats(lookups=4, hits=2)))).rows[0]
    assert (row.up, row.starting, row.state) == (True, False, "up")


def test_down_nodes_counts_are_null_and_dc_lookup_rates_are_summed() -> None:
    a, b, c = node("a", "fra", 1), node("b", "fra", 2), node("c", "ams", 3)
    s = Sampler()
    s.update(poll(0.0, Reading(a, stats()), Reading(b, stats()), Reading(c, None, "down")))
    view = s.update(
        poll(
            2.0,
            Reading(a, stats(lookups=10, hits=5)),
            Reading(b, stats(lookups=30, hits=5)),
            Reading(c, None, "down"),
        )
    )
    data = view.as_dict()
    nodes = {n["node"]: n for n in data["nodes"]}
    assert nodes["a"]["lookups"] == 10
    # not read: unknown, not "0 lookups, 0 hits"
    assert nodes["c"]["lookups"] is None and nodes["c"]["hits"] is None
    assert nodes["c"]["lookups_per_s"] is None
    dcs = {d["dc"]: d for d in data["dcs"]}
    assert dcs["fra"]["lookups_per_s"] == pytest.approx(10 / 2 + 30 / 2)
    assert data["total"]["lookups_per_s"] == pytest.approx(20.0)
    assert dcs["ams"]["lookups"] is None and dcs["ams"]["lookups_per_s"] is None


def test_node_events_are_stamped_in_utc_whatever_the_local_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    from kvctl.tui.node_screen import event_line

    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local time would read 05:30:00
    time.tzset()
    try:
        line = event_line({"time_s": 1_790_035_200.0, "type": "store", "tier": "cpu"})
    finally:
        monkeypatch.undo()
        time.tzset()
    assert line.startswith("00:00:00 store")


def test_the_node_pages_reads_line_says_rejected_read_counts_were_rejected() -> None:
    """An agent older than the read counts reports none ("not reported"); one whose counts
    cannot be true reported them: the line says they were rejected, not that none came."""
    from kvctl.tui.node_screen import since_start_line

    a = node("a")
    older = Sampler().update(poll(1000.0, Reading(a, stats(lookups=4, hits=2)))).rows[0]
    assert "reads gone N/A (not reported)" in since_start_line(older)
    bad = {**stats(lookups=4, hits=2), "dataplane": {"read_chunks": 2, "read_missing_chunks": 6}}
    row = Sampler().update(poll(1000.0, Reading(a, bad))).rows[0]
    assert "dataplane.read_missing_chunks" in row.rejected
    line = since_start_line(row)
    assert "reads gone N/A (rejected)" in line and "not reported" not in line, line
