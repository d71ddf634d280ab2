"""Plotly figures of the pages, built from the query dataclasses (no database access here)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from kvctl.db.analytics.counts import Counts
from kvctl.db.analytics.inventory import Inventory
from kvctl.db.analytics.links import BreakEven, LinkFigures
from kvctl.db.analytics.routing import NodeRouting, PulledSeries
from kvctl.db.analytics.series import TimeSeries
from kvctl.db.analytics.windows import Window

TIER_COLOURS = {
    "gpu": "#6a3d9a",
    "cpu": "#1f78b4",
    "disk": "#33a02c",
    "remote": "#ff7f00",
    "peer": "#e31a1c",
}
REUSE, SHARING = "#1f78b4", "#ff7f00"


def _layout(fig: go.Figure, *, y_title: str = "", percent: bool = False) -> go.Figure:
    fig.update_layout(
        margin={"l": 50, "r": 20, "t": 30, "b": 40},
        height=320,
        legend={"orientation": "h", "y": -0.2},
        template="plotly_white",
    )
    if y_title:
        fig.update_yaxes(title_text=y_title)
    if percent:
        fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return fig


def _times(bucket_ms: Sequence[int]) -> list[datetime]:
    return [datetime.fromtimestamp(b / 1000, UTC) for b in bucket_ms]


def _over_window(fig: go.Figure, win: Window | None) -> go.Figure:
    """The time axis spans the window, so where the data sits in it shows (not stretched to
    the data)."""
    if win is not None:
        fig.update_xaxes(range=_times([win.start_ms, win.end_ms]))
    return fig


def _kept(
    bucket_ms: Sequence[int], values: Sequence[Any], keep: Sequence[bool] | None = None
) -> tuple[list[datetime], list[Any]]:
    """The buckets that have a value (and are in ``keep``): a bucket nothing was recorded in
    is left out, not drawn as zero."""
    pairs = [
        (b, v)
        for i, (b, v) in enumerate(zip(bucket_ms, values, strict=True))
        if v is not None and (keep is None or keep[i])
    ]
    return _times([b for b, _ in pairs]), [v for _, v in pairs]


def hit_ratio_by_tier(dcs: Mapping[str, Counts], fleet: Counts) -> go.Figure:
    """Hits per lookup, stacked by the tier that served them, per DC and for the fleet."""
    names = [*dcs, "fleet"]
    counts = [*dcs.values(), fleet]
    fig = go.Figure()
    for tier in fleet.tiers:
        fig.add_bar(
            name=tier,
            x=names,
            y=[c.tier_hit_ratio(tier) for c in counts],
            marker_color=TIER_COLOURS.get(tier),
        )
    fig.update_layout(barmode="stack")
    return _layout(fig, y_title="hits per lookup", percent=True)


def reuse_vs_sharing(dcs: Mapping[str, Counts], fleet: Counts) -> go.Figure:
    """Hits per lookup split into reuse (same tenant) and sharing (another tenant's chunks)."""
    names = [*dcs, "fleet"]
    counts = [*dcs.values(), fleet]
    fig = go.Figure()
    reuse = [c.reuse_hit_ratio for c in counts]
    sharing = [c.sharing_hit_ratio for c in counts]
    # named as in kvctl/ratios.py: per lookup, not the share of hits `kvctl status` shows
    fig.add_bar(name="reuse hit ratio", x=names, y=reuse, marker_color=REUSE)
    fig.add_bar(name="sharing hit ratio", x=names, y=sharing, marker_color=SHARING)
    fig.update_layout(barmode="stack")
    return _layout(fig, y_title="hits per lookup", percent=True)


def reuse_vs_sharing_by_tier(c: Counts) -> go.Figure:
    """Per tier, the hits it served per lookup of the whole, stacked into reuse and sharing:
    a bar's height is the tier's hit ratio, and the bars add up to the whole's."""
    tiers = c.tiers
    split = [c.tier_hit_counts(t) for t in tiers]
    fig = go.Figure()
    fig.add_bar(
        name="reuse hit ratio", x=tiers, y=[t.reuse_hit_ratio for t in split], marker_color=REUSE
    )
    fig.add_bar(
        name="sharing hit ratio",
        x=tiers,
        y=[t.sharing_hit_ratio for t in split],
        marker_color=SHARING,
    )
    fig.update_layout(barmode="stack")
    return _layout(fig, y_title="hits per lookup", percent=True)


def dc_schematic(
    inv: Inventory,
    links: Sequence[LinkFigures],
    dcs: Sequence[str],
    rtt_labels: Mapping[tuple[str, str], str] | None = None,
) -> go.Figure:
    """DCs on a circle (a schematic, not a map: the inventory has place names, not
    coordinates), links coloured by probed mean RTT, each labelled by its basis (``rtt_labels``
    per DC pair: "measured" where not given); unprobed links dashed grey."""
    shown = [d.name for d in inv.dcs if d.name in dcs]
    n = max(len(shown), 1)
    # first DC on the left, the rest clockwise around the circle
    pos = {
        name: (math.cos(math.pi - 2 * math.pi * i / n), math.sin(math.pi - 2 * math.pi * i / n))
        for i, name in enumerate(shown)
    }
    fig = go.Figure()
    # a mean over probe rows holding Infinity or NaN (written by hand, or by an older
    # collector) is no RTT: it would make every colour NaN and the whole page fail
    measured = [
        lk.rtt_mean_s for lk in links if lk.rtt_mean_s is not None and math.isfinite(lk.rtt_mean_s)
    ]
    hi = max(measured, default=0.0) or 1.0
    for lk in links:
        if lk.dc_a not in pos or lk.dc_b not in pos or lk.dc_a == lk.dc_b:
            continue
        (xa, ya), (xb, yb) = pos[lk.dc_a], pos[lk.dc_b]
        km = "?" if lk.distance_km is None else f"{lk.distance_km:g} km"
        if lk.rtt_mean_s is None:
            line = {"color": "#aaaaaa", "dash": "dash", "width": 2}
            label = f"{lk.dc_a}↔{lk.dc_b}: {km}, not probed in this window"
        elif not math.isfinite(lk.rtt_mean_s):
            line = {"color": "#c0392b", "dash": "dot", "width": 2}
            label = f"{lk.dc_a}↔{lk.dc_b}: {km}, RTT not a finite number in the probe rows"
        else:
            share = lk.rtt_mean_s / hi
            line = {
                "color": f"rgb({int(60 + 190 * share)},{int(170 - 120 * share)},80)",
                "width": 4,
            }
            basis = (rtt_labels or {}).get((lk.dc_a, lk.dc_b), "measured")
            label = f"{lk.dc_a}↔{lk.dc_b}: {km}, RTT {lk.rtt_mean_s * 1e3:.2f} ms ({basis})"
        fig.add_scatter(
            x=[xa, (xa + xb) / 2, xb],
            y=[ya, (ya + yb) / 2, yb],
            mode="lines+text",
            line=line,
            text=["", label, ""],
            textposition="top center",
            hoverinfo="text",
            hovertext=label,
            showlegend=False,
        )
    fig.add_scatter(
        x=[pos[d][0] for d in shown],
        y=[pos[d][1] for d in shown],
        mode="markers+text",
        marker={"size": 28, "color": "#1f3b57"},
        text=shown,
        textposition="bottom center",
        hoverinfo="text",
        showlegend=False,
    )
    fig.update_xaxes(visible=False, range=[-1.6, 1.6])
    fig.update_yaxes(visible=False, range=[-1.5, 1.5])
    return _layout(fig)


def occupancy(s: TimeSeries, win: Window | None = None) -> go.Figure:
    """Used bytes per tier, stacked, with total capacity as a line; buckets without samples
    left out (a stacked area would draw them as zero)."""
    fig = go.Figure()
    for tier, values in s.used_bytes.items():
        t, y = _kept(s.bucket_ms, values)
        fig.add_scatter(
            x=t,
            y=y,
            name=f"{tier} used",
            stackgroup="used",
            line={"color": TIER_COLOURS.get(tier)},
        )
    caps = [
        sum(v for v in vals if v is not None) if any(v is not None for v in vals) else None
        for vals in zip(*s.capacity_bytes.values(), strict=True)
    ]
    if caps:
        t, y = _kept(s.bucket_ms, caps)
        fig.add_scatter(x=t, y=y, name="capacity", line={"color": "#333", "dash": "dot"})
    return _over_window(_layout(fig, y_title="bytes"), win)


def hit_ratio_over_time(s: TimeSeries, win: Window | None = None) -> go.Figure:
    """Per bucket with lookups; the lines join across buckets without any."""
    buckets = s.hit_counts()
    fig = go.Figure()
    for name, values, colour in (
        ("hit ratio", [c.hit_ratio for c in buckets], "#222"),
        ("reuse hit ratio", [c.reuse_hit_ratio for c in buckets], REUSE),
        ("sharing hit ratio", [c.sharing_hit_ratio for c in buckets], SHARING),
    ):
        t, y = _kept(s.bucket_ms, values, s.sampled)
        fig.add_scatter(x=t, y=y, name=name, line={"color": colour})
    return _over_window(_layout(fig, y_title="hits per lookup", percent=True), win)


def evictions(s: TimeSeries, win: Window | None = None) -> go.Figure:
    t, y = _kept(s.bucket_ms, s.evictions, s.sampled)
    fig = go.Figure()
    fig.add_bar(x=t, y=y, name="evictions", marker_color="#b15928")
    fig.update_yaxes(rangemode="nonnegative")
    return _over_window(_layout(fig, y_title="chunks evicted"), win)


def power(s: TimeSeries, win: Window | None = None, *, emulated: bool = False) -> go.Figure:
    """Power (W) and energy (J) per bucket: NVML's, or the emulated series, never both."""
    watts = s.emulated_power_w if emulated else s.power_w
    joules = s.emulated_energy_j if emulated else s.energy_j
    label = " (emulated)" if emulated else ""
    fig = go.Figure()
    t, y = _kept(s.bucket_ms, watts)
    fig.add_scatter(x=t, y=y, name=f"power (W){label}", line={"color": "#e31a1c"})
    t, y = _kept(s.bucket_ms, joules)
    fig.add_bar(
        x=t, y=y, name=f"energy (J){label}", yaxis="y2", marker_color="#fb9a99", opacity=0.6
    )
    _layout(fig, y_title="W")  # titles every y axis: the energy axis gets its own after
    fig.update_layout(
        yaxis={"rangemode": "tozero"},
        yaxis2={
            "overlaying": "y",
            "side": "right",
            "title": {"text": "J per bucket"},
            "rangemode": "tozero",
            "showgrid": False,
        },
    )
    return _over_window(fig, win)


def link_matrix(links: Sequence[LinkFigures], dcs: Sequence[str], what: str) -> go.Figure:
    """A DC x DC heatmap of mean RTT (ms) or bandwidth (Gb/s)."""
    index = {d: i for i, d in enumerate(dcs)}
    z: list[list[float | None]] = [[None] * len(dcs) for _ in dcs]
    for lk in links:
        if lk.dc_a not in index or lk.dc_b not in index:
            continue
        if what == "rtt":
            v = None if lk.rtt_mean_s is None else lk.rtt_mean_s * 1e3
        else:
            bw = lk.bandwidth_bytes_per_s
            v = None if bw is None else bw * 8 / 1e9
        i, j = index[lk.dc_a], index[lk.dc_b]
        z[i][j] = z[j][i] = v
    title = "RTT (ms)" if what == "rtt" else "bandwidth (Gb/s)"
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(dcs),
            y=list(dcs),
            colorscale="RdYlGn_r" if what == "rtt" else "RdYlGn",
            colorbar={"title": title},
            texttemplate="%{z:.3g}",
            hoverongaps=False,
        )
    )
    return _layout(fig)


