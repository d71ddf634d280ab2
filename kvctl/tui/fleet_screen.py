"""The fleet table: one row per node, sorted, filtered and grouped by DC as the operator asks."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static
from textual.widgets.data_table import RowDoesNotExist

from kvctl.format import compact_seconds, percent
from kvctl.tui.cells import Column, columns
from kvctl.tui.model import FleetView, Line, arrange

if TYPE_CHECKING:
    from kvctl.db.inventory import NodeInfo
    from kvctl.tui.app import TopApp


class FleetScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse", show=False),
        Binding("g", "group", "Group DC"),
        Binding("enter", "open", "Node"),
        Binding("f", "flush", "Flush"),
        Binding("z", "resize", "Resize"),
        Binding("r", "refresh", "Refresh", show=False),
        Binding("p", "pause", "Pause"),
        Binding("escape", "clear_filter", "Clear", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.sort = "dc"
        self.reverse = False
        self.query_text = ""
        self.group = False
        self._columns: list[Column] = []
        self._titles: list[tuple[str, str]] = []
        self._lines: list[Line] = []

    @property
    def top(self) -> TopApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield Static("waiting for the first poll…", id="summary", markup=False)
        yield Static("", id="routing", markup=False)
        table: DataTable[object] = DataTable(id="fleet", cursor_type="row", zebra_stripes=True)
        yield table
        yield Input(placeholder="filter: words, dc:NAME, node:NAME, up, down, !word", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#routing", Static).display = False
        self.sub_title = self.top.source.label + (" · READ-ONLY" if self.top.readonly else "")
        if self.top.view is not None:
            self.show_view(self.top.view)

    # --- drawing -------------------------------------------------------------------------------
    def show_view(self, view: FleetView) -> None:
        table = self.query_one("#fleet", DataTable)
        cols = columns(view.tiers, routing=view.routing is not None)
        if self.sort not in {c.key for c in cols}:
            self.sort = "dc"
        # before any clearing: the operator's selection and scroll survive every redraw
        selected = self._selected_key(table)
        scroll = (table.scroll_x, table.scroll_y)
        titles = [(c.key, self._title(c)) for c in cols]
        if titles != self._titles:  # new tiers, or the sort arrow moved
            table.clear(columns=True)
            for key, title in titles:
                table.add_column(title, key=key)
            self._columns, self._titles = cols, titles
        self._lines = arrange(
            view, sort=self.sort, reverse=self.reverse, query=self.query_text, group=self.group
        )
        cells = self.top.cells()
        table.clear()
        for line in self._lines:
            if line.row is not None:
                row = line.row
                table.add_row(
                    *(c.node(cells, row, view.has_links) for c in cols), key=f"node:{row.name}"
                )
            elif line.dc is not None:
                table.add_row(*(c.dc(cells, line.dc) for c in cols), key=f"dc:{line.dc.dc}")
        if selected is not None:
            # filtered out: the cursor stays where it is
            with contextlib.suppress(RowDoesNotExist):
                table.move_cursor(row=table.get_row_index(selected), animate=False, scroll=False)
        table.scroll_to(*scroll, animate=False, immediate=True)
        self._summary(view)
        panel = self.query_one("#routing", Static)
        panel.display = view.routing is not None
        if view.routing is not None:
            panel.update(self.top.cells().routing(view.routing))

    def _title(self, c: Column) -> str:
        if c.key != self.sort:
            return c.title
        return f"{c.title} {'▼' if self.reverse else '▲'}"

    def _summary(self, view: FleetView) -> None:
        app = self.top
        t = view.total
        parts = [
            f"{t.up}/{t.nodes} up",
            f"hit {percent(t.recent.hit_ratio, digits=0)}",
            f"poll {compact_seconds(view.poll_s)} every {app.interval_s:g}s",
        ]
        if app.late_ticks:
            parts.append(f"{app.late_ticks} late")
        if self.query_text:
            shown = sum(1 for ln in self._lines if ln.row is not None)
            parts.append(f"filter {self.query_text!r}: {shown} shown")
        if app.paused:
            parts.append("PAUSED")
        if app.poll_error:
            parts.append(f"poll failed: {app.poll_error}")
        if view.db_error:  # the agents are live; what the database gives is not
            parts.append(
                f"database failed: {view.db_error} (nodes and RTTs as last read; agents live)"
            )
        self.query_one("#summary", Static).update(" · ".join(parts))

    def _selected_key(self, table: DataTable[object]) -> str | None:
        if table.row_count == 0:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except Exception:
            return None
        return key

    def selected_node(self) -> NodeInfo | None:
        key = self._selected_key(self.query_one("#fleet", DataTable))
        view = self.top.view
        if key is None or view is None or not key.startswith("node:"):
            return None
        row = view.row(key.removeprefix("node:"))
        return None if row is None else row.node

    def _redraw(self) -> None:
        if self.top.view is not None:
            self.show_view(self.top.view)

    # --- keys ----------------------------------------------------------------------------------
    def action_sort(self) -> None:
        keys = [c.key for c in self._columns] or ["dc"]
        i = keys.index(self.sort) if self.sort in keys else -1
        self.sort = keys[(i + 1) % len(keys)]
        self._redraw()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self._redraw()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        key = str(event.column_key.value)
        if key == self.sort:
            self.reverse = not self.reverse
        else:
            self.sort, self.reverse = key, False
        self._redraw()

    def action_group(self) -> None:
        self.group = not self.group
        self._redraw()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_text = event.value
        self._redraw()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self.query_one("#fleet", DataTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display or self.query_text:
            box.value = ""
            box.display = False
            self.query_text = ""
            self.query_one("#fleet", DataTable).focus()
            self._redraw()

    def action_refresh(self) -> None:
        self.top.tick()

    def action_pause(self) -> None:
        self.top.paused = not self.top.paused
        self.notify("paused: figures frozen" if self.top.paused else "resumed", timeout=2)
        self._redraw()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_open(self) -> None:
        from kvctl.tui.node_screen import NodeScreen

        node = self.selected_node()
        if node is not None:
            self.app.push_screen(NodeScreen(node))

    def _tier_action(self, action: str) -> None:
        node = self.selected_node()
        if node is None:
            self.notify("select a node first", severity="warning")
            return
        self.top.tier_action(node, action)

    def action_flush(self) -> None:
        self._tier_action("flush")

    def action_resize(self) -> None:
        self._tier_action("resize")
