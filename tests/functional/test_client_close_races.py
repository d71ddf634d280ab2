"""DataClient.close from another thread, against the calls that take a mapping. Found in review:
close did not take the client's lock, so a close just after an ATTACH (or a MAP) was answered
ran before the call kept the new segment (or arena): the call then kept it on a closed client,
its memfd and mapping leaked for the life of the process. And close must not wait for a call
blocked on a dead agent (it holds the client's lock until its socket times out)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvctl.client as client_module
from kvctl.agent.settings import AgentSettings
from kvctl.client import AgentError, DataClient
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import HEADER, HEADER_BYTES, REPLY_BIT, Op, pack_header
from tests.functional.agents import key, payload
from tests.functional.inprocess_node import InProcessNode


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="close", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    n = InProcessNode(tmp_path, settings, [CpuTier(16 << 20, shared=True)])
    try:
        yield n
    finally:
        n.close()


def _open_on(inode: tuple[int, int]) -> int:
    """This process's descriptors on the file ``inode`` (st_dev, st_ino): by inode, not by
    name, so another client's staging segment (one an earlier test leaked, closed by the
    garbage collector meanwhile in a full-suite run) counts for nothing."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (listdir's own)
            st = os.stat(f"/proc/self/fd/{fd}")
            n += (st.st_dev, st.st_ino) == inode
    return n


