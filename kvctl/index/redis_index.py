"""The fleet index on Redis/Valkey (one server): several routers and followers share one index.

Behaves exactly as ``EmbeddedIndex`` (same answers for the same events); only the storage
differs. Key layout, for ``prefix`` P (node names and tenants may hold any characters: names of
Redis keys carry them as hex, hash fields and values carry their UTF-8 bytes)::

    P k:<keyhex>      hash: node -> "size_bytes tokens isolated(0|1) len(tier) " tier tenant
                      (one hash per chunk: ``holders`` reads each whole, in one script,
                      unless past ``MAX_HOLDERS_PER_CHUNK`` or ``MAX_CHUNK_HASH_BYTES``)
    P n:<nodehex>     set of the keyhexes the node holds (what ``drop``/``replace`` delete)
    P nodes           hash: node -> entries (``nodes()``: one HGETALL, with P markers')
    P markers         hash: node -> the marker its first resync left (``marker()``: one HGET;
                      gone with the rest when the server restarts empty or is flushed, so a
                      follower's poll, or a vLLM feed's look every second, notices the index
                      lost the node's entries), and
                      "\\xff" node -> the entries counted for a node with a marker (0xff starts
                      no UTF-8 name: no node's field; in the marker's hash, so lost with it)
                      and "\\xfe" node -> the id of the node's last replace (0xfe: nor this one),
                      written by every replace in its MULTI/EXEC: a replace that outlasts the
                      client's socket timeout may still land, and reading it back says whether
    P claims          hash: router instance -> JSON {"ms": when it last claimed (the server's
                      clock), "nodes": the nodes it knows} (``claim``/``claims``: see
                      ``ClaimingIndex``; a router's field goes an hour after its last claim)

A node's marker is the bare value routers before counts were kept wrote and read (they share
one index with these in a rolling upgrade): they see it change only when the index lost it.

A node with a marker (one a follower resyncs) has its count moved by what the scripts add to and
remove from its set, never read off it. Losing part of a node's keys with its marker kept (a
server evicting under ``maxmemory``, an operator's DEL) is what ``check`` catches, in one script
call: the count off the set's size (the set lost, whole or in part), or, in a rolling audit of a
slice of the set per call resuming at a cursor, a listed chunk whose hash no longer names the
node. A lost set leaves fields it no longer lists, which ``drop`` cannot find: ``purge`` scans
the prefix's chunk keys for them (a repair, rare, O(the index)).

A router of the version before counts moves a node's set and sets its P nodes field to the set's
size (deletes it at 0), and leaves the count as it was: a count off the set while P nodes says
so (here P nodes is the count) is such a write, not a loss (``check`` says nothing), and the next
write here counts from the set again. A count
missing (a marker that version left) is unknown, not damage, until a resync (or a cleared event)
here counts the node afresh. A node without a marker (an engine's own events, never resynced) is
counted by its set's size after each write, as before, so a lost P nodes repairs itself.

Writes run in one Lua script per group of events, so each group is atomic and the per-node
count equals the node's set (while the server loses nothing); an ``apply`` is one round trip
whatever its size (its groups pipelined). ``replace`` is one MULTI/EXEC of its scripts (drop,
then the new holding): a reader never sees the node half dropped or half filled. ``holders`` is
one script reading each key's hash (a chain of 64 keys is one round trip, and one consistent
snapshot); the tenant filter runs here, on the decoded entries, with ``EmbeddedIndex``'s rule.

The scripts go by their SHA-1 (EVALSHA), not their text (a few hundred bytes to 2.6 KB, hashed
again by the server at every EVAL): one the server does not hold (NOSCRIPT: it restarted, a
SCRIPT FLUSH, a failover to a replica that never ran it) is sent again as EVAL, which leaves it
in the server's cache for the next call. In a MULTI/EXEC (``replace``, ``drop``) an EVALSHA that
fails NOSCRIPT does not stop the rest of the transaction (Redis runs it on): there the first call
of a script goes as EVAL, and the later ones of the same EXEC by SHA (nothing runs between them).
A Redis user the ACL lets run EVAL but not EVALSHA (one made for the index before its scripts
went by SHA) is answered NOPERM, which ran nothing either (in a MULTI/EXEC: refused whole): the
call goes again as EVAL, and the index sends its scripts whole from then on (said once at
warning; by SHA again after ``kvctl.redis_scripts.SHA_RETRY_S``).

Any client of the server can write these keys (a prefix shared by mistake, another host's bug,
or hostile): what no index wrote is left out, and logged, never a failure of every reader. An
entry under a chunk's hash is no holder, nor any of a hash past the bounds a fleet's holders
keep within, which is not read (``holders``); a count in P nodes that is none (not
decimal digits up to 2**63 - 1), or a node name that is no UTF-8, leaves out that node alone
(``nodes``); a count in P markers that is none is counted from the node's set again.

Not for a Redis Cluster: the scripts touch keys of many slots.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError, RedisError
from redis.retry import Retry

from kvctl import json_text
from kvctl.errors import InvalidArgument
from kvctl.index.events import MAX_COUNT, ChunkEvent
from kvctl.index.model import Holding, NodeCheck
from kvctl.index.remote import IndexUnavailable
from kvctl.redact import redact_url
from kvctl.redis_scripts import ShaGate, sent_again, sha1

log = logging.getLogger("kvctl.index.redis_index")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "kvctl:index:"
DEFAULT_TIMEOUT_S = 2.0
#: a router's claims (``claim``) are deleted this long after its last one (it stopped)
CLAIMS_KEPT_S = 3600.0
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

#: the field of P markers that holds a node's count is this byte, then the node's name
_COUNT_FIELD = b"\xff"
#: the field of P markers that holds the id of a node's last replace: this byte, then the name
#: (routers before it read P markers' node fields and "\xff" ones only, or split each value at a
#: space, which an id holds none of: they ignore it)
_REPLACED_FIELD = b"\xfe"
#: a count as the scripts write one (decimal digits; 19: past 2**63 - 1 already)
_COUNT_TEXT = re.compile(rb"[0-9]{1,19}")
#: reads of a timed-out replace's id (each up to the socket timeout): the server runs the
#: MULTI/EXEC whole before it answers them, so they wait behind it rather than race it
_REPLACED_READS = 3

# Whether P nodes says a router that keeps no count wrote the node last (it writes its set's
# size there, or deletes its field at 0), given the set's size: P nodes gone whole (evicted)
# says nothing. Here P nodes is always written as the count.
_UNCOUNTED_WRITE = """
local function uncounted_write(nodes, node, listed)
  local noted = redis.call('HGET', nodes, node)
  if noted then return tonumber(noted) == listed end
  return listed == 0 and redis.call('EXISTS', nodes) == 1
