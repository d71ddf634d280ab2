"""A pull from a peer whose FETCH reply trickles (``SlowRelay``: every read within the socket
timeout, the whole transfer hopelessly slow) is abandoned at its deadline, sized from its bytes
and ``PULL_FLOOR_BYTES_PER_S``: a counted miss, nothing partial stored, the connection dropped,
the source's breaker told. Without the deadline such a peer held the pull for as long as it
kept trickling."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvctl.client import DataClient
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.pool import PullTooSlow
from kvctl.store.tiers.base import ChunkMeta
from tests.functional.agents import Agent, running_agent
from tests.functional.slow_relay import SlowRelay
from tests.functional.test_remote import SMALL, chain, put_chain, remote
from tests.functional.waiting import wait_until

#: 16 KiB every 40 ms: each read is well within the 0.5 s read deadline, but a 1 MiB chunk
#: takes 2.6 s, about 80 times longer than the deadline's floor rate allows
PIECE_BYTES = 16 << 10
PIECE_EVERY_S = 0.04


@pytest.fixture
def trickler(tmp_path: Path) -> Iterator[tuple[Agent, SlowRelay]]:
    """An agent holding chunks, behind a relay that trickles FETCH replies when told to."""
    with running_agent(tmp_path / "b", "--name", "b", *SMALL) as b:
        host, port = str(b.state.data_tcp).rsplit(":", 1)
        relay = SlowRelay((host, int(port)), piece_bytes=PIECE_BYTES, piece_every_s=PIECE_EVERY_S)
        try:
            yield b, relay
        finally:
            relay.close()


def test_a_trickling_pull_is_cut_at_its_deadline_and_gives_its_views_back(
    trickler: tuple[Agent, SlowRelay],
) -> None:
    b, relay = trickler
    keys = chain(2, seed=91)
    put_chain(b, keys, tenant="t1")
    source = AgentSource(relay.address, streams=1)
    try:
        assert source.ping() > 0  # a connection kept, and no trickle outside FETCH payloads
        relay.trickling.set()
        given: list[int] = []
        freed: list[int] = []
        landed: list[int] = []

        def into(i: int, meta: ChunkMeta) -> memoryview:
            given.append(i)
            return memoryview(bytearray(meta.size_bytes))

        with pytest.raises(PullTooSlow, match="abandoned"):
            source.get_many(
                keys,
                tenant="t1",
                into=into,
                unused=freed.append,
                arrived=lambda i, _chunk: landed.append(i),
            )
        assert landed == [] and given == freed == [0]  # the chunk cut mid-way went back
        assert source.overdue == 1 and source.corrupt == 0
        wait_until("the puller to drop the connection", lambda: relay.closed_by_client >= 1)

        relay.trickling.clear()  # the same source pulls again once it answers at speed
        got = source.get_many(keys, tenant="t1")
        assert [c is not None for c in got] == [True, True]
        assert source.overdue == 1
    finally:
        source.close()


def test_an_agent_abandons_a_trickling_peer_pull_as_a_counted_miss(
    tmp_path: Path, trickler: tuple[Agent, SlowRelay]
) -> None:
    b, relay = trickler
    keys = chain(2, seed=92)
    put_chain(b, keys, tenant="t1")
    with running_agent(tmp_path / "a", "--name", "a", "--peer", f"pB={relay.address}", *SMALL) as a:
        relay.trickling.set()
        with a.data() as d:
            got = d.get_many(keys, tenant="t1")
        assert got == [None, None]  # misses, not a request held for as long as it trickles
        peer = remote(a)["peers"][0]
        assert peer["overdue"] == 1 and peer["errors"] == 1
        assert "abandoned" in peer["last_error"]
        assert peer["breaker"]["opens"] == 1  # left alone for a backoff, then probed
        assert a.control().stats()["usage"]["cpu"]["chunks"] == 0  # nothing partial kept
        wait_until("a to drop the connection", lambda: relay.closed_by_client >= 1)


def test_a_pull_cut_just_after_it_finished_does_not_leave_a_dead_connection_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline passing between the FETCH's last byte and the watch letting go cuts the
    socket of a pull that succeeded: that connection must be closed, not kept for the next
    call (a review's race: the next ping then failed on a broken pipe and opened the
    breaker of a healthy source)."""
    with running_agent(tmp_path / "b", "--name", "b", *SMALL) as b:
        keys = chain(2, seed=93)
        put_chain(b, keys, tenant="t1")
        source = AgentSource(str(b.state.data_tcp), streams=1)
        try:
            watch = source._watch
            watching = watch.watching

            @contextmanager
            def cut_at_the_end(client: DataClient, allowance_s: float) -> Iterator[Any]:
                with watching(client, allowance_s) as pull:
                    yield pull
                    with watch._cond:  # its deadline passes now, before the watch lets go
                        pull.end_s = 0.0
                        watch._cond.notify()
                    wait_until("the watcher to cut the finished pull", lambda: pull.cut)

            monkeypatch.setattr(watch, "watching", cut_at_the_end)
            got = source.get_many(keys, tenant="t1")
            assert [c is not None for c in got] == [True, True]  # it finished before the cut
            monkeypatch.setattr(watch, "watching", watching)
            assert source.ping() > 0  # on a live connection, not the one cut
            assert source.get_many(keys, tenant="t1")[1] is not None
        finally:
            source.close()