def _closed_by_another_thread_after(c: DataClient, op: Op, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once ``op`` is answered, and before the call keeps what it got, another thread closes
    ``c`` (and is done: close waits on nothing the call holds)."""
    real = c._call_locked

    def answered_then_closed(call_op: Op, *args: Any, **kwargs: Any) -> Any:
        out = real(call_op, *args, **kwargs)
        if call_op == op:
            closer = threading.Thread(target=c.close)
            closer.start()
            closer.join(30.0)
            assert not closer.is_alive(), "close waited on the call in progress"
        return out

    monkeypatch.setattr(c, "_call_locked", answered_then_closed)


def test_a_segment_attached_as_another_thread_closes_the_client_is_not_leaked(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[int, int]] = []
    real_segment = client_module._sealed_segment

    def recorded(size_bytes: int) -> tuple[int, Any]:
        fd, staging = real_segment(size_bytes)
        st = os.fstat(fd)
        made.append((st.st_dev, st.st_ino))
        return fd, staging

    monkeypatch.setattr(client_module, "_sealed_segment", recorded)
    c = DataClient.connect(node.unix)
    assert c.shm
    _closed_by_another_thread_after(c, Op.ATTACH, monkeypatch)
    k = key(1, 90)
    with pytest.raises(AgentError, match="closed"):
        c.put(k, payload(k, 8192), tenant="t")
    assert c.closed and c._staging is None and c._staging_fd == -1
    assert len(made) == 1, made
    # the agent (in this process) holds the segment too, until its connection's thread sees
    # the client gone: waited for, so what is left open is the client's
    for _ in range(400):
        if not node.server._conns:
            break
        time.sleep(0.05)
    assert not node.server._conns, "the agent never closed the client's connection"
    assert _open_on(made[0]) == 0  # the segment's memfd closed (mmap's dup of it too)


def test_an_arena_mapped_as_another_thread_closes_the_client_is_not_kept(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = DataClient.connect(node.unix)
    assert c.shm
    _closed_by_another_thread_after(c, Op.MAP, monkeypatch)
    with pytest.raises(AgentError, match="closed"):
        c.shared_arena()
    assert c.closed and c._arena is None


def test_close_does_not_wait_for_a_call_blocked_on_an_agent_that_never_answers() -> None:
    """A guard: close must never take the lock a blocked call holds (here the socket would
    wait an hour)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(3600.0)

    def agent_answers_hello_only() -> None:
        head = theirs.recv(HEADER_BYTES, socket.MSG_WAITALL)
        _magic, _version, op, rid, meta_len, _payload_len = HEADER.unpack(head)
        theirs.recv(meta_len, socket.MSG_WAITALL)
        meta = json.dumps({"tiers": ["cpu"]}).encode()
        theirs.sendall(pack_header(op | REPLY_BIT, rid, len(meta), 0) + meta)
        theirs.recv(HEADER_BYTES, socket.MSG_WAITALL)  # the PING, never answered

    agent = threading.Thread(target=agent_answers_hello_only, daemon=True)
    agent.start()
    c = DataClient(ours, "unix", use_shm=False)
    failed: list[BaseException] = []

    def ping() -> None:
        try:
            c.ping()
        except BaseException as exc:  # what the blocked call ended with
            failed.append(exc)

    caller = threading.Thread(target=ping, daemon=True)
    caller.start()
    agent.join(30.0)  # the PING was sent: the caller holds the client's lock, waiting
    assert not agent.is_alive()
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(30.0)
    assert not closer.is_alive(), "close waited for the blocked call"
    assert c.closed
    theirs.close()  # the agent goes: the blocked call ends
    caller.join(30.0)
    assert not caller.is_alive()
    assert failed and isinstance(failed[0], AgentError), failed


def _traced_close(client: DataClient, function: str, event: str) -> Any:
    """A tracer for this thread that has another thread close ``client`` (and waits for it)
    at ``function``'s ``event`` ("call" or "return"): the race of a put with ``close``, made
    to happen at that point every time."""

    def close_elsewhere() -> None:
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive(), "close waited on the put in progress"

    def local(frame: Any, ev: str, arg: Any) -> Any:
        if ev == event:
            close_elsewhere()
            return None
        return local

    def tracer(frame: Any, ev: str, arg: Any) -> Any:
        if ev == "call" and frame.f_code.co_name == function and not client.closed:
            if event == "call":
                close_elsewhere()
                return None
            return local
        return None

    return tracer


@pytest.mark.parametrize(
    ("transport", "held", "function", "event"),
    [
        ("unix", True, "_ensure_staging", "return"),  # the segment held, closed before use
        ("unix", False, "_ensure_staging", "return"),  # a new one attached, closed before use
        ("unix", True, "_ensure_staging", "call"),  # closed as the put looks at the segment
        ("tcp", True, "send_all", "call"),  # the socket closed as the put is sent
    ],
)
def test_a_put_racing_close_from_another_thread_says_the_client_is_closed(
    node: InProcessNode, transport: str, held: bool, function: str, event: str
) -> None:
    """A ``close`` from another thread while a put runs: the put raises the SDK's closed
    client error, not a ValueError of the closed mapping (nor 'lost the connection to the
    agent' from the closed socket: the agent is there)."""
    keys = [key(i, 13) for i in range(2)]
    address = node.unix if transport == "unix" else f"tcp://{node.tcp[0]}:{node.tcp[1]}"
    client = DataClient.connect(address)
    if held:
        assert client.put(key(9, 13), payload(key(9, 13), 8192)) == "cpu"
    before = sys.gettrace()
    sys.settrace(_traced_close(client, function, event))
    try:
        with pytest.raises(AgentError) as raised:
            client.put_packed(
                keys, [8192] * 2, lambda i, out: out.__setitem__(slice(None), bytes(8192))
            )
    finally:
        sys.settrace(before)
    assert str(raised.value) == "this client is closed", repr(raised.value)
    assert client.closed
    with DataClient.connect(address) as again:
        assert again.exists(keys) == [None, None]  # nothing stored


def test_a_leased_read_racing_close_from_another_thread_says_the_client_is_closed(
    node: InProcessNode,
) -> None:
    """The same race on a read through the shared arena, closed once its leases are answered
    and before it copies: the read said the chunk was not cached (ChunkNotFound: the arena
    gone, its leased chunks skipped), or, closed a moment later, raised the closed arena's
    ValueError."""
    k = key(1, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, 8192)) == "cpu"
    before = sys.gettrace()
    sys.settrace(_traced_close(client, "_lease_locked", "return"))
    try:
        with pytest.raises(AgentError) as raised:
            client.get(k)
    finally:
        sys.settrace(before)
    assert str(raised.value) == "this client is closed", repr(raised.value)
    assert client.closed


@pytest.mark.parametrize("how", ["leased", "lookup_leased", "hold"])
def test_a_lease_block_whose_client_another_thread_closed_says_the_client_is_closed(
    node: InProcessNode, how: str
) -> None:
    """Inside a ``leased()`` / ``lookup_leased()`` block, or with what ``hold`` returned,
    another thread closes the client (its arena unmapped, the agent's leases ended with the
    connection): ``view`` raised the closed arena's ValueError ('mmap closed or invalid'),
    and ``valid`` still said the lease held though the agent may reuse those bytes."""
    k = key(2, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, 8192)) == "cpu"

    def check(leases: client_module.ArenaLeases) -> None:
        assert bytes(leases.view(0)) == payload(k, 8192) and leases.valid(0)
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive() and client.closed
        with pytest.raises(AgentError) as raised:
            leases.view(0)
        assert str(raised.value) == "this client is closed", repr(raised.value)
        assert not leases.valid(0)

    if how == "leased":
        with client.leased([k]) as leases:
            check(leases)
    elif how == "lookup_leased":
        with client.lookup_leased([k]) as (found, leases):
            assert found.matched_chunks == 1
            check(leases)
    else:
        check(client.hold([k]))


