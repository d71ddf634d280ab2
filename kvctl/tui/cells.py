"""Table cells for `kvctl top`: figures as Rich text, styled by threshold level.

Styles come from the running theme's own colours (``$success``, ``$warning``, ``$error``), so
light and dark themes both read well, and every warning also shows without colour: bold for a
warning, reversed for a critical value, dim for N/A.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rich.style import Style
from rich.text import Text

from kvctl.format import (
    compact_bytes,
    compact_duration,
    compact_per_second,
    compact_seconds,
    format_number,
    percent,
)
from kvctl.tui.model import (
    DcRow,
    Level,
    LinkPulls,
    NodeRouting,
    NodeRow,
    RoutingView,
    Thresholds,
    WindowCounts,
    bar,
    sparkline,
)

TREND_CELLS = 10
BAR_CELLS = 4


@dataclass(frozen=True, slots=True)
class Palette:
    """The theme's colours for each level (hex strings, as Textual's CSS variables give)."""

    good: str = "#4EBF71"
    warn: str = "#ffa62b"
    crit: str = "#ba3c5b"

    @classmethod
    def from_variables(cls, variables: Mapping[str, str]) -> Palette:
        return cls(
            variables.get("success", cls.good),
            variables.get("warning", cls.warn),
            variables.get("error", cls.crit),
        )

    def style(self, level: Level) -> Style:
        if level is Level.GOOD:
            return Style(color=self.good)
        if level is Level.WARN:
            return Style(color=self.warn, bold=True)
        if level is Level.CRIT:
            return Style(color=self.crit, bold=True, reverse=True)
        return Style()


NA = Text("N/A", style="dim")


class Cells:
    """Every column's text for one node or DC row, in the palette of the running theme."""

    def __init__(self, palette: Palette, thresholds: Thresholds) -> None:
        self.palette = palette
        self.t = thresholds

    def _styled(self, text: str, level: Level) -> Text:
        if text == "N/A":
            return NA.copy()
        return Text(text, style=self.palette.style(level))

    def state(self, row: NodeRow) -> Text:
        if row.up:
            up = Text("up", style=self.palette.style(Level.GOOD))
            if row.rejected:  # figures it answered that cannot be true: N/A, and said why here
                up.append(f" {len(row.rejected)} rejected", style=self.palette.style(Level.WARN))
            return up
        if row.auth_refused:  # it answered: restarting it would not help, the token would
            return Text("up, token refused", style=self.palette.style(Level.WARN))
        if row.starting:  # it answered: its tiers are opening (its log shows the progress)
            return Text("up, starting", style=self.palette.style(Level.WARN))
        # ≥: never seen up, by the collectors or this view: down at least since the first poll
        at_least = "≥" if row.last_seen_ms is None else ""
        # hung (took the connection, said nothing) is not down: its log says why, not a start
        word = "NO ANSWER" if row.silent else "DOWN"
        return Text(
            f"{word} {at_least}{compact_duration(row.down_for_s)}",
            style=self.palette.style(Level.CRIT),
        )

    def hit(self, recent: WindowCounts) -> Text:
        if not recent.hit_known:  # a counter rejected from the answer: unknown, not idle
            return NA.copy()
        if recent.seconds and recent.hit_ratio is None:
            return Text("idle", style="dim")
        return self._styled(percent(recent.hit_ratio, digits=0), self.t.hit(recent.hit_ratio))

    def trend(self, row: NodeRow) -> Text:
        return Text(sparkline(row.hit_history, TREND_CELLS))

    def split(self, recent: WindowCounts) -> Text:
        if recent.reuse_share_of_hits is None:
            return NA.copy()
        reuse = round(recent.reuse_share_of_hits * 100)
        return Text(f"{reuse}/{100 - reuse}")

    def occupancy(self, ratio: float | None) -> Text:
        if ratio is None:
            return NA.copy()
        level = self.t.occupancy(ratio)
        # the gauge takes the level's colour only: reversed block glyphs would vanish
        gauge = Style(color=self.palette.style(level).color) if level is not Level.NONE else ""
        return Text.assemble(
            (bar(ratio, BAR_CELLS), gauge), (f"{ratio * 100:4.0f}%", self.palette.style(level))
        )

    def rate(self, per_s: float | None) -> Text:
        return self._styled(compact_per_second(per_s), Level.NONE)

    def io(self, per_s: float | None) -> Text:
        return NA.copy() if per_s is None else Text(f"{compact_bytes(per_s)}/s")

    def rtt(self, row: NodeRow, has_links: bool) -> Text:
        worst = row.worst_link
        if worst is None:
            return Text("no probes" if has_links else "N/A", style="dim")
        # an RTT with an agent-emulated delay in it is not a measurement of the link: say so
        basis = {"emulated": " emu", "mixed": " mix"}.get(row.worst_link_basis or "", "")
        return Text.assemble(
            f"{worst[0]} ",
            (compact_seconds(worst[1]), self.palette.style(self.t.rtt(worst[1]))),
            (basis, "dim"),
        )

    def power(self, watts: float | None) -> Text:
        return NA.copy() if watts is None else Text(f"{watts:.0f}W")

    def routed(self, routing: NodeRouting | None) -> Text:
        """Decisions per second the router sent this node over the recent window."""
        return self._styled(
            compact_per_second(None if routing is None else routing.decisions_per_s), Level.NONE
        )

    def to_holder(self, routing: NodeRouting | None) -> Text:
        """Of those, the share sent here because the node held (part of) the prefix."""
        if routing is None or not routing.seconds:
            return NA.copy()
        if not routing.recent_decisions:
            return Text("idle", style="dim")
        return Text(percent(routing.to_holder_share, digits=0))

    def routing(self, view: RoutingView) -> Text:
        """The routing panel: the router's fleet-wide figures since it started, the recent
        decision rate, and the bytes its decisions pulled across each DC link."""
        if not view.up:
            return Text.assemble(
                ("router down: ", self.palette.style(Level.CRIT)),
                (view.error or "no answer", ""),
                (" · routing figures N/A", "dim"),
            )
        t = view.total
        parts = [
            f"routing since the router started: {format_number(t.decisions)} decisions",
            f"{percent(t.to_holder_share, digits=0)} to a holder",
            f"index hit {percent(t.index_hit_ratio, digits=0)} of "
            f"{format_number(t.requested_chunks)} chunks",
            f"reused {percent(t.reused_ratio, digits=0)}: {format_number(t.local_chunks)} "
            f"local, {format_number(t.pulled_chunks)} pulled",
            f"tokens fetched {format_number(t.fetched_tokens)}, prefilled "
            f"{format_number(t.recomputed_tokens)}",
        ]
        if view.no_node:
            parts.append(f"{format_number(view.no_node)} with no node")

        def pulled(link: LinkPulls, name: str) -> str:
            now = "N/A" if link.bytes_per_s is None else f"{compact_bytes(link.bytes_per_s)}/s"
            return (
                f"{name} {compact_bytes(link.pulled_bytes)} in {format_number(link.chunks)} "
                f"chunks ({now} now)"
            )

        between = [pulled(x, f"{x.from_dc}→{x.to_dc}") for x in view.links if x.from_dc != x.to_dc]
        within = [pulled(x, x.to_dc) for x in view.links if x.from_dc == x.to_dc]
        second = [
            f"now {compact_per_second(view.recent.decisions_per_s)} decisions/s",
            "pulled between DCs since the router started: " + (" · ".join(between) or "none"),
        ]
        if within:
            second.append("within a DC: " + " · ".join(within))
        first, pulls = " · ".join(parts), " · ".join(second)
        return Text(f"{first}\n{pulls}")


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    title: str
    node: Callable[[Cells, NodeRow, bool], Text]
    dc: Callable[[Cells, DcRow], Text]


