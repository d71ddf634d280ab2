"""A tier that accounts sizes but holds no bytes: the offline simulator runs the real store and
its policies over it, so simulated and live eviction decisions come from the same code."""

from __future__ import annotations

from collections.abc import Iterator

from kvctl.store.errors import InvalidArgument, KeyNotFound
from kvctl.store.tiers.base import (
    Buffer,
    ChunkMeta,
    Tier,
    check_capacity,
    check_put,
    check_resize,
)


class MeteredTier(Tier):
    holds_payload = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        self.name = name
        self._capacity_bytes = capacity_bytes
        self._sizes: dict[bytes, int] = {}
        self._used_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def max_chunks(self, capacity_bytes: int | None = None) -> int | None:
        # no bytes and no agent: the simulator counts capacity in blocks of one byte each
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._sizes))

    def size_of(self, key: bytes) -> int:
        try:
            return self._sizes[key]
        except KeyError:
            raise KeyNotFound(f"key {key.hex()} is not in tier {self.name!r}") from None

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        check_put(self, meta, data)
        self._sizes[meta.key] = meta.size_bytes
        self._used_bytes += meta.size_bytes

    def read_into(self, key: bytes, out: memoryview) -> int:
        raise InvalidArgument(f"tier {self.name!r} accounts sizes only and holds no payloads")

    def delete(self, key: bytes) -> int:
        n = self.size_of(key)
        del self._sizes[key]
        self._used_bytes -= n
        return n

    def resize(self, capacity_bytes: int) -> None:
        check_resize(self, capacity_bytes)
        self._capacity_bytes = capacity_bytes
