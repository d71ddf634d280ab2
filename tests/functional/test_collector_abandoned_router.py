"""A router scrape the collector gives up at its deadline lets go, as an agent's and an
engine's do (``test_collector_abandoned_requests``): the router's requests go through the
collector's AbandonableTransport (``RouterClient(transport=...)``), so a router trickling its
answer has the request's connection shut down at the deadline, its thread and socket gone
within a trickled byte or two, and the next cycle asks afresh and records it up.

Before, a router's request was not cut: its thread read on until the trickle ended (here
1,000 s), holding a thread and a socket, and while it ran the next cycles did not ask again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from collectors.router import ROUTER_COUNTERS, router_key
from kvctl.db.migrate import open_db
from kvctl.redact import redact_url
from tests.functional.test_collector_abandoned_requests import (
    DEADLINE_S,
    Trickler,
    _assert_let_go,
)


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Engine]:
    engine = open_db(sqlite_url)
    yield engine
    engine.dispose()


def _router_answers() -> dict[str, tuple[bytes, str]]:
    """A router's /v1/info and /v1/stats with nothing routed yet."""
    stats = {
        **dict.fromkeys(ROUTER_COUNTERS, 0),
        "latency": {"sum_s": 0.0},
        "nodes": {},
        "links": [],
    }
    kind = "application/json"
    return {
        "/v1/info": (json.dumps({"started_s": time.time() - 60}).encode(), kind),
        "/v1/stats": (json.dumps(stats).encode(), kind),
    }


def test_a_router_scrape_given_up_at_its_deadline_lets_go_and_the_next_cycle_asks_again(
    sqlite_db: Engine,
) -> None:
    router = Trickler(_router_answers())  # its first request (GET /v1/info) trickled
    name = router_key(redact_url(router.url))
    try:
        config = CollectorConfig(interval_s=600.0, timeout_s=DEADLINE_S, routers=(router.url,))
        collector = Collector(sqlite_db, config)
        try:
            first = collector.collect_once()
            given_up_s = time.monotonic()
            assert (
                f"no full answer to GET /v1/info within {DEADLINE_S:g} s"
                in (first.routers_down[name])
            )
            _assert_let_go(router, given_up_s)
            second = collector.collect_once()
        finally:
            collector.close()
        # asked again (info and stats), and answered at once: up
        assert router.asked == 3
        assert second.routers_up == [name], second.routers_down
    finally:
        router.close()
