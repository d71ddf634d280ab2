"""Node ids are never reused on SQLite: samples and counter baselines are keyed by node id and
outlive a removed node, so a node added later must not inherit them. PostgreSQL sequences never
reuse ids; SQLite does so without AUTOINCREMENT.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _recreate(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table(
        "node", recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
    ):
        pass


def upgrade() -> None:
    _recreate(True)
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    # ids of nodes removed before this revision still key samples and rollups: start the
    # counter above every id any table has seen, not just above the nodes left
    inspector = sa.inspect(bind)
    highest = 0
    for table in inspector.get_table_names():
        for col in inspector.get_columns(table):
            if col["name"] in ("id", "node_id", "src_node_id", "dst_node_id") and (
                table == "node" or col["name"] != "id"
            ):
                found = bind.execute(sa.text(f'SELECT max("{col["name"]}") FROM "{table}"'))
                highest = max(highest, found.scalar() or 0)
    if highest:
        bind.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = 'node'"))
        bind.execute(
            sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES ('node', :seq)"),
            {"seq": highest},
        )


def downgrade() -> None:
    _recreate(False)
