"""PostgreSQL connections that cannot hang a command or the collector's loop: a server that
takes the connection and never answers, and a table another session holds locked, both end
in an error within the timeouts (a review saw `kvctl status` and the collector hang on each)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from kvctl.db import engine as engine_module
from kvctl.db.engine import create_db_engine, resolve_url
from kvctl.db.migrate import upgrade


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for s in held:
        s.close()
    server.close()


def test_a_server_that_never_answers_fails_the_connection_in_time(
    silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "PG_CONNECT_TIMEOUT_SECONDS", 1)
    engine = create_db_engine(resolve_url(f"postgresql://kvctl@127.0.0.1:{silent_server}/x"))
    started_s = time.monotonic()
    with pytest.raises(OperationalError), engine.connect():
        pass
    assert time.monotonic() - started_s < 8  # not a hang: libpq gives up after the timeout
    engine.dispose()


def test_a_url_keeps_its_own_connect_timeout() -> None:
    url = engine_module.make_url(
        resolve_url(
            "postgresql://kvctl@db.example/kvctl?connect_timeout=30&options=-cwork_mem%3D64MB"
        )
    )
    args = engine_module._pg_connect_args(url)
    assert "connect_timeout" not in args and "options" not in args
    assert args["keepalives"] == 1


def test_a_statement_behind_another_sessions_lock_gives_up(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "PG_LOCK_TIMEOUT_MS", 500)
    engine = create_db_engine(pg_url)
    upgrade(engine)
    holder = create_db_engine(pg_url)
    try:
        with holder.begin() as locked:
            locked.execute(text("LOCK TABLE dc IN ACCESS EXCLUSIVE MODE"))
            started_s = time.monotonic()
            with pytest.raises(OperationalError, match="lock timeout"), engine.connect() as conn:
                conn.execute(text("SELECT count(*) FROM dc"))
            assert time.monotonic() - started_s < 8
    finally:
        holder.dispose()
        engine.dispose()
