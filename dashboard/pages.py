"""The five pages, each a function of the page context returning Dash components."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dash import dcc, html
from sqlalchemy.engine import Connection

from dashboard import figures
from dashboard.components import (
    MEASURED_AND_EMULATED,
    MEASURED_VS_MODELED,
    card,
    empty,
    graph,
    section,
    table,
)
from dashboard.energy import FACILITY, IT, energy_saved_note, energy_units, plan_inputs_note
from kvctl.db.analytics.counts import (
    EMULATED,
    MEASURED,
    MODELED,
    REPLAYED,
    UNKNOWN_ENERGY,
    UNKNOWN_PLANS,
    UNKNOWN_TTFT,
    Assumptions,
    beyond_counts_reason,
    node_counts,
)
from kvctl.db.analytics.counts import total as total_of
from kvctl.db.analytics.inventory import Inventory, has_figures, inventory
from kvctl.db.analytics.links import RttBasis, break_even, link_figures, link_series, rtt_bases
from kvctl.db.analytics.overview import Overview, capacity, overview
from kvctl.db.analytics.routing import RoutingSummary, pulled_series, routing_summary
from kvctl.db.analytics.series import node_events, time_series
from kvctl.db.analytics.windows import Window
from kvctl.db.route_reports import SavedRouteReport, latest_saved_route_report
from kvctl.format import (
    GPU_TIME_UNITS,
    MASS_UNITS,
    NA,
    format_bytes,
    format_number,
    format_scaled,
    format_seconds,
    format_utc_minute,
    percent,
    significant,
)
from kvctl.profiles import BOARD_POWER_SOURCES, GPUS

log = logging.getLogger("kvctl.dashboard")

COLLECT_HINT = "Run `kvctl collect` (or `kvctl demo`) so the collector records samples."


@dataclass(frozen=True, slots=True)
class PageContext:
    conn: Connection
    window: Window
    assume: Assumptions
    #: the DC filter; empty: every DC
    dcs: tuple[str, ...]
    #: an app-relative href, so links work under a URL prefix
    href: Callable[[str], str]
    #: the DC and node the detail page shows (from the URL's query)
    dc: str | None = None
    node: str | None = None


def _filtered(names: list[str], dcs: tuple[str, ...]) -> list[str]:
    return [d for d in names if d in dcs] if dcs else names


def _inputs_note(assume: Assumptions) -> str:
    return (
        f"modeled inputs: model {assume.model.name} "
        f"({assume.model.kv_bytes_per_token:,} KV bytes/token, prefill 2 x "
        f"{assume.model.params / 1e9:.2f} B params FLOPs/token), each node's own GPU profile "
        f"(default {assume.default_gpu} where its GPU model is unknown), MFU {assume.mfu:g}; "
        "energy = GPU-seconds x board power x DC PUE; carbon = that x DC grid intensity; GPU "
        "time saved is the agents' fetch-or-recompute figure where they report one (their own "
        "prefill rate, measured or not, minus fetch time), else tokens at the modeled rate"
    )


# --- fleet overview ----------------------------------------------------------------------------
def fleet_page(ctx: PageContext) -> list[Any]:
    ov = overview(ctx.conn, ctx.window, ctx.assume)
    if not ov.inventory.dcs:
        return [
            empty(
                "The fleet inventory is empty.",
                hint="Add DCs and nodes: `kvctl fleet import fleet.yaml`, or run `kvctl demo`.",
            )
        ]
    names = _filtered(list(ov.dcs), ctx.dcs)
    shown = {n: ov.dcs[n] for n in names}
    total = ov.fleet
    if ctx.dcs:
        total = total_of(shown.values())
    win = ctx.window
    out: list[Any] = [html.H2("Fleet overview" + (f": {', '.join(names)}" if ctx.dcs else ""))]
    if not total.lookups:
        out.append(
            empty(
                f"No cache lookups recorded between {format_utc_minute(win.start_ms)} and "
                f"{format_utc_minute(win.end_ms)}.",
                hint=COLLECT_HINT + " Or pick a longer window.",
            )
        )
    cards = _headline_cards(total, ov) + sharing_cards(latest_saved_route_report(ctx.conn))
    out.append(html.Div(cards, className="cards", id="fleet-cards"))
    if total.lookups:
        out.append(
            section(
                "Hit ratio by tier",
                MEASURED,
                win,
                graph(figures.hit_ratio_by_tier(shown, total), "fig-hit-tier"),
                note="hits per lookup, by the tier that served them (agent counters)",
            )
        )
        out.append(
            section(
                "Reuse vs sharing hit ratio",
                MEASURED,
                win,
                graph(figures.reuse_vs_sharing(shown, total), "fig-reuse-sharing"),
                note="hits per lookup; reuse: a tenant's own chunks; sharing: chunks another "
                "tenant stored (the two add up to the hit ratio)",
            )
        )
        if total.tiers:
            out.append(_tier_split_section(ctx, shown, total))
    bases = _rtt_bases(ctx, ov.inventory)
    out.append(
        section(
            "DCs and links",
            rtt_badge(bases, names),
            win,
            graph(
                figures.dc_schematic(ov.inventory, ov.links, names, _labels_of(bases)),
                "fig-schematic",
            ),
            note="a schematic; links coloured by probed mean RTT (labelled measured or "
            "emulated), dashed when not probed",
        )
    )
    rows = [_dc_row(name, c, ov) for name, c in shown.items()]
    rows.append(_dc_row("fleet" if not ctx.dcs else "selected", total, ov))
    out.append(
        section(
            "Per DC",
            MEASURED,
            win,
            table("table-dcs", rows, list(rows[0])),
            note="modeled columns say so in their name or basis column",
        )
    )
    out.append(html.P(_inputs_note(ctx.assume), className="inputs-note"))
    return out


def _headline_cards(c: Any, ov: Overview) -> list[Any]:
    # hits count at lookup (design): an engine that reads after its lookup (a replay, the
    # vLLM connector's worker) may find a chunk gone by then, which counted all the same
    tokens_note = "prompt tokens found in the cache, counted at lookup (a chunk evicted before "
    tokens_note += "the engine read it counts too)"
    if c.read_nodes:  # agents that count their reads say how often that happened
        tokens_note += (
            f"; of {c.read_chunks:,} chunks read, {c.read_missing_chunks:,} "
            f"({percent(c.read_missing_ratio)}) were gone (evicted since their lookup, or "
            "never looked up)"
        )
    if not c.energy_nodes:
        if c.unknown_figures.get(UNKNOWN_ENERGY):
            energy_note = "no NVML energy that can be true in this window"
        elif ov.nvml_nodes == 0:
            energy_note = "no power samples: NVML unavailable on these nodes"
        else:
            energy_note = "no power samples in this window (NVML readings come from the agents)"
    else:
        energy_note = f"NVML, {c.energy_nodes} node(s)"
    energy_note += left_out(c, UNKNOWN_ENERGY, beyond_counts_reason("power_sample"))
    if c.engine_nodes:
        ttft = f"{format_seconds(c.ttft_mean_s)} vs {format_seconds(c.ttft_without_cache_mean_s)}"
        ttft_note = "measured with cache vs modeled without (+ prefill of cached tokens)"
        ttft_note += left_out(c, UNKNOWN_TTFT, beyond_counts_reason("engine_sample"))
    else:
        ttft = "N/A"
        ttft_note = "no engine metrics: set nodes' engine_url so the collector scrapes them"
    carbon_note = "facility kWh x DC grid intensity"
    if c.carbon_unknown_nodes:
        carbon_note += f"; {c.carbon_unknown_nodes} node(s) in DCs without intensity left out"
    energy_unit = energy_units(c)  # one unit for every energy card on the page
    return [
        card(
            "Hit ratio",
            percent(c.hit_ratio),
            MEASURED,
            f"{c.hits:,} of {c.lookups:,} chunk lookups"
            + left_out(c, beyond_counts_reason("cache_sample")),
            card_id="card-hit-ratio",
        ),
        card(
            # kvctl/ratios.py's names: this is per lookup; `kvctl status` and `top` show the
            # share of hits, which the note gives too
            "Sharing hit ratio",
            percent(c.sharing_hit_ratio),
            MEASURED,
            f"sharing hits per lookup; reuse hit ratio {percent(c.reuse_hit_ratio)} + sharing "
            f"hit ratio = hit ratio; sharing (of hits) {percent(c.sharing_share_of_hits)}",
            card_id="card-sharing",
        ),
        card(
            "Prefill tokens saved",
            _if_looked_up(c, format_number(c.hit_tokens)),
            MEASURED,
            tokens_note,
            card_id="card-tokens",
        ),
        card(
            "GPU time saved",
            _if_looked_up(c, format_scaled(c.gpu_seconds_saved, GPU_TIME_UNITS)),
            c.gpu_time_basis,
            "; ".join(filter(None, (gpu_time_note(c), plan_inputs_note(c, ov.assume.model.name)))),
            card_id="card-gpu-hours",
        ),
        card(
            f"Energy saved, {FACILITY}",
            _if_looked_up(c, format_scaled(c.facility_joules_saved, energy_unit)),
            MODELED,
            energy_saved_note(c, ov.assume.model.name),
            card_id="card-energy",
        ),
        card(
            "Carbon saved",
            _if_looked_up(c, format_scaled(c.carbon_saved_g, MASS_UNITS) + " CO2")
            if c.carbon_saved_g is not None
            else NA,
            MODELED,
            carbon_note,
            card_id="card-carbon",
        ),
        *_energy_cards(c, energy_note, energy_unit),
        # the "without" half is modeled (measured TTFT + modeled prefill): not all measured
        card(
            "TTFT with vs without cache",
            ttft,
            MEASURED_VS_MODELED,
            ttft_note,
            card_id="card-ttft",
        ),
    ]


def _if_looked_up(c: Any, shown: str) -> str:
    """``shown``, or N/A where no lookup was recorded in the window: what the cache saved is
    then unknown, like the hit ratio beside it, not a measured 0. Rendering only: the figure
    itself is computed as before."""
    return shown if c.lookups else NA


def _saved_cell(c: Any, value: float | None) -> float | None:
    """A table's saving, empty (N/A) where no lookup was recorded, as :func:`_if_looked_up`."""
    return value if c.lookups else None


