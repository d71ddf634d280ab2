"""The fleet inventory: DCs, the nodes in them (one agent each), and the links between DCs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from kvctl.db.models import DataCenter, Link, Node


class InventoryError(ValueError):
    """An inventory change that cannot be made as asked (unknown DC, duplicate name...)."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    id: int
    name: str
    dc: str
    agent_url: str
    gpu_model: str
    engine_url: str | None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _insert(conn: Connection, model: Any, duplicate: str, **values: Any) -> int:
    """Insert one inventory row and return its id; a unique-key clash becomes ``duplicate``."""
    try:
        with conn.begin_nested():
            return conn.execute(
                model.__table__.insert().values(**values).returning(model.id)
            ).scalar_one()
    except IntegrityError:
        raise InventoryError(duplicate) from None


def dc_id(conn: Connection, name: str) -> int:
    found = conn.execute(select(DataCenter.id).where(DataCenter.name == name)).scalar()
    if found is None:
        known = conn.execute(select(DataCenter.name).order_by(DataCenter.name)).scalars().all()
        raise InventoryError(
            f"no DC named {name!r} (known: {', '.join(known) or 'none'}); add it with "
            "`kvctl fleet add-dc`"
        )
    return found


def add_dc(
    conn: Connection,
    name: str,
    *,
    region: str = "",
    location: str = "",
    carbon_g_per_kwh: float | None = None,
    pue: float | None = None,
) -> int:
    if pue is not None and pue < 1:
        raise InventoryError(f"PUE must be at least 1, got {pue}")
    if carbon_g_per_kwh is not None and carbon_g_per_kwh < 0:
        raise InventoryError(f"carbon intensity must not be negative, got {carbon_g_per_kwh}")
    return _insert(
        conn,
        DataCenter,
        f"a DC named {name!r} already exists",
        name=name,
        region=region,
        location=location,
        carbon_g_per_kwh=carbon_g_per_kwh,
        pue=pue,
        created_ms=_now_ms(),
    )


def add_node(
    conn: Connection,
    name: str,
    *,
    dc: str,
    agent_url: str,
    gpu_model: str = "",
    engine_url: str | None = None,
) -> int:
    dc_key = dc_id(conn, dc)
    return _insert(
        conn,
        Node,
        f"a node named {name!r} already exists",
        name=name,
        dc_id=dc_key,
        agent_url=agent_url,
        gpu_model=gpu_model,
        engine_url=engine_url,
        created_ms=_now_ms(),
    )


def add_link(conn: Connection, dc_a: str, dc_b: str, *, distance_km: float) -> int:
    if dc_a == dc_b:
        raise InventoryError("a link joins two different DCs")
    if distance_km < 0:
        raise InventoryError(f"distance must not be negative, got {distance_km}")
    a, b = sorted((dc_id(conn, dc_a), dc_id(conn, dc_b)))
    return _insert(
        conn,
        Link,
        f"a link between {dc_a!r} and {dc_b!r} already exists",
        dc_a_id=a,
        dc_b_id=b,
        distance_km=distance_km,
    )


def list_nodes(conn: Connection, *, dc: str | None = None) -> list[NodeInfo]:
    q = (
        select(Node.id, Node.name, DataCenter.name, Node.agent_url, Node.gpu_model, Node.engine_url)
        .join(DataCenter, Node.dc_id == DataCenter.id)
        .order_by(DataCenter.name, Node.name)
    )
    if dc is not None:
        dc_id(conn, dc)
        q = q.where(DataCenter.name == dc)
    return [NodeInfo(*row) for row in conn.execute(q)]
