"""A bandwidth probe over a link that trickles (``TricklingProxy``: every read within the
socket timeout, the whole transfer hopelessly slow) is cut at a deadline, the read deadline (or
the probe's ``timeout_s``) plus its bytes at ``PULL_FLOOR_BYTES_PER_S``, and reported as a
failed probe saying so. Before, only each read had a timeout: a 1 MiB probe at 16 KiB per
40 ms took 2.6 s and was reported as a good measurement (a 4 MiB one, the link monitor's, 10 s
and more, the monitor held all that while), for as long as the link kept trickling.

Covers the three probes: an agent's ``POST /v1/probe`` (``probe_link``), and the link
monitor's download from a peer or pool agent (``AgentSource.probe_transfer``) and from a
Redis pool (``RedisPool.probe_transfer``, and a node's ``measure`` of it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.probe import probe_link
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import running_agent
from tests.functional.test_redis_pull_deadline import TricklingProxy

PROBE_BYTES = 1 << 20  # 2.6 s through the trickle; its deadline: 0.5 s + 1/32 s
#: the link monitor's probe size: 10.4 s through the trickle; its deadline 0.5 s + 1/8 s plus
#: PROBE_SLACK_S (a probe off the request path gets slack for a loaded host)
MONITOR_PROBE_BYTES = 4 << 20
READ_TIMEOUT_S = 0.5


@pytest.fixture
def trickling_agent(tmp_path: Path) -> Iterator[TricklingProxy]:
    """An agent's data plane behind a proxy that trickles its replies when told to."""
    with running_agent(tmp_path / "b", "--name", "b", "--disk", "0", "--cpu", "64MiB") as b:
        host, port = str(b.state.data_tcp).rsplit(":", 1)
        proxy = TricklingProxy((host, int(port)))
        try:
            yield proxy
        finally:
            proxy.close()


@pytest.fixture
def trickling_redis(private_redis: Any) -> Iterator[TricklingProxy]:
    proxy = TricklingProxy(("127.0.0.1", private_redis.port))
    try:
        yield proxy
    finally:
        proxy.close()


def test_a_link_probe_over_a_trickling_link_fails_saying_so(
    trickling_agent: TricklingProxy,
) -> None:
    target = f"127.0.0.1:{trickling_agent.port}"
    trickling_agent.trickling.set()  # pings and the upload's reply are small: at speed
    out = probe_link(target, token="", pings=2, size_bytes=PROBE_BYTES, timeout_s=READ_TIMEOUT_S)
    assert out["ok"] is False
    assert out["rtt_s"] is not None and out["loss_ratio"] == 0.0
    assert out["bandwidth_bytes_per_s"] is None
    error = out["error"] or ""
    assert f"download of {PROBE_BYTES} bytes" in error and "the link trickles" in error

    trickling_agent.trickling.clear()  # the same link at speed: measured as before
    out = probe_link(target, token="", pings=2, size_bytes=PROBE_BYTES, timeout_s=READ_TIMEOUT_S)
    assert out["ok"], out["error"]
    assert out["bandwidth_bytes_per_s"] is not None


def test_the_link_monitors_probe_of_a_trickling_agent_fails_saying_so(
    trickling_agent: TricklingProxy,
) -> None:
    source = AgentSource(f"127.0.0.1:{trickling_agent.port}", read_timeout_s=READ_TIMEOUT_S)
    try:
        assert source.ping() > 0  # a connection kept
        trickling_agent.trickling.set()
        with pytest.raises(TierUnavailable, match=r"bandwidth probe .* the link trickles"):
            source.probe_transfer(MONITOR_PROBE_BYTES)
        assert source.overdue == 0  # a probe, not a pull

        trickling_agent.trickling.clear()
        assert source.probe_transfer(MONITOR_PROBE_BYTES) > 0
    finally:
        source.close()


def test_the_link_monitors_probe_of_a_trickling_redis_pool_fails_saying_so(
    trickling_redis: TricklingProxy,
) -> None:
    pool = RedisPool(trickling_redis.url, prefix="probe", read_timeout_s=READ_TIMEOUT_S)
    try:
        pool.prepare_probe(MONITOR_PROBE_BYTES)
        trickling_redis.trickling.set()
        with pytest.raises(TierUnavailable, match=r"bandwidth probe .* the link trickles"):
            pool.probe_transfer(MONITOR_PROBE_BYTES)
        assert pool.overdue == 0

        trickling_redis.trickling.clear()
        assert pool.probe_transfer(MONITOR_PROBE_BYTES) > 0
    finally:
        pool.close()


def test_a_node_measuring_a_trickling_pool_records_why(
    trickling_redis: TricklingProxy,
) -> None:
    """What an operator sees (``kvctl agent remote``): the pool's last error says the link
    trickles; no bandwidth is learnt from it."""
    backend = RedisPool(trickling_redis.url, prefix="measure")
    pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool"))
    store = TieredStore([CpuTier(64 << 20)], chunk_tokens=256)
    remote = RemoteTiers(
        store, pool=pool, prefill=PrefillRate(1e4, "configured"), write_through=False
    )  # not started: the test runs the monitor's measurement itself
    try:
        trickling_redis.trickling.set()
        remote.measure(pool)
        status = pool.status()
        assert "bandwidth probe" in status["last_error"]
        assert "the link trickles" in status["last_error"]
        assert pool.link.samples["bandwidth"] == 0
        trickling_redis.trickling.clear()
    finally:
        remote.close()
        store.close()
