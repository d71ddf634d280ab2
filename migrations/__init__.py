"""Alembic migrations for the metrics database. Empty until the collectors issue lands."""
