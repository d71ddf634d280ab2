"""Saved capacity plans: `kvctl plan --save` writes them, the dashboard reads the latest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from kvctl.db.models import PlanRecord


@dataclass(frozen=True, slots=True)
class SavedPlan:
    id: int
    created_ms: int
    #: None: made for the fleet as a whole
    dc: str | None
    workload: str
    report: dict[str, Any]


def save_plan(conn: Connection, report: dict[str, Any], *, dc: str | None, now_ms: int) -> int:
    """Store a plan report (as `kvctl plan --json` prints it); returns its id."""
    row = conn.execute(
        PlanRecord.__table__.insert()
        .values(
            created_ms=now_ms,
            dc=dc,
            workload=str(report.get("workload", "")),
            report=json.dumps(report, separators=(",", ":")),
        )
        .returning(PlanRecord.__table__.c.id)
    ).scalar_one()
    return int(row)


def latest_plans(conn: Connection) -> dict[str | None, SavedPlan]:
    """The newest saved plan of each DC (key None: the fleet-wide one)."""
    t = PlanRecord.__table__
    newest = (
        select(func.max(t.c.id).label("id")).group_by(t.c.dc).subquery()  # ids grow with time
    )
    rows = conn.execute(select(t).join(newest, newest.c.id == t.c.id)).all()
    return {
        r.dc: SavedPlan(r.id, r.created_ms, r.dc, r.workload, json.loads(r.report)) for r in rows
    }
