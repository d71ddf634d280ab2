"""Small building blocks of the pages: figure cards with their basis, tables with CSV export,
and empty states that say what to run."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from dash import dash_table, dcc, html

from dashboard.queries import MEASURED, MODELED, Window


def fmt_ratio(v: float | None) -> str:
    return "N/A" if v is None else f"{v * 100:.1f}%"


def fmt_num(v: float | None, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "N/A"
    if abs(v) >= 1000:
        text = f"{v:,.0f}"
    elif v == 0:
        text = "0"
    else:
        text = f"{v:.{digits}g}"
    return f"{text} {unit}".rstrip()


def fmt_scaled(v: float | None, units: tuple[tuple[float, str], ...]) -> str:
    """``v`` in the largest of ``units`` (factor, name; largest first) it reaches, else the
    smallest: 0.003 GPU-hours reads 12.3 GPU-s."""
    if v is None:
        return "N/A"
    for factor, name in units:
        if abs(v) >= factor:
            return fmt_num(v / factor, name)
    factor, name = units[-1]
    return fmt_num(v / factor, name)


GPU_TIME: Final = ((3600.0, "GPU-h"), (1.0, "GPU-s"))
ENERGY: Final = ((3.6e9, "MWh"), (3.6e6, "kWh"), (3.6e3, "Wh"), (1.0, "J"))
MASS: Final = ((1e6, "t"), (1e3, "kg"), (1.0, "g"))


def fmt_seconds(v: float | None) -> str:
    if v is None:
        return "N/A"
    if v < 1e-3:
        return f"{v * 1e6:.0f} µs"
    if v < 1:
        return f"{v * 1e3:.1f} ms"
    return f"{v:.2f} s"


def fmt_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def window_text(win: Window) -> str:
    return f"{fmt_time(win.start_ms)} to {fmt_time(win.end_ms)} (last {win.name})"


def basis_badge(basis: str) -> html.Span:
    return html.Span(basis, className=f"basis basis-{basis}")


def card(
    title: str, value: str, basis: str, note: str = "", *, card_id: str | None = None
) -> html.Div:
    """A headline figure; ``basis`` is measured or modeled, ``note`` says from what."""
    assert basis in (MEASURED, MODELED)
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


def graph(figure: Any, graph_id: str) -> dcc.Graph:
    return dcc.Graph(id=graph_id, figure=figure, config={"displaylogo": False})


def table(table_id: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Any:
    """A sortable table with a CSV export button."""
    return dash_table.DataTable(
        id=table_id,
        columns=[{"name": c, "id": c} for c in columns],
        data=list(rows),
        export_format="csv",
        export_headers="display",
        sort_action="native",
        page_size=25,
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px"},
        style_header={"fontWeight": "600"},
    )
