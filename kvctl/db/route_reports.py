"""Saved routing-policy comparisons (`kvctl bench route`'s result, replayed by the demo): the
demo writes them, the dashboard's routing page reads the latest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection

from kvctl.db.models import RouteReport


def save_route_report(conn: Connection, report: dict[str, Any], *, now_ms: int) -> None:
    """Store a route report (a JSON object, as `kvctl bench route --json` prints it)."""
    if not isinstance(report, dict):
        raise TypeError(f"a route report is a JSON object, got {type(report).__name__}")
    conn.execute(
        insert(RouteReport).values(ts_ms=now_ms, report=json.dumps(report, separators=(",", ":")))
    )


@dataclass(frozen=True, slots=True)
class SavedRouteReport:
    ts_ms: int
    report: dict[str, Any]


def latest_saved_route_report(conn: Connection) -> SavedRouteReport | None:
    """The newest saved route report and when it was saved; None when none was saved."""
    row = conn.execute(
        select(RouteReport.ts_ms, RouteReport.report)
        .order_by(RouteReport.ts_ms.desc(), RouteReport.id.desc())
        .limit(1)
    ).first()
    return None if row is None else SavedRouteReport(int(row.ts_ms), json.loads(row.report))


def latest_route_report(conn: Connection) -> dict[str, Any] | None:
    """The newest saved route report, None when none was saved."""
    saved = latest_saved_route_report(conn)
    return None if saved is None else saved.report