#: what the emulated busy time leaves out (collectors.rows.emulated_power_rows caps it): a
#: burst's prefill beyond its scrape interval is in no figure, so a card must not call the
#: seconds shown all the modeled prefill of the tokens not served
EMULATION_CAP = (
    "at most each scrape interval: a GPU is busy no longer, and prefill past it is not counted"
)


def _energy_cards(c: Any, energy_note: str, unit: tuple[tuple[float, str]]) -> list[Any]:
    """Energy used and tokens per joule: NVML's (measured) and the emulated ones of nodes
    without NVML, each on its own cards, never added together. Without emulated energy the
    measured cards show, N/A when nothing was read; with emulated energy only, the emulated
    cards take their place."""
    out: list[Any] = []
    if c.energy_nodes or not c.emulated_energy_nodes:
        out += [
            card(
                f"Energy used, {IT}",
                format_scaled(None if c.energy_kwh is None else c.energy_j, unit),
                MEASURED,
                energy_note,
                card_id="card-energy-used",
            ),
            card(
                "Tokens per joule",
                format_number(c.tokens_per_joule),
                MEASURED,
                "engine tokens / NVML energy"
                if c.both_nodes
                else "needs engine metrics and NVML on the same nodes",
                card_id="card-tokens-per-joule",
            ),
        ]
    if c.emulated_energy_nodes:
        out += [
            card(
                f"Energy used (emulated), {IT}",
                format_scaled(c.emulated_energy_j, unit),
                EMULATED,
                f"GPU energy of {c.emulated_energy_nodes} node(s) without NVML: "
                f"{format_seconds(c.emulated_busy_s)} of modeled prefill (the tokens their "
                "cache did not serve, whole chunks only: a prompt's partial last chunk is not "
                f"counted; {EMULATION_CAP}) x {emulation_note(c.emulated_profiles)}",
                card_id="card-energy-emulated",
            ),
            card(
                "Tokens per joule (emulated)",
                format_number(c.emulated_tokens_per_joule),
                EMULATED,
                "prompt tokens looked up (agent counters) / emulated GPU energy, same nodes",
                card_id="card-tokens-per-joule-emulated",
            ),
        ]
    return out


