"""Hostile local clients against a real agent process: nothing a client does to a staging
segment it shares may crash the agent (issue 22 item 2), and puts that stall cannot make the
agent hold memory they have not sent, nor hold it after they end (item 5)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvctl.wire.protocol import ErrorCode, MetaWriter, Op, Status, pack_header, put_item

from .agents import key, payload
from .dataplane_hostile_agents import (
    RawConn,
    error_of,
    exit_description,
    hostile_agent,
    rss_bytes,
)

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="memfd staging segments and /proc are Linux"
)

SEGMENT_BYTES = 1 << 20
MAX_CHUNK_BYTES = 256 << 20  # the agent's default largest chunk
REPLY = 0x80
F_SEAL_FUTURE_WRITE = 0x10  # Linux's; Python's fcntl does not name it


@pytest.fixture
def agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0") as a:
        yield a


def _attach_meta(size: int) -> bytes:
    return MetaWriter().u64(size).build()


def _staged_put_meta(k: bytes, size: int, offset: int) -> bytes:
    item = put_item(k, size, staging_offset=offset)
    return MetaWriter().text("t").u32(1).raw(item).build()


def _segment(size: int, *, sealed: bool) -> int:
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0)
    fd = os.memfd_create("hostile-staging", flags)
    os.ftruncate(fd, size)
    os.pwrite(fd, payload(b"seg", size), 0)
    if sealed:  # written in full (no hole), then sealed against shrinking and punching holes
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE)
    return fd


def _assert_serves(agent, space: int) -> None:  # type: ignore[no-untyped-def]
    """The agent is alive and a well-behaved client's round trip is exact, on both transports."""
    assert agent.proc.poll() is None, f"agent {exit_description(agent)}:\n{agent.log()[-2000:]}"
    for transport in ("unix", "tcp"):
        with agent.data(transport) as c:
            k = key(1, space + (transport == "tcp"))
            assert c.put(k, payload(k, 4096), tenant="t") == "cpu"
            assert bytes(c.get(k, tenant="t")) == payload(k, 4096)


# --- item 2: staging segments -----------------------------------------------------------------
def test_a_segment_shrunk_after_attach_cannot_crash_the_agent(agent) -> None:  # type: ignore[no-untyped-def]
    """The exact attack: attach an unsealed memfd, truncate it to 0, ask for a staged put (the
    agent read past the end of the file through its mapping and died of SIGBUS)."""
    conn = RawConn(agent)
    conn.hello()
    fd = _segment(SEGMENT_BYTES, sealed=False)
    try:
        attach = conn.call(Op.ATTACH, _attach_meta(SEGMENT_BYTES), fds=[fd])
        os.ftruncate(fd, 0)
        try:
            staged = conn.call(Op.PUT_STAGED, _staged_put_meta(key(1), 4096, 0))
        except ConnectionError:
            staged = None
    finally:
        os.close(fd)
        conn.close()
    if staged is None:  # the connection dropped: give a dying agent time to be reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.proc.wait(5)
    assert staged is not None, f"the agent dropped the connection; it is {exit_description(agent)}"
    code, message = error_of(attach)
    assert code == ErrorCode.BAD_REQUEST and "seal" in message, message
    assert error_of(staged) == (ErrorCode.BAD_REQUEST, "PUT_STAGED before ATTACH")
    _assert_serves(agent, 10)