@pytest.mark.parametrize("how", ["leased", "lookup_leased", "hold"])
def test_a_lease_racing_close_from_another_thread_says_the_client_is_closed(
    node: InProcessNode, how: str
) -> None:
    """Closed once the leases are answered and before they are handed over: the leases came
    back with the arena gone (None), so ``view`` of a chunk the agent had leased raised
    KeyError 'chunk 0 is not leased'."""
    k = key(3, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, 8192)) == "cpu"
    before = sys.gettrace()
    sys.settrace(_traced_close(client, "_leases_locked", "return"))
    try:
        with pytest.raises(AgentError) as raised:
            if how == "leased":
                with client.leased([k]) as leases:
                    leases.view(0)
            elif how == "lookup_leased":
                with client.lookup_leased([k]) as (_, leases):
                    leases.view(0)
            else:
                client.hold([k]).view(0)
    finally:
        sys.settrace(before)
    assert str(raised.value) == "this client is closed", repr(raised.value)
    assert client.closed


@pytest.mark.parametrize("into", [False, True])
def test_a_leased_read_whose_copy_overlaps_close_is_not_returned(
    node: InProcessNode, into: bool
) -> None:
    """Closed by another thread while the read copies out of the arena: the copy finishes
    (its view keeps the mapping), but the agent ends a connection's leases when it closes and
    may give those bytes to another chunk meanwhile, so what was copied cannot be trusted, as
    with a copy that ended past its lease's deadline. It was returned as the chunk; now the
    read says the client is closed."""
    k = key(4, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, 8192)) == "cpu"
    out = memoryview(bytearray(8192))
    before = sys.gettrace()
    sys.settrace(_traced_close(client, "copy_bytes", "call"))
    try:
        with pytest.raises(AgentError) as raised:
            if into:
                client.get_into([k], [out])
            else:
                client.get(k)
    finally:
        sys.settrace(before)
    assert str(raised.value) == "this client is closed", repr(raised.value)
    assert client.closed


@pytest.mark.parametrize("how", ["leased", "hold"])
def test_a_lease_view_after_close_says_closed_while_an_engine_holds_a_view_of_the_arena(
    node: InProcessNode, how: str
) -> None:
    """An engine holds a view of the arena (its tensor over it, ``arena_tensor``) when another
    thread closes the client: the arena cannot be unmapped under that view (close leaves it,
    BufferError), so ``view`` found it open and returned the chunk's bytes, though the agent
    ended the leases with the connection; ``valid`` said False. Now ``view`` says the client is
    closed, as it does where the arena was unmapped."""
    k = key(5, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, 8192)) == "cpu"

    def check(leases: client_module.ArenaLeases) -> None:
        assert leases.arena is not None
        with memoryview(leases.arena) as engine_view:  # what an engine's tensor holds
            closer = threading.Thread(target=client.close)
            closer.start()
            closer.join(30.0)
            assert not closer.is_alive() and client.closed
            assert not leases.arena.closed  # the engine's view keeps the mapping
            with pytest.raises(AgentError) as raised:
                leases.view(0)
            assert str(raised.value) == "this client is closed", repr(raised.value)
            assert not leases.valid(0)
            assert engine_view.nbytes > 0

    if how == "leased":
        with client.leased([k]) as leases:
            check(leases)
    else:
        check(client.hold([k]))


@pytest.mark.parametrize("how", ["copy_leased", "queue_leased"])
def test_an_engines_copy_from_leases_whose_client_another_thread_closed_is_not_kept(
    node: InProcessNode, how: str
) -> None:
    """An engine's copy from the arena (``kvload``) while another thread closes the client
    (a vLLM link's saver whose put failed closes the connection the worker's loads share):
    the loader's tensor over the arena keeps it mapped, so the copy completes, but the agent
    ended the leases with the connection and may have given those bytes to another chunk.
    Only the leases' deadlines were checked, so the chunk counted as loaded; now none does."""
    torch = pytest.importorskip("torch")
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.engines.kvload import KVLoader, copy_leased, queue_leased
    from kvctl.store.keys import KVLayout

    fmt = ChunkFormat(KVLayout(3, 2, 8, "float32"), 4)
    k = key(6, 14)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, fmt.chunk_bytes)) == "cpu"
    loader = KVLoader(fmt, torch.device("cpu"))
    try:
        leases = client.hold([k])
        arena_tensor = loader.arena_tensor(leases.arena)  # made once per mapping, kept
        kv = loader.alloc(1)
        copies = queue_leased(leases, 1, loader, kv) if how == "queue_leased" else None
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive() and client.closed
        assert leases.arena is not None and not leases.arena.closed  # the loader's tensor
        if copies is not None:
            copies.done()
            assert copies.held() == 0
        else:
            assert copy_leased(leases, 1, loader, kv)[0] == 0
        assert arena_tensor.numel() > 0
    finally:
        loader.close()