def _blank(_c: Cells, _d: DcRow) -> Text:
    return Text("")


def _tier_column(tier: str) -> Column:
    def node(c: Cells, r: NodeRow, _links: bool) -> Text:
        t = r.tiers.get(tier)
        return c.occupancy(None if t is None or not r.up else t.occupancy_ratio)

    def dc(c: Cells, d: DcRow) -> Text:
        t = d.tiers.get(tier)
        return c.occupancy(None if t is None else t.occupancy_ratio)

    return Column(f"tier:{tier}", tier.upper(), node, dc)


def _up(fn: Callable[[Cells, NodeRow], Text]) -> Callable[[Cells, NodeRow, bool], Text]:
    """A live figure: N/A while the node is down (its last figures would be stale)."""

    def cell(c: Cells, r: NodeRow, _links: bool) -> Text:
        return fn(c, r) if r.up else NA.copy()

    return cell


def _routing_columns() -> list[Column]:
    """The router's figures per node; they stand whether the node's agent answers or not."""
    return [
        Column(
            "routed",
            "ROUTED/s",
            lambda c, r, _: c.routed(r.routing),
            lambda c, d: c.routed(d.routing),
        ),
        Column(
            "holder",
            "TO HOLDER",
            lambda c, r, _: c.to_holder(r.routing),
            lambda c, d: c.to_holder(d.routing),
        ),
    ]


def columns(tiers: list[str], *, routing: bool = False) -> list[Column]:
    """The fleet table's columns: the key ones first so an 80-column terminal shows them;
    ``routing`` adds the router's per node (only when a router is watched)."""
    return [
        Column("dc", "DC", lambda c, r, _: Text(r.dc), lambda c, d: Text(d.dc, style="bold")),
        Column(
            "node",
            "NODE",
            lambda c, r, _: Text(r.name),
            lambda c, d: Text(f"{d.up}/{d.nodes} up", style="bold"),
        ),
        Column("state", "STATE", lambda c, r, _: c.state(r), _blank),
        Column("hit", "HIT", _up(lambda c, r: c.hit(r.recent)), lambda c, d: c.hit(d.recent)),
        Column("trend", "TREND", lambda c, r, _: c.trend(r), _blank),
        Column(
            "split",
            # shares of the hits (reuse_/sharing_share_of_hits), not per lookup: said here
            # because the dashboard's "sharing hit ratio" is the per-lookup one
            "HITS R/S",
            _up(lambda c, r: c.split(r.recent)),
            lambda c, d: c.split(d.recent),
        ),
        *(_routing_columns() if routing else []),
        *(_tier_column(t) for t in tiers),
        Column(
            "evictions",
            "EVICT/s",
            _up(lambda c, r: c.rate(r.recent.evictions_per_s)),
            lambda c, d: c.rate(d.evictions_per_s),
        ),
        Column(
            "io",
            "I/O",
            _up(lambda c, r: c.io(r.recent.io_bytes_per_s)),
            lambda c, d: c.io(d.io_bytes_per_s),
        ),
        Column("rtt", "RTT", lambda c, r, links: c.rtt(r, links), _blank),
        Column(
            "power",
            "POWER",
            _up(lambda c, r: c.power(None if r.gpu is None else r.gpu.power_w)),
            lambda c, d: c.power(d.power_w),
        ),
    ]
