"""A stand-in for a tier that could not be opened (a disk tier whose directory cannot be used).

The store keeps the tier's place and name (tier codes on the wire, policies, counters) while it
is absent, and ``TieredStore.adopt_tier`` swaps the real tier in once it opens. An absent tier
holds nothing and the store never writes to it (``TieredStore.absent_tiers``); were it asked
to, it refuses with why it is absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.store.errors import KeyNotFound, TierUnavailable
from kvctl.store.tiers.base import ChunkMeta, Tier, check_capacity

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvctl.store.tiers.base import Buffer


class AbsentTier(Tier):
    """Tier ``name`` of ``capacity_bytes`` (what was asked for), absent because of ``reason``."""

    def __init__(self, name: str, capacity_bytes: int, reason: str) -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        self.name = name
        self.reason = reason
        self._capacity_bytes = capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return 0

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def keys(self) -> Iterator[bytes]:
        return iter(())

    def size_of(self, key: bytes) -> int:
        raise KeyNotFound(f"tier {self.name!r} is absent")

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        raise TierUnavailable(f"tier {self.name!r} is unavailable: {self.reason}")

    def read_into(self, key: bytes, out: memoryview) -> int:
        raise KeyNotFound(f"tier {self.name!r} is absent")

    def delete(self, key: bytes) -> int:
        raise KeyNotFound(f"tier {self.name!r} is absent")

    def resize(self, capacity_bytes: int) -> None:
        raise TierUnavailable(f"tier {self.name!r} is unavailable: {self.reason}")
