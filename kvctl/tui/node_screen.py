"""One node up close: its tiers with occupancy history, since its agent started the share of
reads whose chunk was gone and each tier's reuse/sharing hit ratios, the live event stream, its
hottest prefixes and its pinned chunks, with actions on the selected chunk or tier."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, RichLog, Static, TabbedContent, TabPane

from kvctl.db.inventory import NodeInfo
from kvctl.fleet.actions import ActionRequest, ChunkSelection
from kvctl.format import (
    compact_bytes,
    compact_duration,
    compact_per_second,
    format_bytes,
    percent,
)
from kvctl.tui.app import POLL_WAIT_SHARE
from kvctl.tui.model import FleetView, NodeRow, sparkline, tier_order
from kvctl.tui.sources import Details

if TYPE_CHECKING:
    from kvctl.tui.app import TopApp

#: events kept on screen
EVENT_LINES = 500
HISTORY_CELLS = 30


def event_line(e: dict[str, Any]) -> str:
    # UTC, as every other time kvctl shows (status, audit, dashboard); the tab says so
    at = time.strftime("%H:%M:%S", time.gmtime(float(e.get("time_s", 0))))
    src = f" from {e['src']}" if e.get("src") else ""
    tenant = e.get("tenant") or "-"
    return (
        f"{at} {e.get('type', '?'):<7} {e.get('tier', ''):<6} {str(e.get('key', ''))[:16]} "
        f"{compact_bytes(float(e.get('size_bytes', 0))):>5} {tenant}{src}"
    )


def since_start_line(row: NodeRow) -> str:
    """Since the node's agent started: the share of its engines' reads whose chunk was gone
    (`kvctl status`'s "reads gone") and each tier's reuse / sharing hits per lookup."""
    since = row.since_start
    if since is None:
        return "since start: N/A"
    reads = since.read_figures()
    chunks, missing = reads["read_chunks"], reads["read_missing_chunks"]
    if chunks is None or missing is None:
        # an agent older than the counts reports none; one that cannot be true was rejected
        rejected = any(k.startswith("dataplane") for k in row.rejected)
        gone = f"reads gone N/A ({'rejected' if rejected else 'not reported'})"
    else:
        gone = (
            f"reads gone {percent(reads['read_missing_ratio'])} "
            f"({missing:,.0f} of {chunks:,.0f} chunks)"
        )
    split = []
    for tier in tier_order(since.tier_hits):
        t = since.tier_hit_counts(tier)
        split.append(f"{tier} {percent(t.reuse_hit_ratio)} / {percent(t.sharing_hit_ratio)}")
    by_tier = ", ".join(split) or "N/A"
    return f"since start: {gone} · per tier reuse / sharing: {by_tier}"


class NodeScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace", "back", "Back"),
        Binding("p", "chunk('pin')", "Pin"),
        Binding("u", "chunk('unpin')", "Unpin"),
        Binding("e", "chunk('evict')", "Evict"),
        Binding("f", "tier('flush')", "Flush"),
        Binding("z", "tier('resize')", "Resize"),
        Binding("1", "tab('tab-events')", "Events", show=False),
        Binding("2", "tab('tab-top')", "Top", show=False),
        Binding("3", "tab('tab-pinned')", "Pinned", show=False),
    ]

    def __init__(self, node: NodeInfo) -> None:
        super().__init__()
        self.node = node
        self.cursor: int | None = None
        self.details_error: str | None = None
        self._fetching = False

    @property
    def top(self) -> TopApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield Static("", id="node-summary", markup=False)
        yield DataTable(id="tiers", cursor_type="row")
        with TabbedContent(id="tabs"):
            with TabPane("Events (UTC)", id="tab-events"):
                yield RichLog(id="events", max_lines=EVENT_LINES, wrap=False, markup=False)
            with TabPane("Top prefixes", id="tab-top"):
                yield DataTable(id="top", cursor_type="row")
            with TabPane("Pinned", id="tab-pinned"):
                yield DataTable(id="pinned", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"{self.node.name} · {self.node.dc}" + (
            " · READ-ONLY" if self.top.readonly else ""
        )
        tiers = self.query_one("#tiers", DataTable)
        tiers.add_columns("TIER", "USED", "CAPACITY", "OCC", "PINNED", "CHUNKS", "EVICT/s")
        tiers.add_column("HISTORY", key="history")
        for table_id in ("#top", "#pinned"):
            self.query_one(table_id, DataTable).add_columns(
                "KEY", "TIER", "HITS", "PREFIX", "SIZE", "TENANT", "PIN"
            )
        if self.top.view is not None:
            self.show_view(self.top.view)
        self.fetch_details()
        if self.top.auto_poll:
            self.set_interval(self.top.interval_s, self.fetch_details)

    # --- the fleet poll's figures for this node -------------------------------------------------
    def row(self) -> NodeRow | None:
        view = self.top.view
        return None if view is None else view.row(self.node.name)

    def show_view(self, view: FleetView) -> None:
        row = view.row(self.node.name)
        summary = self.query_one("#node-summary", Static)
        if row is None:
            summary.update(f"{self.node.name}: no longer in the fleet")
            return
        summary.update(self._summary(row))
        tiers = self.query_one("#tiers", DataTable)
        selected = tiers.cursor_row
        tiers.clear()
        cells = self.top.cells()
        for name, t in row.tiers.items():
            history = row.occupancy_history.get(name, [])
            tiers.add_row(
                name,
                format_bytes(t.used_bytes),
                format_bytes(t.capacity_bytes),
                cells.occupancy(t.occupancy_ratio if row.up else None),
                format_bytes(t.pinned_bytes),
                f"{t.chunks:,}",
                compact_per_second(t.evictions_per_s) if row.up else "N/A",
                sparkline(history, HISTORY_CELLS),
                key=name,
            )
        if tiers.row_count:
            tiers.move_cursor(row=min(selected, tiers.row_count - 1), animate=False)

    def _summary(self, row: NodeRow) -> str:
        r = row.recent
        if row.auth_refused:
            head = f"up, token refused: {row.error}"
        elif row.starting:  # its tiers are opening: its log (agent.log) shows the progress
            head = f"up, starting: {row.error}"
        elif not row.up:
            at_least = "≥" if row.last_seen_ms is None else ""  # never seen up: a lower bound
            word = "NO ANSWER" if row.silent else "DOWN"
            head = f"{word} for {at_least}{compact_duration(row.down_for_s)}: {row.error}"
        else:
            head = (
                f"up {compact_duration(row.uptime_s)} · "
                f"hit {percent(r.hit_ratio, digits=0)} recent, "
                f"{percent(row.lifetime_hit_ratio, digits=0)} since start · "
                f"lookups {compact_per_second(r.lookups_per_s)}/s · "
                f"I/O {'N/A' if r.io_bytes_per_s is None else compact_bytes(r.io_bytes_per_s)}/s"
            )
        gpu = row.gpu
        if gpu is not None:
            head += " · power " + (
                f"{gpu.power_w:.0f} W ({gpu.gpus} GPU)" if gpu.power_w is not None else "N/A"
            )
            if gpu.note and gpu.power_w is None:
                head += f" ({gpu.note.removeprefix('NVML unavailable: ')})"
        if row.up:
            head += "\n" + since_start_line(row)
        if self.details_error and self.details_error != row.error:  # (not said twice)
            head += f"\n{self.details_error}"
        return head

    # --- the agent's own detail: events, hot and pinned chunks ----------------------------------
    def fetch_details(self) -> None:
        if self._fetching:
            return
        self._fetching = True
        self._fetch()

    @work(thread=True, group="node", exit_on_error=False)
    def _fetch(self) -> None:
        # waited for as the fleet poll waits for the agents: this worker's thread is the event
        # loop's, which the poll's worker needs too; a node trickling its answer (no read
        # timeout ends it) reads as not answering, its call left on a thread of its own
        wait_s = self.top.interval_s * POLL_WAIT_SHARE
        details = self.top.source.details(self.node, self.cursor, wait_s)
        self.top.from_thread(self._show_details, details)

    def _show_details(self, d: Details) -> None:
        self._fetching = False
        self.details_error = d.error
        log = self.query_one("#events", RichLog)
        if d.restarted:
            log.write("… the agent restarted: its event sequence began again")
        if d.dropped:
            log.write(f"… {d.dropped} events missed (the agent's buffer moved on)")
        for e in d.events:
            log.write(event_line(e))
        self.cursor = d.cursor
        if d.top is not None:
            self._fill("#top", d.top)
        if d.pinned is not None:
            self._fill("#pinned", d.pinned)
        if self.top.view is not None:
            self.show_view(self.top.view)

    def _fill(self, table_id: str, items: list[dict[str, Any]]) -> None:
        table = self.query_one(table_id, DataTable)
        # the list re-sorts by hits each fetch: keep the cursor on the same chunk, not the row
        selected = None
        if table.row_count:
            selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        scroll = (table.scroll_x, table.scroll_y)
        table.clear()
        for it in items:
            prefix = f"{it['prefix_tokens']:,} tok" + ("" if it["prefix_complete"] else "+")
            table.add_row(
                it["key"][:16],
                it["tier"],
                f"{it['hit_count']:,}",
                prefix,
                compact_bytes(float(it["size_bytes"])),
                it["tenant"] or "-",
                "yes" if it["pinned"] else "",
                key=it["key"],
            )
        keys = [str(it["key"]) for it in items]
        if selected in keys:
            table.move_cursor(row=keys.index(selected), animate=False, scroll=False)
        table.scroll_to(*scroll, animate=False, immediate=True)

    # --- actions -------------------------------------------------------------------------------
    def after_action(self) -> None:
        self.fetch_details()

    def action_tab(self, tab: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tab
        target = {"tab-events": "#events", "tab-top": "#top", "tab-pinned": "#pinned"}[tab]
        self.query_one(target).focus()

    def action_back(self) -> None:
        self.app.pop_screen()

    def selected_chunk(self) -> str | None:
        active = self.query_one("#tabs", TabbedContent).active
        table_id = {"tab-top": "#top", "tab-pinned": "#pinned"}.get(active)
        if table_id is None:
            return None
        table = self.query_one(table_id, DataTable)
        if table.row_count == 0:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def action_chunk(self, action: str) -> None:
        key = self.selected_chunk()
        if key is None:
            self.notify(
                f"{action}: select a chunk under Top prefixes or Pinned (Tab switches)",
                severity="warning",
            )
            return
        request = ActionRequest(action, chunks=ChunkSelection(keys=(key,)))
        self.top.request_action(self.node, request, f"chunk {key}")

    def action_tier(self, action: str) -> None:
        table = self.query_one("#tiers", DataTable)
        tier = None
        if table.row_count:
            tier = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        self.top.tier_action(self.node, action, tier)
