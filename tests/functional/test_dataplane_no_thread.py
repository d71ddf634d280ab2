"""A connection the agent cannot start a thread for (its address space short of a stack: RLIMIT_AS,
systemd's LimitAS=; a cap on tasks) is refused BUSY, and the agent goes on accepting. The
thread's RuntimeError ended the data plane's accept loop: from then on every connection sat in
the listen backlog, unanswered, until the agent restarted (many connections at once, or a
limit set too tight, and the agent served no engine again). Memory is made short for real, on
the agent process (prlimit)."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.wire.protocol import ErrorCode, MetaWriter, Op

from .agents import Agent, key, metric, payload
from .dataplane_hostile_agents import RawConn, error_of, hostile_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="prlimit and /proc are Linux")

MiB = 1 << 20


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0") as a:
        yield a


def _vm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


def test_a_connection_without_a_thread_is_refused_and_the_agent_accepts_again(
    agent: Agent,
) -> None:
    pid = agent.proc.pid
    hello = MetaWriter().text("").text("no-thread-test").build()
    conns: list[RawConn] = []
    answers: list[int] = []
    hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
    # no room for a thread's stack (8 MiB); glibc may reuse a cached stack or two of threads
    # that ended, so enough connections to outlast that cache
    resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + MiB, hard))
    try:
        for _ in range(12):
            conn = RawConn(agent, "unix", timeout_s=15.0)
            conns.append(conn)
            with contextlib.suppress(BrokenPipeError):  # refused (and closed) at accept
                conn.send(Op.HELLO, hello)
            op, _rid, meta, _ = conn.read_frame()
            if op == Op.ERROR:
                code, message = error_of((op, _rid, meta, b""))
                assert code == ErrorCode.BUSY and "no thread" in message, message
            answers.append(op)
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        for conn in conns:
            conn.close()
    assert Op.ERROR in answers, answers  # some found no thread
    # and the agent still takes connections once it has room again
    with agent.data("unix", hello_timeout_s=10.0) as c:
        k = key(1, 60)
        assert c.put(k, payload(k, 8192), tenant="t") == "cpu"
        assert bytes(c.get(k, tenant="t")) == payload(k, 8192)
    log = agent.log()
    assert "could not start a thread for a new unix connection" in log, log[-3000:]
    assert "LimitAS=" in log and "Traceback" not in log, log[-3000:]


def test_a_chunk_the_agent_has_no_memory_to_receive_is_refused_busy(agent: Agent) -> None:
    """A chunk larger than a connection's kept buffer is received into memory of its own; where
    none can be had the put is refused BUSY (retry later), one line in the log, not an
    INTERNAL error with a traceback per put, and the agent serves again once it has room."""
    from kvctl.wire.protocol import put_item

    pid = agent.proc.pid
    size = 4 * MiB
    k = key(2, 60)
    conn = RawConn(agent, "tcp", timeout_s=15.0)
    hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
    try:
        conn.hello()  # its thread runs before the limit
        meta = MetaWriter().text("t").u32(1).raw(put_item(k, size)).build()
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + MiB, hard))
        try:
            code, message = error_of(conn.call(Op.PUT, meta, payload(k, size)))
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
    finally:
        conn.close()
    assert code == ErrorCode.BUSY, message
    assert f"could not allocate {size} bytes" in message and "retry later" in message, message
    with agent.data("tcp", hello_timeout_s=10.0) as c:
        assert c.put(k, payload(k, size), tenant="t") == "cpu"
        assert bytes(c.get(k, tenant="t")) == payload(k, size)
    log = agent.log()
    assert "no memory to receive a chunk of 4194304 bytes" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_request_metadata_the_agent_has_no_memory_to_receive_is_refused_as_such(
    agent: Agent,
) -> None:
    """Metadata past the kept buffer (here an EXISTS of 65,536 keys, padded to 6 MiB) is received
    into memory of its own too: where none can be had the refusal names the metadata, not a
    chunk (it said 'could not allocate N bytes to receive a chunk' of a request that had none)."""
    pid = agent.proc.pid
    keys = [key(i, 61) for i in range(65536)]
    # 6 MiB in all, the room left 1 MiB: 65,536 keys alone came to 7 bytes past the kept
    # buffer, so the region missed the room by one page, and any munmap in the agent between
    # the VmSize read and the EXISTS (an arena returned, a large free) let it through. The
    # padding is never parsed: the agent refuses the frame before it reads it
    meta = MetaWriter().text("t").keys(keys).build()
    meta += bytes(6 * MiB - len(meta))
    conn = RawConn(agent, "unix", timeout_s=15.0)
    hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
    try:
        conn.hello()  # its thread runs before the limit
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + MiB, hard))
        try:
            code, message = error_of(conn.call(Op.EXISTS, meta))
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
    finally:
        conn.close()
    assert code == ErrorCode.BUSY, message
    assert f"could not allocate {len(meta)} bytes to receive a request's metadata" in message
    assert "chunk" not in message, message
    log = agent.log()
    assert f"no memory to receive a request's metadata of {len(meta)} bytes" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_staged_put_stops_once_its_client_has_gone(agent: Agent) -> None:
    """A PUT_STAGED batch copies from the client's segment, moving nothing on the socket: a
    client that sent one of 16,384 chunks (16 GiB of copies into a 64 MiB arena, evicting as
    they go) and closed had the agent go on copying all of them for nobody. It stops within
    kvctl.agent.dataplane.STAGED_CHECK_BYTES of the close now."""
    import fcntl
    import os

    from kvctl.wire.protocol import put_item

    n_chunks = 16384
    fd = os.memfd_create("gone", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    conn = RawConn(agent, "unix")
    try:
        os.pwrite(fd, payload(b"gone", MiB), 0)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x10 | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        conn.hello()
        op, _, _, _ = conn.call(Op.ATTACH, MetaWriter().u64(MiB).build(), fds=[fd])
        assert op == Op.ATTACH | 0x80
        before = agent.control().stats()["stats"]["tiers"]["cpu"]["puts"]
        items = b"".join(put_item(key(i, 80), MiB, staging_offset=0) for i in range(n_chunks))
        conn.send(Op.PUT_STAGED, MetaWriter().text("t").u32(n_chunks).raw(items).build())
    finally:
        conn.close()
        os.close(fd)
    # the connection's thread is done (however long that takes) ...
    while metric(agent, "kvctl_dataplane_connections", transport="unix") > 0:
        time.sleep(0.05)
    # ... having stored the chunks it copied before it saw the close, not all of them
    stored = agent.control().stats()["stats"]["tiers"]["cpu"]["puts"] - before
    assert stored < n_chunks // 2, stored
    with agent.data("unix") as c:  # and serves on
        k = key(3, 60)
        assert c.put(k, payload(k, 8192), tenant="t") == "cpu"


def test_a_staged_put_from_a_client_that_shut_its_writing_side_is_answered(agent: Agent) -> None:
    """The check for a client gone (above) takes a half-closed connection (SHUT_WR: it sends no
    more, and waits for its replies) as still there: its batch is stored and answered."""
    import fcntl
    import os
    import socket

    from kvctl.wire.protocol import MetaReader, put_item

    n_chunks = 96  # 96 MiB of copies: past the 64 MiB after which the client is checked
    fd = os.memfd_create("half", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    conn = RawConn(agent, "unix")
    try:
        os.pwrite(fd, payload(b"half", MiB), 0)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x10 | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        conn.hello()
        op, _, _, _ = conn.call(Op.ATTACH, MetaWriter().u64(MiB).build(), fds=[fd])
        assert op == Op.ATTACH | 0x80
        items = b"".join(put_item(key(i, 81), MiB, staging_offset=0) for i in range(n_chunks))
        conn.send(Op.PUT_STAGED, MetaWriter().text("t").u32(n_chunks).raw(items).build())
        conn.sock.shutdown(socket.SHUT_WR)
        op, _, meta, _ = conn.read_frame()
    finally:
        conn.close()
        os.close(fd)
    assert op == Op.PUT_STAGED | 0x80, error_of((op, 0, meta, b""))
    reply = MetaReader(meta)
    assert reply.u32() == n_chunks
