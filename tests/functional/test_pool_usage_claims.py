"""A pool agent's usage as its HELLO reports it is another host's word: a node summed whatever
counts it held (negative ones showed the pool's usage below zero in the node's stats; a string
raised TypeError out of the link monitor's usage read). Counts that are not whole numbers >= 0
are refused whole (TierUnavailable naming the tier and the field); sound ones are summed."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.pool import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.hung import answering_hello_only
from tests.functional.inprocess_node import InProcessNode


def _hello(**cpu: Any) -> dict[str, Any]:
    sound = {"capacity_bytes": 4096, "used_bytes": 1024, "chunks": 1}
    return {
        "tiers": ["cpu", "disk"],
        "usage": {"cpu": {**sound, **cpu}, "disk": {**sound, "used_bytes": 2048, "chunks": 2}},
    }


def test_sound_counts_are_summed_over_the_tiers() -> None:
    with answering_hello_only(hello=_hello()) as address:
        usage = AgentSource(address, timeout_s=2).usage()
    assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (8192, 3072, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("used_bytes", -4096),
        ("chunks", -1),
        ("capacity_bytes", "4096"),
        ("used_bytes", 1.5),
        ("used_bytes", True),
        ("chunks", None),
        # past an int64 (what every count in kvctl is bounded by): 10**400 passed and made
        # `kvctl agent remote` fail on the node (OverflowError formatting the pool's bytes)
        pytest.param("used_bytes", 10**400, id="used_bytes-10**400"),
        pytest.param("capacity_bytes", 2**63, id="capacity_bytes-2**63"),
    ],
)
def test_a_count_that_is_not_one_is_refused_whole(field: str, value: Any) -> None:
    with (
        answering_hello_only(hello=_hello(**{field: value})) as address,
        pytest.raises(TierUnavailable, match=f"tier 'cpu' has {field} "),
    ):
        AgentSource(address, timeout_s=2).usage()


@pytest.mark.parametrize("usage", [[1, 2], {"cpu": 7}, "full"])
def test_a_usage_that_is_not_tiers_of_counts_is_refused(usage: Any) -> None:
    with (
        answering_hello_only(hello={"tiers": ["cpu"], "usage": usage}) as address,
        pytest.raises(TierUnavailable, match="not a count"),
    ):
        AgentSource(address, timeout_s=2).usage()


def test_tiers_whose_sum_is_past_an_int64_are_refused() -> None:
    """Each count fits, their sum does not: refused, as one count past it is."""
    half = {"capacity_bytes": 2**62, "used_bytes": 2**62, "chunks": 1}
    hello = {"tiers": ["cpu", "disk"], "usage": {"cpu": half, "disk": half}}
    with (
        answering_hello_only(hello=hello) as address,
        pytest.raises(TierUnavailable, match="past 2\\*\\*63 - 1"),
    ):
        AgentSource(address, timeout_s=2).usage()


def test_a_pool_agent_reporting_a_bad_usage_stays_in_service(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad usage report is a bad figure, not a failed pool: the pool agent answered, its
    data path works. Refused through the source's call, it counted a failure and opened the
    pool's breaker (one failure opens it) at every usage read (each 5 s): every node stopped
    reading from and writing to a pool agent whose accounting went below zero."""
    pool = InProcessNode(
        tmp_path,
        AgentSettings(name="pool", data_dir=str(tmp_path), cpu_bytes=4 << 20, shm=False),
        [CpuTier(4 << 20, shared=True)],
    )
    told = pool.server.hello_info

    def buggy_hello() -> dict[str, Any]:  # a pool agent whose accounting went below zero
        info = told()
        info["usage"]["cpu"]["used_bytes"] = -4096
        return info

    pool.server.hello_info = buggy_hello  # type: ignore[method-assign]
    key = hashlib.blake2b(b"in-the-pool", digest_size=16).digest()
    pool.store.put(key, bytes(4096), tenant="t", tokens=16)
    host, port = pool.tcp[:2]
    source = Source(
        "pool", POOL_TIER, AgentSource(f"{host}:{port}"), LinkEstimator("pool", override="fetch")
    )
    node = RemoteTiers(
        TieredStore([CpuTier(1 << 20)], chunk_tokens=16),
        pool=source,
        prefill=PrefillRate(1e4, "configured"),
    )
    said = "its HELLO's usage of tier 'cpu' has used_bytes '-4096'"
    try:
        with caplog.at_level(logging.DEBUG, logger="kvctl.remote"):
            node.start()  # its monitor reads the pool's usage at once
            guard_s = time.monotonic() + 30
            while not any(said in r.getMessage() for r in caplog.records):
                assert time.monotonic() < guard_s, "the pool's usage was never read"
                time.sleep(0.05)
        assert source.breaker.state == "closed"
        assert node.fill([key], tenant="t") == 1
        assert node.status()["pool_usage"] is None  # not shown: no figure is better
    finally:
        node.close()
        pool.close()
