"""Shared fixtures. Unit tests: tests/unit; functional (CLI, subprocess): tests/functional."""

from __future__ import annotations

import os
import uuid

import pytest

from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of
from kvctl.workload.trace import find_default_trace

TINY_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype="float16")


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", TINY_LAYOUT)


def chain(ns: Namespace, n_chunks: int, *, seed: int = 0, chunk_tokens: int = 4) -> list[bytes]:
    """Keys of a request of ``n_chunks`` full chunks whose tokens depend on ``seed``."""
    tokens = [seed * 1_000_003 + i for i in range(n_chunks * chunk_tokens)]
    return keys_for(tokens, ns, chunk_tokens)


def put_chain(store, keys: list[bytes], size: int = 100, tenant: str = "a", **kw) -> None:  # type: ignore[no-untyped-def]
    for k, p in zip(keys, parents_of(keys), strict=True):
        store.put(k, bytes([k[0]]) * size, parent=p, tenant=tenant, **kw)


@pytest.fixture
def shared_trace():  # type: ignore[no-untyped-def]
    path = find_default_trace()
    if path is None:
        pytest.skip("shared Mooncake trace not found at ../shared/data (a fresh machine has none)")
    return path


# --- databases ------------------------------------------------------------------------------
# Tests use the real PostgreSQL on this machine: each test gets its own database, created and
# dropped around it. Outside CI an unreachable server skips those tests; with CI=true it fails.
PG_ADMIN_URL = os.environ.get("KVCTL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def pg_admin():  # type: ignore[no-untyped-def]
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    from kvctl.db.engine import resolve_url

    engine = create_engine(resolve_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc.orig}")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_admin):  # type: ignore[no-untyped-def]
    """URL of a new, empty PostgreSQL database, dropped after the test."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    name = f"kvctl_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(pg_admin.url).set(database=name).render_as_string(hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path):  # type: ignore[no-untyped-def]
    return f"sqlite:///{tmp_path / 'metrics.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request):  # type: ignore[no-untyped-def]
    """An empty database of each backend."""
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture
def db(empty_db_url):  # type: ignore[no-untyped-def]
    """An engine on a freshly migrated database of each backend."""
    from kvctl.db.migrate import open_db

    engine = open_db(empty_db_url, auto_upgrade=True)
    yield engine
    engine.dispose()
