"""Small building blocks of the pages: figure cards with their basis, tables with CSV export,
and empty states that say what to run."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dash import dash_table, dcc, html

from kvctl.db.analytics.counts import EMULATED, MEASURED, MODELED, REPLAYED
from kvctl.db.analytics.windows import Window
from kvctl.format import format_utc_minute


def window_text(win: Window) -> str:
    span = f"{win.name} fitted to the data" if win.fitted else f"last {win.name}"
    return f"{format_utc_minute(win.start_ms)} to {format_utc_minute(win.end_ms)} ({span})"


#: a figure whose parts have two bases, badged as such rather than as the better one:
#: RTTs probed where some probes carry an agent-emulated delay (others not)
MEASURED_AND_EMULATED = "measured-emulated"
#: a measured figure shown beside a modeled one (TTFT with cache vs modeled without)
MEASURED_VS_MODELED = "measured-modeled"

#: what each basis badge reads
BASIS_LABELS = {
    MEASURED: "measured",
    MODELED: "modeled",
    EMULATED: "emulated",
    REPLAYED: "measured in replay",
    MEASURED_AND_EMULATED: "measured + emulated",
    MEASURED_VS_MODELED: "measured vs modeled",
}


def basis_badge(basis: str) -> html.Span:
    return html.Span(BASIS_LABELS[basis], className=f"basis basis-{basis}")


def card(
    title: str, value: str, basis: str, note: str = "", *, card_id: str | None = None
) -> html.Div:
    """A headline figure; ``basis`` is one of :data:`BASIS_LABELS` (measured, modeled,
    emulated, measured in replay, or two of them), ``note`` says from what."""
    assert basis in BASIS_LABELS
    kw = {"id": card_id} if card_id else {}
    return html.Div(
        [
            html.Div([html.Span(title, className="card-title"), basis_badge(basis)]),
            html.Div(value, className="card-value"),
            html.Div(note, className="card-note"),
        ],
        className="card",
        **kw,
    )


def empty(message: str, *, hint: str = "") -> html.Div:
    parts: list[Any] = [html.Div(message, className="empty-message")]
    if hint:
        parts.append(html.Div(hint, className="empty-hint"))
    return html.Div(parts, className="empty")


def section(
    title: str, basis: str, win: Window | None, *children: Any, note: str = ""
) -> html.Section:
    """A figure or table with its heading, basis and window: nothing is shown unlabelled."""
    label = [basis_badge(basis)]
    if win is not None:
        label.append(html.Span(window_text(win), className="window"))
    if note:
        label.append(html.Span(note, className="section-note"))
    return html.Section(
        [html.H3(title), html.Div(label, className="section-label"), *children],
        className="section",
    )


#: the trace properties that carry names into a chart: axis categories, labels, legend, hover
_TEXT_PROPS = ("x", "y", "text", "hovertext", "name")


def _as_text(value: Any) -> Any:
    """Plotly reads tags in a chart's text (<a href>, <br>, <span style>), and a DC or node name
    is any printable text: its < and > as entities, which plotly shows as the characters."""
    if isinstance(value, str):
        return value.replace("<", "&lt;").replace(">", "&gt;")
    if isinstance(value, list | tuple):
        return type(value)(_as_text(v) for v in value)
    return value


def graph(figure: Any, graph_id: str) -> dcc.Graph:
    """A chart whose names (whatever the inventory holds) show as text, never as markup."""
    for trace in figure.data:
        for prop in _TEXT_PROPS:
            if prop in trace and trace[prop] is not None:
                trace[prop] = _as_text(trace[prop])
    return dcc.Graph(id=graph_id, figure=figure, config={"displaylogo": False})


#: a signed figure ("+1.2 pts", "-3", "-0.5 ms"), which a spreadsheet reads as a number
_SIGNED_FIGURE = re.compile(r"[+-](\d|\.\d)")


def inert(value: Any) -> Any:
    """``value`` as a spreadsheet opening the table's CSV export reads it as text: a cell that
    starts as a formula would (=, @, tab, CR, or + or - not before a number: a DC or node name is
    any printable text, a scrape's error what the agent or network said) gets a leading
    apostrophe, which spreadsheets take as "text" (OWASP's CSV injection advice). A lone '-' is
    the tables' own placeholder (nothing measured), no formula in any spreadsheet: kept."""
    if not isinstance(value, str) or not value or value == "-":
        return value
    if value[0] in "=@\t\r" or (value[0] in "+-" and not _SIGNED_FIGURE.match(value)):
        return "'" + value
    return value


def table(table_id: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Any:
    """A sortable table with a CSV export button; its text cells :func:`inert`."""
    return dash_table.DataTable(
        id=table_id,
        columns=[{"name": c, "id": c} for c in columns],
        data=[{k: inert(v) for k, v in row.items()} for row in rows],
        export_format="csv",
        export_headers="display",
        sort_action="native",
        page_size=25,
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px"},
        style_header={"fontWeight": "600"},
    )
