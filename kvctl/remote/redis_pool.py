"""The shared remote pool on Redis or Valkey (one server, or a Cluster). Needs Redis >= 7.0 or
Valkey >= 7.2: the Lua scripts declare flags (``#!lua flags=...``).

Key layout, for ``prefix`` P::

    P:c:<keyhex>        one chunk: header + payload in one value (``kvctl.remote.record``).
                        No hash tag, so chunks spread over the slots of a Cluster.
    {P}:lru             zset keyhex -> last access (unix seconds, server clock, strictly
                        increasing: the chunks of one put or get are ordered as given; a score
                        over a day past the server's clock, inf included, is no writer's: that
                        chunk is evicted first)
    {P}:lru:t:<tenant>  the same, per tenant (victims for a tenant's quota)
    {P}:meta            hash keyhex -> "size_bytes put_s isolated(0|1) tenant"
    {P}:used            hash: bytes, chunks, t:<tenant> -> bytes
    {P}:cfg             hash: capacity_bytes (the pool is shared: the last agent to set it wins;
                        when the key is gone, e.g. a server restarted empty, the next put of an
                        agent configured with a capacity writes that back)
    {P}:clock           the last timestamp handed out (keeps lru scores strictly increasing)

Every accounting key carries the hash tag ``{P}``, so they live in one slot and each Lua script
below updates them atomically, on one server or in a Cluster. The scripts also touch
``{P}:lru:t:<tenant>`` keys they cannot declare up front (a victim's tenant is found inside the
script); Redis and Valkey allow undeclared keys of the script's own slot.

Any client of the server can write these keys (another host's bug, or hostile), and what no agent
wrote fails no script: an accounting key of another type is deleted and made again from
{P}:meta (each script checks their types first: a TYPE each), a capacity that is not decimal
digits is none (the configured one is written back), a meta entry that does not parse (a put
time of inf or nan included) is dropped, and a count the scripts cannot add to is counted again.

A put is two round trips: (1) one script call accounts the whole batch (refusals, LRU victims
for quotas and capacity) beside a STRLEN per chunk (a record is present when not empty); (2) the
victims' records are deleted and the new records written, each with ONE
``SET key header+payload`` (atomic: a reader sees a record whole or not at all). Building
header+payload copies the payload once, here, on purpose.
The copy-free alternative, a MULTI/EXEC of ``SET key header`` + ``APPEND key <memoryview>``
(redis-py sends a memoryview argument without copying it), moves that copy to the server: APPEND
memcpys the payload into the value, while a big SET argument becomes the value as read. Measured
with 32 x 4 MiB records into a local Redis 7.0: MULTI+APPEND ~18 ms client CPU and ~100 ms server
CPU per 128 MiB; SET of the joined record ~25-85 ms client CPU and ~50 ms server CPU; the same
wall time (~1.0-1.6 GB/s). A pool's server is single-threaded and shared by every agent, so its
CPU is the scarce one: the copy stays in the agent. (The same SET also works in a Cluster, which
has no transactions across slots; and with hiredis installed redis-py copies arguments anyway.)
Records are sent in groups of at most 64 MiB to bound the copies held at once.

A get is one round trip: the reads (each after a STRLEN: see below) and a script that refreshes
the LRU score of the accounted keys (only for chunks the reader may see). Each record is read with
``GETRANGE key 0 <largest record>``, not GET: a key holds whatever any client of the server wrote
there, up to Redis's 512 MB, and a GET brought all of it into the agent's memory before any check.
A GETRANGE costs what a GET does (the server copies the value into its reply either way) and
brings at most one byte past the largest record the pool takes (``max_record_bytes``: the largest
chunk, ``max_chunk_bytes``, plus the largest header); a longer one is a miss. Agents of a pool
may set ``max_chunk_bytes`` apart (each agent's pool takes its ``max_chunk``): a longer record
whose sound header declares a larger chunk and the record's length, and that ``{P}:meta``
accounts at the size it declares, is another agent's, left in place; so is a longer record of a
format this reader does not know (a newer writer's) that meta accounts. A header is no proof
(anyone can write magic, version and CRC), and a planted one kept would cost every read of it by
this agent up to its whole bound, for good; so one meta does not account (one HMGET, only for
such a record) and any other longer record (grown by APPEND, planted) is broken, counted in
``corrupt`` and deleted if the server still holds more than the bound (one O(1) script call,
only then). A put
refuses a chunk over ``max_chunk_bytes`` (its own reads would not take it back). An empty value
reads as no record (GETRANGE answers a missing key so).
A large get is split into contiguous groups of its keys (``kvctl.remote.pool.stream_groups``),
one pipeline each on its own pooled connection, in parallel, each group's records checked on its
thread; the first group's pipeline carries the one LRU script for every key, in the order asked.
(The pure-Python reply parser, without hiredis, holds one connection to a few hundred MB/s; the
server answers several connections faster.)
Each group is also a pull with a deadline of its own (``kvctl.remote.pool.PullWatch``, as for a
peer's FETCH): the read deadline, which bounds silence and not a transfer, plus
``PULL_ALLOWANCE_PER_RECORD_S`` per record (a busy shared server answers each a little late) and
each record's bytes at ``PULL_FLOOR_BYTES_PER_S``, learnt from a STRLEN per key pipelined ahead of
the reads (an O(1) command; a record replaced between the two only misjudges its own share of the
deadline). A group past it has its connection cut: ``PullTooSlow``, counted in ``overdue`` and a
failure for the pool's breaker, instead of a request held for as long as a server or a link
trickles. (A Cluster's groups keep only the read deadline: redis-py spreads their pipelines over the
nodes' connections out of this code's reach.)
A second, best-effort round trip happens only when something needs repair: a corrupt record
(deleted, accounting dropped), a record that is gone but still accounted, or a record present
but not accounted (re-accounted, without eviction; the next put evicts down to capacity).

A record is shared by every agent, so a reader deletes one only when the damage is in the
server's copy. What fails verification as received may have been damaged on this reader's path
(a bad NIC or link): the reader sends the SHA-1 of the bytes it judged and the server deletes the
record only if it still holds exactly those bytes (``_DROP_IF_SAME_LUA``, one round trip, only
after a failed check; it costs the server one SHA-1 of the record). Otherwise the read is a miss
and the record stays. A record of a version or with flags this reader does not know (a newer
writer, e.g. mid-upgrade) is not judged at all: a miss, never deleted, counted in
``unknown_format`` rather than ``corrupt``. (A bit rotted in the version byte on the server looks
the same and is then left to LRU eviction.)

TTL (``ttl_s``): records are written with PX; the accounting has no TTL of its own. A get that
finds a record missing but still accounted drops its accounting, so expired chunks do not hold
capacity forever; until some get asks for an expired key it still counts in ``usage``. To not
race a put whose write is still in flight, accounting is only dropped when the chunk's last put
is older than ``min(ttl_s, write grace)`` (write grace: how long a write can take with retries).
A re-put of a present chunk refreshes its TTL; reads do not (TTL bounds a chunk's age since it
was last put, LRU orders by access).

The scripts go by their SHA-1 (EVALSHA), not their text (up to ~11 KB, hashed again by the
server at every EVAL): the put's script alone was most of a small put's bytes on the wire. One a
server does not hold (NOSCRIPT: it restarted, a SCRIPT FLUSH, a failover to a replica that never
ran it, a Cluster node added) is sent again as EVAL, in one more round trip, which leaves it in
that server's cache for the next call. Only the calls that failed go again, in their order: an
EVALSHA refused NOSCRIPT ran nothing, and the commands pipelined with it (each script's keys are
its own, or it is the pipeline's last) do not depend on it having run first. A Redis user the
ACL lets run EVAL but not EVALSHA (one made for the pool before its scripts went by SHA) is
answered NOPERM, which ran nothing either: that call goes again as EVAL too, and the pool sends
its scripts whole from then on (said once at warning; by SHA again after
``kvctl.redis_scripts.SHA_RETRY_S``).

Limits: a record left without accounting (a writer killed between its two round trips while
another agent evicted the same key) uses memory outside ``capacity_bytes`` until it is read
(then it is re-accounted), expires, or ``clear`` runs. Keep Redis ``maxmemory`` above
``capacity_bytes`` plus headers (per record: 73 bytes + tenant) and the accounting keys; should
Redis evict or refuse writes itself (OOM), refused writes are put failures (accounting undone)
and evicted records are misses whose accounting the next read drops.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from kvctl.redact import redact_url
from kvctl.redis_scripts import ShaGate, sent_again, sha1
from kvctl.remote import record
from kvctl.remote.pool import (
    DEFAULT_MIN_STREAM_BYTES,
    DEFAULT_STREAMS,
    PROBE_SLACK_S,
    PULL_FLOOR_BYTES_PER_S,
    BadUsageReport,
    PoolChunk,
    PoolUsage,
    Pull,
    PullWatch,
    RemotePool,
    SplitReads,
    SplitStreams,
    check_deadlines,
    probe_too_slow,
    pull_deadline_s,
    usage_count,
    visible_to,
)
from kvctl.store.errors import CorruptChunk, InvalidArgument, TierUnavailable
from kvctl.store.keys import KEY_BYTES
from kvctl.store.tiers.base import Buffer, ChunkMeta, check_capacity

log = logging.getLogger("kvctl.remote.redis_pool")

DEFAULT_CAPACITY_BYTES = 1 << 30
#: the largest chunk a pool stores and reads back when none is given (``max_chunk_bytes``): the
#: agent's own ``max_chunk`` default, so a pool takes every chunk such an agent holds
DEFAULT_MAX_CHUNK_BYTES = 256 << 20
# Writes reconnect backing off 100, 200, 400 ms (cap 500 ms): a restarted server is found again
# quickly, and a dead one fails a write in well under a second plus the connect timeouts.
_RETRIES = 3
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 0.5
# Reads reconnect once, at once (a kept connection the server dropped, e.g. after a restart):
# a read is on a request's path and a dead pool must cost it a miss, not a second of retries.
_READ_RETRIES = 1
# A put's records are sent in groups of at most this many bytes (each group one round trip):
# bounds the copies of payloads held at once (a batch of 1 GiB holds 64 MiB of them, not 1 GiB).
_WRITE_GROUP_BYTES = 64 << 20
# Scan/delete batch for clear().
_SCAN_COUNT = 500

_SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("rediss", False),
    "valkey": ("redis", False),
    "valkeys": ("rediss", False),
    "redis+cluster": ("redis", True),
    "rediss+cluster": ("rediss", True),
    "valkey+cluster": ("redis", True),
    "valkeys+cluster": ("rediss", True),
}

# Put statuses from _PUT_LUA.
_NEW, _TOUCHED = 1, 2  # 3: accounted, then evicted by a later item of its batch
_REFUSED = {-1: "larger than the pool", -2: "over the tenant's quota", -3: "no room"}

# --- Lua ------------------------------------------------------------------------------------
# KEYS: lru, meta, used, cfg, clock (all hash-tagged {P}); ARGV[1]: "{P}:lru:t:" (the per-tenant
# zset prefix). Meta values: "size_bytes put_s isolated tenant" (tenant last: it may hold spaces).
_LUA_COMMON = """
local lru, meta, used, cfg, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local tz = ARGV[1]

