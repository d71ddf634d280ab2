"""`kvctl collect` (the loop) while its PostgreSQL goes away and comes back (connections refused
and the open ones cut, as in a restart): it keeps scraping, says so once on stderr (no traceback,
not once or twice a cycle), keeps every cycle's rows and writes them all once the database is
back, saying that too. A loop at --interval 1 wrote the driver's three-line error twice a second
for as long as the database was away."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import Engine, make_url

from collectors.collector import Collector, CycleReport
from kvctl.counters import CountersMoved
from kvctl.db.engine import create_db_engine, resolve_url
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, NodeSample
from tests.functional.agents import closed_port, running_agent, traffic

pytestmark = pytest.mark.slow


def _allow(admin: Engine, name: str, yes: bool) -> None:
    """Connections to database ``name`` allowed, or refused with the open ones ended."""
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(yes).lower()}'))
        if not yes:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )


def _scrapes(proc: subprocess.Popen[str]) -> queue.Queue[dict[str, Any] | None]:
    """The loop's scrape reports (--json), in order; None once its output ends."""
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        decoder, text = json.JSONDecoder(), ""
        for line in proc.stdout:  # one report a line, or one indented over several
            text += line
            try:
                out, _end = decoder.raw_decode(text.strip())
            except ValueError:
                continue
            text = ""
            if out["kind"] == "scrape":
                lines.put(out)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next(lines: queue.Queue[dict[str, Any] | None]) -> dict[str, Any]:
    scrape = lines.get(timeout=120)  # a bound on a hung loop, not a timing under test
    assert scrape is not None, "the loop ended"
    return scrape


def _read_n1(scrape: dict[str, Any]) -> bool:
    """Whether the cycle read the agent. Not every cycle does on a loaded machine: at
    --interval 0.2 an answer later than the cycle's deadline (0.18 s) is 'no answer', the node
    down in that cycle. A cycle written without it saves no state of its counters, so the hits
    the test then makes are the first the collector sees of them: a baseline, counted by no
    run (a loaded CI run failed 'hits 0 == 3' on it)."""
    return bool(scrape["up"] == ["n1"])