def emulation_note(profiles: dict[str, int]) -> str:
    """The board power each emulated node assumed, with where it is published."""
    parts = []
    for pair in sorted(profiles):
        gpu, _, model = pair.partition("/")
        watts = f"{GPUS[gpu].board_power_watts:g} W" if gpu in GPUS else "?"
        source = BOARD_POWER_SOURCES.get(gpu, "source unknown")
        parts.append(f"{gpu} board power {watts} ({source}; prefill of {model})")
    return "; ".join(parts) or "no profile recorded"


def sharing_cards(saved: SavedRouteReport | None) -> list[Any]:
    """The value of sharing as a measured difference: the latest saved replay of the same
    requests with and without sharing (the demo saves one); no cards without one."""
    sharing = None if saved is None else saved.report.get("sharing")
    if saved is None or not isinstance(sharing, dict):
        return []
    shared, alone = sharing.get("with_sharing") or {}, sharing.get("without_sharing") or {}
    gain = sharing.get("hit_ratio_gain")
    scope = saved.report.get("scope") or f"{saved.report.get('requests', '?')} requests"
    when = format_utc_minute(saved.ts_ms)
    # the replay counts the workload's blocks (a partial last one too), the agents their full
    # chunks: the measured Hit ratio and these are on different bases, and the titles say so
    per = f"per {sharing.get('block_tokens', '?')}-token block"
    return [
        card(
            f"Hit ratio with sharing ({per})",
            percent(shared.get("hit_ratio")),
            REPLAYED,
            f"{scope}, replayed {when} under cost routing on size-only tiers of the fleet's "
            "sizes: any DC's node serves a request and pulls from the others; "
            f"{percent(shared.get('pulled_hit_ratio'))} of chunks pulled",
            card_id="card-sharing-with",
        ),
        card(
            f"Hit ratio without sharing ({per})",
            percent(alone.get("hit_ratio")),
            REPLAYED,
            "the same requests, each served in its home DC by a node using only what it holds "
            "itself (no peers, no pool)"
            + ("" if gain is None else f": sharing adds {gain * 100:+.1f} pts")
            + f"; an unlimited cache: {percent(sharing.get('unlimited_cache_hit_ratio'))} "
            f"({per}; the measured Hit ratio counts the agents' full chunks)",
            card_id="card-sharing-without",
        ),
    ]


TOKENS_NOTE = "tokens / modeled prefill rate (fetch time not deducted)"


def gpu_time_note(c: Any) -> str:
    """What "GPU time saved" is made of: the agents' plans (prefill - fetch time of the chunks
    taken, on the prefill rate's basis) and/or hit tokens at the modeled rate."""
    if not c.plan_nodes:
        return TOKENS_NOTE
    bases = c.plan_bases
    if not bases:  # every node's plans unknown (``UNKNOWN_PLANS``)
        note = "agents' plans: none known"
        if c.token_model_nodes:
            note += f"; {c.token_model_nodes} node(s) without plans: {TOKENS_NOTE}"
        return note + left_out(c, UNKNOWN_PLANS, beyond_counts_reason("plan_sample"))
    if bases == [MEASURED]:
        rate = "measured prefill rate"
    else:  # configured or modeled rates make the plans' saving a model, whatever was measured
        rate = f"{' + '.join(bases)} prefill rate: modeled from plan"
    note = (
        f"agents' plans: prefill {format_seconds(c.plan_recompute_s)} - fetch "
        f"{format_seconds(c.plan_fetch_s)} of {c.plan_fetch_chunks:,} chunks taken ({rate})"
    )
    if c.token_model_nodes:
        note += f"; {c.token_model_nodes} node(s) without plans: {TOKENS_NOTE}"
    return note + left_out(c, UNKNOWN_PLANS, beyond_counts_reason("plan_sample"))


def left_out(c: Any, *reasons: str) -> str:
    """A note's words on the nodes whose figure is unknown for one of ``reasons`` (rows no
    collector writes: ``Counts.unknown_figures``), left out of it; "" where none is."""
    return "".join(
        f"; {n} node(s) left out, unknown: {reason}"
        for reason in reasons
        if (n := c.unknown_figures.get(reason))
    )


