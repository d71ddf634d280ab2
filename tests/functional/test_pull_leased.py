"""A same-host engine's reuse of chunks held on another node: LOOKUP_LEASE_LOCAL answers at once
with the local part leased and the rest REMOTE (nothing pulled), and the engine pulls the rest in
slices (``hold``: each LEASE pulls its slice), copying each while the next is pulled
(``pull_leased``). Real agents on loopback (a pool, the node that wrote, the node that reads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.client import DataClient
from tests.functional.agents import Agent, payload, running_agent
from tests.functional.test_remote import (
    CHUNK_BYTES,
    SLOW_GPU,
    SMALL,
    chain,
    link_costed,
    pool_holds,
    put_chain,
    remote,
)
from tests.functional.waiting import wait_until

CHUNKS = 12


class Fleet:
    def __init__(self, pool: Agent, writer: Agent, reader: Agent) -> None:
        self.pool, self.writer, self.reader = pool, writer, reader

    def local_chunks(self) -> int:
        return int(self.reader.control().stats()["usage"]["cpu"]["chunks"])

    def leases(self) -> int:
        return int(self.reader.control().stats()["leases"])


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, list[bytes]]]:
    keys = chain(CHUNKS, seed=7)
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *SMALL) as pool:
        url = f"kvctl://{pool.state.data_tcp}"
        with (
            running_agent(tmp_path / "a", "--name", "a", "--pool", url, *SMALL) as a,
            running_agent(tmp_path / "b", "--name", "b", "--pool", url, *SLOW_GPU, *SMALL) as b,
        ):
            put_chain(a, keys, tenant="t1")
            wait_until("the write-through to reach the pool", pool_holds(pool, CHUNKS))
            wait_until("b to measure its link to the pool", link_costed(b, "pool"))
            yield Fleet(pool, a, b), keys


def _slices_held(client: DataClient, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of each ``hold`` the client is asked for from now on (each one still made)."""
    slices: list[int] = []
    hold = client.hold

    def counted(keys: Any, **kw: Any) -> Any:
        slices.append(len(keys))
        return hold(keys, **kw)

    monkeypatch.setattr(client, "hold", counted)
    return slices


def test_the_local_lookup_leases_what_is_here_and_pulls_nothing(
    fleet: tuple[Fleet, list[bytes]],
) -> None:
    f, keys = fleet
    with f.reader.data("unix") as d:
        assert d.shm
        d.get_many(keys[:3], tenant="t1")  # pulled here earlier: now local
        assert f.local_chunks() == 3
        with d.lookup_leased(keys, tenant="t1", local_only=True) as (found, leases):
            assert found.matched_chunks == CHUNKS
            assert found.locations == ("cpu",) * 3 + ("remote",) * (CHUNKS - 3)
            assert leases.remote == frozenset(range(3, CHUNKS)) and not leases.missing
            assert [bytes(leases.view(i)) for i in range(3)] == [
                payload(k, CHUNK_BYTES) for k in keys[:3]
            ]
            assert all(leases.chunks[i] is None for i in range(3, CHUNKS))
            assert f.local_chunks() == 3  # the answer did not wait for a pull
        # a hold pulls its slice and keeps it leased beside the others until release_pending
        with d.lookup_leased(keys, tenant="t1", local_only=True, release_later=True) as _:
            pass
        held = d.hold(keys[3:7], tenant="t1")
        assert not held.remote and not held.missing
        assert [bytes(held.view(i)) for i in range(4)] == [
            payload(k, CHUNK_BYTES) for k in keys[3:7]
        ]
        assert f.local_chunks() == 7
        assert f.leases() == 3 + 4  # the lookup's three are still held
        d.release_pending()
        wait_until("the leases released", lambda: f.leases() == 0, timeout_s=5)


