"""The kvctl agents' Grafana dashboard, built as code with grafana-foundation-sdk.

    python deploy/grafana/generate.py           # (re)write deploy/grafana/kvctl-agents.json
    python deploy/grafana/generate.py --check   # exit 1 when the checked-in JSON is stale

The panels read the agents' /metrics as Prometheus scrapes them (``dc`` and ``instance`` are
target labels, see deploy/prometheus/kvctl-rules.yml) and the recording rules of that file. Hit
ratios follow kvctl/ratios.py: chunk hits per chunk looked up. GPU power comes from NVIDIA's
DCGM exporter, scraped with the same ``dc`` target label; its own labels (``Hostname``, ``gpu``,
``UUID``) are kept as DCGM names them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableModel,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).with_name("kvctl-agents.json")
UID = "kvctl-agents"

#: every panel and variable query goes to the data source the dashboard's variable picks
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
#: the selected DCs and nodes (target labels)
DCS = 'dc=~"$dc"'
NODES = 'dc=~"$dc", instance=~"$instance"'
RATE = "$__rate_interval"
#: a remote source as seen from one node
SOURCE = "instance, source, tier"
#: DCGM exporter's GPU power draw (watts), a series of another exporter: not on kvctl's /metrics
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"


def rate_by(labels: str, metric: str, matchers: str = NODES) -> str:
    """``sum by (labels) (rate(metric{matchers}[$__rate_interval]))``; no labels: one sum."""
    total = f"sum by ({labels}) " if labels else "sum"
    return f"{total}(rate({metric}{{{matchers}}}[{RATE}]))"


def quantile(q: str, labels: str, histogram: str) -> str:
    """The ``q`` quantile of a histogram's buckets over the selected nodes, by ``labels``."""
    return f"histogram_quantile({q}, {rate_by(f'{labels}, le', f'{histogram}_bucket')})"


def gauge_by(labels: str, metric: str) -> str:
    return f"sum by ({labels}) ({metric}{{{NODES}}})"


@dataclass
class Query:
    expr: str
    legend: str


def each(names: Sequence[str], expr: Callable[[str], str], legend: str) -> list[Query]:
    """One query per ``name`` (a metric's variants: used and capacity, calls and skips):
    ``expr(name)``, its legend ``legend`` followed by the name."""
    return [Query(expr(name), f"{legend} {name}") for name in names]


@dataclass
class Chart:
    """A time series panel: its queries, unit and layout."""

    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    width: int = 12
    height: int = 8
    stacked: bool = False
    ratio: bool = False  # 0..1, drawn as a percentage
    #: per query ref id (A, B, ...): a unit and right axis for a second quantity
    right_axis: dict[str, str] = field(default_factory=dict)


def _target(q: Query, ref_id: str) -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .expr(q.expr)
        .legend_format(q.legend)
        .ref_id(ref_id)
        .range()
        .datasource(DATASOURCE)
    )


def _ref_ids(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)]


def chart(c: Chart, panel_id: int) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(panel_id)
        .title(c.title)
        .description(c.description)
        .datasource(DATASOURCE)
        .unit(c.unit)
        .span(c.width)
        .height(c.height)
        .fill_opacity(20 if c.stacked else 8)
        .legend(
            common_builder.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
    )
    for q, ref in zip(c.queries, _ref_ids(len(c.queries)), strict=True):
        panel.with_target(_target(q, ref))
    if c.ratio:
        panel.min(0).max(1)
    else:
        panel.min(0)
    if c.stacked:
        panel.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL))
    for ref, unit in c.right_axis.items():
        panel.override_by_query(
            ref,
            [
                DynamicConfigValue(id_val="unit", value=unit),
                DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
            ],
        )
    return panel