@pytest.mark.parametrize("kind", ["unsealed", "regular-file", "smaller-than-declared", "two-fds"])
def test_an_unsafe_segment_is_refused_and_the_connection_stays_usable(
    agent, tmp_path: Path, kind: str
) -> None:  # type: ignore[no-untyped-def]
    fds: list[int] = []
    if kind == "unsealed":
        fds = [_segment(SEGMENT_BYTES, sealed=False)]
    elif kind == "regular-file":  # no seals on a plain file: it can shrink under the mapping
        path = tmp_path / "segment"
        path.write_bytes(bytes(SEGMENT_BYTES))
        fds = [os.open(path, os.O_RDWR)]
    elif kind == "smaller-than-declared":
        fds = [_segment(SEGMENT_BYTES // 2, sealed=True)]
    else:
        fds = [_segment(SEGMENT_BYTES, sealed=True), _segment(SEGMENT_BYTES, sealed=True)]
    conn = RawConn(agent)
    try:
        conn.hello()
        code, message = error_of(conn.call(Op.ATTACH, _attach_meta(SEGMENT_BYTES), fds=fds))
        assert code == ErrorCode.BAD_REQUEST, message
        op, _, _, _ = conn.call(Op.PING, b"")  # a refused ATTACH is not fatal to the connection
        assert op == Op.PING | REPLY
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()
    _assert_serves(agent, 20)


def test_a_sealed_segment_serves_staged_puts_and_cannot_shrink(agent) -> None:  # type: ignore[no-untyped-def]
    conn = RawConn(agent)
    fd = _segment(SEGMENT_BYTES, sealed=True)
    try:
        conn.hello()
        op, _, _, _ = conn.call(Op.ATTACH, _attach_meta(SEGMENT_BYTES), fds=[fd])
        assert op == Op.ATTACH | REPLY
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # the seal is what keeps the agent's mapping valid
        # an item past the segment's end is refused on its own; one inside it is stored
        for offset, status in ((SEGMENT_BYTES - 100, Status.BAD), (4096, Status.OK)):
            op, _, meta, _ = conn.call(Op.PUT_STAGED, _staged_put_meta(key(2), 4096, offset))
            assert op == Op.PUT_STAGED | REPLY and meta[4] == status
    finally:
        os.close(fd)
        conn.close()
    with agent.data("unix") as c:
        assert bytes(c.get(key(2), tenant="t")) == payload(b"seg", SEGMENT_BYTES)[4096:8192]


def test_the_sdk_seals_its_staging_segment(agent) -> None:  # type: ignore[no-untyped-def]
    with agent.data("unix") as c:
        assert c.shm
        k = key(3)
        assert c.put(k, payload(k, 8192), tenant="t") == "cpu"
        seals = fcntl.fcntl(c._staging_fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & F_SEAL_FUTURE_WRITE
        assert c._staging is not None  # written in full: no hole the agent's reads could fill
        assert os.lseek(c._staging_fd, 0, os.SEEK_HOLE) == len(c._staging)
        assert bytes(c.get(k, tenant="t")) == payload(k, 8192)


def test_the_sdk_puts_over_the_socket_where_it_cannot_seal(agent, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import kvctl.client as client_module

    def cannot_seal(size: int) -> tuple[int, mmap.mmap]:
        raise OSError("no sealing on this system")

    monkeypatch.setattr(client_module, "_sealed_segment", cannot_seal)
    with agent.data("unix") as c:
        k = key(4)
        assert c.put(k, payload(k, 8192), tenant="t") == "cpu"
        assert c._staging is None  # the bytes went over the socket
        assert bytes(c.get(k, tenant="t")) == payload(k, 8192)


# --- item 5: stalled puts ---------------------------------------------------------------------
def _stalled_put(agent, size: int, sent: bytes = b"0123456789", transport: str = "tcp") -> RawConn:  # type: ignore[no-untyped-def]
    """A connection that declares a put of ``size`` bytes and sends only ``sent`` of them."""
    conn = RawConn(agent, transport)
    meta = MetaWriter().text("t").u32(1).raw(put_item(key(size, 77), size)).build()
    conn.sock.sendall(pack_header(Op.PUT, 1, len(meta), size) + meta + sent)
    return conn


def _rss_anon_bytes(pid: int) -> int:
    """Anonymous resident memory (RssAnon): the put buffers, without the shared cpu arena."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def _peak_rss_within(pid: int, seconds: float, limit_bytes: int) -> int:
    """Highest VmRSS seen while polling for ``seconds`` (stops early once past ``limit_bytes``)."""
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and peak <= limit_bytes:
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.05)
    return peak


def test_stalled_max_size_puts_do_not_reserve_their_declared_size(tmp_path: Path) -> None:
    """Six connections each declare a 256 MiB put and send 10 bytes: the agent used to allocate
    every declared chunk at once (1.5 GiB here); now it holds what arrived, and after they end
    it still stores puts."""
    n_conns = 6
    with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0", frame_timeout_s=30) as a:
        _assert_serves(a, 30)
        base = rss_bytes(a.proc.pid)
        limit = base + n_conns * (8 << 20) + (64 << 20)  # generous: far below 6 x 256 MiB
        conns = [_stalled_put(a, MAX_CHUNK_BYTES) for _ in range(n_conns)]
        try:
            peak = _peak_rss_within(a.proc.pid, 3.0, limit)
            assert peak <= limit, (
                f"RSS {peak >> 20} MiB with {n_conns} stalled puts (base {base >> 20} MiB)"
            )
            # a well-behaved client still stores small chunks meanwhile
            with a.data("tcp") as c:
                k = key(5)
                assert c.put(k, payload(k, 4096), tenant="t") == "cpu"
        finally:
            for conn in conns:
                conn.close()
        _assert_serves(a, 40)
        assert rss_bytes(a.proc.pid) <= limit


def test_a_large_put_does_not_keep_its_buffer(tmp_path: Path) -> None:
    """A connection that sent one 128 MiB chunk used to keep a 128 MiB receive buffer for
    the rest of its life."""
    size = 128 << 20
    with (
        hostile_agent(tmp_path / "a", "--cpu", "256MiB", "--disk", "0") as a,
        a.data("tcp") as c,
    ):
        c.ping()
        base = _rss_anon_bytes(a.proc.pid)
        k = key(6)
        assert c.put(k, payload(k, size), tenant="t") == "cpu"
        held = _rss_anon_bytes(a.proc.pid) - base
        assert held < size // 2, f"{held >> 20} MiB of anonymous memory kept after the put"
        assert bytes(c.get(k, tenant="t")) == payload(k, size)


@pytest.mark.parametrize("where", ["header", "meta", "payload", "trickle"])
def test_a_stalled_sender_gets_an_error_and_is_cut_off(tmp_path: Path, where: str) -> None:
    """With a 1 s stall timeout, a sender that stops mid-header, mid-metadata or mid-payload, or
    sends one byte every 0.3 s, is cut off (an error frame where one can still be framed)."""
    with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0", frame_timeout_s=1.0) as a:
        conn = RawConn(a, "tcp", timeout_s=20.0)
        meta = MetaWriter().text("t").u32(1).raw(put_item(key(7), 1 << 20)).build()
        frame = pack_header(Op.PUT, 9, len(meta), 1 << 20) + meta
        if where == "header":
            conn.sock.sendall(frame[:7])
        elif where == "meta":
            conn.sock.sendall(frame[:30])
        elif where == "payload":
            conn.sock.sendall(frame + b"x" * 1000)
        stop = threading.Event()

        def trickle() -> None:
            conn.sock.sendall(frame)
            while not stop.wait(0.3):
                try:
                    conn.sock.send(b"x")
                except OSError:
                    return

        t = threading.Thread(target=trickle, daemon=True)
        if where == "trickle":
            t.start()
        try:
            got: list[tuple[int, str]] = []
            try:
                while True:  # the agent's answer, then the end of the stream
                    got.append(error_of(conn.read_frame()))
            except ConnectionError:
                pass
            except OSError as exc:  # a reset after the error frame also ends the stream
                assert not isinstance(exc, socket.timeout), "the stalled sender was not cut off"
        finally:
            stop.set()
            conn.close()
            if t.is_alive():
                t.join(5)
        if where != "header":  # mid-header nothing can be framed back, the socket just closes
            assert [c for c, _ in got] == [ErrorCode.TIMEOUT], got
            assert "stalled" in got[0][1]
        _assert_serves(a, 50)


def test_a_put_that_cannot_get_budget_waits_then_is_refused(tmp_path: Path) -> None:
    """With a 300 MiB in-flight budget, a slow but steady 256 MiB put holds most of it: a second
    256 MiB put waits, then gets an error when its wait runs out, and 8 MiB puts still fit."""
    with hostile_agent(
        tmp_path / "a",
        "--cpu",
        "64MiB",
        "--disk",
        "0",
        frame_timeout_s=2.0,
        put_budget_bytes=300 << 20,
    ) as a:
        base = rss_bytes(a.proc.pid)
        holder = _stalled_put(a, MAX_CHUNK_BYTES)
        stop = threading.Event()

        def steady() -> None:  # 2.5 MiB/s: above the agent's minimum rate, never cut off
            piece = bytes(256 << 10)
            while not stop.wait(0.1):
                try:
                    holder.sock.sendall(piece)
                except OSError:
                    return

        t = threading.Thread(target=steady, daemon=True)
        t.start()
        try:
            time.sleep(0.5)  # the holder's reservation is made before the waiter asks
            waiter = RawConn(a, "tcp")
            meta = MetaWriter().text("t").u32(1).raw(put_item(key(8), MAX_CHUNK_BYTES)).build()
            waiter.sock.sendall(pack_header(Op.PUT, 3, len(meta), MAX_CHUNK_BYTES) + meta)
            with a.data("tcp") as c:
                k = key(9)
                assert c.put(k, payload(k, 8 << 20), tenant="t") == "cpu"
            code, message = error_of(waiter.read_frame())
            assert code == ErrorCode.BUSY and "budget" in message, message
            waiter.close()
        finally:
            stop.set()
            holder.close()
            t.join(5)
        _assert_serves(a, 60)
        assert rss_bytes(a.proc.pid) <= base + (64 << 20)


@pytest.mark.parametrize("op", [Op.LEASE, Op.LOOKUP_LEASE, Op.LOOKUP_LEASE_LOCAL])
def test_a_lease_with_a_nan_ttl_is_refused(agent, op: Op) -> None:  # type: ignore[no-untyped-def]
    """A NaN ttl slipped past the clamp to lease_seconds: the lease's deadline was NaN, which no
    expiry ever passes, so the chunk stayed held for as long as the connection lived."""
    k = key(11)
    with agent.data("unix") as c:
        assert c.put(k, payload(k, 4096), tenant="t") == "cpu"
    conn = RawConn(agent)
    try:
        lease = MetaWriter().text("t").f64(float("nan")).keys([k]).build()
        reply = conn.call(op, lease)
        code, message = error_of(reply)
        assert code == ErrorCode.BAD_REQUEST and "ttl" in message, message
    finally:
        conn.close()
    _assert_serves(agent, 70)


def test_replies_and_the_error_reach_a_client_still_sending_when_the_agent_closes(
    agent,
) -> None:  # type: ignore[no-untyped-def]
    """A fatal frame arrives while the client still has bytes in flight: the agent used to close
    with them unread, so the kernel reset the connection and dropped the replies not yet
    delivered, the error frame among them (found by the fuzz test, seed 22)."""
    conn = RawConn(agent, "tcp")
    try:
        # a reply, then garbage (fatal), then bytes the agent never reads
        want = 4 << 20
        probe = pack_header(Op.PROBE, 1, 8, 0) + MetaWriter().u64(want).build()
        conn.sock.sendall(probe + b"garbage!" * 8 + bytes(256 << 10))
        op, _rid, _meta, body = conn.read_frame()
        assert op == Op.PROBE | REPLY and len(body) == want
        code, _message = error_of(conn.read_frame())
        assert code == ErrorCode.BAD_FRAME
    finally:
        conn.close()
    _assert_serves(agent, 80)


@pytest.mark.parametrize("sdk", ["unsealed", "sparse"])
def test_the_sdk_puts_over_the_socket_when_the_agent_refuses_its_segment(
    agent, monkeypatch, sdk: str
) -> None:  # type: ignore[no-untyped-def]
    import kvctl.client as client_module

    def old_segment(size: int) -> tuple[int, mmap.mmap]:
        # what older SDKs sent, refused now: unsealed; then sealed against resizing only, its
        # pages left for the puts' writes (holes the agent's reads would allocate)
        fd = os.memfd_create("old-sdk-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        if sdk == "sparse":
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        return fd, mmap.mmap(fd, size)

    monkeypatch.setattr(client_module, "_sealed_segment", old_segment)
    with agent.data("unix") as c:
        keys = [key(i, 12) for i in range(3)]
        out = c.put_many([(k, payload(k, 8192)) for k in keys], tenant="t")
        assert [o.status for o in out] == ["stored"] * 3
        # over the socket; the segment is tried again after a back-off (test_staging_retry)
        assert c._staging is None and c._staging_failures == 1
        assert [bytes(g) for g in c.get_many(keys, tenant="t")] == [payload(k, 8192) for k in keys]