def gpu_time_basis_label(c: Any) -> str:
    """The DC table's short form of :func:`gpu_time_note`."""
    if not c.plan_nodes:
        return "modeled (tokens)"
    label = f"{c.gpu_time_basis} (plan)"
    return label + " + modeled (tokens)" if c.token_model_nodes else label


def _dc_row(name: str, c: Any, ov: Overview) -> dict[str, Any]:
    info = next((d for d in ov.inventory.dcs if d.name == name), None)
    return {
        "DC": name,
        # the nodes removed since the window started still count in the DC's figures
        "nodes": f"{c.nodes} + {c.removed_nodes} removed" if c.removed_nodes else c.nodes,
        "up": percent(c.up_ratio),
        # up but unread (token refused, starting, rejected): the DC's lookups miss those scrapes
        "unread scrapes": c.unread_samples,
        "lookups": c.lookups,
        "hit ratio": percent(c.hit_ratio),
        "reuse hit ratio": percent(c.reuse_hit_ratio),
        "sharing hit ratio": percent(c.sharing_hit_ratio),
        "sharing (of hits)": percent(c.sharing_share_of_hits),
        "tokens saved": _saved_cell(c, c.hit_tokens),
        "GPU-h saved": _saved_cell(c, significant(c.gpu_seconds_saved / 3600)),
        "GPU-h basis": gpu_time_basis_label(c),
        "kWh saved (modeled, facility)": _saved_cell(c, significant(c.facility_kwh_saved)),
        "kg CO2 saved (modeled)": None
        if c.carbon_saved_g is None
        else _saved_cell(c, significant(c.carbon_saved_g / 1000)),
        "kWh used (IT)": None if c.energy_kwh is None else significant(c.energy_kwh),
        "kWh used (emulated, IT)": None
        if c.emulated_energy_kwh is None
        else significant(c.emulated_energy_kwh),
        "PUE": "" if info is None or info.pue is None else info.pue,
        "gCO2/kWh": "" if info is None or info.carbon_g_per_kwh is None else info.carbon_g_per_kwh,
    }


def _tier_split_section(ctx: PageContext, shown: dict[str, Any], total: Any) -> Any:
    """Per tier, its hits split into reuse and sharing, per lookup: the chart for the total,
    the table per DC too."""
    whole = "the selected DCs" if ctx.dcs else "the fleet"
    scopes = [*shown.items(), ("selected" if ctx.dcs else "fleet", total)]
    rows = [_tier_row(name, c, t) for name, c in scopes for t in total.tiers]
    return section(
        "Reuse vs sharing by tier",
        MEASURED,
        ctx.window,
        graph(figures.reuse_vs_sharing_by_tier(total), "fig-tier-reuse-sharing"),
        table("table-tier-split", rows, list(rows[0])),
        note=f"hits each tier served per lookup (the chart: {whole}), split into reuse (a "
        "tenant's own chunks) and sharing (another tenant's): a tier's reuse + sharing is its "
        "hit ratio, and the tiers add up to the whole's",
    )


def _tier_row(name: str, c: Any, tier: str) -> dict[str, Any]:
    f = c.tier_figures(tier)
    return {
        "DC": name,
        "tier": tier,
        "hits": f["hits"],
        "hit ratio": percent(f["hit_ratio"]),
        "reuse hit ratio": percent(f["reuse_hit_ratio"]),
        "sharing hit ratio": percent(f["sharing_hit_ratio"]),
        "sharing (of hits)": percent(f["sharing_share_of_hits"]),
    }