def rtt_over_time(
    bucket_ms: Sequence[int],
    rtt_s: Mapping[tuple[str, str], Sequence[Any]],
    win: Window | None = None,
) -> go.Figure:
    fig = go.Figure()
    for (a, b), values in rtt_s.items():
        t, ms = _kept(bucket_ms, [None if v is None else v * 1e3 for v in values])
        fig.add_scatter(x=t, y=ms, name=a if a == b else f"{a}↔{b}", mode="lines+markers")
    return _over_window(_layout(fig, y_title="RTT (ms)"), win)


def fetch_vs_recompute(rows: Sequence[BreakEven]) -> go.Figure:
    names = [
        f"{r.link.dc_a}↔{r.link.dc_b}" if r.link.dc_a != r.link.dc_b else r.link.dc_a for r in rows
    ]
    fig = go.Figure()
    fig.add_bar(
        name="fetch (measured RTT + bytes / measured bandwidth)",
        x=names,
        y=[None if r.fetch_s is None else r.fetch_s * 1e3 for r in rows],
        marker_color="#1f78b4",
    )
    fig.add_bar(
        name="recompute (modeled prefill)",
        x=names,
        y=[r.recompute_s * 1e3 for r in rows],
        marker_color="#e31a1c",
    )
    fig.update_layout(barmode="group")
    return _layout(fig, y_title="ms per chunk")


