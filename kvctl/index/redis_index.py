"""The fleet index on Redis/Valkey (one server): several routers and followers share one index.

Behaves exactly as ``EmbeddedIndex`` (same answers for the same events); only the storage
differs. Key layout, for ``prefix`` P (node names and tenants may hold any characters: names of
Redis keys carry them as hex, hash fields and values carry their UTF-8 bytes)::

    P k:<keyhex>      hash: node -> "size_bytes tokens isolated(0|1) len(tier) " tier tenant
                      (one hash per chunk: ``holders`` is one HGETALL per key)
    P n:<nodehex>     set of the keyhexes the node holds (what ``drop``/``replace`` delete)
    P nodes           hash: node -> entries (``nodes()`` is one HGETALL)
    P markers         hash: node -> the marker its first resync left (``marker()``: one HGET;
                      gone with the rest when the server restarts empty or is flushed, so a
                      follower's poll notices the index lost the node's entries)

Writes run in one Lua script per group of events, so each group is atomic and the per-node
count always equals the node's set; an ``apply`` is one round trip whatever its size (its
groups pipelined). ``replace`` is one MULTI/EXEC of its scripts (drop, then the new holding):
a reader never sees the node half dropped or half filled. ``holders`` is one MULTI/EXEC of an
HGETALL per key (a chain of 64 keys is one round trip, and one consistent snapshot); the
tenant filter runs here, on the decoded entries, with ``EmbeddedIndex``'s rule.

Not for a Redis Cluster: the scripts touch keys of many slots.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent
from kvctl.index.model import Holding
from kvctl.index.remote import IndexUnavailable
from kvctl.wire.address import redact_url

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "kvctl:index:"
DEFAULT_TIMEOUT_S = 2.0
#: the URL schemes a RedisIndex opens (valkey:// is redis:// to the client)
SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "unix": "unix",
    "valkey": "redis",
    "valkeys": "rediss",
}
# Events per script call: bounds how long one call holds the (single-threaded) server, so an
# apply of a whole resync does not stall every reader; the calls still go in one round trip.
_EVENTS_PER_SCRIPT = 1024
_SCAN_COUNT = 1000

# KEYS[1]: the node's set, KEYS[2]: the nodes hash. ARGV[1]: chunk key prefix ("P k:"),
# ARGV[2]: the node (hash field), ARGV[3]: "1" to drop the node's holding first, then the ops:
# "s" keyhex value (stored) | "r" keyhex (removed) | "c" (cleared).
# Returns {entries the node holds after, entries dropped}. Invariant kept by every branch: the
# node is a field of P k:<kh> exactly when kh is in its set (HDEL of a hash's last field
# deletes the hash, so a chunk nobody holds leaves no key).
_BODY = """
local nset, nodes = KEYS[1], KEYS[2]
local kp, node = ARGV[1], ARGV[2]
local function drop()
  local held = redis.call('SMEMBERS', nset)
  for _, kh in ipairs(held) do redis.call('HDEL', kp .. kh, node) end
  redis.call('DEL', nset)
  return #held
end
local dropped = 0
if ARGV[3] == '1' then dropped = drop() end
local i = 4
local n = #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 's' then
    local kh = ARGV[i + 1]
    if redis.call('HSET', kp .. kh, node, ARGV[i + 2]) == 1 then redis.call('SADD', nset, kh) end
    i = i + 3
  elseif op == 'r' then
    local kh = ARGV[i + 1]
    if redis.call('HDEL', kp .. kh, node) == 1 then redis.call('SREM', nset, kh) end
    i = i + 2
  else
    dropped = dropped + drop()
    i = i + 1
  end