-- server time, strictly increasing across calls (ties would order by key name, not by access)
local function now_s()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  -- a clock that is no number (another host's bug, or hostile) failed every script: restarted.
  -- So is one a day past the server's time (inf, 1e300: Lua reads them as numbers): every
  -- timestamp after it was that one, for good, the LRU order lost
  local last = tonumber(redis.call('GET', clock) or '0') or 0
  if last > now + 86400 then last = 0 end
  if now <= last then now = last + 0.000001 end
  local s = string.format('%.6f', now)
  redis.call('SET', clock, s)
  return s
end

-- nil for an entry no writer of this format made (another host's bug, or hostile): the
-- scripts raised on it (arithmetic on nil), failing every put that met it as a victim or re-put
local function parse(m)
  local a = string.find(m, ' ', 1, true)
  local b = a and string.find(m, ' ', a + 1, true)
  local c = b and string.find(m, ' ', b + 1, true)
  if not c then return nil end
  local size, put_s = tonumber(string.sub(m, 1, a - 1)), tonumber(string.sub(m, a + 1, b - 1))
  -- a put time of inf or nan (put_s ~= put_s) was never older than the write grace: its
  -- accounting outlived its record for good
  if not size or not put_s or size < 0 or size > 9007199254740992 or size ~= math.floor(size)
    or put_s ~= put_s or put_s == math.huge or put_s == -math.huge
  then
    return nil
  end
  return size, put_s, string.sub(m, b + 1, c - 1), string.sub(m, c + 1)
end

-- {P}:used counted again from {P}:meta, whose entries are what it counts (O(entries): on a
-- broken count, or once an entry no writer made was dropped, never on the hot path). A count
-- HINCRBY cannot take (no integer, or one so large that it would overflow: another host's bug,
-- or hostile) failed every put that counted into it, and restarting it at 0 left every chunk
-- held uncounted (the pool filling past its capacity, the count going negative as they went);
-- the bytes of a dropped entry no writer made stayed counted for good, the pool's room shrunk
-- by as much for every agent (all of it: every put refused 'no room'). Called once meta holds
-- the change being counted.
local recount_due = false

local function recount()
  recount_due = false
  local bytes, chunks, tenants = 0, 0, {}
  for _, m in ipairs(redis.call('HVALS', meta)) do
    local size, _, _, t = parse(m)
    if size then
      bytes, chunks = bytes + size, chunks + 1
      tenants[t] = (tenants[t] or 0) + size
    end
  end
  for _, f in ipairs(redis.call('HKEYS', used)) do
    if string.sub(f, 1, 2) == 't:' and not tenants[string.sub(f, 3)] then
      redis.call('HDEL', used, f)
    end
  end
  redis.call('HSET', used, 'bytes', string.format('%.0f', bytes),
    'chunks', string.format('%.0f', chunks))
  for t, n in pairs(tenants) do redis.call('HSET', used, 't:' .. t, string.format('%.0f', n)) end
end

-- the entry of zset z to evict first: one scored past the server's time by over a day (inf,
-- 1e300: no writer's timestamp, since every score is now_s()'s; another host's bug, or hostile),
-- else the oldest. Taken in LRU order, such an entry kept its chunk from eviction for good, ahead
-- of every chunk read since (enough of them left the pool room for nothing else). -inf is the
-- lowest score, taken first already; Redis keeps no NaN score
local function oldest(z)
  local t = redis.call('TIME')
  local far = string.format('(%.6f', tonumber(t[1]) + 86400)
  local v = redis.call('ZRANGE', z, '+inf', far, 'BYSCORE', 'REV', 'LIMIT', 0, 1)[1]
  return v or redis.call('ZRANGE', z, 0, 0)[1]
end

local function count_of(field)
  return tonumber(redis.call('HGET', used, field) or '0')
end

local function used_bytes(field)
  if recount_due then recount() end
  local v = redis.call('HGET', used, field)
  if v and (#v > 18 or not string.match(v, '^%-?%d+$')) then
    recount()
    return count_of(field)
  end
  return tonumber(v or '0')
end

-- HINCRBY alone on the hot path (a put's or an eviction's three counts): only when it fails, or
-- leaves a count no pool holds (negative, or of 19 digits), are the counts counted again, once
-- the other counts of the change are made (before they are next read, or at the script's end):
-- counted at once, the change's increments after this one added it a second time. 1 then (not
-- taken for a tenant's last bytes: the recount drops a tenant's count with no entries left)
local function incr(field, by)
  local r = redis.pcall('HINCRBY', used, field, by)
  if type(r) == 'table' or r < 0 or r >= 1e18 then
    recount_due = true
    return 1
  end
  return r
end

-- An accounting key holding another type than its own (another host's bug, or hostile) failed
-- every script that met it (WRONGTYPE): every put of every agent, and with them the pool's
-- breaker, which reads share. Deleted, and made again from {P}:meta: a recency zset with each
-- entry's last put as its score (left empty, it made no room: every put refused), the counts by
-- recount. Each check is a TYPE (O(1)); a rebuild is O(entries), only after such a key.
local function own_type(k, want)
  local t = redis.call('TYPE', k)['ok']
  if t == want or t == 'none' then return false end
  redis.call('DEL', k)
  return true
end

local function rebuild(z, only_tenant)
  local all = redis.call('HGETALL', meta)
  for i = 1, #all, 2 do
    local size, put_s, _, t = parse(all[i + 1])
    if size and (not only_tenant or t == only_tenant) then
      redis.call('ZADD', z, string.format('%.6f', put_s), all[i])
    end
  end
end

local function sound()
  if own_type(meta, 'hash') then recount_due = true end  -- nothing is accounted now
  if own_type(used, 'hash') then recount_due = true end
  own_type(cfg, 'hash')
  own_type(clock, 'string')
  if own_type(lru, 'zset') then rebuild(lru) end
end

-- a tenant's recency zset, of its own type (see sound)
local function tzset(tenant)
  local k = tz .. tenant
  if own_type(k, 'zset') then rebuild(k, tenant) end
  return k
end

local function account(kh, size, iso, tenant, now)
  redis.call('HSET', meta, kh, size .. ' ' .. now .. ' ' .. iso .. ' ' .. tenant)
  redis.call('ZADD', lru, now, kh)
  redis.call('ZADD', tzset(tenant), now, kh)
  incr('bytes', size)
  incr('chunks', 1)
  incr('t:' .. tenant, size)
end

local function forget(kh)
  redis.call('ZREM', lru, kh)
  local m = redis.call('HGET', meta, kh)
  if not m then return 0 end
  local size, _, _, tenant = parse(m)
  redis.call('HDEL', meta, kh)
  if not size then  -- no size, no tenant known: counted again before the counts are next used
    recount_due = true
    return 0
  end
  redis.call('ZREM', tzset(tenant), kh)
  incr('bytes', -size)
  incr('chunks', -1)
  if incr('t:' .. tenant, -size) <= 0 then
    redis.call('HDEL', used, 't:' .. tenant)
  end
  return size
end

sound()
"""

# ARGV: tz, fallback capacity, write it back (0|1), n, then n x (keyhex, size_bytes, isolated 0|1,
# tenant, quota_bytes). The fallback applies when {P}:cfg has no capacity: it is the agent's
# configured capacity (written back, so every agent enforces it again) or, for an agent that
# configured none, the default (not written: it would override the configured agents').
# Returns {statuses, victims}: per item 1 new, 2 already accounted (touched), 3 accounted then
# evicted by a later item of the batch (not to be written), -1/-2/-3 refused; victims: keyhexes
# whose accounting was removed and whose records the caller deletes.
_PUT_LUA = (
    "#!lua\n"  # a shebang script is refused whole under OOM, rather than failing half done
    + _LUA_COMMON
    + """
-- a capacity no agent set (inf or nan stopped every eviction, a negative or a fraction refused
-- every put; agents write decimal digits) is none: the configured one is written back
local cap = redis.call('HGET', cfg, 'capacity_bytes')
if cap and (#cap > 19 or not string.match(cap, '^%d+$')) then
  redis.call('HDEL', cfg, 'capacity_bytes')
  cap = nil
end
cap = tonumber(cap)
if not cap then
  cap = tonumber(ARGV[2])
  if ARGV[3] == '1' then redis.call('HSET', cfg, 'capacity_bytes', ARGV[2]) end
end
local n = tonumber(ARGV[4])
local status, khs, victims = {}, {}, {}
-- nothing left to evict and a count still over: a count no put made (a whole number another
-- client wrote far past what the pool holds) refused every put for good, as no eviction brings
-- it down. Counted again from meta, once a call (O(entries), only then). The recency zset z is
-- empty here: where meta still holds entries (z deleted by another client, or evicted by a
-- server's allkeys-* maxmemory policy) they are added to it again, to evict: else every put
-- was refused for good, each paying this O(entries) recount
local recounted = false
local function recount_once(z, only_tenant)
  if recounted then return false end
  recounted = true
  recount()
  rebuild(z, only_tenant)
  return true
end
for i = 1, n do
  local j = 5 + (i - 1) * 5
  local kh, size, iso, tenant = ARGV[j], tonumber(ARGV[j + 1]), ARGV[j + 2], ARGV[j + 3]
  local quota = tonumber(ARGV[j + 4])
  khs[i] = kh
  local now = now_s()
  local m = redis.call('HGET', meta, kh)
  local osize, oiso, otenant, _
  if m then
    osize, _, oiso, otenant = parse(m)
    if not osize then  -- an entry of no writer: dropped, the chunk accounted anew
      forget(kh)
      m = nil
    end
  end
  if m then
    -- a re-put is a touch: no second accounting
    redis.call('HSET', meta, kh, osize .. ' ' .. now .. ' ' .. oiso .. ' ' .. otenant)
    redis.call('ZADD', lru, now, kh)
    redis.call('ZADD', tzset(otenant), now, kh)
    status[i] = 2
  elseif size > cap then
    status[i] = -1
  elseif quota > 0 and size > quota then
    status[i] = -2
  else
    local ok = true
    local tkey = 't:' .. tenant
    -- the tenant's own oldest chunks make room for its quota, never another tenant's
    while ok and quota > 0 and used_bytes(tkey) + size > quota do
      local v = oldest(tzset(tenant))
      if v then
        -- an entry in this tenant's zset of a chunk it does not hold (another tenant's, or one
        -- not accounted: no writer's, another host's bug or hostile) evicted that chunk for
        -- this tenant's quota: it is dropped from the zset, the chunk left alone
        local m = redis.call('HGET', meta, v)
        local _, _, _, owner = parse(m or '')
        if owner == tenant then
          forget(v)
          victims[#victims + 1] = v
        end
        redis.call('ZREM', tzset(tenant), v)
      elseif not recount_once(tzset(tenant), tenant) then
        ok = false
      end
    end
    while ok and used_bytes('bytes') + size > cap do
      local v = oldest(lru)
      if v then
        forget(v)
        victims[#victims + 1] = v
      elseif not recount_once(lru) then
        ok = false
      end
    end
    if ok then
      account(kh, ARGV[j + 1], iso, tenant, now)
      status[i] = 1
    else
      status[i] = -3
    end
  end
end
for i = 1, n do
  if status[i] > 0 and redis.call('HEXISTS', meta, khs[i]) == 0 then status[i] = 3 end
end
local gone, seen = {}, {}
for _, v in ipairs(victims) do
  if not seen[v] and redis.call('HEXISTS', meta, v) == 0 then
    seen[v] = true
    gone[#gone + 1] = v
  end
end
if recount_due then recount() end
return {status, gone}
"""
)

# ARGV: tz, reader's tenant, keyhexes. Refreshes the LRU score of accounted keys the reader may
# see; returns per key 1 when accounted, else 0.
_TOUCH_LUA = (
    "#!lua flags=allow-oom\n"  # reads go on when the server is full
    + _LUA_COMMON
    + """
local out = {}
for i = 3, #ARGV do
  local kh = ARGV[i]
  local m = redis.call('HGET', meta, kh)
  if m then
    local _, _, iso, tenant = parse(m)
    if iso == '0' or tenant == ARGV[2] then
      local now = now_s()  -- per key: a batch is ordered as asked, like a put's
      redis.call('ZADD', lru, now, kh)
      redis.call('ZADD', tzset(tenant), now, kh)
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if recount_due then recount() end
return out
"""
)

# ARGV: tz, grace_s, n_stale, keyhex..., n_drop, keyhex..., n_heal, (keyhex, size, iso, tenant)...
# stale: record found missing; drop its accounting if its last put is older than grace_s.
# drop: drop the accounting now (record deleted). heal: account a record found unaccounted.
_REPAIR_LUA = (
    "#!lua flags=allow-oom\n"  # it frees memory: most needed when the server is full
    + _LUA_COMMON
    + """
local now = now_s()
local grace = tonumber(ARGV[2])
local i = 3
local n = tonumber(ARGV[i])
for j = 1, n do
  local kh = ARGV[i + j]
  local m = redis.call('HGET', meta, kh)
  if m then
    local _, put_s = parse(m)
    if not put_s or tonumber(now) - put_s > grace then forget(kh) end
  end
end
i = i + n + 1
n = tonumber(ARGV[i])
for j = 1, n do forget(ARGV[i + j]) end
i = i + n + 1
n = tonumber(ARGV[i])
for j = 0, n - 1 do
  local k = i + 1 + j * 4
  if redis.call('HEXISTS', meta, ARGV[k]) == 0 then
    account(ARGV[k], ARGV[k + 1], ARGV[k + 2], ARGV[k + 3], now)
  end
end
if recount_due then recount() end
return 0
"""
)

# ARGV: tz, capacity_bytes. Sets the pool's capacity and evicts (LRU) down to it; returns victims.
_RESIZE_LUA = (
    "#!lua flags=allow-oom\n"
    + _LUA_COMMON
    + """
local cap = tonumber(ARGV[2])
redis.call('HSET', cfg, 'capacity_bytes', ARGV[2])
local victims = {}
while used_bytes('bytes') > cap do
  local v = oldest(lru)
  if not v then break end
  forget(v)
  victims[#victims + 1] = v
end
if recount_due then recount() end
return victims
"""
)

# KEYS[1]: a chunk record. ARGV: its length, n, the SHA-1 (hex) of its first n bytes as a reader
# received them (which failed verification). Deletes the record only when the server holds those
# exact bytes, so the damage is in the shared copy and not on that reader's path (nor was the
# record replaced since); returns 1 when deleted. Verified here, not re-read: a path that damages
# every read alike would damage a re-read too. allow-oom: deleting frees memory.
_DROP_IF_SAME_LUA = """#!lua flags=allow-oom
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
local n = tonumber(ARGV[2])
local head = ''
if n > 0 then head = redis.call('GETRANGE', KEYS[1], 0, n - 1) end
if redis.sha1hex(head) ~= ARGV[3] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# KEYS[1]: a chunk record. ARGV[1]: the longest record the reader takes; ARGV[2]: the length a
# sound header the reader read declares for a chunk larger than it takes, or -1. Deletes the
# record only while it is still longer (a put since has written a record there) and not that
# long (a record of an agent configured for larger chunks, left to it: 2); returns 1 when
# deleted. O(1): a record's length is the server's, not damage on a reader's path. allow-oom:
# deleting frees memory.
_DROP_IF_LONGER_LUA = """#!lua flags=allow-oom
local n = redis.call('STRLEN', KEYS[1])
if n <= tonumber(ARGV[1]) then return 0 end
if n == tonumber(ARGV[2]) then return 2 end
return redis.call('DEL', KEYS[1])
"""

# KEYS[1]: a chunk's key that held no string (WRONGTYPE). Deletes it only if it still holds none
# (a put since has written a record there); returns 1 when deleted.
_DROP_IF_NOT_STRING_LUA = """#!lua flags=allow-oom
if redis.call('TYPE', KEYS[1]).ok == 'string' then return 0 end
return redis.call('DEL', KEYS[1])
"""

# KEYS[1]: a chunk record. ARGV[1]: bytes to read first. Returns {header, record length} (the
# whole header, whatever the tenant's length) or nil: atomic, so header and length agree.
_PROBE_LUA = f"""#!lua flags=no-writes
local h = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #h == 0 then return nil end
local n = redis.call('STRLEN', KEYS[1])
if #h >= {record.FIXED_BYTES} then
  local hl = {record.MIN_HEADER_BYTES} + string.byte(h, {record.FIXED_BYTES - 1})
    + 256 * string.byte(h, {record.FIXED_BYTES})
  if hl > #h and hl <= n then h = redis.call('GETRANGE', KEYS[1], 0, hl - 1) end
end
return {{h, n}}
"""


@dataclass(frozen=True, slots=True)
class _Damaged:
    """A record that failed verification as received, and what identifies the received bytes:
    the server deletes the record only if it holds the same (``_DROP_IF_SAME_LUA``)."""

    reason: CorruptChunk
    record_bytes: int  # the record's length (STRLEN)
    judged_bytes: int  # how many of its first bytes were judged (all, or a probe's header)
    judged_sha1_hex: str

    @classmethod
    def of(cls, reason: CorruptChunk, judged: bytes, record_bytes: int) -> _Damaged:
        # SHA-1 because the server has it (redis.sha1hex); it identifies bytes, it secures nothing
        digest = hashlib.sha1(judged, usedforsecurity=False).hexdigest()
        return cls(reason, record_bytes, len(judged), digest)


@dataclass(frozen=True, slots=True)
class _Oversized:
    """A record longer than any chunk the pool takes (``max_record_bytes``), read no further
    than one byte past the bound: a miss. One whose sound header declares a chunk larger than
    ``max_chunk_bytes`` and the record's length, accounted in {P}:meta at that size, is another
    agent's, configured for larger chunks (agents of a pool need not agree on it): left in
    place, not counted corrupt; so is one of a newer format (``unknown``) meta accounts. Any
    other no writer made (grown by APPEND, planted: another host's bug, or hostile; a key may
    hold up to 512 MB): counted corrupt, deleted while the server still holds more than the
    bound and not a sound larger chunk's length (``_DROP_IF_LONGER_LUA``)."""

    #: the record's length as the server said it (None where not asked: a Cluster's read)
    record_bytes: int | None
    #: the record length its sound header declares for a chunk larger than this pool takes,
    #: where the server's length (when asked) agrees; None: a broken record
    sound_bytes: int | None = None
    #: the chunk size that sound header declares (kept only where {P}:meta accounts it so)
    sound_size_bytes: int | None = None
    #: what about the record's format this reader does not know (a newer writer's?), or None
    unknown: str | None = None

    @property
    def needs_accounting(self) -> bool:
        """Kept only where {P}:meta accounts it: a sound header or a newer format is no proof
        (anyone can write one: magic, version and a CRC), and a smaller reader meeting a
        planted one would pull up to its whole bound for a miss on every read, for good."""
        return self.sound_bytes is not None or self.unknown is not None

    @classmethod
    def of(
        cls, head: bytes, record_bytes: int | None, *, key: bytes, max_chunk_bytes: int
    ) -> _Oversized:
        """What a record of ``record_bytes`` (None: not asked) starting with ``head`` is."""
        try:
            header = record.decode_header(head, key=key)
        except CorruptChunk:
            return cls(record_bytes)
        if header.meta.size_bytes <= max_chunk_bytes:  # longer than its own header says
            return cls(record_bytes)
        if record_bytes is not None and record_bytes != header.record_bytes:
            return cls(record_bytes)
        return cls(record_bytes, header.record_bytes, header.meta.size_bytes)

    def larger_chunk(self, max_chunk_bytes: int) -> str:
        """How the log says a sound record of a chunk larger than this pool takes."""
        return (
            f"a record of {self.sound_bytes} bytes, of a chunk larger than this pool's "
            f"max_chunk_bytes {max_chunk_bytes} (an agent configured for larger chunks wrote "
            "it): a miss, left in place"
        )

    def reason(self, max_record_bytes: int) -> str:
        limit = (
            f"the {max_record_bytes} bytes a record of this pool's largest chunk "
            "(max_chunk_bytes) and header takes at most"
        )
        if self.record_bytes is None:
            return f"record of more than {limit}"
        return f"record of {self.record_bytes} bytes, over {limit}"


@dataclass(frozen=True, slots=True)
class _Unknown:
    """A record this reader cannot judge (a newer version or flags): a miss, left in place."""

    why: str


@dataclass(frozen=True, slots=True)
class _WrongType:
    """A chunk's key holding no string (a hash, a list: another host's bug, or hostile): its
    reads fail WRONGTYPE. A miss counted corrupt, not a failure of the pool: it failed the
    whole get or probe (TierUnavailable, the pool's breaker opening) over one key. The
    server's copy is what is wrong, so the key is deleted (its accounting dropped) as a corrupt
    record is, unless a put has written a record there since (``_DROP_IF_NOT_STRING_LUA``)."""

    error: str


#: what a read of one key found (``RedisPool._read``): the chunk, how it failed, or None (absent)
_Read = tuple[ChunkMeta, memoryview] | _Damaged | _Oversized | _Unknown | _WrongType | None


@dataclass(frozen=True, slots=True)
class _Item:
    """One distinct chunk of a put batch."""

    meta: ChunkMeta
    payload: memoryview
    header: bytes
    keyhex: str


class RedisPool(SplitStreams, RemotePool):
    """A pool on Redis/Valkey shared by every agent that opens the same URL and ``prefix``.

    ``capacity_bytes`` (payload bytes, headers not counted) is written to the pool when given
    (the last agent to set it wins), and written back by this agent's next put whenever the pool
    has lost it (a server restarted empty); when None the pool's setting is used, 1 GiB if none.
    ``tenant_quotas[tenant]``, else ``tenant_quota_bytes`` (0: none), caps the bytes a tenant
    holds; quotas are this agent's configuration, applied to the puts it makes.
    ``streams``: pipelines one get may be split over, on as many pooled connections (1: one);
    ``min_stream_bytes``: the least a pipeline should carry for the split to pay.
    ``read_timeout_s`` (default ``min(DEFAULT_READ_TIMEOUT_S, timeout_s)``) bounds the reads
    (get, probe, usage, ping) and ``timeout_s`` the writes (put, delete, resize, clear), each on
    its own connections: a write is behind the request that made it and may wait longer.
    ``max_chunk_bytes`` (default ``DEFAULT_MAX_CHUNK_BYTES``, the agent's ``max_chunk``): the
    largest chunk put or read; a record longer than it plus the largest header is broken, and
    no more of it than that is read (see the module docstring).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvctl",
        capacity_bytes: int | None = None,
        ttl_s: float | None = None,
        tenant_quota_bytes: int = 0,
        tenant_quotas: Mapping[str, int] | None = None,
        timeout_s: float = 2.0,
        read_timeout_s: float | None = None,
        streams: int = DEFAULT_STREAMS,
        min_stream_bytes: int = DEFAULT_MIN_STREAM_BYTES,
        max_chunk_bytes: int | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise InvalidArgument(f"pool URL must be a string, got {url!r:.60}")
        self.address = _mask_password(url)
        if not prefix or "{" in prefix or "}" in prefix:
            raise InvalidArgument(
                f"pool prefix must be non-empty without '{{' or '}}' (it becomes the hash tag "
                f"of the accounting keys), got {prefix!r}"
            )
        if capacity_bytes is not None:
            check_capacity(capacity_bytes, "pool capacity")
        check_capacity(tenant_quota_bytes, "tenant quota")
        quotas = dict(tenant_quotas or {})
        for tenant, quota in quotas.items():
            check_capacity(quota, f"quota of tenant {tenant!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"pool ttl_s must be positive, got {ttl_s!r}")
        read_timeout_s = check_deadlines("pool", timeout_s, read_timeout_s)
        if max_chunk_bytes is None:
            max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
        if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int):
            raise InvalidArgument(f"pool max_chunk_bytes must be an int, got {max_chunk_bytes!r}")
        if max_chunk_bytes < 1:
            raise InvalidArgument(f"pool max_chunk_bytes must be positive, got {max_chunk_bytes}")
        if streams < 1 or min_stream_bytes < 1:
            raise InvalidArgument(
                f"pool streams and min_stream_bytes must be positive, got {streams}, "
                f"{min_stream_bytes}"
            )

        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self.tenant_quota_bytes = tenant_quota_bytes
        self.tenant_quotas = quotas
        self.max_chunk_bytes = max_chunk_bytes
        #: the longest record a chunk this pool takes can make (its largest header included):
        #: what a read brings of a key at most, and past which a record is broken
        self.max_record_bytes = max_chunk_bytes + record.MIN_HEADER_BYTES + record.MAX_TENANT_BYTES
        self.corrupt = 0
        self.overdue = 0
        #: records read in a format this reader does not know (left in the pool, misses)
        self.unknown_format = 0
        self._wrong_type_said = False
        #: the scripts go by SHA unless this pool's Redis user was denied EVALSHA lately
        self._sha = ShaGate(lambda: f"pool {self.address}", log)
        self._watch = PullWatch(f"pool {self.address}")
        #: sized by the chunks read last; workers enough for a few gets at once
        self._split = SplitReads(
            f"pool {self.address}",
            streams=streams,
            min_stream_bytes=min_stream_bytes,
            workers=2 * streams,
            thread_name="kvctl-pool-get",
        )
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        # a generous bound on how long after its accounting a put's write can still land
        write_grace_s = (_RETRIES + 1) * (2 * timeout_s + _BACKOFF_CAP_S) + 1.0
        self._stale_grace_s = write_grace_s if ttl_s is None else min(ttl_s, write_grace_s)

        tag = "{" + prefix + "}"
        self._acct_keys = tuple(f"{tag}:{n}" for n in ("lru", "meta", "used", "cfg", "clock"))
        self._cfg_key = self._acct_keys[3]
        self._used_key = self._acct_keys[2]
        self._tenant_lru_prefix = f"{tag}:lru:t:"

        self._lock = threading.Lock()
        self._pending_capacity_bytes = capacity_bytes  # written before the next call
        self._capacity_set_bytes = capacity_bytes  # the last capacity this agent set
        self._closed = False
        self._client_url, self.cluster = _parse_url(url, self.address)
        # reads and writes on separate clients (and connections): each its own deadline
        self._client_kwargs: dict[bool, dict[str, Any]] = {
            True: {
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                # timeouts are not retried (a hung server fails a call in one timeout_s);
                # connection errors are, with backoff, so a restarted server is reconnected to
                # transparently
                "retry": Retry(
                    ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S),
                    _RETRIES,
                    supported_errors=(redis.exceptions.ConnectionError,),
                ),
            },
            False: {
                "socket_timeout": read_timeout_s,
                "socket_connect_timeout": read_timeout_s,
                "retry": Retry(
                    NoBackoff(), _READ_RETRIES, supported_errors=(redis.exceptions.ConnectionError,)
                ),
            },
        }
        #: by ``write``: the write client and the read client
        self._clients: dict[bool, redis.Redis | RedisCluster | None] = {True: None, False: None}
        if not self.cluster:
            # no I/O here: connections open on first use
            try:
                for write, kwargs in self._client_kwargs.items():
                    self._clients[write] = redis.Redis.from_url(self._client_url, **kwargs)
            except (ValueError, RedisError) as exc:
                raise InvalidArgument(f"pool URL {self.address}: {exc}") from None

    def __repr__(self) -> str:
        return f"RedisPool({self.address!r}, prefix={self.prefix!r})"

    # --- RemotePool -----------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        batch: list[_Item] = []
        slot_of: dict[bytes, int] = {}
        item_slots: list[int] = []
        for meta, data in items:
            _check_key(meta.key)
            if meta.size_bytes <= 0:
                raise InvalidArgument(f"chunk size must be positive, got {meta.size_bytes}")
            payload = record.byte_view(data)
            header = record.encode_header(meta, payload)  # checks the payload size too
            if meta.size_bytes > self.max_chunk_bytes:
                # no reader of this pool would read it back (``max_record_bytes``): refused
                log.debug(
                    "pool %s refused chunk %s: %d bytes, over its max_chunk_bytes %d",
                    self.address,
                    meta.key.hex(),
                    meta.size_bytes,
                    self.max_chunk_bytes,
                )
                item_slots.append(-1)
                continue
            slot = slot_of.get(meta.key)
            if slot is None:  # a key twice in one batch is stored once
                slot = slot_of[meta.key] = len(batch)
                batch.append(_Item(meta, payload, header, meta.key.hex()))
            item_slots.append(slot)
        if not batch:
            return [False] * len(item_slots)

        with self._lock:
            configured_bytes = self._capacity_set_bytes
        args: list[Any] = [
            self._tenant_lru_prefix,
            DEFAULT_CAPACITY_BYTES if configured_bytes is None else configured_bytes,
            int(configured_bytes is not None),
            len(batch),
        ]
        for it in batch:
            m = it.meta
            args += [it.keyhex, m.size_bytes, int(m.isolated), m.tenant, self._quota(m.tenant)]
        with self._guard():
            client = self._client(write=True)
            pipe = self._pipe(client)
            _eval(pipe, _PUT_LUA, self._acct_keys, args)
            # STRLEN, not EXISTS: a record is present only when it holds bytes. An empty value
            # (reads take it as no record: GETRANGE answers a missing key so) or a key of
            # another type (WRONGTYPE here) was present to EXISTS: never written again while
            # re-puts kept its accounting alive, a hot chunk was lost for good. SET replaces both
            for it in batch:
                pipe.strlen(self._rec(it.keyhex))
            replies = pipe.execute(raise_on_error=False)
            _raise_errors([r for r in replies[1:] if not _is_wrong_type(r)])
            if isinstance(replies[0], ResponseError) and _is_oom(replies[0]):
                # the server is full outside our accounting (maxmemory): refused, nothing done
                log.warning("pool %s refused a put batch: %s", self.address, replies[0])
                return [False] * len(item_slots)
            _raise_errors(replies[:1])
            statuses, victims = replies[0]
            present = [isinstance(r, int) and r > 0 for r in replies[1:]]

            stored = [int(s) > 0 for s in statuses]
            writes = [
                i
                for i, (s, ex) in enumerate(zip(statuses, present, strict=True))
                if s == _NEW or (s == _TOUCHED and not ex)
            ]
            refresh = [
                i
                for i, (s, ex) in enumerate(zip(statuses, present, strict=True))
                if s == _TOUCHED and ex and self._ttl_ms is not None
            ]
            victim_hexes = [_text(v) for v in victims]
            for i, s in enumerate(statuses):
                if int(s) < 0:
                    log.debug(
                        "pool %s refused chunk %s: %s",
                        self.address,
                        batch[i].keyhex,
                        _REFUSED.get(int(s), s),
                    )
            if writes or victim_hexes or refresh:
                for i in self._write(client, batch, writes, victim_hexes, refresh):
                    stored[i] = False
        return [s >= 0 and stored[s] for s in item_slots]

    def get_many(self, keys: Sequence[bytes], *, tenant: str) -> list[PoolChunk | None]:
        keys = _checked(keys)
        if not keys:
            return []
        hexes = [k.hex() for k in keys]
        with self._guard():
            client = self._client()
        touch_args = [self._tenant_lru_prefix, tenant, *hexes]
        # the first group (on this thread) carries the LRU script; every group is waited for,
        # and the first that failed raises its TierUnavailable
        groups = self._split.run(
            self._split.groups(len(keys)),
            lambda lo, hi: self._read(
                client, keys[lo:hi], hexes[lo:hi], touch_args if lo == 0 else None
            ),
        )
        accounted = groups[0][1]
        values = [value for group, _ in groups for value in group]
        if isinstance(accounted, Exception):
            # the LRU touch is best effort: the reads themselves succeeded
            log.info("pool %s: LRU touch failed: %s", self.address, accounted)
            accounted = [True] * len(keys)
        out: list[PoolChunk | None] = []
        stale: list[str] = []
        damaged: list[tuple[str, _Damaged]] = []
        heal: list[tuple[str, ChunkMeta]] = []
        wrong: list[str] = []
        oversized: list[tuple[str, _Oversized]] = []
        for h, value, acc in zip(hexes, values, accounted, strict=True):
            if value is None:
                if acc:
                    stale.append(h)
                out.append(None)
                continue
            if isinstance(value, _Damaged):
                self._count_corrupt()
                damaged.append((h, value))
                out.append(None)
                continue
            if isinstance(value, _Unknown):
                self._count_unknown(h, value)
                out.append(None)
                continue
            if isinstance(value, _WrongType):
                self._count_wrong_type(h, value)
                wrong.append(h)
                out.append(None)
                continue
            if isinstance(value, _Oversized):
                self._oversized(h, value, oversized)
                out.append(None)
                continue
            meta, data = value
            if not acc:
                heal.append((h, meta))
            out.append(PoolChunk(meta, data) if visible_to(meta, tenant) else None)
        if stale or damaged or heal or wrong or oversized:
            self._repair(stale=stale, damaged=damaged, heal=heal, wrong=wrong, oversized=oversized)
        self._split.saw([c.meta.size_bytes for c in out if c is not None])
        return out

    def _read(
        self,
        client: redis.Redis | RedisCluster,
        keys: Sequence[bytes],
        hexes: Sequence[str],
        touch_args: Sequence[Any] | None,
    ) -> tuple[list[_Read], Any]:
        """One pipeline: the reads of ``keys`` (GETRANGE, at most ``max_record_bytes`` + 1 bytes
        each; and the LRU script when ``touch_args``), each record decoded and checked here (on
        this stream's thread): per key the chunk, how it failed (``_Damaged``, ``_Oversized``,
        ``_WrongType``, or ``_Unknown`` when its format is newer than this reader), or None when
        absent; and the script's reply (None when not run, or the error it failed with)."""
        # inclusive end: one byte past the longest record says a record is longer
        last = self.max_record_bytes
        lengths: list[Any] = [None] * len(hexes)
        with self._guard():
            if isinstance(client, RedisCluster):
                # a Cluster's pipeline spreads over nodes and their connections: no deadline
                # beyond the read deadline (see the module docstring)
                pipe = self._pipe(client)
                for h in hexes:
                    pipe.getrange(self._rec(h), 0, last)
                if touch_args is not None:
                    _eval(pipe, _TOUCH_LUA, self._acct_keys, touch_args)
                # best effort, as the touch is (the only script here): a failure to send it
                # again is its reply
                replies = pipe.execute(raise_on_error=False, resend_best_effort=True)
            else:
                commands: list[tuple[Any, ...]] = [("STRLEN", self._rec(h)) for h in hexes]
                commands += [("GETRANGE", self._rec(h), 0, last) for h in hexes]
                touch = None
                by_sha = self._sha.by_sha()
                if touch_args is not None:
                    touch = _Call(len(commands), _TOUCH_LUA, self._acct_keys, touch_args)
                    commands.append((_verb(by_sha), *touch.args(by_sha=by_sha)))
                pulled = self._pull(client, commands, len(hexes), record_cap_bytes=last + 1)
                if touch is not None and by_sha and sent_again(pulled[-1]):
                    # best effort, as the touch is: a failure to send it again is its reply
                    try:
                        pulled = _resent(client, pulled, [touch], self._sha.denied)
                    except (RedisError, OSError) as exc:
                        pulled[-1] = exc
                lengths, replies = pulled[: len(hexes)], pulled[len(hexes) :]
            _raise_errors([r for r in replies[: len(hexes)] if not _is_wrong_type(r)])
        out: list[_Read] = []
        for key, value, length in zip(keys, replies[: len(hexes)], lengths, strict=True):
            if _is_wrong_type(value):
                out.append(_WrongType(str(value)))
                continue
            if not value:  # GETRANGE answers a missing key with no bytes, not nil
                out.append(None)
                continue
            if len(value) > last:
                # a newer writer's format first: judged as this reader's record, it was
                # deleted as corrupt for every agent (left in place only where accounted)
                why = _unknown_format(value)
                if why:
                    size = length if isinstance(length, int) else None
                    out.append(_Oversized(size, unknown=why))
                    continue
                out.append(
                    _Oversized.of(
                        value,
                        length if isinstance(length, int) else None,
                        key=key,
                        max_chunk_bytes=self.max_chunk_bytes,
                    )
                )
                continue
            try:
                out.append(record.decode(value, key=key))
            except CorruptChunk as exc:
                why = _unknown_format(value)
                out.append(_Unknown(why) if why else _Damaged.of(exc, value, len(value)))
        return out, replies[-1] if touch_args is not None else None

    def _pull(
        self,
        client: redis.Redis,
        commands: Sequence[tuple[Any, ...]],
        n_sized: int,
        *,
        probe_bytes: int | None = None,
        record_cap_bytes: int | None = None,
    ) -> list[Any]:
        """The replies to ``commands``, pipelined on one connection of ``client`` and read one
        by one under a pull deadline (``PullWatch``): the read deadline and
        ``PULL_ALLOWANCE_PER_RECORD_S`` for each of the ``n_sized`` records, plus, as each of
        the first ``n_sized`` replies (STRLENs of the records the reads after them bring) is read,
        that record's bytes at ``PULL_FLOOR_BYTES_PER_S``. Past it the connection is cut:
        ``PullTooSlow``, counted in ``overdue``. A reply that is an error is returned as its
        ``ResponseError``. A connection the server dropped is retried once, as the read client
        does (never one this watch cut), under the same deadline. ``probe_bytes``: a bandwidth
        probe of that many bytes, its deadline theirs from the start; cut, it is no pull (not
        counted in ``overdue``). ``record_cap_bytes``: the most of each record the commands
        read (a longer record's STRLEN extends the deadline by this much only)."""
        pool = client.connection_pool
        conn = _connection_of(pool)
        sized: dict[int, int] = {}  # by reply index: the bytes already added to the deadline
        pull: Pull | None = None
        try:
            allowance_s = pull_deadline_s(probe_bytes or 0, self.read_timeout_s, n_sized)
            if probe_bytes:  # the link monitor's, off the request path
                allowance_s += PROBE_SLACK_S
            with self._watch.watching(functools.partial(_shut, conn), allowance_s) as pull:
                for attempt in range(_READ_RETRIES + 1):
                    try:
                        if attempt:
                            # the watch cuts by shutting the socket down, and while the retry's
                            # connection was being made there was none: a deadline that passed
                            # then cut nothing, and the retry would read on with no deadline
                            conn.connect()
                            if pull.cut:
                                raise redis.ConnectionError("deadline passed while reconnecting")
                        conn.send_packed_command(conn.pack_commands(commands))
                        replies: list[Any] = []
                        for i in range(len(commands)):
                            try:
                                reply = conn.read_response()
                            except ResponseError as exc:
                                reply = exc
                            if i < n_sized and isinstance(reply, int) and i not in sized:
                                sized[i] = reply_bytes = (
                                    reply
                                    if record_cap_bytes is None
                                    else min(reply, record_cap_bytes)
                                )
                                self._watch.extend(pull, reply_bytes / PULL_FLOOR_BYTES_PER_S)
                            replies.append(reply)
                        break
                    except redis.ConnectionError:
                        conn.disconnect()
                        if pull.cut or attempt == _READ_RETRIES:
                            raise
            # read once the watch let go (a cut is final then): a pull that ended just as it
            # was cut has its socket shut all the same, so it goes back to the pool closed
            if pull.cut:
                conn.disconnect()
            return replies
        except (RedisError, OSError) as exc:
            conn.disconnect()  # replies may be left unread on it
            if pull is None or not pull.cut:
                raise
            if probe_bytes is not None:
                took_s = time.monotonic() - pull.started_s
                what = f"download of {probe_bytes} bytes"
                raise probe_too_slow(f"pool {self.address}", what, took_s, allowance_s) from exc
            with self._lock:
                self.overdue += 1
            raise pull.too_slow(
                f"pool {self.address}", f"{n_sized} chunks", self.read_timeout_s
            ) from exc
        finally:
            pool.release(conn)

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        """Headers only (GETRANGE), checked by their CRC and against the record's length (one
        longer than any chunk this pool takes is broken, as for a get)."""
        keys = _checked(keys)
        if not keys:
            return []
        hexes = [k.hex() for k in keys]
        with self._guard():
            pipe = self._pipe(self._client())
            for h in hexes:
                _eval(pipe, _PROBE_LUA, [self._rec(h)], [record.HEADER_PROBE_BYTES])
            replies = pipe.execute(raise_on_error=False)
            _raise_errors([r for r in replies if not _is_wrong_type(r)])
        out: list[ChunkMeta | None] = []
        damaged: list[tuple[str, _Damaged]] = []
        wrong: list[str] = []
        oversized: list[tuple[str, _Oversized]] = []
        for key, h, reply in zip(keys, hexes, replies, strict=True):
            if reply is None:
                out.append(None)
                continue
            if _is_wrong_type(reply):
                self._count_wrong_type(h, _WrongType(str(reply)))
                wrong.append(h)
                out.append(None)
                continue
            head, record_bytes = reply
            if int(record_bytes) > self.max_record_bytes:  # what a get would not read
                why = _unknown_format(head)
                if why:  # a newer writer's only where accounted (as a get judges it)
                    oversized.append((h, _Oversized(int(record_bytes), unknown=why)))
                    out.append(None)
                    continue
                found = _Oversized.of(
                    head, int(record_bytes), key=key, max_chunk_bytes=self.max_chunk_bytes
                )
                self._oversized(h, found, oversized)
                out.append(None)
                continue
            try:
                header = record.decode_header(head, key=key)
                if header.record_bytes != int(record_bytes):
                    raise CorruptChunk(
                        f"record is {record_bytes} bytes, its header declares {header.record_bytes}"
                    )
            except CorruptChunk as exc:
                why = _unknown_format(head)
                if why:
                    self._count_unknown(h, _Unknown(why))
                else:
                    self._count_corrupt()
                    damaged.append((h, _Damaged.of(exc, head, int(record_bytes))))
                out.append(None)
                continue
            out.append(header.meta if visible_to(header.meta, tenant) else None)
        if damaged or wrong or oversized:
            self._repair(damaged=damaged, wrong=wrong, oversized=oversized)
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        keys = _checked(keys)
        if not keys:
            return 0
        hexes = list(dict.fromkeys(k.hex() for k in keys))
        with self._guard():
            pipe = self._pipe(self._client(write=True))
            for h in hexes:
                pipe.delete(self._rec(h))
            self._queue_repair(pipe, drop=hexes)
            replies = pipe.execute()
        return sum(int(n) for n in replies[:-1])

    def usage(self) -> PoolUsage:
        """The pool's usage as its accounting keys hold it. Every agent of the prefix writes
        them: a count there that is not one (``usage_count``), or a key that is not a hash, is
        a BadUsageReport (the pool answered; the figure is not shown), not a failure of it."""
        with self._guard():
            client = self._client()
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(self._used_key)
            pipe.hget(self._cfg_key, "capacity_bytes")
            replies = pipe.execute(raise_on_error=False)
            for name, reply in zip((self._used_key, self._cfg_key), replies, strict=True):
                if _is_wrong_type(reply):
                    raise BadUsageReport(f"pool {self.address}: its {name} is not a hash")
            _raise_errors(replies)
        used, capacity = replies

        def count(key: str, field: str, value: object) -> int:
            return usage_count(value, f"pool {self.address}: its {key} has {field[:40]}")

        tenant_bytes = {
            _text(k)[2:]: count(self._used_key, _text(k), v)
            for k, v in used.items()
            if _text(k).startswith("t:")
        }
        quotas = dict(self.tenant_quotas)
        if self.tenant_quota_bytes:
            for tenant in tenant_bytes:
                quotas.setdefault(tenant, self.tenant_quota_bytes)
        if capacity is None:  # the pool lost it: what this agent's next put will enforce
            with self._lock:
                configured_bytes = self._capacity_set_bytes
            capacity = DEFAULT_CAPACITY_BYTES if configured_bytes is None else configured_bytes
        return PoolUsage(
            capacity_bytes=count(self._cfg_key, "capacity_bytes", capacity),
            used_bytes=count(self._used_key, "bytes", used.get(b"bytes", 0)),
            chunks=count(self._used_key, "chunks", used.get(b"chunks", 0)),
            tenant_bytes=tenant_bytes,
            tenant_quota_bytes=quotas,
        )

    def resize(self, capacity_bytes: int) -> None:
        """Set the pool's capacity (for every agent) and evict LRU chunks down to it."""
        check_capacity(capacity_bytes, "pool capacity")
        with self._lock:
            self._pending_capacity_bytes = None  # superseded
            self._capacity_set_bytes = capacity_bytes
        with self._guard():
            client = self._client(write=True)
            victims = self._script(
                client, _RESIZE_LUA, self._acct_keys, [self._tenant_lru_prefix, capacity_bytes]
            )
            if victims:
                pipe = client.pipeline(transaction=False)
                for v in victims:
                    pipe.delete(self._rec(_text(v)))
                pipe.execute()

    def clear(self) -> int:
        """Delete every key of this prefix (records and accounting); returns how many. For
        tests and operators: other agents sharing the prefix lose their chunks too. A capacity
        this agent set is set again (the other settings are per agent)."""
        patterns = (f"{_glob_escape(self.prefix)}:c:*", "{" + _glob_escape(self.prefix) + "}:*")
        deleted = 0
        with self._guard():
            client = self._client(write=True)
            for pattern in patterns:
                batch: list[bytes] = []
                for name in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                    batch.append(name)
                    if len(batch) >= _SCAN_COUNT:
                        deleted += _delete_keys(client, batch)
                        batch = []
                deleted += _delete_keys(client, batch)
        with self._lock:
            self._pending_capacity_bytes = self._capacity_set_bytes
        return deleted

    def close(self) -> None:
        with self._lock:
            clients = [c for c in self._clients.values() if c is not None]
            self._clients = {True: None, False: None}
            self._closed = True
        self._split.close()
        self._watch.close()
        for client in clients:
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                client.close()

    # --- link measurement -----------------------------------------------------------------
    def ping(self) -> float:
        """Seconds of one PING round trip."""
        with self._guard():
            client = self._client()
            t0 = time.perf_counter()
            client.ping()
            return time.perf_counter() - t0

    def prepare_probe(self, nbytes: int) -> None:
        """Leave ``nbytes`` of filler under this agent's probe key (expires in 10 min), so
        ``probe_transfer`` times a download only."""
        with self._guard():
            self._client(write=True).set(self._probe_key(), bytes(nbytes), px=600_000)

    def probe_transfer(self, nbytes: int) -> float:
        """Seconds to download the probe filler (a bandwidth sample for the link), cut at a
        pull's deadline for as many bytes (see ``_pull``): the read deadline bounds silence
        only, and a link that trickles held the link monitor for as long as it did."""
        with self._guard():
            client = self._client()
        # GETRANGE, one byte past the filler: the key may hold up to 512 MB meanwhile
        if isinstance(client, RedisCluster):  # no deadline of its own here (see the module)
            with self._guard():
                t0 = time.perf_counter()
                got = client.getrange(self._probe_key(), 0, nbytes)
                elapsed_s = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            with self._guard():
                command = ("GETRANGE", self._probe_key(), 0, nbytes)
                (got,) = self._pull(client, [command], 0, probe_bytes=nbytes)
                elapsed_s = time.perf_counter() - t0
                _raise_errors([got])
        if got is None or len(got) != nbytes:
            raise TierUnavailable(f"pool {self.address}: the probe filler is gone (or replaced)")
        return elapsed_s

    def _probe_key(self) -> str:
        return f"{self.prefix}:probe:{os.getpid()}:{id(self):x}"

    # --- internals ------------------------------------------------------------------------
    def _client(self, *, write: bool = False) -> redis.Redis | RedisCluster:
        """The write client or the read client (their deadlines differ), made on first use for
        a Cluster (RedisCluster connects to discover the slots); writes a capacity given at
        construction before the first call."""
        with self._lock:
            if self._closed:
                raise TierUnavailable(f"pool {self.address}: closed")
            client = self._clients[write]
            if client is None:
                client = self._clients[write] = RedisCluster.from_url(
                    self._client_url, **self._client_kwargs[write]
                )
            pending = self._pending_capacity_bytes
        if pending is not None:
            try:
                client.hset(self._cfg_key, "capacity_bytes", pending)
            except ResponseError as exc:
                # {P}:cfg of another type (another client wrote it) failed every call this
                # write came before: left pending; the next put's script makes the key a hash
                # again and writes the capacity (``_LUA_COMMON``'s sound)
                log.info("pool %s: capacity not written yet: %s", self.address, exc)
                return client
            with self._lock:
                if self._pending_capacity_bytes == pending:
                    self._pending_capacity_bytes = None
        return client

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Every backend failure leaves as TierUnavailable, naming the pool."""
        try:
            yield
        except (RedisError, RedisClusterException, OSError) as exc:
            raise TierUnavailable(f"pool {self.address}: {exc}") from exc

    def _rec(self, keyhex: str) -> str:
        return f"{self.prefix}:c:{keyhex}"

    def _quota(self, tenant: str) -> int:
        return self.tenant_quotas.get(tenant, self.tenant_quota_bytes)

    def _pipe(self, client: redis.Redis | RedisCluster) -> _Pipe:
        """A pipeline (no transaction) of ``client`` whose scripts go by SHA unless denied."""
        return _Pipe(client, by_sha=self._sha.by_sha(), denied=self._sha.denied)

    def _script(
        self,
        client: redis.Redis | RedisCluster,
        script: str,
        keys: Sequence[str],
        args: Sequence[Any],
    ) -> Any:
        """One call of ``script`` by its SHA, as EVAL where it cannot be (``ShaGate.call``)."""
        return self._sha.call(client, script, keys, args)

    def _write(
        self,
        client: redis.Redis | RedisCluster,
        batch: list[_Item],
        writes: list[int],
        victims: list[str],
        refresh: list[int],
    ) -> list[int]:
        """Delete the victims' records, write the new records, refresh re-put TTLs; returns
        the batch indexes whose write the server refused (their accounting is undone)."""
        px = self._ttl_ms
        # Records are built (one copy each, see the module docstring) a group at a time, so a
        # large batch does not hold a second copy of all its payloads at once.
        groups: list[list[int]] = [[]]
        group_bytes = 0
        for i in writes:
            n = len(batch[i].header) + batch[i].meta.size_bytes
            if groups[-1] and group_bytes + n > _WRITE_GROUP_BYTES:
                groups.append([])
                group_bytes = 0
            groups[-1].append(i)
            group_bytes += n
        failed: list[int] = []
        refusal: Exception | None = None
        for g, group in enumerate(groups):
            pipe = client.pipeline(transaction=False)
            if g == 0:
                for v in victims:
                    pipe.delete(self._rec(v))
                if px is not None:  # refreshes exist only with a TTL
                    for i in refresh:
                        pipe.pexpire(self._rec(batch[i].keyhex), px)
            for i in group:
                it = batch[i]
                pipe.set(self._rec(it.keyhex), b"".join((it.header, it.payload)), px=px)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            _raise_errors([r for r in replies if not isinstance(r, ResponseError)])
            for i, reply in zip(group, replies[len(replies) - len(group) :], strict=True):
                if isinstance(reply, ResponseError):  # e.g. OOM: Redis is fuller than we account
                    failed.append(i)
                    refusal = reply
        if failed:
            failed_hexes = [batch[i].keyhex for i in failed]
            cleanup = self._pipe(client)
            self._queue_repair(cleanup, drop=failed_hexes)
            cleanup.execute()
            log.warning(
                "pool %s refused %d of %d chunk writes: %s",
                self.address,
                len(failed),
                len(writes),
                refusal,
            )
        return failed

    def _queue_repair(
        self,
        pipe: Any,
        *,
        stale: Sequence[str] = (),
        drop: Sequence[str] = (),
        heal: Sequence[tuple[str, ChunkMeta]] = (),
    ) -> None:
        args: list[Any] = [self._tenant_lru_prefix, self._stale_grace_s, len(stale), *stale]
        args += [len(drop), *drop, len(heal)]
        for h, meta in heal:
            args += [h, meta.size_bytes, int(meta.isolated), meta.tenant]
        _eval(pipe, _REPAIR_LUA, self._acct_keys, args)

    def _oversized(
        self, h: str, found: _Oversized, oversized: list[tuple[str, _Oversized]]
    ) -> None:
        """A read found record ``h`` oversized: counted corrupt at once when broken; one of a
        sound header declaring a larger chunk, or of a newer format, is judged in ``_repair``
        by {P}:meta (left in place only where accounted)."""
        if not found.needs_accounting:
            self._count_corrupt()
        oversized.append((h, found))

    def _repair(
        self,
        *,
        stale: Sequence[str] = (),
        damaged: Sequence[tuple[str, _Damaged]] = (),
        heal: Sequence[tuple[str, ChunkMeta]] = (),
        wrong: Sequence[str] = (),
        oversized: Sequence[tuple[str, _Oversized]] = (),
    ) -> None:
        """Best effort after a read: the caller already has its answer, and whatever is not
        repaired now is found again by the next read of the same keys. A damaged record is
        deleted (and its accounting dropped) only where the server holds the very bytes that
        failed: the records are shared, and the damage may be on this reader's path alone.
        A key of the ``wrong`` type is deleted (its accounting dropped) unless it holds a
        string now; an ``oversized`` record while it is still longer than any this pool takes,
        unless it is as long as its sound header says (another agent's larger chunk: left)."""
        try:
            client = self._client()
            dropped: list[str] = []
            if oversized:
                oversized = self._judge_by_accounting(client, oversized)
            if oversized:
                pipe = self._pipe(client)
                for h, o in oversized:
                    sound = -1 if o.sound_bytes is None else o.sound_bytes
                    _eval(pipe, _DROP_IF_LONGER_LUA, [self._rec(h)], [self.max_record_bytes, sound])
                for (h, o), deleted in zip(oversized, pipe.execute(), strict=True):
                    reason = o.reason(self.max_record_bytes)
                    if int(deleted) == 2:  # as its sound header says: another agent's
                        log.debug(
                            "pool %s: chunk %s: %s",
                            self.address,
                            h,
                            o.larger_chunk(self.max_chunk_bytes),
                        )
                        continue
                    if o.sound_bytes is not None and int(deleted) == 1:
                        self._count_corrupt()  # not counted yet: broken after all
                    if int(deleted):
                        dropped.append(h)
                        log.warning(
                            "pool %s: dropped corrupt chunk %s: %s", self.address, h, reason
                        )
                    else:
                        log.warning(
                            "pool %s: chunk %s: %s; no longer (replaced since): a miss, left "
                            "in place",
                            self.address,
                            h,
                            reason,
                        )
            if wrong:
                pipe = self._pipe(client)
                for h in wrong:
                    _eval(pipe, _DROP_IF_NOT_STRING_LUA, [self._rec(h)], [])
                for h, deleted in zip(wrong, pipe.execute(), strict=True):
                    if int(deleted):
                        dropped.append(h)
            if damaged:
                pipe = self._pipe(client)
                for h, d in damaged:
                    args = [d.record_bytes, d.judged_bytes, d.judged_sha1_hex]
                    _eval(pipe, _DROP_IF_SAME_LUA, [self._rec(h)], args)
                for (h, d), deleted in zip(damaged, pipe.execute(), strict=True):
                    if int(deleted):
                        dropped.append(h)
                        log.warning(
                            "pool %s: dropped corrupt chunk %s: %s", self.address, h, d.reason
                        )
                    else:
                        log.warning(
                            "pool %s: chunk %s arrived damaged (%s) but the pool holds other "
                            "bytes (damaged in transit, or replaced since): a miss, left in place",
                            self.address,
                            h,
                            d.reason,
                        )
            if stale or dropped or heal:
                pipe = self._pipe(client)
                self._queue_repair(pipe, stale=stale, drop=dropped, heal=heal)
                pipe.execute()
        except (RedisError, RedisClusterException, OSError, TierUnavailable) as exc:
            log.info("pool %s: repair after a read failed: %s", self.address, exc)

    def _judge_by_accounting(
        self, client: redis.Redis | RedisCluster, oversized: Sequence[tuple[str, _Oversized]]
    ) -> list[tuple[str, _Oversized]]:
        """The ``oversized`` records still to drop or check on the server, once those that
        need accounting are judged by {P}:meta (one HMGET, only when there are such): a newer
        format's record is left in place (counted unknown) where meta accounts it; a sound
        larger chunk's goes on to the server's length check where meta accounts it at the size
        its header declares (or at no size meta can say). Any other is broken: counted corrupt,
        dropped while still longer than this pool's bound (not as a larger chunk's length)."""
        judge = [h for h, o in oversized if o.needs_accounting]
        if not judge:
            return list(oversized)
        entries = dict(zip(judge, client.hmget(self._acct_keys[1], judge), strict=True))
        out: list[tuple[str, _Oversized]] = []
        for h, o in oversized:
            if not o.needs_accounting:
                out.append((h, o))
                continue
            entry = entries.get(h)
            if entry is not None and o.unknown is not None:
                self._count_unknown(h, _Unknown(o.unknown))
                continue
            if entry is not None and _accounted_size(entry) in (None, o.sound_size_bytes):
                if o.record_bytes is not None:
                    # its length, read with it, is its header's already: no server check
                    log.debug(
                        "pool %s: chunk %s: %s",
                        self.address,
                        h,
                        o.larger_chunk(self.max_chunk_bytes),
                    )
                    continue
                out.append((h, o))  # the server checks its length (2: left to its agent)
                continue
            self._count_corrupt()
            out.append((h, _Oversized(o.record_bytes)))  # broken after all
        return out

    def _count_corrupt(self) -> None:
        with self._lock:
            self.corrupt += 1

    def _count_wrong_type(self, keyhex: str, wrong: _WrongType) -> None:
        with self._lock:
            self.corrupt += 1
            first = not self._wrong_type_said
            self._wrong_type_said = True
        # once at warning, then debug: every read of the key would say it again
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "pool %s: chunk %s's key holds no record (%s): a miss, the key deleted",
            self.address,
            keyhex,
            wrong.error.splitlines()[0][:120] if wrong.error else "",
        )

    def _count_unknown(self, keyhex: str, unknown: _Unknown) -> None:
        with self._lock:
            self.unknown_format += 1
            first = self.unknown_format == 1
        # once at warning (an operator should know this agent is older than a writer), then
        # debug: during an upgrade every read of a newer record would log it
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "pool %s: chunk %s is a %s this kvctl does not read (a newer writer?): a miss, "
            "left in the pool",
            self.address,
            keyhex,
            unknown.why,
        )


# --- helpers ------------------------------------------------------------------------------
# Offsets in a record's fixed header (``kvctl.remote.record``: magic 4 bytes, version u8, flags u8).
_VERSION_AT = len(record.MAGIC)
_FLAGS_AT = _VERSION_AT + 1
_KNOWN_FLAGS = record.FLAG_ISOLATED | record.FLAG_HAS_PARENT


def _accounted_size(entry: bytes | str) -> int | None:
    """The chunk size a {P}:meta entry ("size_bytes put_s isolated tenant") records, or None
    where it records none this reader can parse (the scripts drop such an entry)."""
    head = _text(entry).split(" ", 1)[0]
    return int(head) if head.isdigit() else None


def _unknown_format(value: bytes) -> str | None:
    """For a record that failed verification: what about it this reader does not know (its
    version, or flags in an intact header), or None when it is simply damaged. A newer writer's
    record is no damage, and judging it would delete it for every agent."""
    if len(value) <= _FLAGS_AT or not value.startswith(record.MAGIC):
        return None
    if value[_VERSION_AT] != record.FORMAT_VERSION:
        return f"record version {value[_VERSION_AT]}"
    # Flags are covered by the header's CRC: only unknown bits in a header that passes it were
    # written so; a flip on the wire or on the server fails the CRC and is damage.
    try:
        header_bytes = record.header_length(value)
    except CorruptChunk:
        return None
    crc_at = header_bytes - 4
    if len(value) < header_bytes or zlib.crc32(value[:crc_at]) != int.from_bytes(
        value[crc_at:header_bytes], "little"
    ):
        return None
    flags = value[_FLAGS_AT]
    return f"record with flags {flags:#x}" if flags & ~_KNOWN_FLAGS else None


def _connection_of(pool: Any) -> Any:
    """A connection of ``pool``, connected (redis-py before 5.3 wants a command name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("GET")


def _shut(conn: Any) -> None:
    """Shut a redis-py connection's socket down from another thread (``PullWatch``'s cut), so
    a read blocked on it returns at once; redis-py has no public way to end a call in flight."""
    sock = getattr(conn, "_sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True)
class _Call:
    """One script call queued in a pipeline, at reply ``index``: what to send again as EVAL."""

    index: int
    script: str
    keys: Sequence[str]
    argv: Sequence[Any]

    def args(self, *, by_sha: bool) -> tuple[Any, ...]:
        """The command's arguments after EVALSHA (``by_sha``) or EVAL."""
        first = sha1(self.script) if by_sha else self.script
        return (first, len(self.keys), *self.keys, *self.argv)


class _Pipe:
    """A pipeline (no transaction) of ``client`` whose scripts (``_eval``) go by SHA (as EVAL
    where not ``by_sha``): a reply of NOSCRIPT, or NOPERM for EVALSHA (``denied`` is called),
    is replaced by that call's, sent again as EVAL (``_resent``). Other commands
    are queued on it as on the pipeline. Not redis-py's ``register_script``: its pipelines ask
    SCRIPT EXISTS before every execute, one more round trip each time. (redis-py's
    ClusterPipeline has no eval(); its execute_command routes EVALSHA and EVAL by their keys.)"""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        by_sha: bool = True,
        denied: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._pipe: Any = client.pipeline(transaction=False)
        self._calls: list[_Call] = []
        self._by_sha = by_sha
        self._denied = denied

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def script(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        call = _Call(len(self._pipe), script, keys, args)
        if self._by_sha:  # (as EVAL, there is nothing to send again)
            self._calls.append(call)
        self._pipe.execute_command(_verb(self._by_sha), *call.args(by_sha=self._by_sha))

    def execute(
        self, raise_on_error: bool = True, *, resend_best_effort: bool = False
    ) -> list[Any]:
        """The replies (an error one as its exception where not ``raise_on_error``; else the
        first raised). ``resend_best_effort``: where sending the scripts again fails (that
        round trip raised), the failure is the reply of each call it was to send, not raised
        (as a get's LRU touch is on a single server: its reads are kept)."""
        # (the pipeline is empty again after its execute: so are the calls to send again)
        calls, self._calls = self._calls, []
        replies = self._pipe.execute(raise_on_error=False)
        try:
            replies = _resent(self._client, replies, calls, self._denied)
        except (RedisError, RedisClusterException, OSError) as exc:
            if not resend_best_effort:
                raise
            replies = list(replies)
            for call in calls:
                if sent_again(replies[call.index]):
                    replies[call.index] = exc
        if raise_on_error:
            _raise_errors(replies)
        return replies


def _eval(pipe: _Pipe, script: str, keys: Sequence[str], args: Sequence[Any]) -> None:
    """Queue a call of ``script`` on ``pipe``, by its SHA (unless the pipe's user is denied it)."""
    pipe.script(script, keys, args)


def _verb(by_sha: bool) -> str:
    return "EVALSHA" if by_sha else "EVAL"


def _resent(
    client: redis.Redis | RedisCluster,
    replies: list[Any],
    calls: Sequence[_Call],
    denied: Callable[[], None] | None = None,
) -> list[Any]:
    """``replies`` with each of ``calls`` (EVALSHA) the server answered NOSCRIPT or NOPERM for
    EVALSHA (it ran nothing) sent again as EVAL, in order, in one more round trip, and its reply
    put in place; ``denied`` is called where EVALSHA was denied."""
    missing = [c for c in calls if sent_again(replies[c.index])]
    if not missing:
        return replies
    if denied is not None and any(isinstance(replies[c.index], NoPermissionError) for c in missing):
        denied()
    pipe: Any = client.pipeline(transaction=False)
    for call in missing:
        pipe.execute_command("EVAL", *call.args(by_sha=False))
    out = list(replies)
    for call, reply in zip(missing, pipe.execute(raise_on_error=False), strict=True):
        out[call.index] = reply
    return out


def _raise_errors(replies: Sequence[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def _is_wrong_type(reply: object) -> bool:
    """Whether ``reply`` is Redis's WRONGTYPE error (a script's too: Redis keeps the code)."""
    return isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply)[:200]


def _is_oom(exc: ResponseError) -> bool:
    return str(exc).startswith("OOM") or "used memory > 'maxmemory'" in str(exc)


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"a key is {KEY_BYTES} bytes, got {key!r:.60}")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _delete_keys(client: redis.Redis | RedisCluster, names: list[bytes]) -> int:
    if not names:
        return 0
    pipe = client.pipeline(transaction=False)
    for name in names:  # one key per DEL: keys of a Cluster span slots
        pipe.delete(name)
    return sum(int(n) for n in pipe.execute())


def _mask_password(url: str) -> str:
    return redact_url(url)


def _parse_url(url: str, masked: str) -> tuple[str, bool]:
    """(the URL redis-py is given, whether it names a Cluster); InvalidArgument when unusable."""

    def bad(why: str) -> NoReturn:
        raise InvalidArgument(f"pool URL {masked}: {why}")

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        bad(str(exc))
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        bad(
            f"unsupported scheme {parts.scheme + '://' if parts.scheme else '(none)'}; use "
            "redis://, rediss://, valkey://, valkeys://, redis+cluster:// or rediss+cluster://"
        )
    client_scheme, cluster = _SCHEMES[scheme]
    if not parts.hostname:
        bad("no host")
    if port == 0:
        bad("port 0")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        bad(f"the path must be a database number, got {parts.path!r}")
    if cluster and db not in ("", "0"):
        bad("a Cluster has only database 0")
    return urlunsplit(parts._replace(scheme=client_scheme)), cluster


def _checked(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, each checked (a bad key fails the call before any request)."""
    out = list(keys)
    for k in out:
        _check_key(k)
    return out
