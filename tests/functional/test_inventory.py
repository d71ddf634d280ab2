"""Fleet inventory on a real SQLite and PostgreSQL: clear errors, nothing half-written."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from kvctl.db.inventory import InventoryError, add_dc, add_link, add_node, list_nodes
from kvctl.db.models import Link


def test_add_and_list(db: Engine) -> None:
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu-central", carbon_g_per_kwh=350, pue=1.2)
        add_dc(conn, "ams")
        add_node(conn, "n2", dc="fra", agent_url="http://10.0.0.2:7070", gpu_model="H100")
        add_node(conn, "n1", dc="ams", agent_url="http://10.0.0.1:7070", engine_url="http://x/m")
        add_link(conn, "fra", "ams", distance_km=360)
    with db.connect() as conn:
        nodes = list_nodes(conn)
        assert [(n.dc, n.name) for n in nodes] == [("ams", "n1"), ("fra", "n2")]
        assert [n.name for n in list_nodes(conn, dc="fra")] == ["n2"]
        # stored once per pair, in id order, whichever way it was given
        a, b = conn.execute(select(Link.dc_a_id, Link.dc_b_id)).one()
        assert a < b


def test_errors_are_clear_and_change_nothing(db: Engine) -> None:
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "n1", dc="fra", agent_url="http://a")
        with pytest.raises(InventoryError, match="already exists"):
            add_dc(conn, "fra")
        with pytest.raises(InventoryError, match=r"no DC named 'nope' \(known: fra\)"):
            add_node(conn, "n2", dc="nope", agent_url="http://b")
        with pytest.raises(InventoryError, match="node named 'n1' already exists"):
            add_node(conn, "n1", dc="fra", agent_url="http://c")
        with pytest.raises(InventoryError, match="PUE"):
            add_dc(conn, "x", pue=0.9)
        with pytest.raises(InventoryError, match="two different DCs"):
            add_link(conn, "fra", "fra", distance_km=1)
        add_dc(conn, "ams")
        add_link(conn, "ams", "fra", distance_km=360)
        with pytest.raises(InventoryError, match="link between 'fra' and 'ams' already exists"):
            add_link(conn, "fra", "ams", distance_km=1)
        # the failed inserts rolled back to their savepoints; the transaction is still usable
        assert conn.execute(select(func.count()).select_from(Link)).scalar() == 1
        with pytest.raises(InventoryError, match="no DC named"):
            list_nodes(conn, dc="nope")


def test_a_removed_nodes_id_is_never_given_to_a_new_node(db: Engine) -> None:
    from kvctl.db.inventory import remove_node

    with db.begin() as conn:
        add_dc(conn, "fra")
        first = add_node(conn, "n1", dc="fra", agent_url="http://10.0.0.1:7070")
        remove_node(conn, "n1")
        # its samples and counter baselines stay keyed by its id: a newcomer must not inherit them
        second = add_node(conn, "n2", dc="fra", agent_url="http://10.0.0.2:7070")
    assert second > first