end
"""

# KEYS[1]: the node's set, KEYS[2]: the nodes hash, KEYS[3]: the markers hash. ARGV[1]: chunk
# key prefix ("P k:"), ARGV[2]: the node (hash field), ARGV[3]: the mode: "" (apply), "drop"
# (drop the node's holding and count first), or a marker (a replace: drop first, leave this
# marker unless the node has one, and count the node afresh), then the ops: "s" keyhex value
# (stored) | "r" keyhex (removed) | "c" (cleared). Returns {entries the node holds after,
# entries dropped}.
# Invariants kept by every branch: the node is a field of P k:<kh> exactly when kh is in its set
# (HDEL of a hash's last field deletes the hash, so a chunk nobody holds leaves no key), and its
# count (P nodes; with a marker, P markers' "\xff" node too) is the set's size. With a marker
# and a count, the count moves with what SADD/SREM changed, never read off the set, so a set the
# server lost shows as a count off (``check``); without either, it is the set's size (SCARD), as
# routers before counts kept it. A stored event adds the key to the set and a removed one
# deletes the field whatever the set says, so a resync puts back the set's members a loss took,
# for every chunk the agent lists. The marker's value is never rewritten: routers before counts
# compare it, raw, with the one they saw.
_BODY = (
    _UNCOUNTED_WRITE
    + """
