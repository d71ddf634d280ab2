"""A pull of a chain larger than the puller's local tiers can hold takes the prefix they can
hold: it never evicts the chunks it just stored (nor the chain's chunks already here) to land
later ones, which would leave a tail no lookup can use."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.functional.agents import payload, running_agent
from tests.functional.test_remote import CHUNK_BYTES, SMALL, chain, put_chain, remote

#: the puller's only tier: 8 chunks of the 20-chunk chain fit
PULLER = ["--disk", "0", "--cpu", "8MiB", "--link", "pool:override=fetch"]
CHAIN_CHUNKS = 20


@pytest.mark.parametrize("looked_up", [False, True], ids=["unsized", "sized-by-lookup"])
def test_a_pull_larger_than_the_cpu_tier_keeps_the_chains_head(
    tmp_path: Path, looked_up: bool
) -> None:
    """Unsized: a get with no lookup before it (nothing known of the chunks' sizes) pulls in
    order and keeps what fits; sized: after a lookup (which counts the whole chain, found in the
    pool) the pull asks only for what the room holds."""
    keys = chain(CHAIN_CHUNKS, seed=101)
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *SMALL) as pool:
        put_chain(pool, keys, tenant="t1")
        pool_url = f"kvctl://{pool.state.data_tcp}"
        with running_agent(tmp_path / "a", "--name", "a", "--pool", pool_url, *PULLER) as a:
            with a.data() as d:
                if looked_up:
                    assert d.lookup(keys, tenant="t1").matched_chunks == CHAIN_CHUNKS
                got = d.get_many(keys, tenant="t1")
                where = d.exists(keys, tenant="t1")
            held = sum(t == "cpu" for t in where)
            assert 0 < held < CHAIN_CHUNKS
            # the head is here, whole, and read; the rest is left where it was
            assert where == ["cpu"] * held + ["remote"] * (CHAIN_CHUNKS - held), where
            assert (
                [bytes(g) for g in got[:held]]
                == [  # type: ignore[arg-type]
                    payload(k, CHUNK_BYTES) for k in keys[:held]
                ]
            )
            assert got[held:] == [None] * (CHAIN_CHUNKS - held)
            assert a.control().stats()["usage"]["cpu"]["chunks"] == held
            pulled = remote(a)
            assert pulled["pull"]["no_room_chunks"] == CHAIN_CHUNKS - held
