"""Entries of a Redis fleet index that no index wrote are skipped as no holder and counted in
RedisIndex.malformed_entries; only the first is logged. The count is shown where an operator
looks: /v1/health, /v1/index, /metrics and `kvctl router status` (real Redis, a real router)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis
from typer.testing import CliRunner

from kvctl.cli.main import app as cli_app
from kvctl.index.redis_index import RedisIndex
from kvctl.router.app import RouterServer
from tests.unit.test_fleet_index import key, stored
from tests.unit.test_router_service import make_router


@pytest.fixture
def router_url(redis_url: str, redis_prefix: str) -> Iterator[tuple[str, RedisIndex]]:
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:index:")
    with RouterServer(make_router(index), listen="127.0.0.1:0") as server:  # type: ignore[arg-type]
        yield server.url, index


def _plant(index: RedisIndex, redis_url: str) -> None:
    """A sound holder of key(0) and, beside it, an entry no index wrote."""
    index.apply("a1", [stored(0)])
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{index.prefix}k:{key(0).hex()}", "intruder", b"not an entry")
    finally:
        raw.close()


def test_malformed_index_entries_are_counted_where_an_operator_looks(
    router_url: tuple[str, RedisIndex], redis_url: str
) -> None:
    url, index = router_url
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/health").json()["index_malformed_entries"] == 0
        _plant(index, redis_url)
        for _ in range(3):  # every lookup over the key meets it again
            r = http.post("/v1/index/holders", json={"keys": [key(0).hex()]})
            assert r.status_code == 200, r.text
        assert index.malformed_entries == 3
        assert http.get("/v1/health").json()["index_malformed_entries"] == 3
        assert http.get("/v1/index").json()["malformed_entries"] == 3
        metrics = http.get("/metrics").text
        assert "kvctl_index_malformed_entries_total 3.0" in metrics, metrics
    done = CliRunner().invoke(
        cli_app, ["router", "status", "--router", url], env={"COLUMNS": "300"}
    )
    assert done.exit_code == 0, done.output
    assert "index entries skipped as malformed: 3" in done.output, done.output
    done = CliRunner().invoke(cli_app, ["router", "status", "--router", url, "--json"])
    assert done.exit_code == 0, done.output
    assert '"malformed_entries": 3' in done.output, done.output


def test_status_says_nothing_of_malformed_entries_when_there_are_none(
    router_url: tuple[str, RedisIndex],
) -> None:
    url, _ = router_url
    done = CliRunner().invoke(
        cli_app, ["router", "status", "--router", url], env={"COLUMNS": "300"}
    )
    assert done.exit_code == 0, done.output
    assert "malformed" not in done.output, done.output
