"""Alembic migrations for the metrics database (SQLite and PostgreSQL); see ``kvctl.db.migrate``."""
