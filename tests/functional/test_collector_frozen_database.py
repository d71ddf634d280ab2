"""A PostgreSQL that stops answering while its host still acknowledges the packets (hung on its
storage; here a TCP proxy in front of it stopped with SIGSTOP): the collector's cycle gives its
database calls up after ``db_timeout_s``, says so, scrapes on keeping its rows, and writes them
once the database answers again. It waited as long as the database stayed so, no TCP keepalive
firing (the peer's kernel acknowledges them), with no word and no scrape: 100 s in a run of
`kvctl collect` against a proxy stopped that long."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import URL, make_url

from collectors.collector import Collector, CollectorConfig, CycleReport
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import NodeSample
from tests.functional.agents import running_agent

pytestmark = pytest.mark.slow

#: a TCP proxy on a free loopback port (printed) to the address in argv
PROXY = """
import socket, sys, threading
target = (sys.argv[1], int(sys.argv[2]))
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    client, _ = listener.accept()
    server = socket.create_connection(target)
    for a, b in ((client, server), (server, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def _through(url: URL, port: int) -> str:
    """The database's URL through the proxy; a connection tried while the proxy is stopped
    fails after 2 s, not libpq's 10 (the pool reconnects after a cut: time, not behaviour)."""
    proxied = url.set(port=port, query={**url.query, "connect_timeout": "2"})
    return proxied.render_as_string(hide_password=False)


def _cycle(collector: Collector) -> CycleReport:
    """One cycle, on a thread of its own: a cycle stuck on the database does not hold the test
    past its bound (a bound on a hang, not a timing under test)."""
    out: list[CycleReport] = []
    thread = threading.Thread(target=lambda: out.append(collector.collect_once()), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert out, "the cycle is still waiting on the stopped database"
    return out[0]


def test_a_database_that_stops_answering_is_given_up_and_its_rows_kept(
    pg_url: str, tmp_path: Path
) -> None:
    url = make_url(pg_url)
    proxy = subprocess.Popen(
        [sys.executable, "-c", PROXY, url.host or "127.0.0.1", str(url.port or 5432)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        proxied = _through(url, port)
        db = open_db(proxied, auto_upgrade=True)
        try:
            with running_agent(tmp_path / "a1", "--name", "n1") as a1:
                with db.begin() as conn:
                    add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                    add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
                collector = Collector(db, CollectorConfig(db_timeout_s=2))
                try:
                    assert _cycle(collector).written
                    proxy.send_signal(signal.SIGSTOP)
                    try:
                        frozen = _cycle(collector)
                    finally:
                        proxy.send_signal(signal.SIGCONT)
                    back = _cycle(collector)
                finally:
                    collector.close()
            assert not frozen.written and frozen.up == ["n1"]  # scraped on
            assert "no answer within 2 s" in frozen.warnings[0], frozen.warnings
            assert back.written and back.rows["node_sample"] == 2  # the frozen cycle's too
            with db.connect() as conn:
                assert conn.execute(select(func.count()).select_from(NodeSample)).scalar() == 3
        finally:
            db.dispose()
    finally:
        proxy.kill()
        proxy.wait()


def test_an_upkeep_given_up_is_said_so_not_as_a_server_that_hung_up(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The upkeep cut after ``maintenance_timeout_s`` says so, in its report (the loop's
    --json line) and its log line, as a cycle's cut does: it said the driver's 'server closed
    the connection unexpectedly', sending the operator to a server that never went away."""
    url = make_url(pg_url)
    proxy = subprocess.Popen(
        [sys.executable, "-c", PROXY, url.host or "127.0.0.1", str(url.port or 5432)],
        stdout=subprocess.PIPE,
        text=True,
    )
    caplog.set_level(logging.INFO, logger="kvctl.collect")
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        db = open_db(_through(url, port), auto_upgrade=True)
        config = CollectorConfig(
            db_timeout_s=2, maintenance_timeout_s=3, link_interval_s=float("inf")
        )
        collector = Collector(db, config)
        stop = threading.Event()
        seen: dict[str, Any] = {}

        def on_cycle(kind: str, report: CycleReport | dict[str, Any]) -> None:
            if kind == "scrape":  # written: the database stops answering for the upkeep
                seen["scrape"] = report
                proxy.send_signal(signal.SIGSTOP)
            elif kind == "maintenance":
                seen["maintenance"] = report
                proxy.send_signal(signal.SIGCONT)
                stop.set()

        try:
            loop = threading.Thread(target=collector.run, args=(stop,), daemon=True,
                                    kwargs={"on_cycle": on_cycle})  # fmt: skip
            loop.start()
            loop.join(timeout=120)
            assert not loop.is_alive(), "the upkeep is still waiting on the stopped database"
        finally:
            proxy.send_signal(signal.SIGCONT)
            stop.set()
            collector.close()
            db.dispose()
        assert isinstance(seen["scrape"], CycleReport) and seen["scrape"].written
        error = seen["maintenance"]["error"]
        assert error == "no answer within 3 s, its connections cut", error
        said = [r.getMessage() for r in caplog.records if "rollup/retention" in r.getMessage()]
        assert said == [f"rollup/retention failed, will retry: {error}"], said
    finally:
        proxy.kill()
        proxy.wait()
