"""Remote sources that answer, but slowly, between real agents on loopback: a slow peer
(``SlowRelay``: each reply held back, within the socket timeout) must not crowd the pool's
probes out of concurrent lookups, and it ends up backed off by its breaker."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import PEER_TIER, POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.keys import parents_of
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import Agent, payload, running_agent
from tests.functional.slow_relay import SlowRelay
from tests.functional.test_remote import chain

TENANT = "t1"
CHUNK_BYTES = 64 << 10
AGENT_SMALL = ["--disk", "0", "--cpu", "64MiB"]
#: lookups made at once: more than a source's probe workers, so probes queue
CONCURRENT_LOOKUPS = 16
LOOKUPS_EACH = 6
#: the slow peer's replies are held this long: longer than the lookup's wait (0.5 s), within
#: its socket's read deadline (SLOW_READ_TIMEOUT_S), so every answer it gives comes, and late
SLOW_REPLY_S = 0.7
SLOW_READ_TIMEOUT_S = 3.0


def put_into(agent: Agent, keys: list[bytes]) -> None:
    with agent.data() as d:
        outs = d.put_many(
            [(k, payload(k, CHUNK_BYTES)) for k in keys],
            tenant=TENANT,
            parents=parents_of(keys),
            tokens=256,
        )
    assert {o.status for o in outs} == {"stored"}


def source(name: str, tier: str, address: str, *, read_timeout_s: float | None = None) -> Source:
    # fetch forced: the test is about reaching the sources, not about whether fetching pays
    backend = AgentSource(address, timeout_s=5.0, read_timeout_s=read_timeout_s)
    return Source(name, tier, backend, LinkEstimator(name, override="fetch"))


@contextlib.contextmanager
def node(pool: Source, peer: Source) -> Iterator[RemoteTiers]:
    store = TieredStore([CpuTier(64 << 20)], chunk_tokens=256)
    remote = RemoteTiers(
        store, pool=pool, peers=[peer], prefill=PrefillRate(1e4, "configured"), write_through=False
    )
    remote.start()  # the link monitor: it probes a source whose backoff ran out
    try:
        yield remote
    finally:
        remote.close()
        store.close()


def test_a_slow_peer_neither_starves_the_pools_probes_nor_stays_in_use(tmp_path: Path) -> None:
    keys = chain(4, seed=71)
    with (
        running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *AGENT_SMALL) as p,
        running_agent(tmp_path / "peer", "--name", "peer", *AGENT_SMALL) as q,
    ):
        put_into(p, keys)
        host, port = str(q.state.data_tcp).rsplit(":", 1)
        relay = SlowRelay((host, int(port)), reply_delay_s=SLOW_REPLY_S)
        try:
            pool = source("pool", POOL_TIER, str(p.state.data_tcp))
            slow = source("slow", PEER_TIER, relay.address, read_timeout_s=SLOW_READ_TIMEOUT_S)
            with node(pool, slow) as remote:

                def lookups(_: int) -> list[int]:
                    return [
                        remote.lookup(keys, tenant=TENANT).matched_chunks
                        for _ in range(LOOKUPS_EACH)
                    ]

                with ThreadPoolExecutor(CONCURRENT_LOOKUPS) as lookers:
                    matched = [
                        m for ms in lookers.map(lookups, range(CONCURRENT_LOOKUPS)) for m in ms
                    ]
                pool_status, slow_status = pool.status(), slow.status()
        finally:
            relay.close()
    # every lookup found the pool's chunks: none waited behind the slow peer's probes
    assert matched == [len(keys)] * (CONCURRENT_LOOKUPS * LOOKUPS_EACH), pool_status
    assert pool_status["late"] == 0 and pool_status["errors"] == 0
    # the slow peer's answers all took longer than the lookups' wait: its breaker opened for
    # them, and lookups meanwhile left it alone instead of waiting on it
    breaker = slow_status["breaker"]
    assert breaker["late_answers"] >= 1 and breaker["late_opens"] >= 1, slow_status
    assert slow_status["skipped"] >= 1, slow_status
