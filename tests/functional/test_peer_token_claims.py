"""A peer or pool agent whose chunks claim more tokens than a chunk holds (a hostile or buggy
agent: its store took any count a client gave, the wire carries a u32): a node must not count
those tokens as hits nor store them, since its hit and saved-token counters (and every figure a
manager reads from them) would be inflated by the claim. Each such chunk is a bad answer: a
miss, counted in the source's ``corrupt``, said in one log line; chunks whose counts fit are
served as ever."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import PEER_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.inprocess_node import InProcessNode

CHUNK_TOKENS = 16
CHUNK_BYTES = 4096
#: what the buggy peer's chunks claim: far more than a chunk of CHUNK_TOKENS holds
CLAIMED_TOKENS = 1_000_000


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}:{i}".encode(), digest_size=16).digest() for i in range(n)]


SANE = chain("sane", 3)  # the last one a chain's short tail: fewer tokens than a chunk holds
OVERLONG = chain("overlong", 3)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(
        name="peer", data_dir=str(tmp_path), cpu_bytes=4 << 20, shm=False, chunk_tokens=CHUNK_TOKENS
    )
    node = InProcessNode(tmp_path, settings, [CpuTier(4 << 20, shared=True)])
    for i, k in enumerate(SANE):
        tokens = CHUNK_TOKENS if i < len(SANE) - 1 else 5
        node.store.put(k, bytes(CHUNK_BYTES), tenant="t", tokens=tokens)
    for k in OVERLONG:
        node.store.put(k, bytes(CHUNK_BYTES), tenant="t", tokens=CLAIMED_TOKENS)
    yield node
    node.close()


@pytest.fixture
def node(peer: InProcessNode) -> Iterator[RemoteTiers]:
    host, port = peer.tcp[:2]
    source = Source(
        "peer", PEER_TIER, AgentSource(f"{host}:{port}"), LinkEstimator("peer", override="fetch")
    )
    store = TieredStore([CpuTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    remote = RemoteTiers(store, pool=None, peers=[source], prefill=PrefillRate(1e4, "configured"))
    yield remote
    remote.close()


def corrupt(node: RemoteTiers) -> int:
    return int(node.sources[0].status()["corrupt"])


def test_a_lookup_answer_claiming_more_tokens_than_a_chunk_holds_is_a_miss(
    node: RemoteTiers, caplog: pytest.LogCaptureFixture
) -> None:
    sane = node.lookup(SANE, tenant="t")
    assert (sane.matched_chunks, sane.matched_tokens) == (3, 2 * CHUNK_TOKENS + 5)
    assert corrupt(node) == 0
    with caplog.at_level(logging.WARNING, logger="kvctl.remote"):
        res = node.lookup(OVERLONG, tenant="t")
    assert (res.matched_chunks, res.matched_tokens) == (0, 0)
    stats = node.store.stats
    assert stats.hit_tokens == 2 * CHUNK_TOKENS + 5  # the sane lookup's hits alone
    assert stats.tiers[PEER_TIER].hit_tokens == 2 * CHUNK_TOKENS + 5
    assert corrupt(node) == len(OVERLONG)
    said = [r.getMessage() for r in caplog.records if "more tokens than a chunk holds" in r.message]
    assert len(said) == 1, said  # one line for the answer, naming the claim
    assert f"claims {CLAIMED_TOKENS}, at most {CHUNK_BYTES // 2} " in said[0]


def test_a_pulled_chunk_claiming_more_tokens_than_a_chunk_holds_is_not_stored(
    node: RemoteTiers, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvctl.remote"):
        assert node.fill(OVERLONG, tenant="t") == 0
    assert node.store.locate(OVERLONG, tenant="t") == [None] * len(OVERLONG)
    assert node.store.usage()["cpu"]["used_bytes"] == 0  # no reserved room left behind
    assert corrupt(node) == len(OVERLONG)
    assert any("more tokens than a chunk holds" in r.getMessage() for r in caplog.records)
    # chunks whose counts fit are pulled and kept with them
    assert node.fill(SANE, tenant="t") == len(SANE)
    assert [node.store.entry(k).tokens for k in SANE] == [CHUNK_TOKENS, CHUNK_TOKENS, 5]
    assert corrupt(node) == len(OVERLONG)


#: an engine's chunks twice the agent's chunk_tokens (the vLLM connector's and the transformers
#: adapter's ``chunk_tokens`` option: models with different chunk sizes share an agent's tiers)
ENGINE_TOKENS = 2 * CHUNK_TOKENS
LARGER = chain("larger", 3)


def test_chunks_of_an_engine_chunking_larger_than_the_agent_are_hits(
    peer: InProcessNode, node: RemoteTiers
) -> None:
    """A chunk's tokens are bounded by what its bytes can hold (2 bytes a token at the least),
    not by the agent's chunk_tokens alone: a fleet whose engines chunk by 32 tokens on agents
    of 16 lost every remote hit (each counted corrupt, said as a hostile claim), on a node
    whose engines had stored nothing yet as on any other, since a key matches only a chunk of
    the asking engine's own size."""
    for k in LARGER:
        peer.store.put(k, bytes(CHUNK_BYTES), tenant="t", tokens=ENGINE_TOKENS)
    res = node.lookup(LARGER, tenant="t")
    assert (res.matched_chunks, res.matched_tokens) == (3, 3 * ENGINE_TOKENS)
    assert corrupt(node) == 0
    assert node.fill(LARGER, tenant="t") == len(LARGER)
    assert [node.store.entry(k).tokens for k in LARGER] == [ENGINE_TOKENS] * 3
    # a claim past what the bytes hold is still a miss
    res = node.lookup(OVERLONG, tenant="t")
    assert (res.matched_chunks, res.matched_tokens) == (0, 0)
    assert corrupt(node) == len(OVERLONG)