# --- DC and node detail ------------------------------------------------------------------------
def dc_page(ctx: PageContext) -> list[Any]:
    inv = inventory(ctx.conn, removed_since_ms=ctx.window.start_ms)
    if not inv.dcs:
        return [
            empty("The fleet inventory is empty.", hint="`kvctl fleet import` or `kvctl demo`.")
        ]
    names = [d.name for d in inv.dcs if not ctx.dcs or d.name in ctx.dcs] or [inv.dcs[0].name]
    dc = ctx.dc if ctx.dc in names else names[0]
    nodes = inv.nodes_of(dc)
    node = next((n for n in nodes if n.name == ctx.node), None)
    # the DC's figures keep the nodes removed since the window started (listed as removed)
    gone = inv.removed_of(dc)
    ids = [node.id] if node else [n.id for n in [*nodes, *gone]]
    subject = f"node {node.name}" if node else f"DC {dc}"
    out: list[Any] = [
        html.H2(f"Detail: {subject}"),
        html.Div(
            [
                html.Div(
                    [html.Label("DC"), dcc.Dropdown(names, dc, id="detail-dc", clearable=False)],
                    className="picker",
                ),
                html.Div(
                    [
                        html.Label("Node"),
                        dcc.Dropdown(
                            [n.name for n in nodes],
                            node.name if node else None,
                            id="detail-node",
                            placeholder="every node of the DC",
                        ),
                    ],
                    className="picker",
                ),
            ],
            className="pickers",
        ),
    ]
    if not nodes and not gone:
        return [*out, empty(f"DC {dc} has no nodes.", hint="`kvctl fleet add-node`")]
    s = time_series(ctx.conn, ctx.window, ids)
    win = ctx.window
    if not any(s.lookups) and not s.used_bytes:
        out.append(empty(f"No cache samples for {subject} in this window.", hint=COLLECT_HINT))
    else:
        out += [
            section(
                "Tier occupancy",
                MEASURED,
                win,
                graph(figures.occupancy(s, win), "fig-occupancy"),
                note="stacked used bytes per tier; dotted: capacity",
            ),
            section(
                "Hit ratio over time",
                MEASURED,
                win,
                graph(figures.hit_ratio_over_time(s, win), "fig-hit-time"),
            ),
            section(
                "Evictions",
                MEASURED,
                win,
                graph(figures.evictions(s, win), "fig-evictions"),
                note="chunks that left the node (not demotions)",
            ),
        ]
    if any(v is not None for v in s.power_w):
        out.append(
            section(
                "Power and energy",
                MEASURED,
                win,
                graph(figures.power(s, win), "fig-power"),
                note="NVML",
            )
        )
    if any(v is not None for v in s.emulated_power_w):
        out.append(
            section(
                "Power and energy (emulated)",
                EMULATED,
                win,
                graph(figures.power(s, win, emulated=True), "fig-power-emulated"),
                note="nodes without NVML: modeled prefill time of the tokens their cache did "
                f"not serve ({EMULATION_CAP}) x the GPU profile's board power (kvctl collect "
                "--emulate-power)",
            )
        )
    elif not any(v is not None for v in s.power_w):
        out.append(
            section(
                "Power and energy",
                MEASURED,
                win,
                empty(
                    f"No power samples for {subject}: NVML unavailable on these nodes, or "
                    "the collector has not read them yet.",
                    hint="`kvctl doctor` checks NVML on each node.",
                ),
            )
        )
    if node:
        events = node_events(ctx.conn, win, node.id)
        rows = [
            {"time": format_utc_minute(e.ts_ms), "event": e.kind, "detail": e.detail}
            for e in events
        ]
        body = (
            table("table-events", rows, ["time", "event", "detail"])
            if rows
            else empty(
                "No notable events: no restarts, unreachable or unread spells, or evictions."
            )
        )
        out.append(
            section("Top events", MEASURED, win, body, note="from raw samples (kept 2 days)")
        )
    else:
        per = _node_rows(ctx, inv, [*nodes, *gone], win)
        if per:
            out.append(section("Nodes", MEASURED, win, table("table-nodes", per, list(per[0]))))
    return out


def _node_rows(
    ctx: PageContext, inv: Inventory, nodes: list[Any], win: Window
) -> list[dict[str, Any]]:
    dcs = {d.name: d for d in [*inv.dcs, *inv.removed_dcs()]}
    counts = node_counts(ctx.conn, win.start_ms, win.end_ms, nodes, dcs, ctx.assume)
    rows = []
    for n in nodes:
        c = counts[n.id]
        if n.removed and not has_figures(c):
            continue  # removed before the window's samples: nothing of it here
        used = sum(c.used_bytes.values()) if c.used_bytes else None
        cap = sum(c.capacity_bytes.values()) if c.capacity_bytes else None
        rows.append(
            {
                "node": n.label,
                "GPU": n.gpu_model or "unknown",
                "up": percent(c.up_ratio),
                # up but unread (token refused, starting): its lookups are unknown, not an idle 0
                "unread scrapes": c.unread_samples,
                "lookups": c.lookups,
                "hit ratio": percent(c.hit_ratio),
                "sharing hit ratio": percent(c.sharing_hit_ratio),
                "sharing (of hits)": percent(c.sharing_share_of_hits),
                "evictions": c.evictions,
                "used / capacity": percent(None if not cap or used is None else used / cap),
                "kWh used (IT)": None if c.energy_kwh is None else significant(c.energy_kwh),
                "kWh used (emulated, IT)": None
                if c.emulated_energy_kwh is None
                else significant(c.emulated_energy_kwh),
            }
        )
    return rows


# --- links -------------------------------------------------------------------------------------
def links_page(ctx: PageContext) -> list[Any]:
    # links and inventory only: the page needs none of the overview's per-node counts (the
    # removed nodes': their probes in the window still count)
    win = ctx.window
    inv = inventory(ctx.conn, removed_since_ms=win.start_ms)
    names = _filtered([d.name for d in inv.dcs], ctx.dcs)
    links = [
        lk
        for lk in link_figures(ctx.conn, win.start_ms, win.end_ms, inv)
        if lk.dc_a in names or lk.dc_b in names
    ]
    out: list[Any] = [html.H2("Links between DCs")]
    if not links:
        return [
            *out,
            empty(
                "No links in the inventory and no probes recorded.",
                hint="`kvctl fleet add-link A B --distance-km N`; the collector probes links "
                "every --link-interval.",
            ),
        ]
    probed = [lk for lk in links if lk.probes]
    bases = _rtt_bases(ctx, inv)
    labels = _labels_of(bases)
    rtt_basis = rtt_badge(bases, names)
    if not probed:
        out.append(
            empty(
                "No link probes in this window.",
                hint="The collector probes links between nodes; see `kvctl collect --help`.",
            )
        )
    else:
        out += [
            section(
                "RTT matrix",
                rtt_basis,
                win,
                graph(figures.link_matrix(links, names, "rtt"), "fig-rtt-matrix"),
                note="mean of successful probes; diagonal: within a DC; RTT "
                + _basis_summary(labels),
            ),
            section(
                "Bandwidth matrix",
                MEASURED,
                win,
                graph(figures.link_matrix(links, names, "bandwidth"), "fig-bw-matrix"),
            ),
        ]
        ls = link_series(ctx.conn, win, inv)
        rtt = {k: v for k, v in ls.rtt_s.items() if k[0] in names or k[1] in names}
        out.append(
            section(
                "RTT over time",
                rtt_basis,
                win,
                graph(figures.rtt_over_time(ls.bucket_ms, rtt, win), "fig-rtt-time"),
            )
        )
    inputs = ctx.assume.inputs_for(ctx.assume.default_gpu)
    rows = break_even(links, inputs)
    out.append(
        section(
            "Fetch or recompute, per link",
            MODELED,
            win,
            graph(figures.fetch_vs_recompute(rows), "fig-break-even"),
            table(
                "table-links",
                [_link_row(r, labels) for r in rows],
                list(_link_row(rows[0], labels)),
            ),
            note=(
                f"a {rows[0].chunk_tokens}-token chunk of {ctx.assume.model.name} "
                f"({rows[0].chunk_bytes / 2**20:.1f} MiB) on {ctx.assume.default_gpu}: fetch "
                "when probed RTT (its basis per link) + bytes / measured bandwidth < modeled "
                "prefill time"
            ),
        )
    )
    return out


