"""How long an engine waits on its agent before it gives up on the cache for a request.

An engine must never wait on its cache longer than the prefill it would save. Its calls to the
agent on a request's path (a lookup, a lease, a hold, a read; a save, written behind the request
but not left to hang) each get a deadline (``DataClient.timeout``): short for a call that moves
no chunk bytes, longer for one that may, in proportion to its bytes. A call past its deadline
closes the connection, the request prefills what the agent did not give, and the engine tries the
agent again later with backoff. A hung agent (stopped, or accepting connections and never
answering) so costs one request one deadline, where the connection's own socket timeout (30 s
by default) used to be paid.

Nothing here imports torch: the write-behind writer uses it too.
"""

from __future__ import annotations

#: a call that moves no chunk bytes may take this long (a lookup, a lease of chunks the arena
#: holds, a tenant's policy, mapping the arena, a HELLO). A healthy same-host agent answers one
#: in well under a millisecond, but its lookup may first ask the fleet index (up to 0.25 s per
#: HTTP phase, kvctl.index.remote.DEFAULT_TIMEOUT_S) and then wait on the pool and peers (0.5 s,
#: kvctl.remote.federation.PROBE_DEADLINE_S): about 1.25 s on a healthy agent whose index and
#: peers are slow, before a loaded host's scheduling delay. 2 s leaves room for that: shorter
#: would turn a slow-but-sound agent into lost reuse well beyond one request (the connection is
#: dropped and tried again only after the reconnect backoff, 2 s and up, or the vLLM
#: connector's retry_seconds)
ANSWER_SECONDS = 2.0

#: a call that may move chunk bytes gets ANSWER_SECONDS plus its bytes at this rate: chunks the
#: agent reads from its disk or pulls from the pool or a peer before it answers a lease or a
#: hold, and reads through the socket where the arena is not shared (multi-GiB for a long
#: prefix). Every path that serves reuse runs well above it (disks measured here at 0.4-1.9 GB/s,
#: the shared arena and loopback at several GB/s), so a legitimate move is not cut off; one
#: slower is stalled or, on a GPU, loses to recomputing anyway (an 8B model's prefill is worth
#: ~3 GB/s of its KV on an H100). It also bounds what a hung agent costs a request that asks for
#: a long prefix: 2 s + 4 s per GiB asked for. The agent's own pulls wait on slower sources
#: (down to kvctl.remote.pool.PULL_FLOOR_BYTES_PER_S, 32 MiB/s) before giving up on them: an
#: engine stops waiting on such a pull sooner, and the agent goes on landing its chunks.
MOVE_BYTES_PER_SECOND = 256 << 20


def answer_seconds(move_bytes: int = 0, answer_s: float = ANSWER_SECONDS) -> float:
    """The deadline of one call to the agent that may move ``move_bytes`` of chunks, for an
    engine whose calls that move none may take ``answer_s``."""
    return answer_s + max(move_bytes, 0) / MOVE_BYTES_PER_SECOND