def hit_ratio_stat(panel_id: int) -> stat.Panel:
    """One figure: the hit ratio over the selected nodes (not an average of their ratios)."""
    expr = (
        f"{rate_by('', 'kvctl_hits_total')}\n  / ({rate_by('', 'kvctl_lookup_chunks_total')} > 0)"
    )
    return (
        stat.Panel()
        .id(panel_id)
        .title("Hit ratio, selected nodes")
        .description(
            "Chunk hits per chunk looked up over the selected DCs and nodes (measured, agent "
            "counters). Empty while nothing is looked up."
        )
        .datasource(DATASOURCE)
        .with_target(_target(Query(expr, "hit ratio"), "A"))
        .unit("percentunit")
        .min(0)
        .max(1)
        .decimals(1)
        .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .span(6)
        .height(8)
        .thresholds(
            dash.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps(
                [
                    Threshold(value=None, color="red"),
                    Threshold(value=0.2, color="orange"),
                    Threshold(value=0.5, color="green"),
                ]
            )
        )
    )


def breaker_timeline(panel_id: int) -> statetimeline.Panel:
    expr = (
        f"max by (instance, source, tier) "
        f'(kvctl_remote_source_breaker_state{{{NODES}, state="closed"}})'
    )
    return (
        statetimeline.Panel()
        .id(panel_id)
        .title("Pool and peers: circuit breakers")
        .description(
            "Each node's remote sources (the shared pool, peer agents): closed = reachable, "
            "open or half-open = lookups skip the source and recompute what it holds. The "
            "KvctlRemoteSourceDown alert fires after 5 minutes not closed."
        )
        .datasource(DATASOURCE)
        .with_target(_target(Query(expr, "{{instance}} -> {{source}} ({{tier}})"), "A"))
        .span(12)
        .height(8)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .legend(common_builder.VizLegendOptions().show_legend(False))
        .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.SINGLE))
        .mappings(
            [
                ValueMap(
                    options={
                        "1": ValueMappingResult(text="closed", color="green", index=0),
                        "0": ValueMappingResult(text="open / half-open", color="red", index=1),
                    }
                )
            ]
        )
    )


def variables() -> list[Builder[VariableModel]]:
    def label_variable(name: str, label: str, query: str) -> dash.QueryVariable:
        return (
            dash.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
        )

    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        label_variable("dc", "DC", "label_values(kvctl_build_info, dc)"),
        label_variable("instance", "Node", 'label_values(kvctl_build_info{dc=~"$dc"}, instance)'),
    ]