def _rtt_bases(ctx: PageContext, inv: Inventory) -> dict[tuple[str, str], RttBasis]:
    win = ctx.window
    return rtt_bases(ctx.conn, win.start_ms, win.end_ms, inv)


def _labels_of(bases: dict[tuple[str, str], RttBasis]) -> dict[tuple[str, str], str]:
    return {k: rtt_basis_label(b) for k, b in bases.items()}


def rtt_badge(bases: dict[tuple[str, str], RttBasis], dcs: list[str]) -> str:
    """The badge of a figure of the RTTs between ``dcs``: emulated when every probe carried an
    agent-emulated delay, measured + emulated when only some did, else measured. An emulated
    delay is part of the RTT it is in, so a "measured" badge would overstate it."""
    shown = [b for (a, z), b in bases.items() if a in dcs or z in dcs]
    emulated = sum(b.probes.get("emulated", 0) for b in shown)
    if not emulated:
        return MEASURED
    total = sum(sum(b.probes.values()) for b in shown)
    return EMULATED if emulated == total else MEASURED_AND_EMULATED


def rtt_basis_label(b: RttBasis) -> str:
    """'measured', 'emulated (+0.80 ms delay)', or both when the window holds both."""
    parts = []
    if b.emulated:
        lo, hi = b.emulated_delay_min_s, b.emulated_delay_max_s
        if lo is None or hi is None:
            delay = "delay not reported"
        elif lo == hi:
            delay = f"+{lo * 1e3:.2f} ms delay"
        else:
            delay = f"+{lo * 1e3:.2f} to {hi * 1e3:.2f} ms delay"
        parts.append(f"emulated ({delay})")
    parts += [k for k in b.probes if k != "emulated"]
    return " and ".join(parts)


def _basis_summary(labels: dict[tuple[str, str], str]) -> str:
    emulated = {k: v for k, v in labels.items() if v != "measured"}
    if not emulated:
        return "measured"
    return "; ".join(
        f"{a if a == b else f'{a}↔{b}'}: {label}" for (a, b), label in emulated.items()
    ) + ("; others measured" if len(emulated) < len(labels) else "")


def _link_row(r: Any, labels: dict[tuple[str, str], str]) -> dict[str, Any]:
    lk = r.link
    worth = {None: "not measured", True: "fetch", False: "recompute"}[r.worth_fetching]
    return {
        "link": lk.dc_a if lk.dc_a == lk.dc_b else f"{lk.dc_a}↔{lk.dc_b}",
        "km": lk.distance_km,
        "probes": lk.probes,
        "ok": percent(lk.ok_ratio),
        "RTT mean": format_seconds(lk.rtt_mean_s),
        "RTT basis": labels.get((lk.dc_a, lk.dc_b), "-" if lk.rtt_mean_s is None else "measured"),
        "RTT max": format_seconds(lk.rtt_max_s),
        "fiber RTT (modeled)": format_seconds(lk.fiber_rtt_s),
        "Gb/s": None
        if lk.bandwidth_bytes_per_s is None
        else round(lk.bandwidth_bytes_per_s * 8 / 1e9, 3),
        "fetch / chunk": format_seconds(r.fetch_s),
        "recompute / chunk (modeled)": format_seconds(r.recompute_s),
        # bandwidth alone loses: no break-even RTT ("none"), not "0 µs"
        "break-even RTT": "none" if r.fetch_never_wins else format_seconds(r.max_rtt_s),
        "verdict": worth,
    }


# --- capacity planning -------------------------------------------------------------------------
def capacity_page(ctx: PageContext) -> list[Any]:
    ov = overview(ctx.conn, ctx.window, ctx.assume)
    view = capacity(ctx.conn, ov)
    out: list[Any] = [html.H2("Capacity planning")]
    if not view.plans:
        return [
            *out,
            empty(
                "No capacity plan saved.",
                hint="Run `kvctl plan --trace TRACE --save --dc DC` (or without --dc for the "
                "fleet); the demo saves one.",
            ),
        ]
    keys = [k for k in view.plans if k is None or not ctx.dcs or k in ctx.dcs]
    for key in sorted(keys, key=lambda k: (k is not None, k or "")):
        saved = view.plans[key]
        r = saved.report
        scope = f"DC {key}" if key else "the fleet"
        cap = view.cpu_capacity_bytes_per_node.get(key)
        out.append(html.H3(f"Plan for {scope}"))
        if isinstance(r, dict) and not r.get("candidates"):
            out.append(empty(f"The plan saved for {scope} holds no configuration."))
            continue
        try:
            inputs = r.get("modeled_inputs", {})
            note = (
                f"workload {saved.workload}, saved {format_utc_minute(saved.created_ms)}; model "
                f"{inputs.get('model', {}).get('name', '?')}, GPU "
                f"{inputs.get('gpu', {}).get('name', '?')}, MFU {inputs.get('mfu', '?')}"
            )
            out += _plan_sections(r, key, cap, note)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # a report saved by an older (or newer) kvctl: this plan says so, the others show
            log.warning("the plan saved for %s cannot be read: %r", scope, exc)
            dc_opt = f" --dc {shlex.quote(key)}" if key else ""  # copied into a shell
            out.append(
                empty(
                    f"The plan saved for {scope} has a shape this dashboard does not read "
                    f"(saved {format_utc_minute(saved.created_ms)}, by another kvctl version: "
                    f"{type(exc).__name__} {exc}).",
                    hint="Save it again with this kvctl: "
                    f"`kvctl plan --trace TRACE --save{dc_opt}`.",
                )
            )
    return out


