"""The Redis fleet index as routers before counts were kept wrote and read it (de0ba3d^), for
tests of routers of both versions sharing one index (a rolling upgrade).

``IndexBeforeCounts`` sends exactly that version's commands: its Lua script, copied verbatim (the
node's count re-read from its set, SCARD, into P nodes), its marker left by HSETNX and read raw
by HGET, its drop's HDEL of the marker, and ``nodes`` from P nodes alone. Its ``check`` is that
version's follower's check, the marker alone (that follower knew no other), so a current
``Follower`` over it polls as that version's did. Chunk values, key names and op encoding did
not change, so they are reused."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any, cast

from kvctl.index.events import ChunkEvent
from kvctl.index.model import NodeCheck
from kvctl.index.redis_index import RedisIndex

# verbatim from de0ba3d^:kvctl/index/redis_index.py
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
_APPLY_LUA = "#!lua\n" + _BODY
_DROP_LUA = "#!lua flags=allow-oom\n" + _BODY


class IndexBeforeCounts(RedisIndex):
    """A router of the version before counts, on the same server and prefix (see the module)."""

    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        groups = list(self._ops(events))
        n = sum(count for count, _ in groups)
        if n:
            with self._guard():
                pipe = self._client.pipeline(transaction=False)
                for _, ops in groups:
                    self._queue_v1(pipe, _APPLY_LUA, node, ops, drop_first=False)
                pipe.execute()
        return n

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        groups = [ops for _, ops in self._ops(chunks)] or [[]]
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            for i, ops in enumerate(groups):
                self._queue_v1(pipe, _APPLY_LUA, node, ops, drop_first=i == 0)
            pipe.hsetnx(self._markers_key, node.encode(), uuid.uuid4().hex.encode())
            replies = pipe.execute()
        return int(replies[-2][0])

    def drop(self, node: str) -> int:
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            self._queue_v1(pipe, _DROP_LUA, node, [], drop_first=True)
            pipe.hdel(self._markers_key, node.encode())
            reply, _ = pipe.execute()
        return int(reply[1])

    def marker(self, node: str) -> str | None:
        with self._guard():
            raw = cast("bytes | None", self._client.hget(self._markers_key, node.encode()))
        return None if raw is None else raw.decode("ascii", "replace")

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        return NodeCheck(self.marker(node), "", 0, 0)

    def purge(self, node: str) -> int:
        raise AssertionError("a router before counts never purges")

    def nodes(self) -> dict[str, int]:
        with self._guard():
            raw = cast("dict[bytes, bytes]", self._client.hgetall(self._nodes_key))
        return dict(sorted((node.decode(), int(n)) for node, n in raw.items()))

    def _queue_v1(
        self, pipe: Any, script: str, node: str, ops: list[bytes], *, drop_first: bool
    ) -> None:
        name = node.encode()
        node_set = self._prefix + b"n:" + name.hex().encode()
        args = (self._chunk_prefix, name, b"1" if drop_first else b"0", *ops)
        pipe.execute_command("EVAL", script, 2, node_set, self._nodes_key, *args)
