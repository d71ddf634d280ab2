"""Random store operations for the policies' bookkeeping property tests: chains put (or touched
where cached), touches, pins, unpins and deletes, over one tier or two (demotions between
them). One driver, so every policy is checked against the same operations. Also the entries
and accesses that the policies' hand-built sequences feed a policy directly."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import strategies as st

from kvctl.store.index import Entry
from kvctl.store.policies.base import EvictionPolicy
from kvctl.store.store import TieredStore
from kvctl.store.tiers.metered import MeteredTier

OPS = st.lists(
    st.tuples(
        st.sampled_from(["chain", "touch", "pin", "unpin", "delete"]),
        st.integers(0, 7),
        st.integers(1, 5),
    ),
    min_size=1,
    max_size=60,
)


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def small_tiers(two_tiers: bool) -> list[MeteredTier]:
    """A 6-chunk cpu tier, over a 10-chunk disk tier when ``two_tiers``."""
    return [MeteredTier("cpu", 6)] + ([MeteredTier("disk", 10)] if two_tiers else [])


def apply_ops(store: TieredStore, ops: list[tuple[str, int, int]]) -> Iterator[None]:
    """Carry out ``ops`` on ``store``, yielding after each one (for the caller's checks)."""
    for op, doc, n in ops:
        keys = [k(f"{doc}-{i}") for i in range(n)]
        if op == "chain":
            parent = None
            for depth, key in enumerate(keys):
                if key in store:
                    store.touch(key)
                else:
                    store.put(key, None, size_bytes=1, parent=parent, depth=depth)
                parent = key
        else:
            present = [key for key in keys if key in store]
            if op == "touch":
                for key in present:
                    if key in store:  # a promotion before it may have dropped it
                        store.touch(key)
            elif op == "pin":
                store.pin(present[:1])
            elif op == "unpin":
                store.unpin(present)
            elif present:
                store.evict(present[-1:])
        yield


def entry(
    name: str, tick: int, parent: Entry | None = None, tokens: int = 512, tenant: str = ""
) -> Entry:
    """A cpu-tier entry of one byte accessed at ``tick``, counted as ``parent``'s child."""
    e = Entry(key=name.encode(), tier="cpu", size_bytes=1, tokens=tokens, tenant=tenant,
              parent=parent.key if parent else None, last_tick=tick)  # fmt: skip
    if parent is not None:
        parent.children += 1
    return e


def access(policy: EvictionPolicy, e: Entry, tick: int) -> None:
    """``e`` read again at ``tick``, as the store tells the policy."""
    e.last_tick = tick
    e.access_count += 1
    policy.on_access(e)