def _plan_sections(r: dict[str, Any], key: str | None, cap: float | None, note: str) -> list[Any]:
    """One saved plan's curve and candidates; raises on a report of another shape."""
    return [
        section(
            "Miss-ratio curve",
            MODELED,
            None,
            graph(figures.miss_ratio_curve(r, cap), f"fig-mrc-{key or 'fleet'}"),
            note="hit ratio simulated by the store's own policies; " + note,
        ),
        section(
            "More DRAM, SSD or a remote pool",
            MODELED,
            None,
            graph(figures.candidates(r), f"fig-candidates-{key or 'fleet'}"),
            table(
                f"table-plan-{key or 'fleet'}",
                [_candidate_row(c) for c in r["candidates"]],
                list(_candidate_row(r["candidates"][0])),
            ),
            note="hit ratios simulated; TTFT and energy modeled (fetch-or-recompute per block)",
        ),
    ]


def _candidate_row(c: dict[str, Any]) -> dict[str, Any]:
    sim, mod = c["simulated"], c["modeled"]
    return {
        "configuration": c["name"],
        "tiers": ", ".join(f"{t} {b / 2**30:,.0f} GiB" for t, b in c["tiers_bytes"].items()),
        "km": c["distance_km"],
        "hit ratio (simulated)": percent(sim["hit_ratio"]),
        "mean TTFT (modeled)": format_seconds(mod["mean_ttft_seconds"]),
        "p99 TTFT (modeled)": format_seconds(mod["p99_ttft_seconds"]),
        "TTFT saved (modeled)": percent(mod["mean_ttft_saved_ratio"]),
        "energy saved (modeled)": percent(mod["prefill_joules_saved_ratio"]),
        "not worth fetching": ", ".join(mod["not_worth_fetching"]) or "-",
    }


# --- routing -----------------------------------------------------------------------------------
ROUTER_HINT = (
    "Run `kvctl collect --router URL` (the router's URL, e.g. http://127.0.0.1:9480; token from "
    "--router-token-file or $KVCTL_ROUTER_TOKEN) so the collector records the router's decisions."
)
#: what the router's fetched tokens and pulled bytes are: its plans, not bytes seen moving
PLANS_NOTE = "the chosen nodes' fetch plans (the router's cost model), not transfers observed"


def routing_page(ctx: PageContext) -> list[Any]:
    win = ctx.window
    r = routing_summary(ctx.conn, win.start_ms, win.end_ms)
    out: list[Any] = [html.H2("Routing")]
    if not r.has_data:
        out.append(
            empty(
                f"No router decisions recorded between {format_utc_minute(win.start_ms)} and "
                f"{format_utc_minute(win.end_ms)}.",
                hint=ROUTER_HINT + " Or pick a longer window.",
            )
        )
    else:
        out.append(html.Div(_routing_cards(r), className="cards", id="routing-cards"))
        if r.nodes:
            out.append(
                section(
                    "Decisions per node",
                    MEASURED,
                    win,
                    graph(figures.decisions_per_node(r.nodes), "fig-route-nodes"),
                    table(
                        "table-route-nodes",
                        [_route_node_row(n) for n in r.nodes],
                        list(_route_node_row(r.nodes[0])),
                    ),
                    note="the router's counts: sent to a node holding part of the prompt's "
                    "prefix (its own tiers), or to one holding none of it",
                )
            )
        out.append(_pulls_section(ctx, r))
    out.append(_route_report_section(r))
    return out


def _routing_cards(r: RoutingSummary) -> list[Any]:
    routers = f"{len(r.routers)} router(s)"
    return [
        card(
            "Decisions",
            f"{r.decisions:,}",
            MEASURED,
            f"{routers}; {r.no_node:,} request(s) no node could serve; mean decision "
            f"{format_seconds(r.decision_mean_s)} (index lookup + scoring, in the router)",
            card_id="card-route-decisions",
        ),
        card(
            "Sent to a holder",
            percent(r.to_holder_share),
            MEASURED,
            f"{r.to_holder:,} of {r.decisions:,} decisions went to a node already holding part "
            "of the prefix",
            card_id="card-route-holder",
        ),
        card(
            "Index hit ratio",
            percent(r.index_hit_ratio),
            MEASURED,
            f"{r.indexed_chunks:,} of {r.requested_chunks:,} chunks of the routed prompts were "
            "held somewhere in the fleet (fleet index)",
            card_id="card-route-index",
        ),
        card(
            "Tokens fetched instead of prefilled",
            format_number(r.fetched_tokens),
            MODELED,
            f"{percent(r.fetched_token_share)} of {r.tokens:,} routed tokens; "
            f"{r.recomputed_tokens:,} recomputed; " + PLANS_NOTE,
            card_id="card-route-fetched",
        ),
        card(
            "Bytes pulled across nodes",
            format_bytes(r.pulled_bytes),
            MODELED,
            f"{r.pulled_chunks:,} chunks from other nodes, {r.local_chunks:,} read on the chosen "
            "node; " + PLANS_NOTE,
            card_id="card-route-pulled",
        ),
    ]