def rows() -> list[tuple[str, list[Chart]]]:
    """The dashboard's rows of time series panels (the stat and state panels are added in
    ``build``)."""
    hits, lookups = "kvctl_hits_total", "kvctl_lookup_chunks_total"
    node_legend = "{{dc}} {{instance}}"
    return [
        (
            "Hit ratio",
            [
                Chart(
                    "Hit ratio by DC",
                    "Chunk hits per chunk looked up, per DC (recording rule "
                    "dc:kvctl_hit_ratio:rate5m, measured).",
                    "percentunit",
                    [Query(f"dc:kvctl_hit_ratio:rate5m{{{DCS}}}", "{{dc}}")],
                    width=9,
                    ratio=True,
                ),
                Chart(
                    "Hit ratio by node",
                    "Chunk hits per chunk looked up, per node (recording rule "
                    "dc_instance:kvctl_hit_ratio:rate5m).",
                    "percentunit",
                    [Query(f"dc_instance:kvctl_hit_ratio:rate5m{{{NODES}}}", node_legend)],
                    width=9,
                    ratio=True,
                ),
                Chart(
                    "Reuse and sharing, selected nodes",
                    "The hit ratio split by whose chunk was hit: reuse = the asking tenant's own, "
                    "sharing = another tenant's. Stacked, they add up to the hit ratio.",
                    "percentunit",
                    [
                        Query(
                            f"{rate_by('kind', hits)}\n  / ignoring (kind) group_left ()\n"
                            f"({rate_by('', lookups)} > 0)",
                            "{{kind}}",
                        )
                    ],
                    stacked=True,
                    ratio=True,
                ),
                Chart(
                    "Hits by tier, selected nodes",
                    "Chunk hits per second by the tier that held the chunk (gpu, cpu, disk, "
                    "remote = the pool, peer = another agent).",
                    "suffix: chunks/s",
                    [Query(rate_by("tier", hits), "{{tier}}")],
                    stacked=True,
                ),
                Chart(
                    "GPU power (DCGM) and KV hit ratio by DC",
                    f"GPU power draw summed per DC from the DCGM exporter ({DCGM_POWER}, "
                    "watts, left axis) beside the DC's KV hit ratio (right axis): a higher "
                    "hit ratio should buy the same tokens for less prefill energy.",
                    "watt",
                    [
                        Query(f"sum by (dc) ({DCGM_POWER}{{{DCS}}})", "{{dc}} GPU power"),
                        Query(f"dc:kvctl_hit_ratio:rate5m{{{DCS}}}", "{{dc}} hit ratio"),
                    ],
                    right_axis={"B": "percentunit"},
                ),
                Chart(
                    "GPU power by GPU (DCGM)",
                    f"Each GPU's power draw ({DCGM_POWER}), labelled as the DCGM exporter "
                    "labels it: Hostname and gpu index (UUID in the series' labels).",
                    "watt",
                    [Query(f"{DCGM_POWER}{{{DCS}}}", "{{Hostname}} gpu {{gpu}}")],
                ),
            ],
        ),
        (
            "Tiers",
            [
                Chart(
                    "Tier occupancy",
                    "Bytes held per bytes of capacity, per node and tier (recording rule "
                    "dc_instance_tier:kvctl_tier_used:ratio). A full cache tier is normal; "
                    "evictions climbing with it are not.",
                    "percentunit",
                    [
                        Query(
                            f"dc_instance_tier:kvctl_tier_used:ratio{{{NODES}}}",
                            "{{instance}} {{tier}}",
                        )
                    ],
                    ratio=True,
                ),
                Chart(
                    "Tier used and capacity, selected nodes",
                    "Bytes held and configured capacity, summed by tier.",
                    "bytes",
                    each(
                        ("used", "capacity"),
                        lambda kind: gauge_by("tier", f"kvctl_tier_{kind}_bytes"),
                        "{{tier}}",
                    ),
                ),
                Chart(
                    "Evictions by reason, selected nodes",
                    "Chunks per second leaving a tier by eviction (demoted or dropped), by tier "
                    "and reason: capacity, resize, flush, explicit, corrupt, replaced.",
                    "suffix: chunks/s",
                    [
                        Query(
                            rate_by("tier, reason", "kvctl_evictions_total"), "{{tier}} {{reason}}"
                        )
                    ],
                    stacked=True,
                ),
                Chart(
                    "Corrupt chunks",
                    "Chunks found corrupt on read and dropped (served as misses, never as wrong "
                    "bytes). Anything above zero deserves a look at the node's disk and memory.",
                    "suffix: chunks/s",
                    [Query(rate_by("dc, instance", "kvctl_corrupt_chunks_total"), node_legend)],
                ),
            ],
        ),
        (
            "Data plane",
            [
                Chart(
                    "Data plane bytes/s",
                    "Payload bytes per second over the data plane, per node; in = received by "
                    "the agent (puts), out = sent (gets, fetches).",
                    "Bps",
                    [
                        Query(
                            rate_by("instance, direction", "kvctl_dataplane_bytes_total"),
                            "{{instance}} {{direction}}",
                        )
                    ],
                ),
                Chart(
                    "Data plane latency p50 and p99 by op",
                    "Request service time quantiles from the agents' histograms, over the "
                    "selected nodes.",
                    "s",
                    [
                        Query(
                            quantile(q, "op", "kvctl_dataplane_request_duration_seconds"),
                            f"{{{{op}}}} {name}",
                        )
                        for q, name in (("0.5", "p50"), ("0.99", "p99"))
                    ],
                ),
                Chart(
                    "Data plane requests by outcome",
                    "Requests per second by op and outcome (ok, error), over the selected nodes.",
                    "reqps",
                    [
                        Query(
                            rate_by("op, outcome", "kvctl_dataplane_requests_total"),
                            "{{op}} {{outcome}}",
                        )
                    ],
                    stacked=True,
                ),
                Chart(
                    "Data plane connections",
                    "Open data plane connections per node and transport.",
                    "short",
                    [
                        Query(
                            gauge_by("instance, transport", "kvctl_dataplane_connections"),
                            "{{instance}} {{transport}}",
                        )
                    ],
                ),
            ],
        ),
        (
            "Pool and peers",
            [
                Chart(
                    "Remote source error ratio",
                    "Failed calls per call to each remote source (the pool, peer agents), per "
                    "node.",
                    "percentunit",
                    [
                        Query(
                            f"{rate_by(SOURCE, 'kvctl_remote_source_errors_total')}\n"
                            f"  / ({rate_by(SOURCE, 'kvctl_remote_source_calls_total')} > 0)",
                            "{{instance}} -> {{source}}",
                        )
                    ],
                    ratio=True,
                ),
                Chart(
                    "Remote source calls and skips",
                    "Calls made to each remote source, and calls not made because its breaker "
                    "was open, over the selected nodes.",
                    "reqps",
                    each(
                        ("calls", "skipped"),
                        lambda counter: rate_by(
                            "source, tier", f"kvctl_remote_source_{counter}_total"
                        ),
                        "{{source}}",
                    ),
                ),
            ],
        ),
        (
            "Control API and clock",
            [
                Chart(
                    "Control API errors",
                    "Control API answers with a 4xx or 5xx status per second, by node, route "
                    "template and status (401s included: a client without the token).",
                    "reqps",
                    [
                        Query(
                            rate_by(
                                "instance, route, status",
                                "kvctl_http_requests_total",
                                f'{NODES}, status=~"[45].."',
                            ),
                            "{{instance}} {{route}} {{status}}",
                        )
                    ],
                    width=8,
                ),
                Chart(
                    "Control API latency p99",
                    "99th percentile of control API request duration, by route.",
                    "s",
                    [
                        Query(
                            quantile("0.99", "route", "kvctl_http_request_duration_seconds"),
                            "{{route}}",
                        )
                    ],
                    width=8,
                ),
                Chart(
                    "Clock skew",
                    "Each agent's clock (kvctl_time_seconds, read when scraped) minus the "
                    "scrape's timestamp on Prometheus' clock. KvctlClockSkew fires beyond 1 s.",
                    "s",
                    [
                        Query(
                            f"kvctl_time_seconds{{{NODES}}}"
                            f" - timestamp(kvctl_time_seconds{{{NODES}}})",
                            node_legend,
                        )
                    ],
                    width=8,
                ),
            ],
        ),
    ]


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("kvctl agents")
        .uid(UID)
        .description(
            "KV-cache agents across DCs: hit ratio (reuse and sharing), tiers, evictions, the "
            "data plane, the pool and peers, the control API. Generated by "
            "deploy/grafana/generate.py: edit that, not this JSON."
        )
        .tags(["kvctl", "kv-cache"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .variables(variables())
    )
    next_id = 1
    for title, charts in rows():
        board.with_row(dash.Row(title).id(next_id))
        next_id += 1
        if title == "Hit ratio":
            board.with_panel(hit_ratio_stat(next_id))
            next_id += 1
        for c in charts:
            board.with_panel(chart(c, next_id))
            next_id += 1
        if title == "Pool and peers":
            board.with_panel(breaker_timeline(next_id))
            next_id += 1
    return board


def render() -> str:
    """The dashboard's JSON text as checked in (stable: sorted keys, two-space indent)."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(
                f"{args.output} differs from what {Path(__file__).name} generates: "
                f"run python deploy/grafana/generate.py",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