@dataclass
class _Loop:
    """A `kvctl collect --json` loop at --interval 0.2 on its own PostgreSQL database, scraping
    one real agent; ``admin`` refuses or allows that database's connections (``_allow``).
    ``lines``: its scrape reports (``_scrapes``, the only reader of its stdout); its stderr
    goes to ``err_path``."""

    db: Engine
    admin: Engine
    name: str
    agent: Any
    env: dict[str, str]
    proc: subprocess.Popen[str]
    lines: queue.Queue[dict[str, Any] | None]
    err_path: Path
    err: str = ""

    def stop(self) -> None:
        """SIGTERM, then its stderr (once). Its stdout is left to ``lines``: read here too
        (communicate), the reports this read took were lost to the count of cycles, the
        samples written outnumbering them (a loaded run failed 9 == 8 on it)."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            self.err = self.err_path.read_text()


@contextlib.contextmanager
def _loop_on(pg_url: str, tmp_path: Path) -> Iterator[_Loop]:
    name = pg_url.rsplit("/", 1)[1]
    db = open_db(pg_url, auto_upgrade=True)
    admin = create_engine(
        resolve_url(pg_url).rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT"
    )
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
            env = {**os.environ, "KVCTL_DB_URL": pg_url}
            argv = ["collect", "--interval", "0.2", "--no-links", "--metrics-listen", "off"]
            err_path = tmp_path / "collect.stderr"
            with err_path.open("w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvctl", *argv, "--json"],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            loop = _Loop(db, admin, name, a1, env, proc, _scrapes(proc), err_path)
            try:
                yield loop
            finally:
                loop.stop()
    finally:
        _allow(admin, name, True)
        admin.dispose()
        db.dispose()


def test_the_loop_says_once_that_the_database_is_away_and_loses_no_cycle(
    pg_url: str, tmp_path: Path
) -> None:
    with _loop_on(pg_url, tmp_path) as loop:
        try:
            lines = loop.lines
            seen = [_next(lines)]
            # the first cycle written with the agent read: its counters' state saved
            while not (seen[-1]["written"] and _read_n1(seen[-1])):
                seen.append(_next(lines))
            _allow(loop.admin, loop.name, False)
            traffic(loop.agent, 3, space=7)
            away = 0
            while away < 5:  # cycles the database failed that read the agent, once it is away
                seen.append(_next(lines))
                away += not seen[-1]["written"] and _read_n1(seen[-1])
            _allow(loop.admin, loop.name, True)
            seen.append(_next(lines))
            while not seen[-1]["written"]:
                seen.append(_next(lines))
        finally:
            loop.stop()
        err = loop.err
        assert loop.proc.returncode == 0, err
        cycles = len(seen) + sum(1 for s in iter(lines.get, None) if s)  # those after, too
        assert "Traceback" not in err and "Background on this error" not in err, err
        # said once as it went (by the inventory's read or the batch's write, whichever
        # failed first; an upkeep under way may fail first, saying so) and once back
        assert err.count("the loop goes on") == 1, err
        assert err.count("database back after") == 1, err
        assert len(err.splitlines()) <= 4, err  # with the banner
        failed = [s for s in seen if not s["written"]]
        # the node scraped on meanwhile (5 cycles read it, above); a cycle whose scrape missed
        # its deadline (a loaded machine) asked it too
        missed = ("no answer in ", "previous scrape still running")
        assert all(_read_n1(s) or s["down"].get("n1", "").startswith(missed) for s in failed)
        assert all("database" in s["warnings"][0] for s in failed)
        assert all("\n" not in w for s in failed for w in s["warnings"])  # one line each
        with loop.db.connect() as conn:
            samples = conn.execute(select(NodeSample.ts_ms)).scalars().all()
            hits = conn.execute(select(CacheSample.hits).where(CacheSample.tier == "all")).scalars()
            assert len(samples) == cycles  # every cycle's sample, those of the outage too
            assert sum(hits) == 3


def test_the_loop_stopped_while_the_database_is_away_says_what_it_did_not_write(
    pg_url: str, tmp_path: Path
) -> None:
    """SIGTERM while cycles' rows wait for the database: exit 0 (a stop asked for), saying how
    many rows were not written and that the counted increases are not lost; the next run
    records them. It stopped without a word of the rows it dropped."""
    with _loop_on(pg_url, tmp_path) as loop:
        try:
            lines = loop.lines
            while not ((scrape := _next(lines))["written"] and _read_n1(scrape)):
                pass  # the counters' state saved (_read_n1)
            _allow(loop.admin, loop.name, False)
            traffic(loop.agent, 3, space=7)
            away = 0
            while away < 2:
                away += not _next(lines)["written"]
        finally:
            loop.stop()
        _allow(loop.admin, loop.name, True)
        after = subprocess.run(
            [sys.executable, "-m", "kvctl", "collect", "--once", "--no-links"],
            capture_output=True,
            text=True,
            env=loop.env,
            timeout=120,
            check=False,
        )
        err = loop.err
        assert loop.proc.returncode == 0, err
        assert "rows unwritten" in err and "increases are not" in err, err
        assert "Traceback" not in err, err
        assert after.returncode == 0, after.stdout + after.stderr
        with loop.db.connect() as conn:
            hits = conn.execute(select(CacheSample.hits).where(CacheSample.tier == "all"))
            assert sum(hits.scalars()) == 3  # counted by the run after


@pytest.mark.parametrize("away", ["refusing connections", "server down"])
def test_a_failed_reread_of_the_counters_state_is_logged_on_one_line_without_the_password(
    away: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another collector saved counters this loop was about to (``CountersMoved``), and the
    reread of their saved state fails: its database refusing connections (as in a restart),
    or its server gone. The loop logged SQLAlchemy's text of it, over several lines; now the
    driver's words on one line, as its other database failures, the URL's password in none."""
    secret = "s3cret-rebase-pw"
    name = pg_url.rsplit("/", 1)[1]
    open_db(pg_url, auto_upgrade=True).dispose()  # the schema, as the loop found it
    # this server trusts loopback: the password is taken, and must never be shown
    url = make_url(resolve_url(pg_url)).set(password=secret)
    if away == "server down":
        url = url.set(port=closed_port())
    admin = create_engine(
        resolve_url(pg_url).rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT"
    )
    loop = Collector(create_db_engine(url.render_as_string(hide_password=False)))
    try:
        _allow(admin, name, away != "refusing connections")
        moved = CountersMoved(["n1/cache/all/lookup_chunks"])
        with caplog.at_level(logging.ERROR, logger="kvctl.collect"):
            assert not loop._rebase(moved, CycleReport(int(time.time() * 1000)))
    finally:
        loop.close()
        loop.engine.dispose()
        _allow(admin, name, True)
        admin.dispose()
    (said,) = [r.getMessage() for r in caplog.records if "saved state again" in r.getMessage()]
    assert "\n" not in said and "sqlalche.me" not in said, said
    assert secret not in said, said
    assert said.startswith("cannot read the counters' saved state again: connection failed"), said