local nset, nodes, markers = KEYS[1], KEYS[2], KEYS[3]
local kp, node, mode = ARGV[1], ARGV[2], ARGV[3]
local cfield = '\\255' .. node
local function drop()
  local held = redis.call('SMEMBERS', nset)
  for _, kh in ipairs(held) do redis.call('HDEL', kp .. kh, node) end
  redis.call('DEL', nset)
  redis.call('HDEL', nodes, node)
  return #held
end
local marker = redis.call('HGET', markers, node)
local dropped, delta, base = 0, 0, nil
if mode == 'drop' then
  dropped = drop()
  redis.call('HDEL', markers, cfield)
  marker = false
elseif mode ~= '' then
  dropped = drop()
  base = 0
  if not marker then redis.call('HSET', markers, node, mode); marker = mode end
elseif marker then
  base = tonumber(redis.call('HGET', markers, cfield))  -- nil: unknown, until a resync
  -- one no script wrote (inf, nan, -1, 1.5: another host's bug, or hostile) is counted from the
  -- set again, as after a router that keeps no count: counted on, it made the node's count inf
  -- or nan for good (written to P nodes, and nodes() left the node out)
  if base and not (base >= 0 and base < 2 ^ 53 and base == math.floor(base)) then
    base = redis.call('SCARD', nset)
  end
  -- a router that keeps no count moved the set: count from the set again
  if base then
    local listed = redis.call('SCARD', nset)
    if base ~= listed and uncounted_write(nodes, node, listed) then base = listed end
  end
end
local i = 4
local n = #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 's' then
    local kh = ARGV[i + 1]
    redis.call('HSET', kp .. kh, node, ARGV[i + 2])
    delta = delta + redis.call('SADD', nset, kh)
    i = i + 3
  elseif op == 'r' then
    local kh = ARGV[i + 1]
    redis.call('HDEL', kp .. kh, node)
    delta = delta - redis.call('SREM', nset, kh)
    i = i + 2
  else
    dropped = dropped + drop()
    delta = 0
    if marker then base = 0 end
    i = i + 1
  end
end
local count
if base then
  count = math.max(0, base + delta)
  redis.call('HSET', markers, cfield, count)
else  -- no marker (an engine's own events), or its count unknown: the set's size
  count = redis.call('SCARD', nset)
end
if count > 0 then redis.call('HSET', nodes, node, count) else redis.call('HDEL', nodes, node) end
return {count, dropped}
"""
)
# refused whole when the server is out of memory, rather than failing half done
_APPLY_LUA = "#!lua\n" + _BODY
# a drop frees memory: most needed when the server is full
_DROP_LUA = "#!lua flags=allow-oom\n" + _BODY

# KEYS: as _BODY's. ARGV[1]: chunk key prefix, ARGV[2]: the node, ARGV[3]: SSCAN cursor, ARGV[4]:
# entries to audit (0: none). Returns {marker or "", damage ("", "count" or "entries"), next
# cursor, entries audited}. Read-only (runs on a full server too); the first damage found ends
# it. A count off the set is no damage when a router that keeps no count wrote last, nor is a
# count missing.
_CHECK_LUA = (
    "#!lua flags=no-writes\n"
    + _UNCOUNTED_WRITE
    + """
local nset, kp, node = KEYS[1], ARGV[1], ARGV[2]
local marker = redis.call('HGET', KEYS[3], node)
if not marker then return {'', '', '0', 0} end
local listed = redis.call('SCARD', nset)
local counted = tonumber(redis.call('HGET', KEYS[3], '\\255' .. node))
if counted and counted ~= listed and not uncounted_write(KEYS[2], node, listed) then
  return {marker, 'count', '0', 0}
end
if listed == 0 or ARGV[4] == '0' then return {marker, '', ARGV[3], 0} end
local scan = redis.call('SSCAN', nset, ARGV[3], 'COUNT', ARGV[4])
for _, kh in ipairs(scan[2]) do
  if redis.call('HEXISTS', kp .. kh, node) == 0 then
    return {marker, 'entries', '0', #scan[2]}
  end
end
return {marker, '', scan[1], #scan[2]}
"""
)

#: the most holders one chunk's hash is read with (one field per node holding the chunk, and
#: per engine feeding its own events), and the most bytes the server's accounting of it may
#: take (MEMORY USAGE, overhead included: ~570 KiB for 4,096 holders of 100-byte names and
#: entries): a hash past either is skipped whole and counted as malformed, not sent over the
#: network at every lookup over its key
MAX_HOLDERS_PER_CHUNK = 4096
MAX_CHUNK_HASH_BYTES = 1 << 20

#: a Redis user the ACL denies MEMORY (``holders``' bytes bound) is asked again this long after:
#: each denial is an ACL LOG entry and an error reply on the server, so not one per lookup
MEMORY_RETRY_S = 600.0

# KEYS: the chunk hashes. ARGV[1]: MAX_HOLDERS_PER_CHUNK, ARGV[2]: MAX_CHUNK_HASH_BYTES, ARGV[3]:
# '1' to ask MEMORY USAGE. Returns, per key, its HGETALL, or its field count when past either
# bound; then a 1 past the keys' replies when MEMORY was denied. HLEN first: O(1), so a hash of
# millions of fields costs no more than a sound one; MEMORY USAGE is O(1) for the small
# (listpack) hashes of the normal path, O(fields) past them, which HLEN bounded. Without MEMORY
# (not asked, or the ACL denies it: pcall, an error, not a number) the bytes bound is taken on
# the fields and values read here: the server copies such a hash, but no router is sent it.
_HOLDERS_LUA = """#!lua flags=no-writes
local max_fields, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local ask_memory, denied = ARGV[3] == '1', false
local out = {}
for i, key in ipairs(KEYS) do
  local n = redis.call('HLEN', key)
  local bytes = nil
  if n > 0 and n <= max_fields and ask_memory and not denied then
    bytes = redis.pcall('MEMORY', 'USAGE', key, 'SAMPLES', '0')
    if type(bytes) ~= 'number' then
      bytes, denied = nil, true
    end
  end
  if n > max_fields or (bytes ~= nil and bytes > max_bytes) then
    out[i] = n
  else
    local held = redis.call('HGETALL', key)
    if bytes == nil then
      local read = 0
      for j = 1, #held do
        read = read + #held[j]
      end
      if read > max_bytes then
        held = n
      end
    end
    out[i] = held
  end
end
if denied then
  out[#KEYS + 1] = 1
end
return out
"""

# KEYS: as _BODY's. ARGV[1]: the node. After ``purge`` removed the node's fields: its set and
# counts go (unknown until the resync that follows), its marker stays.
_PURGED_LUA = """#!lua flags=allow-oom
local node = ARGV[1]
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], node)
redis.call('HDEL', KEYS[3], '\\255' .. node)
"""


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


def _count(raw: bytes | None) -> int | None:
    """A node's count as the scripts write it (decimal digits, up to ``MAX_COUNT``); None for
    anything else (another host's bug, or hostile: any client of the server can write it)."""
    if raw is None or not _COUNT_TEXT.fullmatch(raw):
        return None
    count = int(raw)
    return count if count <= MAX_COUNT else None


def _shown(raw: bytes) -> str:
    """``raw`` as a log line shows it: its first 40 bytes, undecodable ones escaped."""
    return repr(raw[:40].decode("utf-8", "backslashreplace")) + ("..." if len(raw) > 40 else "")


def _holding(node: bytes, value: bytes, tenant: bytes) -> Holding | None:
    """The entry as a Holding when ``tenant`` may see it, else None; None too for one whose
    counts are past an int64, which routers before events were bounded (``MAX_COUNT``) stored
    from a buggy or hostile agent: every route over its key failed (OverflowError, a 500)
    until its node was resynced."""
    size, tokens, isolated, tier_len, rest = value.split(b" ", 4)
    n = int(tier_len)
    if isolated != b"0" and rest[n:] != tenant:
        return None
    size_bytes, token_count = int(size), int(tokens)
    if not (0 <= size_bytes <= MAX_COUNT and 0 <= token_count <= MAX_COUNT):
        return None
    return Holding(_str(node), _str(rest[:n]), size_bytes, token_count)


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
        self._claims_key = self._prefix + b"claims"
        #: the (field, value) pairs of P nodes last said to be no node's count: each is said
        #: and counted once while it stays (``nodes`` is read on every status and inventory
        #: reread, from several threads)
        self._bad_counts_said: set[tuple[bytes, bytes]] = set()
        #: entries skipped as no index's writing since this index was opened (``holders``'
        #: each time a lookup meets one, ``nodes``' once while it stays); guards
        #: ``_bad_counts_said`` too
        self._malformed_entries = 0
        self._malformed_lock = threading.Lock()
        #: the kinds of malformed entries said at warning already (then at debug)
        self._malformed_said: set[str] = set()
        #: when MEMORY was last denied to ``holders`` (monotonic; None: never): not asked
        #: again for ``MEMORY_RETRY_S``
        self._memory_denied_s: float | None = None
        #: the scripts go by SHA unless this index's Redis user was denied EVALSHA lately
        self._sha = ShaGate(lambda: f"index at {self.address}", log)
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
            calls = [self._call_args(node, ops) for _, ops in groups]
            by_sha = self._sha.by_sha()
            with self._guard():
                pipe: Any = self._client.pipeline(transaction=False)
                for call in calls:
                    if by_sha:
                        pipe.execute_command("EVALSHA", sha1(_APPLY_LUA), *call)
                    else:
                        pipe.execute_command("EVAL", _APPLY_LUA, *call)
                replies = pipe.execute(raise_on_error=False)
                resend = (i for i, r in enumerate(replies) if by_sha and sent_again(r))
                missing = next(resend, None)
                if missing is not None and isinstance(replies[missing], NoPermissionError):
                    self._sha.denied()
                if missing is not None:
                    # as EVAL, in order, from the first the server did not hold: a node's
                    # groups apply in order, so one after it that ran all the same (another
                    # client loaded the script in between) runs again after it (applying the
                    # same events twice changes nothing)
                    pipe = self._client.pipeline(transaction=False)
                    for call in calls[missing:]:
                        pipe.execute_command("EVAL", _APPLY_LUA, *call)
                    replies[missing:] = pipe.execute(raise_on_error=False)
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise reply
        return n

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        groups = [ops for _, ops in self._ops(chunks)] or [[]]
        name = _utf8(node)
        with self._guard():
            # MULTI/EXEC: the drop and every group land together (readers see old or new)
            pipe = self._client.pipeline(transaction=True)
            # the first group's marker is left only where the node has none: another router's
            # resync of the node left one already, and both keep that one. The same id marks
            # this replace, always written: whether it landed is knowable after a timeout
            replace_id = uuid.uuid4().hex.encode()
            by_sha = self._sha.by_sha()
            for i, ops in enumerate(groups):
                mode = replace_id if i == 0 else b""
                self._queue(pipe, _APPLY_LUA, node, ops, mode=mode, by_sha=by_sha and i > 0)
            pipe.hset(self._markers_key, _REPLACED_FIELD + name, replace_id)
            try:
                try:
                    replies = pipe.execute()
                except NoPermissionError as exc:
                    # an EVALSHA the ACL denies is refused as it is queued: nothing ran (EXEC
                    # aborted). Sent again, every group as EVAL
                    if not (by_sha and len(groups) > 1 and sent_again(exc)):
                        raise
                    self._sha.denied()
                    pipe = self._client.pipeline(transaction=True)
                    for i, ops in enumerate(groups):
                        mode = replace_id if i == 0 else b""
                        self._queue(pipe, _APPLY_LUA, node, ops, mode=mode)
                    pipe.hset(self._markers_key, _REPLACED_FIELD + name, replace_id)
                    replies = pipe.execute()
            except redis.exceptions.TimeoutError:
                # the server still runs the whole MULTI/EXEC (a large node, or others' ahead of
                # it): sent again, it would time out again, each time holding the server for
                # its whole length
                entries = self._landed(name, replace_id)
                if entries is None:
                    raise
                return entries
        return int(replies[-2][0])

    def _landed(self, name: bytes, replace_id: bytes) -> int | None:
        """After a replace of node ``name`` timed out: the node's entries when the replace
        ``replace_id`` landed (its id is the node's last; MULTI/EXEC is all or nothing), None
        when it did not, or when that cannot be read in ``_REPLACED_READS`` tries."""
        for _ in range(_REPLACED_READS):
            pipe = self._client.pipeline(transaction=True)
            pipe.hget(self._markers_key, _REPLACED_FIELD + name)
            pipe.hget(self._markers_key, _COUNT_FIELD + name)
            try:
                last_id, count = pipe.execute()
            except redis.exceptions.TimeoutError:
                continue  # still behind the replace (or others'): ask again
            if last_id != replace_id:
                return None
            # the count this replace wrote, unless another client wrote one that is none since
            return 0 if count is None else _count(count)
        return None

    def drop(self, node: str) -> int:
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            self._queue(pipe, _DROP_LUA, node, [], mode=b"drop")
            pipe.hdel(self._markers_key, _utf8(node), _REPLACED_FIELD + _utf8(node))
            reply, _ = pipe.execute()
        return int(reply[1])

    def marker(self, node: str) -> str | None:
        with self._guard():
            raw = cast("bytes | None", self._client.hget(self._markers_key, _utf8(node)))
        return None if raw is None else raw.decode("ascii", "replace")

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"check limit must be an int >= 0, got {limit!r}")
        name = _utf8(node)
        with self._guard():
            reply = self._script(
                _CHECK_LUA, self._node_keys(name),
                self._chunk_prefix, name, max(0, int(cursor)), limit,
            )  # fmt: skip
            marker, damage, nxt, audited = cast("list[Any]", reply)
        return NodeCheck(
            marker.decode("ascii", "replace") or None, damage.decode(), int(nxt), int(audited)
        )

    def purge(self, node: str) -> int:
        name = _utf8(node)
        removed = 0
        with self._guard():
            batch: list[bytes] = []
            for key in self._client.scan_iter(
                match=_glob_escape(self._chunk_prefix) + b"*", count=_SCAN_COUNT
            ):
                batch.append(key)
                if len(batch) >= _SCAN_COUNT:
                    removed += self._hdel_each(batch, name)
                    batch = []
            removed += self._hdel_each(batch, name)
            self._script(_PURGED_LUA, self._node_keys(name), name)
        return removed

    def _hdel_each(self, keys: list[bytes], field: bytes) -> int:
        """HDEL ``field`` from each of ``keys`` in one round trip; how many it was in."""
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hdel(key, field)
        return sum(int(n) for n in pipe.execute())

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        if not keys:
            return []
        asking = _utf8(tenant)
        names = [self._chunk_prefix + key.hex().encode() for key in keys]
        with self._guard():
            # one round trip and one snapshot (a script runs whole: a replace in flight is seen
            # whole or not at all); a hash past the bounds comes back as its field count
            denied_s = self._memory_denied_s
            ask_memory = denied_s is None or time.monotonic() - denied_s >= MEMORY_RETRY_S
            reply = self._script(
                _HOLDERS_LUA,
                names,
                MAX_HOLDERS_PER_CHUNK,
                MAX_CHUNK_HASH_BYTES,
                1 if ask_memory else 0,
            )
            replies = cast("list[list[bytes] | int]", reply)
        if len(replies) > len(names):  # MEMORY denied: the bytes bound is taken on what is read
            replies = replies[: len(names)]
            if self._memory_denied_s is None:
                log.info(
                    "index at %s: the Redis user may not run MEMORY USAGE; chunk hashes are "
                    "bounded by the bytes read in the script instead (asked again every %.0f s)",
                    self.address,
                    MEMORY_RETRY_S,
                )
            self._memory_denied_s = time.monotonic()
        out: list[list[Holding]] = []
        for key, held in zip(keys, replies, strict=True):
            row: list[Holding] = []
            if isinstance(held, int):
                self._oversized_chunk(key, held)
                out.append(row)
                continue
            for node, value in zip(held[::2], held[1::2], strict=True):
                try:
                    holding = _holding(node, value, asking)
                except ValueError as exc:
                    self._malformed_entry(key, node, value, exc)
                    continue
                if holding is not None:
                    row.append(holding)
            row.sort(key=lambda h: h.node)
            out.append(row)
        return out

    def _oversized_chunk(self, key: bytes, fields: int) -> None:
        """A chunk's hash past ``MAX_HOLDERS_PER_CHUNK`` fields or ``MAX_CHUNK_HASH_BYTES``: no
        index writes one (one field per node holding the chunk), so it was planted (a prefix
        shared by mistake, or hostile). Read whole, every lookup over its key pulled it from
        the server, every router's; its ``fields`` entries are skipped and counted, no holder
        (its sound ones too: a worse route, never wrong data), said at warning the first time."""
        first = self._count_malformed(fields, "oversized chunk")
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "index at %s: the hash of chunk %s (%d entries) is past what an index writes (%d "
            "entries, %d bytes at most); skipped whole, not read (a prefix shared by mistake, "
            "or another writer: delete the key)",
            self.address,
            key.hex(),
            fields,
            MAX_HOLDERS_PER_CHUNK,
            MAX_CHUNK_HASH_BYTES,
        )

    def _malformed_entry(self, key: bytes, node: bytes, value: bytes, exc: ValueError) -> None:
        """An entry no RedisIndex wrote (a prefix shared by mistake, another host's bug, or
        hostile): no holder, the key's sound holders stand. It failed every lookup over its
        key (IndexUnavailable: the router's answers 503, its index said to be down). Said at
        warning the first time, then at debug: every lookup over the key meets it again."""
        first = self._count_malformed(1, "entry")
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "index at %s: malformed entry for %s under node %s: %s (value %s); skipped, not a "
            "holder (a resync of the node writes its entries again)",
            self.address,
            key.hex(),
            _shown(node),
            exc,
            _shown(value),
        )

    @property
    def malformed_entries(self) -> int:
        """Entries skipped as no index's writing since this index was opened: each chunk entry
        every time ``holders`` meets it, and each node count ``nodes`` left out, once while it
        stays."""
        return self._malformed_entries

    def _count_malformed(self, n: int, kind: str) -> bool:
        """Add ``n`` to ``malformed_entries`` (lookups run on many threads); whether it is the
        first of its ``kind`` (said at warning, the others at debug)."""
        with self._malformed_lock:
            self._malformed_entries += n
            first = kind not in self._malformed_said
            self._malformed_said.add(kind)
            return first

    def nodes(self) -> dict[str, int]:
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            pipe.hgetall(self._nodes_key)
            pipe.hgetall(self._markers_key)
            # bytes: the client is made without decode_responses
            counts, markers = cast("list[dict[bytes, bytes]]", pipe.execute())
        # P nodes gone whole (evicted on its own): a node with a marker has its count there too.
        # Not a field gone alone: a router before counts deletes it when the node holds none.
        if not counts:
            for field, count in markers.items():
                node = field[len(_COUNT_FIELD) :]
                if field.startswith(_COUNT_FIELD) and node in markers:
                    counts[node] = count
        out: dict[str, int] = {}
        bad: dict[tuple[bytes, bytes], str] = {}
        for field, raw in counts.items():
            # one count that is none (a prefix shared by mistake, another host's bug, or
            # hostile) failed nodes() for every router: only its node is left out, and said
            n = _count(raw)
            try:
                name = _str(field)
            except UnicodeDecodeError:  # no router writes a name it cannot read back
                bad[field, raw] = "its name is no UTF-8"
                continue
            if n is None:
                bad[field, raw] = (
                    f"its count of entries is {_shown(raw)}, not one from 0 to {MAX_COUNT}"
                )
            elif n > 0:
                out[name] = n
        # one lock: two reads at once must neither both say and count a new one, nor lose one
        with self._malformed_lock:
            new = bad.keys() - self._bad_counts_said
            self._bad_counts_said = set(bad)
            self._malformed_entries += len(new)
        for field, raw in new:
            log.warning(
                "index at %s: node %s: %s (a prefix shared by mistake, or another writer); "
                "the node is left out of the index's nodes until a write of its entries "
                "counts it again",
                self.address,
                _shown(field),
                bad[field, raw],
            )
        return dict(sorted(out.items()))

    # --- ClaimingIndex -------------------------------------------------------------------
    def claim(self, claimant: str, nodes: Iterable[str]) -> None:
        with self._guard():
            # the server's clock: routers' clocks may disagree, its own does not
            seconds, micros = self._client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            value = json.dumps({"ms": now_ms, "nodes": sorted(nodes)})
            self._client.hset(self._claims_key, _utf8(claimant), _utf8(value))

    def claims(self, *, excluding: str = "") -> dict[str, float]:
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            pipe.time()
            pipe.hgetall(self._claims_key)
            (seconds, micros), raw = pipe.execute()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            out: dict[str, float] = {}
            gone: list[bytes] = []
            for field, value in cast("dict[bytes, bytes]", raw).items():
                claim = _claim(value)
                if claim is None:
                    continue  # not a claim (a prefix shared by mistake)
                claimed_ms, nodes = claim
                # a router that stopped long ago: its field goes; and one dated over that far
                # ahead of the server's clock, whose age would be 0 at every read (its nodes
                # claimed for ever): no router's clock (the server's) wrote it
                if abs(now_ms - claimed_ms) > CLAIMS_KEPT_S * 1000:
                    gone.append(field)
                    continue
                age_s = max(0.0, (now_ms - claimed_ms) / 1000)
                if field == _utf8(excluding):
                    continue
                for node in nodes:
                    out[node] = min(age_s, out.get(node, age_s))
            if gone:
                self._client.hdel(self._claims_key, *gone)
        return out

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

    def _call_args(self, node: str, ops: list[bytes], mode: bytes = b"") -> tuple[Any, ...]:
        """A ``_BODY`` script call's arguments after the script: its keys' count, its KEYS and
        its ARGV. ``mode``: see ``_BODY``."""
        name = _utf8(node)
        return (3, *self._node_keys(name), self._chunk_prefix, name, mode, *ops)

    def _queue(
        self,
        pipe: Any,
        script: str,
        node: str,
        ops: list[bytes],
        *,
        mode: bytes = b"",
        by_sha: bool = False,
    ) -> None:
        """Queue one script call in a MULTI/EXEC: EVALSHA when ``by_sha`` (a call after one of
        the same script as EVAL in the same transaction), else EVAL. Not redis-py's
        ``register_script``: its pipelines ask SCRIPT EXISTS first (one more round trip), and a
        SCRIPT FLUSH between that and the EXEC would still fail the EVALSHA inside it, the
        rest of the transaction run."""
        call = self._call_args(node, ops, mode)
        if by_sha:
            pipe.execute_command("EVALSHA", sha1(script), *call)
        else:
            pipe.execute_command("EVAL", script, *call)

    def _script(self, script: str, keys: Sequence[bytes], *args: Any) -> Any:
        """One call of ``script`` by its SHA, as EVAL where it cannot be (``ShaGate.call``)."""
        return self._sha.call(self._client, script, keys, args)

    def _node_keys(self, name: bytes) -> tuple[bytes, bytes, bytes]:
        """The scripts' KEYS for a node (``name``: its UTF-8 bytes): its set, the nodes hash
        and the markers hash."""
        return self._prefix + b"n:" + name.hex().encode(), self._nodes_key, self._markers_key

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Every backend failure leaves as IndexUnavailable, naming the server."""
        try:
            yield
        except (RedisError, OSError) as exc:
            raise IndexUnavailable(f"index at {self.address}: {exc}") from exc


def _claim(value: bytes) -> tuple[int, list[str]] | None:
    """(when, the nodes) of a claim as ``claim`` writes it; None for anything else (JSON of
    another shape: a "ms" of 1e400 raised OverflowError, "nodes" of "xy" claimed x and y)."""
    try:
        claim = json_text.loads(value)
    except ValueError:
        return None
    if not isinstance(claim, dict):
        return None
    ms, nodes = claim.get("ms"), claim.get("nodes")
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
        return None
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        return None
    return int(ms), nodes


def _glob_escape(raw: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in raw)
