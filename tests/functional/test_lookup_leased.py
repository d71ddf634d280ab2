"""LOOKUP_LEASE: a same-host engine's lookup that leases the matched prefix in the same round trip
(the LEASE that always followed a hit, saved). It counts exactly one lookup, holds just the
matched chunks (cpu ones in place, disk ones read into the arena), releases them on exit, and is
refused off the Unix socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent import dataplane
from kvctl.agent.settings import AgentSettings
from kvctl.client import AgentError, DataClient, RequestError
from kvctl.store.tiers.base import Tier
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.protocol import ErrorCode, Op
from tests.functional.agents import key, payload
from tests.functional.inprocess_node import InProcessNode
from tests.functional.waiting import wait_until

CHUNK = 64 << 10


class Node(InProcessNode):
    def __init__(self, tmp_path: Path, cpu_bytes: int = 1 << 20, **settings: Any) -> None:
        config = AgentSettings(
            name="ll", data_dir=str(tmp_path), cpu_bytes=cpu_bytes, shm=True, **settings
        )
        tiers: list[Tier] = [CpuTier(cpu_bytes, shared=True), DiskTier(tmp_path / "d", 8 << 20)]
        super().__init__(tmp_path, config, tiers)
        self.sock = self.unix


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


def test_the_matched_prefix_is_leased_with_the_lookup(node: Node) -> None:
    chain = [key(i) for i in range(4)]
    for i, k in enumerate(chain[:3]):
        node.store.put(k, payload(k, CHUNK), parent=chain[i - 1] if i else None, tokens=16)
    node.store.move([chain[2]], "disk")  # a disk hit is read into the arena for its lease
    with DataClient.connect(node.sock) as client:
        with client.lookup_leased(chain) as (found, leases):
            assert found.matched_chunks == 3
            assert found.locations == ("cpu", "cpu", "disk", None)
            assert len(leases.chunks) == 3 and not leases.missing
            for i in range(3):
                assert bytes(leases.view(i)) == payload(chain[i], CHUNK)
            assert node.leases() == 3
        # released on exit (RELEASE is sent without waiting for its answer)
        wait_until("the leases released", lambda: node.leases() == 0)
    stats = node.store.stats
    assert (stats.lookups, stats.lookup_chunks, stats.hit_chunks) == (1, 4, 3)


def test_leases_released_later_stay_held_until_the_next_call_or_release_pending(
    node: Node,
) -> None:
    """An engine releases after its first token (``release_later``): the leases outlive the
    block, and go with the client's next call, or with ``release_pending``."""
    chain = [key(i) for i in range(3)]
    for i, k in enumerate(chain):
        node.store.put(k, payload(k, CHUNK), parent=chain[i - 1] if i else None, tokens=16)
    with DataClient.connect(node.sock) as client:
        with client.lookup_leased(chain, release_later=True) as (found, _):
            assert found.matched_chunks == 3
        assert node.leases() == 3  # nothing sent on exit
        assert client.exists(chain) == ["cpu"] * 3  # the next call releases them first
        assert node.leases() == 0  # its answer came after the RELEASE was handled
        with client.lookup_leased(chain[:2], release_later=True):
            pass
        assert node.leases() == 2
        client.release_pending()
        wait_until("the leases released", lambda: node.leases() == 0)
        client.release_pending()  # nothing pending: a no-op
    assert node.store.stats.lookups == 2


def test_a_miss_leases_nothing(node: Node) -> None:
    with (
        DataClient.connect(node.sock) as client,
        client.lookup_leased([key(7), key(8)]) as (found, leases),
    ):
        assert found.matched_chunks == 0 and leases.chunks == []
        assert node.leases() == 0
    assert node.store.stats.lookups == 1


def test_the_client_is_usable_inside_and_after_the_block(node: Node) -> None:
    k = key(1)
    node.store.put(k, payload(k, CHUNK), tokens=16)
    with DataClient.connect(node.sock) as client:
        with client.lookup_leased([k]) as (found, _):
            assert found.matched_chunks == 1
            assert client.exists([k]) == ["cpu"]  # the client's lock is re-entrant
        assert bytes(client.get(k)) == payload(k, CHUNK)


def test_off_the_unix_socket_it_is_refused(node: Node) -> None:
    host, port = node.tcp
    with DataClient.connect(f"{host}:{port}") as client:
        assert not client.shm
        with pytest.raises(AgentError, match="Unix socket"), client.lookup_leased([key(1)]):
            pass


def _reused_on_the_second_prefill(client: DataClient) -> Any:
    """A tiny engine on ``client``, after one prefill and the same prompt again, which must
    reuse its three chunks from the shared arena."""
    import torch

    from kvctl.engines.hf import CachedLM
    from kvctl.engines.models import build_model

    lm = CachedLM(build_model("tiny-llama", dtype=torch.float32), client)
    ids = list(range(1, 64 * 3 + 2))
    lm.prefill(ids)
    lm.flush()
    again = lm.prefill(ids)
    assert (again.reused_chunks, again.fetch_path) == (3, "lease")
    return lm


