"""A DC's link goes down: its agents all hang at once (each takes the request and answers
nothing, every scrape held for its request timeout). The agents that answer are still recorded
up, from the first cycle on: their scrapes, queued behind the hung ones', get a thread of their
own once they have waited a while (``kvctl.daemon_pool.DaemonPool``'s overflow), and from the
second cycle on the hung nodes are scraped on threads of their own.

Before, every scrape ran on one pool of ``max_workers`` threads: with more hung nodes ahead of
them than threads, the sound nodes' scrapes did not start before the cycle's deadline and were
recorded down ("no answer in 5.4s"), every cycle while the outage lasted.

Real hung stand-ins (loopback HTTP servers that take each request and answer none) and real
answering stand-ins, on a real SQLite database.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.hung import HungHttp, guarded
from tests.functional.test_collector_impossible_values import StandIn, _rows

#: hung agents, all ahead of the sound ones in the inventory's order, and the pool's threads:
#: ten request timeouts of hung scrapes (20 s) before a sound one's turn, far past the deadline
HUNG = 40
THREADS = 4
#: each request's timeout, and the cycle (its deadline: 0.9 of it, 5.4 s)
TIMEOUT_S = 2.0
INTERVAL_S = 6.0
#: cycles the second test gives the sound nodes' first scrapes, queued past the bound
MAX_CYCLES = 5


@contextlib.contextmanager
def hung_agents(count: int) -> Iterator[list[HungHttp]]:
    """``count`` hung stand-ins (``tests.functional.hung.HungHttp``), each shut within a
    moment at the end (40 servers polling every 0.5 s took 20 s to shut one by one)."""
    agents = [HungHttp() for _ in range(count)]
    for h in agents:
        threading.Thread(target=h.server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield agents
    finally:
        for h in agents:
            h.release.set()
            h.server.shutdown()
            h.server.server_close()


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Engine]:
    engine = open_db(sqlite_url)
    yield engine
    engine.dispose()


def test_a_dcs_agents_hanging_at_once_do_not_make_the_answering_ones_recorded_down(
    sqlite_db: Engine,
) -> None:
    sound = [StandIn("z0"), StandIn("z1")]
    with contextlib.ExitStack() as stack:
        for s in sound:
            s.answers["/v1/health"] = {"status": "ok"}  # (no uptime: no restart check)
            stack.callback(s.close)
        hung = stack.enter_context(hung_agents(HUNG))
        ids: dict[str, int] = {}
        with sqlite_db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            for i, h in enumerate(hung):
                ids[f"a{i:02d}"] = add_node(conn, f"a{i:02d}", dc="fra", agent_url=h.url)
            for s, name in zip(sound, ("z0", "z1"), strict=True):
                ids[name] = add_node(conn, name, dc="fra", agent_url=s.url)
        config = CollectorConfig(interval_s=INTERVAL_S, timeout_s=TIMEOUT_S, max_workers=THREADS)
        collector = Collector(sqlite_db, config)
        stack.callback(collector.close)

        first = guarded(collector.collect_once)
        assert sorted(first.up) == ["z0", "z1"], {n: first.down.get(n) for n in ("z0", "z1")}
        assert sorted(first.down) == sorted(f"a{i:02d}" for i in range(HUNG))
        assert all(h.asked.is_set() for h in hung)  # each hung one was asked, in this cycle
        # the hung ones now scraped on threads of their own: the sound ones still up
        second = guarded(collector.collect_once)
        assert sorted(second.up) == ["z0", "z1"], {n: second.down.get(n) for n in ("z0", "z1")}
        assert len(second.down) == HUNG
        for name in ("z0", "z1"):  # what was recorded: up both cycles, no error
            rows = _rows(sqlite_db, "node_sample", ids[name])
            assert [(r["up"], r["error"]) for r in rows] == [(True, None), (True, None)]
        rows = _rows(sqlite_db, "node_sample", ids["a00"])
        assert [r["up"] for r in rows] == [False, False]


def test_past_the_thread_bound_the_answering_agents_are_up_once_the_hung_ones_failed(
    sqlite_db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More hung agents than the scrapes' thread bound (here 8): the sound nodes' first scrape
    waits for a thread past the first cycle's deadline (down then, as before), but once the
    hung nodes' scrapes failed they run on the failing nodes' threads, and the sound nodes are
    recorded up each cycle. A sound node that waited for a thread is not moved there itself.
    Before (one pool, or none of its own for the failing nodes), every cycle queued them behind
    the hung ones again: down while the outage lasted."""
    import collectors.collector as collector_module

    monkeypatch.setattr(collector_module, "MAX_SCRAPE_THREADS", 2 * THREADS, raising=False)
    sound = [StandIn("z0"), StandIn("z1")]
    with contextlib.ExitStack() as stack:
        for s in sound:
            s.answers["/v1/health"] = {"status": "ok"}
            stack.callback(s.close)
        hung = stack.enter_context(hung_agents(HUNG))
        with sqlite_db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            for i, h in enumerate(hung):
                add_node(conn, f"a{i:02d}", dc="fra", agent_url=h.url)
            for s, name in zip(sound, ("z0", "z1"), strict=True):
                add_node(conn, name, dc="fra", agent_url=s.url)
        config = CollectorConfig(interval_s=INTERVAL_S, timeout_s=TIMEOUT_S, max_workers=THREADS)
        collector = Collector(sqlite_db, config)
        stack.callback(collector.close)

        ups: list[list[str]] = []
        # (the queue ahead of them takes 40 x 2 s / 8 threads: 10 s, two cycles' deadlines)
        for _ in range(MAX_CYCLES):
            ups.append(sorted(guarded(collector.collect_once).up))
            if ups[-1]:
                break
        assert ups[-1] == ["z0", "z1"], ups
        # and from then on, every cycle (the hung ones still hung)
        report = guarded(collector.collect_once)
        assert sorted(report.up) == ["z0", "z1"], report.down
        assert len(report.down) == HUNG
