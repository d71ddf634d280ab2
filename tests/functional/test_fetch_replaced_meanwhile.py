"""A FETCH whose chunk is replaced while the agent answers it: the reply must never pair one
chunk's bytes with another chunk's owner. The agent reads a FETCH's bytes first (leased, or
copied), then each entry's metadata; a put by another tenant over the key in between (the
isolation rule: a put over a chunk the putter may not see replaces it) made the reply carry
the isolated owner's bytes under the new owner's name and flags, checksummed as sent. A pool
agent (``--role pool`` knows no tenant's settings: isolation travels in the PUT's flag) then
handed an isolated tenant's chunk to a node that stored it as the other tenant's shared
chunk, served to every tenant there. Or, with another size, the reply's items and payload
disagreed and the puller dropped the whole pull and its connection.

The race is made certain here: the real data plane's ``_send_views`` (the bytes step) is
followed by the replacing put before the metadata step runs, as a put from another connection
landing between the two would."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent import dataplane
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.inprocess_node import InProcessNode

CHUNK_BYTES = 4096
KEY = hashlib.blake2b(b"victim-prefix", digest_size=16).digest()
VICTIM_BYTES = b"\xaa" * CHUNK_BYTES


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[InProcessNode]:
    """A pool agent: no isolated tenants of its own; acme's chunk stored there isolated by its
    PUT's flag, as a node's write-through sends it."""
    settings = AgentSettings(name="pool", data_dir=str(tmp_path), cpu_bytes=4 << 20, shm=False)
    node = InProcessNode(tmp_path, settings, [CpuTier(4 << 20, shared=True)])
    node.store.put(KEY, VICTIM_BYTES, tenant="acme", isolated=True)
    yield node
    node.close()


def address(node: InProcessNode) -> str:
    host, port = node.tcp[:2]
    return f"{host}:{port}"


def replace_after_the_bytes(
    monkeypatch: pytest.MonkeyPatch, pool: InProcessNode, size_bytes: int
) -> list[int]:
    """Once: right after a FETCH's bytes are taken, globex puts over acme's key (a chunk of
    ``size_bytes``). Returns a list that gets one item when it happened."""
    done: list[int] = []
    send_views = dataplane.Connection._send_views

    def then_replace(self: dataplane.Connection, *args: object, **kw: object) -> object:
        views = send_views(self, *args, **kw)  # type: ignore[arg-type]
        if not done:
            done.append(1)
            pool.store.put(KEY, b"\xee" * size_bytes, tenant="globex", isolated=False)
        return views

    monkeypatch.setattr(dataplane.Connection, "_send_views", then_replace)
    return done


def test_a_fetch_never_sends_one_chunks_bytes_under_anothers_owner(
    pool: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk replaced between its bytes and its metadata is reported missing (the bytes
    read are no longer the chunk's); the next FETCH, the race over, sends the new chunk: its
    bytes with its own owner. (The check of the pair ran only when an item came back, and
    none came: the race's reply is a miss.)"""
    done = replace_after_the_bytes(monkeypatch, pool, CHUNK_BYTES)
    sums: list[int | None] = []
    with DataClient.connect(address(pool), use_shm=False) as c:
        got = c.fetch([KEY], tenant="acme", checksums=sums)
        assert done
        assert got == [None], got
        (item,) = c.fetch([KEY], tenant="acme", checksums=[])
    assert item is not None
    meta, data = item
    assert (meta.tenant, meta.isolated, bytes(data or b"")) == (
        "globex",
        False,
        b"\xee" * CHUNK_BYTES,
    ), f"{meta.tenant}'s chunk (isolated={meta.isolated}) sent with other bytes"


def test_a_replacement_of_another_size_is_a_miss_not_a_broken_reply(
    pool: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    replace_after_the_bytes(monkeypatch, pool, 2 * CHUNK_BYTES)
    with DataClient.connect(address(pool), use_shm=False) as c:
        got = c.fetch([KEY], tenant="acme", checksums=[])
        assert got == [None]
        assert c.ping() > 0  # the connection stays in step


def test_a_node_pulling_from_the_pool_never_serves_acmes_chunk_to_another_tenant(
    pool: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node isolates acme by its request's flag only (as the pool does), so only the
    chunk's own metadata tells it whose the bytes are. The raced pull is a miss: the node
    stores nothing. Pulled again, the race over, the chunk is globex's shared one, which every
    tenant reads, as globex's bytes. (The tenants' reads were checked only when the node had
    stored something, and it had not: the check never ran.)"""
    store = TieredStore([CpuTier(1 << 20)], chunk_tokens=16)
    source = Source(
        "pool", POOL_TIER, AgentSource(address(pool)), LinkEstimator("pool", override="fetch")
    )
    node = RemoteTiers(store, pool=source, prefill=PrefillRate(1e4, "configured"))
    try:
        done = replace_after_the_bytes(monkeypatch, pool, CHUNK_BYTES)
        node.fill([KEY], tenant="acme")
        assert done
        assert KEY not in store  # the raced pull brought nothing
        node.fill([KEY], tenant="acme")
        assert KEY in store
        for tenant in ("umbrella", "globex", "initech", "acme"):
            data = bytes(store.get(KEY, tenant=tenant))
            assert data != VICTIM_BYTES, f"{tenant} read acme's isolated chunk"
            assert data == b"\xee" * CHUNK_BYTES, tenant
    finally:
        node.close()