@pytest.mark.parametrize("how", ["copy_past_blocked", "pull_leased_counted"])
def test_an_engines_copy_past_a_block_or_pulled_in_slices_is_not_kept_once_closed(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The other two copies from the arena (``kvload``): ``copy_past_blocked`` (the rest of a
    leased prefix past a chunk that could not be copied) and ``pull_leased_counted`` (a prefix
    held slice by slice). Another thread closes the client while the copy is queued (a vLLM
    link's saver whose put failed); the loader's tensor keeps the arena mapped, so the copy
    completes. The agent ended the leases with the connection: the chunk must not count as
    arrived (a re-read on the closed client says so, or none arrives)."""
    torch = pytest.importorskip("torch")
    from kvctl.engines import kvload
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout

    fmt = ChunkFormat(KVLayout(3, 2, 8, "float32"), 4)
    k = key(6, 15)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, fmt.chunk_bytes)) == "cpu"
    loader = kvload.KVLoader(fmt, torch.device("cpu"))
    kv = loader.alloc(1)

    def close_from_another_thread() -> None:
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive() and client.closed

    def then_closed(real: Any) -> Any:
        def queued_then_closed(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)  # the copy is queued (on the CPU: done) first
            close_from_another_thread()
            return out

        return queued_then_closed

    try:
        if how == "copy_past_blocked":
            leases = client.hold([k])
            monkeypatch.setattr(loader, "load", then_closed(loader.load))
        else:
            monkeypatch.setattr(loader, "load_timed", then_closed(loader.load_timed))

        def run() -> int:
            if how == "copy_past_blocked":
                return kvload.copy_past_blocked(client, [k], "", loader, kv, 0, leases, 0)
            return kvload.pull_leased_counted(client, [k], "", loader, kv, 0).held

        try:
            arrived = run()
        except AgentError as exc:  # the re-read of what did not hold, on the closed client
            assert "closed" in str(exc)
            arrived = 0
        assert client.closed and arrived == 0
    finally:
        loader.close()


@pytest.mark.parametrize(
    "how", ["copy_leased", "queue_leased", "copy_past_blocked", "pull_leased_counted"]
)
def test_an_engines_first_copy_from_an_arena_unmapped_by_a_close_says_the_client_is_closed(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A close from another thread between a lease's answer and the engine's first copy from
    that arena mapping (no tensor over it yet, so close unmaps it: a vLLM link's first load on
    a new connection as its saver fails) raised the mmap's ValueError out of ``kvload``, which
    an engine's prefill (``except AgentError``) did not handle: it says the client is closed,
    as every call on a closed client does, and the engine prefills in full."""
    torch = pytest.importorskip("torch")
    from kvctl.engines import kvload
    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.store.keys import KVLayout

    fmt = ChunkFormat(KVLayout(3, 2, 8, "float32"), 4)
    k = key(6, 16)
    client = DataClient.connect(node.unix)
    assert client.shm and client.put(k, payload(k, fmt.chunk_bytes)) == "cpu"
    loader = kvload.KVLoader(fmt, torch.device("cpu"))  # no tensor over the arena yet
    kv = loader.alloc(1)
    real_hold = client.hold

    def held_then_closed(*args: Any, **kwargs: Any) -> Any:
        leases = real_hold(*args, **kwargs)
        closer = threading.Thread(target=client.close)
        closer.start()
        closer.join(30.0)
        assert not closer.is_alive() and leases.arena is not None and leases.arena.closed
        return leases

    try:
        if how == "pull_leased_counted":  # closed as its slice's hold is answered
            monkeypatch.setattr(client, "hold", held_then_closed)
        else:
            leases = held_then_closed([k])
        with pytest.raises(AgentError, match="closed"):
            if how == "pull_leased_counted":
                kvload.pull_leased_counted(client, [k], "", loader, kv, 0)
            elif how == "copy_leased":
                kvload.copy_leased(leases, 1, loader, kv)
            elif how == "queue_leased":
                kvload.queue_leased(leases, 1, loader, kv)
            else:
                kvload.copy_past_blocked(client, [k], "", loader, kv, 0, leases, 0)
    finally:
        loader.close()
