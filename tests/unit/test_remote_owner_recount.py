"""A remote hit counts as reuse or sharing by the owner of the copy that arrived: when the source
a lookup chose loses the chunk before the pull and another source serves a copy another tenant
stored, the lookup's count moves to the other side (the demo's exact accounting checks the split
against the copies the replay received)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvctl.remote.counting import RemoteTierCounts
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.unit.test_federation_index import Fleet, key, put_chain


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def held_twice_and_looked_up(fleet: Fleet, i: int) -> tuple[bytes, tuple[int, int, int, int]]:
    """Key ``i`` held by peer b (stored by x) and c (stored by y), looked up by x on node a:
    the key and a's split after the lookup."""
    k = key("shared", i)
    put_chain(fleet.peers["b"].store, [k], "x")
    put_chain(fleet.peers["c"].store, [k], "y")
    assert fleet.a.lookup([k], tenant="x").matched_chunks == 1
    return k, split(fleet.a.store)


def split(store: TieredStore, tier: str = "peer") -> tuple[int, int, int, int]:
    st = store.stats
    ts = st.tiers[tier]
    return st.reuse_hits, st.sharing_hits, ts.reuse_hits, ts.sharing_hits


def test_a_hit_served_by_another_owners_copy_counts_by_that_copy(fleet: Fleet) -> None:
    k, counted = held_twice_and_looked_up(fleet, 0)
    local = fleet.a.store
    counted_reuse = counted[0] == 1
    # the chosen peer loses the chunk before the pull; the other one serves its own copy
    chosen, other = ("b", "c") if counted_reuse else ("c", "b")
    fleet.peers[chosen].store.evict([k])
    assert fleet.a.fill([k], tenant="x") == 1
    assert fleet.peers[other].gets == 1
    assert local.entry(k).tenant == ("y" if counted_reuse else "x")
    assert split(local) == ((0, 1, 0, 1) if counted_reuse else (1, 0, 1, 0))
    # one lookup, one hit: the totals stay as counted
    assert (local.stats.lookups, local.stats.hit_chunks) == (1, 1)


def test_a_hit_served_by_the_chosen_copy_keeps_its_count(fleet: Fleet) -> None:
    k, before = held_twice_and_looked_up(fleet, 1)
    assert fleet.a.fill([k], tenant="x") == 1
    assert split(fleet.a.store) == before
    assert sum(before[:2]) == 1


def test_a_pull_for_another_tenant_does_not_move_the_lookups_count(fleet: Fleet) -> None:
    k, before = held_twice_and_looked_up(fleet, 2)
    chosen = "b" if before[0] else "c"
    fleet.peers[chosen].store.evict([k])  # a pull now gets the other owner's copy
    fleet.a.fill([k], tenant="z")  # another tenant's read: not the lookup that counted it
    assert split(fleet.a.store) == before


def test_recount_owner_moves_one_hit_between_reuse_and_sharing() -> None:
    store = TieredStore([CpuTier(1 << 20)], chunk_tokens=16)
    counts = RemoteTierCounts(store, ["remote"])
    counts.count_hits("remote", ["a", "b"], [16, 16], tenant="a")
    counts.recount_owner("remote", reuse=True)
    assert split(store, "remote") == (2, 0, 2, 0)
    counts.recount_owner("remote", reuse=False)
    counts.recount_owner("remote", reuse=False)
    assert split(store, "remote") == (0, 2, 0, 2)


def test_a_chunk_held_here_past_a_gap_is_a_hit_here_by_its_own_owner(fleet: Fleet) -> None:
    """Chunks 0 and 2 here (stored by y), 1 not: the peer's copies (stored by x) fill the gap,
    but chunk 2 is served from here, so it counts here, as this copy's owner's."""
    chain = [key("gap", i) for i in range(3)]
    put_chain(fleet.peers["b"].store, chain, "x")
    local = fleet.a.store
    put_chain(local, [chain[0]], "y")
    put_chain(local, [chain[2]], "y", parents=[chain[1]])
    res = fleet.a.lookup(chain, tenant="x")
    assert res.matched_chunks == 3
    assert res.locations == ("cpu", "peer", "cpu")
    st = local.stats
    assert (st.hit_chunks, st.reuse_hits, st.sharing_hits) == (3, 1, 2)
    assert (st.tiers["cpu"].hits, st.tiers["cpu"].sharing_hits) == (2, 2)
    assert (st.tiers["peer"].hits, st.tiers["peer"].reuse_hits) == (1, 1)
    assert fleet.a.fill(chain, tenant="x") == 1  # only the gap is pulled
    assert [local.entry(k).tenant for k in chain] == ["y", "x", "y"]


def test_each_tenants_lookup_is_recounted_by_its_own_pull(fleet: Fleet) -> None:
    """x and z both count a sharing hit on y's copy at b; b then loses it and c serves x's own
    copy to x's pull: x's hit moves to reuse, z's stays (found in review: the hints were kept
    by key alone, so z's lookup replaced x's and x's pull moved nothing)."""
    k = key("tenants", 0)
    put_chain(fleet.peers["b"].store, [k], "y")
    for tenant in ("x", "z"):
        assert fleet.a.lookup([k], tenant=tenant).matched_chunks == 1
    assert split(fleet.a.store) == (0, 2, 0, 2)
    fleet.peers["b"].store.evict([k])
    put_chain(fleet.peers["c"].store, [k], "x")
    assert fleet.a.fill([k], tenant="x") == 1
    assert fleet.a.store.entry(k).tenant == "x"
    assert split(fleet.a.store) == (1, 1, 1, 1)


def test_a_read_with_no_lookup_before_it_moves_nothing(fleet: Fleet) -> None:
    """x's lookup counts sharing on y's copy at b; before x reads, z's copy lands here, so
    x's read pulls nothing (and uses up the lookup's hint). Later the chunk leaves here and
    b, c holds x's own copy, and x reads again with no lookup: no hit was counted for that
    read, so none moves (found in review: the first read left the hint for the second)."""
    k = key("stale", 0)
    local = fleet.a.store
    put_chain(fleet.peers["b"].store, [k], "y")
    assert fleet.a.lookup([k], tenant="x").matched_chunks == 1
    put_chain(local, [k], "z")
    assert fleet.a.fill([k], tenant="x") == 0
    local.evict([k])
    fleet.peers["b"].store.evict([k])
    put_chain(fleet.peers["c"].store, [k], "x")
    assert fleet.a.fill([k], tenant="x") == 1
    assert split(local) == (0, 1, 0, 1)


def test_a_hit_found_here_keeps_its_count_when_a_pull_replaces_its_copy(fleet: Fleet) -> None:
    """The convention the demo's exact accounting relies on: a hit the lookup counted in a
    local tier counts by that copy's owner, even when the copy left before the read and a pull
    brought another owner's (the replay knows the owners of what it stored here, not of what
    a pull brought in place of a local hit)."""
    chain = [key("gap-evicted", i) for i in range(3)]
    put_chain(fleet.peers["b"].store, chain, "x")
    local = fleet.a.store
    put_chain(local, [chain[0]], "y")
    put_chain(local, [chain[2]], "y", parents=[chain[1]])
    assert fleet.a.lookup(chain, tenant="x").matched_chunks == 3
    counted = split(local, "cpu")
    local.evict([chain[2]])
    assert fleet.a.fill(chain, tenant="x") == 2
    assert [local.entry(k).tenant for k in chain] == ["y", "x", "x"]
    assert split(local, "cpu") == counted == (1, 2, 0, 2)
