"""The dashboard's figures on a real SQLite and PostgreSQL with a known history: every hit
ratio, energy and carbon figure equals the one worked out by hand here."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine

from kvctl.db.analytics.inventory import inventory
from kvctl.db.analytics.links import break_even, link_series
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.series import time_series
from kvctl.db.analytics.windows import bucket_starts, window_for
from kvctl.db.models import raw_table
from kvctl.db.rollup import HOUR_MS, MINUTE_MS, rollup_all
from tests.functional.dashboard_history import (
    A100_RATE,
    ASSUME,
    H100_RATE,
    L4_RATE,
    NOW,
    T,
    fill_history,
)


@pytest.fixture
def history(db: Engine) -> dict[str, int]:
    return fill_history(db)


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_fleet_overview_figures_are_exact(
    db: Engine, history: dict[str, int], rolled_up: bool
) -> None:
    if rolled_up:  # the same figures whether read from raw samples or from rollups
        rollup_all(db.begin, NOW)
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
    fra, ams, fleet = ov.dcs["fra"], ov.dcs["ams"], ov.fleet

    assert (fra.lookups, fra.hits, fra.reuse_hits, fra.sharing_hits) == (150, 70, 50, 20)
    assert fra.hit_ratio == pytest.approx(70 / 150)
    assert fra.reuse_hit_ratio == pytest.approx(50 / 150)
    assert fra.sharing_hit_ratio == pytest.approx(20 / 150)
    assert fleet.hit_ratio == pytest.approx(100 / 190)
    assert fleet.sharing_hit_ratio == pytest.approx(50 / 190)
    assert fleet.token_hit_ratio == pytest.approx(25600 / 48640)
    assert fra.tier_hits == {"cpu": 55, "disk": 15}
    assert fra.tier_hit_ratio("cpu") == pytest.approx(55 / 150)
    assert fleet.tier_hit_ratio("cpu") == pytest.approx(85 / 190)
    assert fleet.tiers == ["cpu", "disk"]
    assert fra.evictions == 7 and fleet.evictions == 8
    # occupancy: each node's mean over the window, summed over the DC's nodes
    assert fra.used_bytes["cpu"] == pytest.approx(500 + 900)
    assert fra.used_bytes["disk"] == pytest.approx(200)
    assert fra.capacity_bytes == {"cpu": pytest.approx(2000), "disk": pytest.approx(4000)}
    assert fra.up_ratio == pytest.approx(4 / 5)

    # modeled savings: fra-a runs H100s, fra-b names no GPU (the default a100), ams-a L4s
    fra_a_s = 15360 / H100_RATE
    fra_b_s = 2560 / A100_RATE
    ams_s = 7680 / L4_RATE
    assert fra.gpu_seconds_saved == pytest.approx(fra_a_s + fra_b_s)
    assert fra.it_joules_saved == pytest.approx(fra_a_s * 700 + fra_b_s * 400)
    assert fra.facility_joules_saved == pytest.approx((fra_a_s * 700 + fra_b_s * 400) * 1.5)
    fra_kwh = (fra_a_s * 700 + fra_b_s * 400) * 1.5 / 3.6e6
    assert fra.facility_kwh_saved == pytest.approx(fra_kwh)
    assert fra.carbon_g_saved == pytest.approx(fra_kwh * 400)
    assert fra.default_gpu_nodes == 1
    # ams: no PUE (IT energy only), no grid intensity (no carbon)
    assert ams.facility_joules_saved == pytest.approx(ams_s * 72)
    assert ams.carbon_g_saved == 0 and ams.carbon_unknown_nodes == 1
    assert ams.pue_unknown_nodes == 1
    assert fleet.carbon_g_saved == pytest.approx(fra_kwh * 400)
    assert fleet.gpu_seconds_saved == pytest.approx(fra_a_s + fra_b_s + ams_s)

    # measured energy (only fra-a has NVML), tokens per joule, TTFT
    assert fleet.energy_j == pytest.approx(3.6e6) and fleet.energy_kwh == pytest.approx(1.0)
    assert fleet.energy_nodes == 1
    assert fra.power_w == pytest.approx(600.0)
    assert fleet.tokens_per_joule == pytest.approx(12_000 / 3.6e6)
    assert fleet.ttft_mean_s == pytest.approx(0.2)
    assert fleet.ttft_without_cache_mean_s == pytest.approx((2.0 + 4000 / H100_RATE) / 10)
    assert ams.ttft_mean_s is None and ams.tokens_per_joule is None
    assert ov.nvml_nodes is None  # energy was measured: no need to explain its absence

    (link,) = ov.links
    assert (link.dc_a, link.dc_b, link.distance_km) == ("ams", "fra", 100.0)
    assert (link.probes, link.ok_probes) == (3, 2)
    assert link.rtt_mean_s == pytest.approx(0.003) and link.rtt_max_s == pytest.approx(0.004)
    assert link.bandwidth_bytes_per_s == pytest.approx(2e9)
    assert link.fiber_rtt_s == pytest.approx(1e-3)


def test_break_even_uses_measured_rtt_and_bandwidth(db: Engine, history: dict[str, int]) -> None:
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
    inputs = ASSUME.inputs_for("h100")
    (be,) = break_even(ov.links, inputs, chunk_tokens=256)
    chunk_bytes = 256 * 131_072
    assert be.chunk_bytes == chunk_bytes
    assert be.recompute_s == pytest.approx(256 / H100_RATE)
    assert be.fetch_s == pytest.approx(0.003 + chunk_bytes / 2e9)
    assert be.worth_fetching is (0.003 + chunk_bytes / 2e9 < 256 / H100_RATE)
    slack_s = 256 / H100_RATE - chunk_bytes / 2e9
    assert be.fetch_never_wins is (slack_s <= 0)
    assert be.max_rtt_s == (None if slack_s <= 0 else pytest.approx(slack_s))


def test_no_break_even_rtt_where_bandwidth_alone_loses() -> None:
    """A link whose bandwidth alone takes longer than recompute has no break-even RTT (None,
    shown as "none"), not 0 s; one with time to spare has its slack; unmeasured: None."""
    from dashboard.pages import _link_row
    from kvctl.db.analytics.links import LinkFigures

    def link(bw: float | None) -> LinkFigures:
        return LinkFigures("ams", "fra", 100.0, 3, 3, 0.001, 0.002, bw, 0.0)

    inputs = ASSUME.inputs_for("h100")
    chunk_bytes = 256 * 131_072
    recompute_s = 256 / H100_RATE
    slow, fast, unknown = break_even(
        [link(chunk_bytes / recompute_s / 2), link(chunk_bytes / recompute_s * 4), link(None)],
        inputs,
        chunk_tokens=256,
    )
    assert slow.fetch_never_wins and slow.max_rtt_s is None
    assert _link_row(slow, {})["break-even RTT"] == "none"
    assert not fast.fetch_never_wins
    assert fast.max_rtt_s == pytest.approx(recompute_s * 0.75)
    assert _link_row(fast, {})["break-even RTT"] != "none"
    assert not unknown.fetch_never_wins and unknown.max_rtt_s is None
    assert _link_row(unknown, {})["break-even RTT"] == "N/A"


def test_empty_window_has_no_made_up_figures(db: Engine, history: dict[str, int]) -> None:
    with db.connect() as conn:
        ov = overview(conn, window_for("15m", NOW - 2 * HOUR_MS - 30 * MINUTE_MS), ASSUME)
    assert ov.fleet.lookups == 0
    assert ov.fleet.hit_ratio is None and ov.fleet.tokens_per_joule is None
    assert ov.fleet.energy_kwh is None and ov.fleet.ttft_mean_s is None
    assert ov.links[0].rtt_mean_s is None and ov.links[0].probes == 0


def test_nvml_absence_is_explained(db: Engine, history: dict[str, int]) -> None:
    with db.begin() as conn:
        conn.execute(raw_table("power_sample").delete())
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
    assert ov.fleet.energy_nodes == 0 and ov.nvml_nodes == 0


def test_dc_time_series_buckets(db: Engine, history: dict[str, int]) -> None:
    win = window_for("1h", NOW)
    with db.connect() as conn:
        s = time_series(conn, win, [history["fra-a"], history["fra-b"]])
    assert len(s.bucket_ms) == 60 and s.bucket_ms[0] == win.start_ms
    i, j = s.bucket_ms.index(T), s.bucket_ms.index(T + 10 * MINUTE_MS)
    assert (s.lookups[i], s.hits[i], s.lookups[j], s.hits[j]) == (110, 50, 40, 20)
    assert s.hit_counts()[i].hit_ratio == pytest.approx(50 / 110)
    assert s.hit_counts()[j].sharing_hit_ratio == pytest.approx(10 / 40)
    assert s.used_bytes["cpu"][i] == pytest.approx(400 + 900)
    assert s.used_bytes["cpu"][j] == pytest.approx(600)
    assert s.used_bytes["cpu"][i + 1] is None  # no sample: no reading, not zero
    assert s.evictions[i] == 5 and sum(s.evictions) == 7
    assert s.power_w[i] == pytest.approx(500.0) and s.energy_j[j] == pytest.approx(1.8e6)


def test_link_series_puts_each_probe_in_its_bucket(db: Engine, history: dict[str, int]) -> None:
    win = window_for("1h", NOW)
    with db.connect() as conn:
        ls = link_series(conn, win, inventory(conn))
    assert ls.bucket_ms == bucket_starts(win)
    (rtt,) = ls.rtt_s.values()
    assert list(ls.rtt_s) == [("ams", "fra")]  # either way round, one pair
    i = ls.bucket_ms.index(T)
    assert rtt[i] == pytest.approx(0.002) and rtt[i + 1] == pytest.approx(0.004)
    # the failed probe's bucket and every other: no RTT, not zero
    assert rtt[i + 2] is None and sum(v is not None for v in rtt) == 2
