"""Another agent as a source of chunks, over its data plane: a pool agent (``--role pool``,
the embedded alternative to Redis) or a peer in another node or DC.

The FETCH op brings each chunk with its metadata (owner tenant, isolation, parent, tokens), so
a chunk pulled from elsewhere keeps its owner here: isolation holds and hits still count as reuse
or sharing correctly. Connections are kept open (a few, for concurrent requests) and a broken
one is dropped; every failure surfaces as ``TierUnavailable``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby

from kvctl.client import AgentError, DataClient
from kvctl.remote.pool import PoolChunk, PoolUsage, RemotePool
from kvctl.store.errors import TierUnavailable
from kvctl.store.tiers.base import Buffer, ChunkMeta

#: connections kept open per source; more concurrent requests than this open short-lived ones
_KEEP_CONNECTIONS = 4

Arrived = Callable[[int, PoolChunk], None]


class AgentSource(RemotePool):
    def __init__(self, address: str, *, token: str = "", timeout_s: float = 5.0) -> None:
        self.address = f"kvctl://{address.removeprefix('kvctl://').rstrip('/')}"
        self._target = self.address.removeprefix("kvctl://")
        self._token = token
        self._timeout_s = timeout_s
        self._idle: list[DataClient] = []
        self._lock = threading.Lock()
        self._closed = False
        self.corrupt = 0

    @contextmanager
    def _client(self) -> Iterator[DataClient]:
        with self._lock:
            if self._closed:
                raise TierUnavailable(f"source {self.address} is closed")
            client = self._idle.pop() if self._idle else None
        try:
            if client is None:
                # no shared memory: the peer is another host as far as this code knows
                client = DataClient.connect(
                    self._target, token=self._token, timeout_s=self._timeout_s, use_shm=False
                )
            yield client
        except (AgentError, OSError) as exc:
            if client is not None:
                client.close()
            raise TierUnavailable(f"{self.address}: {exc}") from exc
        else:
            with self._lock:
                if not self._closed and len(self._idle) < _KEEP_CONNECTIONS:
                    self._idle.append(client)
                    return
            client.close()

    def ping(self) -> float:
        with self._client() as c:
            return c.ping()

    def probe_transfer(self, nbytes: int) -> float:
        """Seconds to download ``nbytes`` of filler from the agent (a bandwidth sample)."""
        with self._client() as c:
            return c.probe(download_bytes=nbytes)

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        out: list[bool] = []
        # one request per (tenant, isolation): both travel per request
        for (tenant, isolated), group in groupby(
            items, key=lambda it: (it[0].tenant, it[0].isolated)
        ):
            batch = list(group)
            with self._client() as c:
                outcomes = c.put_many(
                    [(m.key, data) for m, data in batch],
                    tenant=tenant,
                    parents=[m.parent for m, _ in batch],
                    tokens=[m.tokens for m, _ in batch],
                    isolated=isolated,
                )
            out += [o.status == "stored" for o in outcomes]
        return out

    def get_many(
        self, keys: Sequence[bytes], *, tenant: str, arrived: Arrived | None = None
    ) -> list[PoolChunk | None]:
        def landed(i: int, meta: ChunkMeta, data: bytearray) -> None:
            if arrived is not None:
                arrived(i, PoolChunk(meta, memoryview(data)))

        with self._client() as c:
            got = c.fetch(keys, tenant=tenant, arrived=landed)
        return [
            None if g is None or g[1] is None else PoolChunk(g[0], memoryview(g[1])) for g in got
        ]

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        with self._client() as c:
            got = c.fetch(keys, tenant=tenant, payload=False)
        return [None if g is None else g[0] for g in got]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        raise TierUnavailable(f"{self.address}: evict through its control API (kvctl evict)")

    def usage(self) -> PoolUsage:
        # a new connection: its HELLO carries the agent's usage now, a kept one's is stale
        try:
            with DataClient.connect(
                self._target, token=self._token, timeout_s=self._timeout_s, use_shm=False
            ) as c:
                tiers = c.info.get("usage", {})
        except (AgentError, OSError) as exc:
            raise TierUnavailable(f"{self.address}: {exc}") from exc
        return PoolUsage(
            capacity_bytes=sum(t["capacity_bytes"] for t in tiers.values()),
            used_bytes=sum(t["used_bytes"] for t in tiers.values()),
            chunks=sum(t["chunks"] for t in tiers.values()),
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
