"""The read deadline of the pool backends (no I/O: the constructors only): reads default to a
short deadline, never longer than the write deadline, and a bad figure is refused clearly.
That the deadline holds against a real stalled pool is tests/functional/test_pool_outage.py."""

from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.pool import DEFAULT_READ_TIMEOUT_S
from kvctl.remote.redis_pool import RedisPool

BACKENDS = {
    "redis": lambda **kw: RedisPool("redis://127.0.0.1:1/0", **kw),
    "agent": lambda **kw: AgentSource("127.0.0.1:1", **kw),
}
#: both backends share one read deadline
DEFAULTS = {"redis": DEFAULT_READ_TIMEOUT_S, "agent": DEFAULT_READ_TIMEOUT_S}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_reads_get_a_short_deadline_and_writes_keep_theirs(kind: str) -> None:
    backend = BACKENDS[kind]()
    try:
        assert backend.read_timeout_s == DEFAULTS[kind] <= 0.5
    finally:
        backend.close()
    slow_writes = BACKENDS[kind](timeout_s=30.0)
    try:  # a long write deadline does not lengthen the reads
        assert slow_writes.read_timeout_s == DEFAULTS[kind]
    finally:
        slow_writes.close()
    quick = BACKENDS[kind](timeout_s=0.2)
    try:  # nor is a read allowed longer than a write
        assert quick.read_timeout_s == 0.2
    finally:
        quick.close()
    chosen = BACKENDS[kind](read_timeout_s=1.5)
    try:
        assert chosen.read_timeout_s == 1.5
    finally:
        chosen.close()


@pytest.mark.parametrize("kind", sorted(BACKENDS))
@pytest.mark.parametrize(
    "kw",
    [
        {"read_timeout_s": 0},
        {"read_timeout_s": -1.0},
        {"read_timeout_s": float("nan")},
        {"read_timeout_s": float("inf")},
        {"read_timeout_s": True},
        {"read_timeout_s": "0.5"},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
    ],
)
def test_bad_deadlines_are_refused(kind: str, kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="timeout_s must be positive"):
        BACKENDS[kind](**kw)


def test_a_full_write_behind_batch_has_time_at_the_agents_own_frame_floor() -> None:
    """A write to a pool agent (off the request path) is bounded at the rate the receiving
    agent itself cuts a frame at, not a pull's 32 MiB/s: at the pull floor a full batch (256
    MiB) had 13 s, so every batch on a working path under ~160 Mbit/s failed and opened the
    source's breaker, which its reads share."""
    from kvctl.agent.dataplane import MIN_FRAME_BYTES_PER_SECOND
    from kvctl.remote.federation import _WRITE_BATCH_BYTES, _WRITE_BATCH_CHUNKS
    from kvctl.remote.pool import write_deadline_s

    at_floor_s = _WRITE_BATCH_BYTES / MIN_FRAME_BYTES_PER_SECOND
    assert write_deadline_s(_WRITE_BATCH_BYTES, 2.0, _WRITE_BATCH_CHUNKS) >= at_floor_s
    assert write_deadline_s(_WRITE_BATCH_BYTES, 2.0, _WRITE_BATCH_CHUNKS) < 2 * at_floor_s