end
local count = redis.call('SCARD', nset)
if count > 0 then redis.call('HSET', nodes, node, count) else redis.call('HDEL', nodes, node) end
return {count, dropped}
"""
# refused whole when the server is out of memory, rather than failing half done
_APPLY_LUA = "#!lua\n" + _BODY
# a drop frees memory: most needed when the server is full
_DROP_LUA = "#!lua flags=allow-oom\n" + _BODY


def _utf8(text: str) -> bytes:
    # surrogatepass: any Python str round-trips (a JSON "\\ud800" tenant must not fail a write)
    return text.encode("utf-8", "surrogatepass")


def _str(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def encode_entry(e: ChunkEvent) -> bytes:
    """The hash value of a stored event: counts, then tier and tenant, length-prefixed."""
    tier = _utf8(e.tier)
    head = b"%d %d %d %d " % (e.size_bytes, e.tokens, 1 if e.isolated else 0, len(tier))
    return head + tier + _utf8(e.tenant)


def _holding(node: bytes, value: bytes, tenant: bytes) -> Holding | None:
    """The entry as a Holding when ``tenant`` may see it, else None."""
    size, tokens, isolated, tier_len, rest = value.split(b" ", 4)
    n = int(tier_len)
    if isolated != b"0" and rest[n:] != tenant:
        return None
    return Holding(_str(node), _str(rest[:n]), int(size), int(tokens))


class RedisIndex:
    """``FleetIndex`` on Redis/Valkey: every process opening the same URL and ``prefix`` shares
    one index. ``client``: an open ``redis.Redis`` (``decode_responses`` off) to use instead of
    connecting to ``url``; it is not closed by ``close``. Every backend failure raises
    ``IndexUnavailable``."""

    kind = "redis"
    #: other routers read and write it too: a router never drops a node's entries because it
    #: alone cannot reach the agent (``Follower``)
    shared = True

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgument(f"index prefix must be a non-empty string, got {prefix!r}")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise InvalidArgument(f"index timeout_s must be a positive number, got {timeout_s!r}")
        self.prefix = prefix
        self._prefix = _utf8(prefix)
        self._chunk_prefix = self._prefix + b"k:"
        self._nodes_key = self._prefix + b"nodes"
        self._markers_key = self._prefix + b"markers"
        if client is not None:
            if client.connection_pool.connection_kwargs.get("decode_responses"):
                raise InvalidArgument("the index's Redis client must not decode responses")
            self.address = "(given client)"
            self._client = client
            self._owns_client = False
            return
        if not isinstance(url, str):
            raise InvalidArgument(f"index URL must be a string, got {url!r:.60}")
        self.address = redact_url(url)
        try:
            scheme = urlsplit(url).scheme.lower()
        except ValueError as exc:
            raise InvalidArgument(f"index URL {self.address}: {exc}") from exc
        if scheme not in SCHEMES:
            raise InvalidArgument(
                f"index URL {self.address}: unsupported scheme; use redis://, rediss://, "
                "unix://, valkey:// or valkeys://"
            )
        client_url = SCHEMES[scheme] + url[len(scheme) :]
        try:
            self._client = redis.Redis.from_url(
                client_url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # one reconnect, at once: a kept connection the server dropped (a restart).
                # Replaying a write is safe: applying the same events twice changes nothing.
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"index URL {self.address}: {exc}") from exc
        self._owns_client = True

    # --- FleetIndex -----------------------------------------------------------------------
    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        groups = list(self._ops(events))
        n = sum(count for count, _ in groups)
        if n:
            with self._guard():
                pipe = self._client.pipeline(transaction=False)
                for _, ops in groups:
                    self._queue(pipe, _APPLY_LUA, node, ops, drop_first=False)
                pipe.execute()
        return n

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        groups = [ops for _, ops in self._ops(chunks)] or [[]]
        with self._guard():
            # MULTI/EXEC: the drop and every group land together (readers see old or new)
            pipe = self._client.pipeline(transaction=True)
            for i, ops in enumerate(groups):
                self._queue(pipe, _APPLY_LUA, node, ops, drop_first=i == 0)
            # NX: another router's resync of the node left one already; both keep that one
            pipe.hsetnx(self._markers_key, _utf8(node), uuid.uuid4().hex.encode())
            replies = pipe.execute()
        return int(replies[-2][0])

    def drop(self, node: str) -> int:
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            self._queue(pipe, _DROP_LUA, node, [], drop_first=True)
            pipe.hdel(self._markers_key, _utf8(node))
            reply, _ = pipe.execute()
        return int(reply[1])

    def marker(self, node: str) -> str | None:
        with self._guard():
            raw = cast("bytes | None", self._client.hget(self._markers_key, _utf8(node)))
        return None if raw is None else raw.decode("ascii", "replace")

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        if not keys:
            return []
        asking = _utf8(tenant)
        with self._guard():
            # one round trip and one snapshot (a replace in flight is seen whole or not at all)
            pipe = self._client.pipeline(transaction=True)
            for key in keys:
                pipe.hgetall(self._chunk_prefix + key.hex().encode())
            replies: list[dict[bytes, bytes]] = pipe.execute()
        out: list[list[Holding]] = []
        for key, held in zip(keys, replies, strict=True):
            try:
                row = [h for n, v in held.items() if (h := _holding(n, v, asking)) is not None]
            except ValueError as exc:  # not written by a RedisIndex (a prefix shared by mistake)
                raise IndexUnavailable(
                    f"index at {self.address}: malformed entry for {key.hex()}: {exc}"
                ) from exc
            row.sort(key=lambda h: h.node)
            out.append(row)
        return out

    def nodes(self) -> dict[str, int]:
        with self._guard():
            # bytes: the client is made without decode_responses
            raw = cast("dict[bytes, bytes]", self._client.hgetall(self._nodes_key))
        return dict(sorted((_str(node), int(n)) for node, n in raw.items()))

    def __len__(self) -> int:
        """Entries (one per node and chunk)."""
        return sum(self.nodes().values())

    def close(self) -> None:
        if self._owns_client:
            with contextlib.suppress(RedisError, OSError):
                self._client.close()

    # --- operators and tests ---------------------------------------------------------------
    def clear(self) -> int:
        """Delete every key of this prefix (the whole shared index); returns how many."""
        pattern = _glob_escape(self._prefix) + b"*"
        deleted = 0
        with self._guard():
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=pattern, count=_SCAN_COUNT):
                batch.append(name)
                if len(batch) >= _SCAN_COUNT:
                    deleted += int(self._client.delete(*batch))
                    batch = []
            if batch:
                deleted += int(self._client.delete(*batch))
        return deleted

    # --- internals ------------------------------------------------------------------------
    @staticmethod
    def _ops(events: Iterable[ChunkEvent]) -> Iterator[tuple[int, list[bytes]]]:
        """The events as script arguments, in groups of ``_EVENTS_PER_SCRIPT``: (events, ops)."""
        ops: list[bytes] = []
        count = 0
        for e in events:
            if e.kind == "stored":
                ops += (b"s", e.key.hex().encode(), encode_entry(e))
            elif e.kind == "removed":
                ops += (b"r", e.key.hex().encode())
            else:
                ops.append(b"c")
            count += 1
            if count == _EVENTS_PER_SCRIPT:
                yield count, ops
                ops, count = [], 0
        if count:
            yield count, ops

    def _queue(
        self, pipe: Any, script: str, node: str, ops: list[bytes], *, drop_first: bool
    ) -> None:
        """Queue one script call (EVAL, not EVALSHA: redis-py's pipelines would check the
        script cache first, a second round trip; the server caches the compiled text)."""
        name = _utf8(node)
        node_set = self._prefix + b"n:" + name.hex().encode()
        args = (self._chunk_prefix, name, b"1" if drop_first else b"0", *ops)
        pipe.execute_command("EVAL", script, 2, node_set, self._nodes_key, *args)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Every backend failure leaves as IndexUnavailable, naming the server."""
        try:
            yield
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(f"index at {self.address}: {exc}") from exc


def _glob_escape(raw: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in raw)
