"""Alembic environment. kvctl runs migrations in-process (``kvctl db upgrade``) and hands the
connection over in ``config.attributes``; the ``alembic`` command line works too, reading the
URL from ``-x url=...`` or ``KVCTL_DB_URL``."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from kvctl.db.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode copies the table instead
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run(connection)
        return
    from kvctl.db.engine import create_db_engine, resolve_url

    url = context.get_x_argument(as_dictionary=True).get("url")
    engine = create_db_engine(resolve_url(url))
    with engine.connect() as conn:
        run(conn)
    engine.dispose()


main()