def _route_node_row(n: Any) -> dict[str, Any]:
    return {
        "node": n.node,
        "decisions": n.decisions,
        "to a holder": n.to_holder,
        "to no holder": n.not_to_holder,
        "share to a holder": percent(n.to_holder_share),
    }


def _pulls_section(ctx: PageContext, r: RoutingSummary) -> Any:
    win = ctx.window
    if not r.links:
        body: list[Any] = [empty("No chunks pulled between nodes in this window.")]
    else:
        rows = [
            {
                "link": lk.from_dc if lk.from_dc == lk.to_dc else f"{lk.from_dc}→{lk.to_dc}",
                "chunks": lk.pulled_chunks,
                "bytes": lk.pulled_bytes,
                "pulled": format_bytes(lk.pulled_bytes),
            }
            for lk in r.links
        ]
        body = [
            graph(
                figures.pulled_bytes_over_time(pulled_series(ctx.conn, win), win),
                "fig-route-pulls",
            ),
            table("table-route-links", rows, list(rows[0])),
        ]
    return section(
        "Bytes pulled per DC link",
        MODELED,
        win,
        *body,
        note="holder's DC → chosen node's DC (one DC: between its nodes); " + PLANS_NOTE,
    )


def _route_report_section(r: RoutingSummary) -> Any:
    saved = r.report
    title = "Routing policies on the same requests, replayed"
    if saved is None:
        return section(
            title,
            MODELED,
            None,
            empty(
                "No route report saved.",
                hint="The demo saves one: a replay of its trace under each routing policy "
                "(`kvctl bench route`'s comparison).",
            ),
        )
    report = saved.report
    basis = report.get("basis") or (report.get("modeled_inputs") or {}).get("basis")
    children: list[Any] = []
    for i, w in enumerate(_report_workloads(report)):
        policies: dict[str, Any] = w["policies"]
        reference = str(w.get("reference", "round-robin"))
        rows = [_policy_row(name, p, reference) for name, p in policies.items()]
        if not rows:
            continue
        head = f"{w.get('workload', 'replay')}: {w.get('requests', '?')} requests"
        children += [html.H4(head), table(f"table-route-report-{i}", rows, list(rows[0]))]
    if not children:
        children = [empty("The saved route report compares no policies.")]
    return section(
        title,
        MODELED,
        None,
        *children,
        note=f"{basis or 'the report states no basis'}; "
        + (f"{report['scope']}; " if report.get("scope") else "")
        + _report_bytes_note(report)
        + f"saved {format_utc_minute(saved.ts_ms)}",
    )


def _report_bytes_note(report: dict[str, Any]) -> str:
    """What one pulled block weighs in the report's byte figures: the model's whole KV, which a
    demo's agents (their payloads scaled down by --kv-scale) do not move; '' where no policy
    pulled anything."""
    for w in _report_workloads(report):
        for p in w["policies"].values():
            chunks = sum((p.get("pulled_chunks_by_link") or {}).values())
            if chunks and p.get("pulled_bytes"):
                per = format_bytes(p["pulled_bytes"] / chunks)
                return (
                    f"bytes at {per} per pulled block (the model's whole KV; the live figures "
                    "above count the bytes the agents' chunks hold); "
                )
    return ""


def _report_workloads(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The workloads of a route report: `kvctl bench route`'s result (``workloads``) or one
    workload's comparison (``policies`` at the top)."""
    if isinstance(report.get("workloads"), list):
        return [w for w in report["workloads"] if isinstance(w, dict) and w.get("policies")]
    return [report] if isinstance(report.get("policies"), dict) else []


def _policy_row(name: str, p: dict[str, Any], reference: str) -> dict[str, Any]:
    vs = p.get("vs_reference") or {}
    ttft = (p.get("ttft_modeled") or {}).get("mean_s")
    ttft_ratio = vs.get("ttft_mean_ratio_to_reference")
    hit_gain = vs.get("hit_ratio_minus_reference")
    return {
        "policy": name,
        "hit ratio": percent(p.get("hit_ratio")),
        "local / pulled": f"{percent(p.get('local_hit_ratio'))} / "
        f"{percent(p.get('pulled_hit_ratio'))}",
        "sent to a holder": percent(p.get("to_holder_share")),
        "bytes pulled": None if p.get("pulled_bytes") is None else format_bytes(p["pulled_bytes"]),
        "mean TTFT (modeled)": format_seconds(ttft),
        f"hit ratio vs {reference}": "-" if hit_gain is None else f"{hit_gain * 100:+.1f} pts",
        f"mean TTFT vs {reference}": "-" if ttft_ratio is None else f"{ttft_ratio:.2f}x",
    }


PAGES: dict[str, tuple[str, Callable[[PageContext], list[Any]]]] = {
    "/": ("Fleet", fleet_page),
    "/detail": ("DCs and nodes", dc_page),
    "/links": ("Links", links_page),
    "/routing": ("Routing", routing_page),
    "/capacity": ("Capacity", capacity_page),
}
