"""A client's staging segment costs the agent none of its memory: every page the agent reads
through its mapping must exist before it reads it. A hole (never written, or punched out after
ATTACH) read through a shared mapping is allocated by that read, in the agent (its memory, its
cgroup's): a 2 GiB sparse segment, sealed against shrinking as the agent asked, made the agent
allocate 2 GiB of shared memory through a few PUT_STAGED frames, its client holding none, and
a segment of a terabyte would have run the host out of memory (found by review, hostile
clients). So a segment must be written in full at ATTACH and sealed against punching holes
(F_SEAL_FUTURE_WRITE, or F_SEAL_WRITE) as well as shrinking, or it is refused (BAD_REQUEST;
the SDK then puts over the socket)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from pathlib import Path

import pytest

from kvctl.wire.protocol import ErrorCode, MetaWriter, Op, parse_error, put_item

from .agents import key
from .dataplane_hostile_agents import RawConn, hostile_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd staging segments are Linux")

F_SEAL_FUTURE_WRITE = 0x10
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
SEGMENT_BYTES = 256 << 20
CHUNK_BYTES = 16 << 20


def _allocated(fd: int) -> int:
    """Bytes of memory the segment holds (its pages, whoever faulted them)."""
    return os.fstat(fd).st_blocks * 512


def _punch(fd: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, mode, offset, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def _put_all_staged(conn: RawConn) -> list[tuple[int, bytes]]:
    """PUT_STAGED of chunks covering the whole segment, one a frame: (op, meta) of each reply."""
    replies = []
    for i in range(SEGMENT_BYTES // CHUNK_BYTES):
        item = put_item(key(i, 31), CHUNK_BYTES, staging_offset=i * CHUNK_BYTES)
        op, _rid, meta, _payload = conn.call(
            Op.PUT_STAGED, MetaWriter().text("t").u32(1).raw(item).build()
        )
        replies.append((op, meta))
    return replies


@pytest.mark.parametrize("how", ["never_written", "punched_after_attach"])
def test_the_agent_allocates_no_hole_of_a_clients_segment(tmp_path: Path, how: str) -> None:
    fd = os.memfd_create("hostile-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SEGMENT_BYTES)
        if how == "never_written":  # sealed every way the agent could ask: the holes stay
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE)
        else:  # written in full and sealed against shrinking, then punched out once attached
            for offset in range(0, SEGMENT_BYTES, CHUNK_BYTES):
                os.pwrite(fd, bytes(CHUNK_BYTES), offset)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0") as agent:
            conn = RawConn(agent, "unix")
            assert conn.call(Op.HELLO, MetaWriter().text("").text("hostile").build())[0] == (
                Op.HELLO | 0x80
            )
            conn.call(Op.ATTACH, MetaWriter().u64(SEGMENT_BYTES).build(), fds=[fd])
            if how == "punched_after_attach":
                _punch(fd, 0, SEGMENT_BYTES)
            held = _allocated(fd)
            assert held < CHUNK_BYTES, held
            replies = _put_all_staged(conn)
            grown = _allocated(fd) - held
            assert grown < CHUNK_BYTES, (
                f"the agent allocated {grown >> 20} MiB of the client's segment "
                f"(replies: {replies[:2]})"
            )
            # refused, as a PUT_STAGED without a segment is; the connection stays usable
            op, meta = replies[0]
            assert op == Op.ERROR and parse_error(meta)[0] == ErrorCode.BAD_REQUEST, replies[0]
            assert conn.call(Op.PING, b"")[0] == Op.PING | 0x80
            conn.sock.close()
    finally:
        os.close(fd)


def test_a_clients_segment_is_sized_to_its_puts_not_to_a_floor(tmp_path: Path) -> None:
    # the SDK writes its whole segment before attaching it (above), so all of it is the client's
    # memory from the first put: a 64 MiB floor made a 4 KiB put hold 64 MiB, and take the time
    # to write them (found by a second review of 71334fe: 0.7 ms -> 74 ms, RssShmem 0 -> 64 MiB)
    from .agents import running_agent

    with running_agent(tmp_path / "a") as agent, agent.data("unix") as client:
        assert client.shm
        small = key(0, 32)
        assert client.put_many([(small, b"x" * 4096)])[0].status == "stored"
        assert client._staging is not None  # staged, not sent over the socket
        held = os.fstat(client._staging_fd).st_blocks * 512
        assert len(client._staging) <= 2 << 20 and held <= 2 << 20, (len(client._staging), held)
        # a larger put gets a larger segment, written in full, at most twice what it needs
        big = (3 << 20) + 1
        assert client.put_many([(key(1, 32), b"y" * big)])[0].status == "stored"
        assert big <= len(client._staging) <= 2 * big, len(client._staging)
        assert os.lseek(client._staging_fd, 0, os.SEEK_HOLE) == len(client._staging)
        assert bytes(client.get(key(1, 32))) == b"y" * big
        assert bytes(client.get(small)) == b"x" * 4096


def test_the_agent_says_once_that_it_refused_a_segment(tmp_path: Path) -> None:
    # an SDK older than 71334fe (its segment sealed against resizing only, and sparse) puts
    # over the socket once refused, saying nothing: the agent's log is where an operator learns
    # why that engine's stores got slower (second review of 71334fe). Once: any client may
    # send many
    with hostile_agent(tmp_path / "a", "--cpu", "64MiB", "--disk", "0") as agent:
        with agent.data("unix") as sdk:  # this SDK's segment: accepted, nothing said
            assert sdk.put_many([(key(0, 33), b"s" * 4096)])[0].status == "stored"
            assert sdk._staging is not None
        for _ in range(2):
            fd = os.memfd_create("older-sdk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 1 << 20)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                conn = RawConn(agent, "unix")
                conn.call(Op.HELLO, MetaWriter().text("").text("older").build())
                op, _rid, meta, _ = conn.call(
                    Op.ATTACH, MetaWriter().u64(1 << 20).build(), fds=[fd]
                )
                assert op == Op.ERROR and parse_error(meta)[0] == ErrorCode.BAD_REQUEST
                assert conn.call(Op.PING, b"")[0] == Op.PING | 0x80
                conn.sock.close()
            finally:
                os.close(fd)
        said = [line for line in agent.log().splitlines() if "staging segment" in line]
        assert len(said) == 1, said
        assert "refused a client's staging segment" in said[0] and "over the socket" in said[0]