def miss_ratio_curve(report: Mapping[str, Any], current_bytes: float | None) -> go.Figure:
    points = report["miss_ratio_curve"]["points"]
    x = [p["capacity_bytes"] / 2**30 for p in points]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[p["lru_hit_ratio"] for p in points], name="LRU", mode="lines+markers")
    if points and points[0].get("policy_hit_ratio") is not None:
        fig.add_scatter(
            x=x,
            y=[p["policy_hit_ratio"] for p in points],
            name=str(report.get("policy", "policy")),
            mode="lines+markers",
        )
    if current_bytes:
        fig.add_vline(
            x=current_bytes / 2**30,
            line_dash="dot",
            annotation_text="cpu tier per node now (measured)",
        )
    fig.update_xaxes(title_text="cache size (GiB)", type="log")
    return _layout(fig, y_title="hit ratio (simulated)", percent=True)


def candidates(report: Mapping[str, Any]) -> go.Figure:
    """Simulated hit ratio per tier configuration, stacked by tier, and the modeled TTFT saved."""
    cands = report["candidates"]
    names = [c["name"] for c in cands]
    tiers: list[str] = []
    for c in cands:
        tiers += [t for t in c["simulated"]["hit_ratio_by_tier"] if t not in tiers]
    fig = go.Figure()
    for tier in tiers:
        fig.add_bar(
            name=f"{tier} hits (simulated)",
            x=names,
            y=[c["simulated"]["hit_ratio_by_tier"].get(tier, 0.0) for c in cands],
            marker_color=TIER_COLOURS.get(tier),
        )
    fig.add_scatter(
        name="mean TTFT saved (modeled)",
        x=names,
        y=[c["modeled"]["mean_ttft_saved_ratio"] for c in cands],
        mode="markers",
        marker={"size": 12, "symbol": "diamond", "color": "#222"},
    )
    fig.update_layout(barmode="stack")
    return _layout(fig, y_title="share", percent=True)


def decisions_per_node(nodes: Sequence[NodeRouting]) -> go.Figure:
    """Decisions per chosen node, stacked: sent to a node holding part of the prefix or not."""
    names = [n.node for n in nodes]
    fig = go.Figure()
    fig.add_bar(
        name="to a holder of the prefix",
        x=names,
        y=[n.to_holder for n in nodes],
        marker_color="#33a02c",
    )
    fig.add_bar(
        name="to a node holding none of it",
        x=names,
        y=[n.not_to_holder for n in nodes],
        marker_color="#b2b2b2",
    )
    fig.update_layout(barmode="stack")
    return _layout(fig, y_title="decisions")


def pulled_bytes_over_time(s: PulledSeries, win: Window | None = None) -> go.Figure:
    """Bytes the decisions pulled per DC link (holder's DC -> chosen node's DC), per bucket."""
    fig = go.Figure()
    for (a, b), values in s.pulled_bytes.items():
        t, y = _kept(s.bucket_ms, values)
        fig.add_bar(x=t, y=y, name=a if a == b else f"{a}→{b}")
    fig.update_layout(barmode="stack")
    return _over_window(_layout(fig, y_title="bytes pulled"), win)