def _agent_without(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *ops: Op) -> Node:
    """An agent older than ``ops``: it answers them UNSUPPORTED, as an unknown op."""
    init = dataplane.Connection.__init__

    def older(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for op in ops:
            del self._handlers[op]

    monkeypatch.setattr(dataplane.Connection, "__init__", older)
    return Node(tmp_path, cpu_bytes=64 << 20, chunk_tokens=64)


def test_an_engine_on_an_agent_without_it_looks_up_then_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent older than LOOKUP_LEASE answers it UNSUPPORTED (an unknown op): the engine then
    looks up and leases in two round trips, as before, and still reuses its chunks."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    node = _agent_without(monkeypatch, tmp_path, Op.LOOKUP_LEASE, Op.LOOKUP_LEASE_LOCAL)
    try:
        with DataClient.connect(node.sock) as client:
            with pytest.raises(RequestError) as refused, client.lookup_leased([key(1)]):
                pass
            assert refused.value.code == ErrorCode.UNSUPPORTED
            lm = _reused_on_the_second_prefill(client)
            assert lm._no_lookup_lease is client  # asked once, then not again
    finally:
        node.close()


def test_the_shared_arena_can_be_mapped_before_any_lease(node: Node, tmp_path: Path) -> None:
    """An engine maps (and on CUDA registers) the arena when it starts: the mapping it gets is
    the one later leases point into, and TCP has none."""
    with DataClient.connect(node.sock) as client:
        arena = client.shared_arena()
        assert arena is not None and len(arena) == 1 << 20
        assert client.shared_arena() is arena  # mapped once
        client.put(key(0), payload(key(0), CHUNK))
        with client.leased([key(0)]) as leases:
            assert leases.arena is arena
            assert bytes(leases.view(0)) == payload(key(0), CHUNK)
    host, port = node.tcp
    with DataClient.connect(f"{host}:{port}") as remote:
        assert remote.shared_arena() is None


def test_an_engine_on_an_agent_without_the_local_lookup_lease_pulls_in_its_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that has LOOKUP_LEASE but not LOOKUP_LEASE_LOCAL: the engine asks the local one
    once, then leases with the lookup as before (asked once per client), and reuses its chunks."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    node = _agent_without(monkeypatch, tmp_path, Op.LOOKUP_LEASE_LOCAL)
    try:
        with DataClient.connect(node.sock) as client:
            lm = _reused_on_the_second_prefill(client)
            assert lm._no_local_lease is client and lm._no_lookup_lease is None
        stats = node.store.stats
        assert stats.lookups == 2  # one per prefill: the refused op counted nothing
    finally:
        node.close()


def test_the_local_lookup_lease_is_the_lookup_lease_where_everything_is_local(node: Node) -> None:
    chain = [key(i) for i in range(4)]
    for i, k in enumerate(chain[:3]):
        node.store.put(k, payload(k, CHUNK), parent=chain[i - 1] if i else None, tokens=16)
    node.store.move([chain[2]], "disk")
    with DataClient.connect(node.sock) as client:
        with client.lookup_leased(chain, local_only=True) as (found, leases):
            assert found.matched_chunks == 3
            assert not leases.remote and not leases.missing
            assert [bytes(leases.view(i)) for i in range(3)] == [
                payload(k, CHUNK) for k in chain[:3]
            ]
        wait_until("the leases released", lambda: node.leases() == 0)


def test_another_threads_call_on_a_shared_client_leaves_this_threads_leases_held(
    node: Node,
) -> None:
    """Two engines share one client (it is thread-safe): engine B's call must not release the
    leases engine A's layer-wise copies still read (a review saw A copy its last layers from
    regions the agent had reused, a wrong answer nobody noticed). A thread's own next call, or
    its release_pending, still releases them; so does any call once that thread has ended."""
    import threading

    chain = [key(i, 5) for i in range(3)]
    for i, k in enumerate(chain):
        node.store.put(k, payload(k, CHUNK), parent=chain[i - 1] if i else None, tokens=16)
    with DataClient.connect(node.sock) as shared:
        took = threading.Event()
        done = threading.Event()

        def engine_a() -> None:
            with shared.lookup_leased(chain, release_later=True) as (found, _):
                assert found.matched_chunks == 3
            took.set()
            done.wait(10)  # its copies run here
            shared.release_pending()

        a = threading.Thread(target=engine_a)
        a.start()
        assert took.wait(10)
        shared.ping()  # engine B's call, from its own thread
        shared.lookup(chain)
        assert node.leases() == 3 and shared.pending_leases() == 3
        done.set()
        a.join(10)
        wait_until("A released its own", lambda: node.leases() == 0)

        def leaves_leases() -> None:
            with shared.lookup_leased(chain, release_later=True):
                pass

        gone = threading.Thread(target=leaves_leases)
        gone.start()
        gone.join(10)
        assert node.leases() == 3  # held after its thread ended...
        shared.ping()
        wait_until("released by the next call", lambda: node.leases() == 0)
        assert shared.pending_leases() == 0