def test_an_engine_pulls_a_remote_prefix_in_slices_with_every_byte_in_place(
    fleet: tuple[Fleet, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from kvctl.engines import kvload
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout

    # 2 layers x K/V x 2 heads x 64 dims x float32 = 2 KiB a token: 512 tokens are one 1 MiB chunk
    fmt = ChunkFormat(KVLayout(2, 2, 64, "float32"), 512)
    assert fmt.chunk_bytes == CHUNK_BYTES
    monkeypatch.setattr(kvload, "MIN_PULL_SLICE_BYTES", 2 * CHUNK_BYTES)
    f, keys = fleet
    loader = kvload.KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(CHUNKS)
    with f.reader.data("unix") as d:
        slices = _slices_held(d, monkeypatch)
        with d.lookup_leased(keys, tenant="t1", local_only=True, release_later=True) as (
            found,
            leases,
        ):
            assert found.matched_chunks == CHUNKS and leases.remote == frozenset(range(CHUNKS))
        got, blocked = kvload.pull_leased(d, keys, "t1", loader, kv, 0)
        assert (got, blocked) == (CHUNKS, False)
        assert slices == [2] * 6  # 12 MiB in 2 MiB slices (at most MAX_PULL_SLICES)
        # the copies' own time, the rate an engine reports: every pulled byte counted
        assert loader.last_copy is not None
        assert loader.last_copy[0] == CHUNKS * CHUNK_BYTES and loader.last_copy[1] > 0
        assert f.leases() == CHUNKS
        d.release_pending()
    t = fmt.chunk_tokens
    for i, k in enumerate(keys):
        want = (
            torch.frombuffer(bytearray(payload(k, CHUNK_BYTES)), dtype=torch.float32)
            .view(fmt.chunk_shape)
            .unsqueeze(2)  # [layers, 2, 1, heads, T, dim], as the cache holds it
        )
        got = kv[:, :, :, :, i * t : (i + 1) * t, :]
        # as bits: random payload bytes hold NaNs, which equal nothing
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"chunk {i}"
    wait_until("the leases released", lambda: f.leases() == 0, timeout_s=5)


def test_a_slice_the_pool_no_longer_has_ends_the_reuse_there(
    fleet: tuple[Fleet, list[bytes]],
) -> None:
    """A chunk the lookup saw in the pool but gone by its slice's pull: the chunks before it are
    reused, it and the rest are not (recomputed), and nothing stays leased."""
    torch = pytest.importorskip("torch")
    from kvctl.engines import kvload
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout

    fmt = ChunkFormat(KVLayout(2, 2, 64, "float32"), 512)
    f, keys = fleet
    loader = kvload.KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(CHUNKS)
    with f.reader.data("unix") as d:
        with d.lookup_leased(keys, tenant="t1", local_only=True, release_later=True) as (
            found,
            _,
        ):
            assert found.matched_chunks == CHUNKS
        f.pool.control().evict([keys[5].hex()])
        got, blocked = kvload.pull_leased(d, keys, "t1", loader, kv, 0)
        assert (got, blocked) == (5, False)
        d.release_pending()
    wait_until("the leases released", lambda: f.leases() == 0, timeout_s=5)


def test_a_read_without_a_lookup_goes_in_slices_and_lets_go_of_them(
    fleet: tuple[Fleet, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_chunks`` (the vLLM connector's load, an engine without the leased lookup) reads
    through the same slices, local chunks and remote ones alike, and holds nothing after."""
    torch = pytest.importorskip("torch")
    from kvctl.engines import kvload
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout

    fmt = ChunkFormat(KVLayout(2, 2, 64, "float32"), 512)
    monkeypatch.setattr(kvload, "MIN_PULL_SLICE_BYTES", 4 * CHUNK_BYTES)
    f, keys = fleet
    loader = kvload.KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(CHUNKS)
    with f.reader.data("unix") as d:
        d.get_many(keys[:5], tenant="t1")  # these are local now, the rest in the pool
        slices = _slices_held(d, monkeypatch)
        assert kvload.read_chunks(d, keys, "t1", loader, kv) == (CHUNKS, "lease")
        assert slices == [4, 4, 4]
        wait_until("the leases released", lambda: f.leases() == 0, timeout_s=5)
    t = fmt.chunk_tokens
    for i, k in enumerate(keys):
        want = torch.frombuffer(bytearray(payload(k, CHUNK_BYTES)), dtype=torch.int32)
        got = kv[:, :, 0, :, i * t : (i + 1) * t, :].contiguous().view(torch.int32)
        # the chunk's bytes are [layers, K|V, heads, tokens, dim]: the same order as these
        assert torch.equal(got.flatten(), want), f"chunk {i}"


# --- one agent, no pool: what a slice's lease promises --------------------------------------
def _one_agent_format() -> Any:
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout
    from tests.functional.test_lookup_leased import CHUNK

    fmt = ChunkFormat(KVLayout(2, 2, 64, "float32"), 32)
    assert fmt.chunk_bytes == CHUNK
    return fmt


def test_a_pull_longer_than_a_lease_keeps_the_slices_copied_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each slice's leases are checked once its copy is done, not all at the end: a pull that
    outlasts the first slice's lease (a slow link) keeps every chunk copied while it held."""
    torch = pytest.importorskip("torch")
    import time

    from kvctl.engines import kvload
    from tests.functional.test_lookup_leased import CHUNK, Node, key

    node = Node(tmp_path, cpu_bytes=4 << 20, lease_seconds=0.5)
    keys = [key(i) for i in range(8)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    monkeypatch.setattr(kvload, "MIN_PULL_SLICE_BYTES", CHUNK)  # 8 slices of one chunk
    loader = kvload.KVLoader(_one_agent_format(), torch.device("cpu"))
    kv = loader.alloc(len(keys))
    try:
        with DataClient.connect(node.sock) as d:
            hold = d.hold

            def slow(ks: Any, **kw: Any) -> Any:  # each slice's pull takes 100 ms
                got = hold(ks, **kw)
                time.sleep(0.1)
                return got

            monkeypatch.setattr(d, "hold", slow)
            assert kvload.pull_leased(d, keys, "", loader, kv, 0) == (len(keys), False)
            d.release_pending()
            assert kvload.pull_leased(d, [], "", loader, kv, 0) == (0, False)  # nothing asked
    finally:
        node.close()


def test_a_resize_between_slices_keeps_the_earlier_slices_pending(tmp_path: Path) -> None:
    """A slice's reply in a new arena generation maps the new arena; that must not release the
    slices held before it (their copies may still be queued on a GPU)."""
    from tests.functional.test_lookup_leased import CHUNK, Node, key

    node = Node(tmp_path, cpu_bytes=1 << 20)
    a, b = key(1), key(2)
    node.store.put(a, payload(a, CHUNK))
    node.store.put(b, payload(b, CHUNK))
    try:
        with DataClient.connect(node.sock) as d:
            first = d.hold([a])
            node.store.resize("cpu", 2 << 20)  # a new arena generation
            second = d.hold([b])
            assert second.generation != first.generation
            assert d.pending_leases() == 2  # both lease ids still to be released
            d.release_pending()
            assert not d.pending_leases()
    finally:
        node.close()


def test_on_cuda_sliced_copies_land_exactly_and_are_timed_by_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path of the slices: each slice's copy queued on the side stream from the
    registered arena while the next is leased, its leases checked once its end event is done,
    every byte on the device exact, and the copies' own time (events) in ``last_copy``."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvctl.engines import kvload
    from tests.functional.test_lookup_leased import CHUNK, Node, key

    node = Node(tmp_path, cpu_bytes=4 << 20)
    keys = [key(i) for i in range(8)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    monkeypatch.setattr(kvload, "MIN_PULL_SLICE_BYTES", 2 * CHUNK)  # 4 slices of 2 chunks
    fmt = _one_agent_format()
    loader = kvload.KVLoader(fmt, torch.device("cuda"))
    kv = loader.alloc(len(keys))
    try:
        with DataClient.connect(node.sock) as d:
            slices = _slices_held(d, monkeypatch)
            assert kvload.pull_leased(d, keys, "", loader, kv, 0) == (len(keys), False)
            assert slices == [2, 2, 2, 2] and loader.register_failures == 0
            d.release_pending()
        assert loader.last_copy is not None
        assert loader.last_copy[0] == len(keys) * CHUNK and loader.last_copy[1] > 0
        t = fmt.chunk_tokens
        host = kv.cpu()
        for i, k in enumerate(keys):
            want = torch.frombuffer(bytearray(payload(k, CHUNK)), dtype=torch.int32)
            got = host[:, :, 0, :, i * t : (i + 1) * t, :].contiguous().view(torch.int32)
            assert torch.equal(got.flatten(), want), f"chunk {i}"
    finally:
        loader.close()
        node.close()


def test_a_prompt_no_fetch_could_speed_up_is_not_asked_of_the_pool(
    fleet: tuple[Fleet, list[bytes]],
) -> None:
    """An engine far quicker at prefill than the link (0.1 us a token: 26 us a chunk against
    ~0.5 ms for its 1 MiB over loopback): once the pool has answered with one chain, a lookup of
    a chain with nothing here does not ask it, and says so (reason ``unasked``)."""
    from tests.functional.test_remote import NS

    f, keys = fleet
    with f.reader.data("unix") as d:
        fast = [(n, a, n * 1e-7) for n, a in ((256, 0), (1024, 0), (512, 2048), (2048, 4096))]
        assert d.report_rates(fast, model=NS.model_id)["kept"] == len(fast)
        with d.lookup_leased(keys, tenant="t1", local_only=True) as (asked, leases):
            assert asked.matched_chunks == 0 and not leases.chunks
        assert asked.locations == ("remote",) * CHUNKS  # found there, left to recompute
        with d.lookup_leased(keys, tenant="t1", local_only=True) as (unasked, leases):
            assert unasked.matched_chunks == 0 and not leases.chunks
        assert unasked.locations == (None,) * CHUNKS
    report = remote(f.reader)
    plans = report["plans"]
    assert plans["unasked_lookups"] == 1 and plans["reasons"]["unasked"] == 1
    last = report["last_plan"]
    assert last["reason"] == "unasked" and last["unasked"] == CHUNKS
    assert last["links"]["pool"]["source"] == "measured"
    metrics = f.reader.control().metrics_text()
    assert "kvctl_plan_unasked_lookups_total 1.0" in metrics
