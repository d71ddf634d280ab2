"""A staging segment an agent at its open files limit takes, but cannot map: mapping takes a
descriptor of its own (Python's mmap dups the one passed), so EMFILE comes from the mapping
after the kernel found room for the passed one. Found in review: that refusal was logged as
short memory ('raise LimitAS= or MemoryMax='), the wrong remedy; its cause is descriptors
('raise LimitNOFILE='). Served in this process, whose open files limit the test sets to leave
room for exactly one more descriptor: the one ATTACH passes."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
)
from tests.functional.inprocess_node import InProcessNode

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd seals are Linux")

SEGMENT_BYTES = 2 << 20
F_SEAL_FUTURE_WRITE = 0x10


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="fds", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    n = InProcessNode(tmp_path, settings, [CpuTier(16 << 20, shared=True)])
    try:
        yield n
    finally:
        n.close()


def _sealed_segment() -> int:
    fd = os.memfd_create("open-files", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.pwrite(fd, bytes(SEGMENT_BYTES), 0)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _call(sock: socket.socket, op: int, meta: bytes, fd: int = -1) -> tuple[int, bytes]:
    frame = pack_header(op, 1, len(meta), 0) + meta
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))] if fd >= 0 else []
    sock.sendmsg([frame], anc)
    head = _exactly(sock, HEADER_BYTES)
    _magic, _version, rop, _rid, meta_len, _payload_len = HEADER.unpack(head)
    return rop, _exactly(sock, meta_len)


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        assert got, f"the agent closed the connection after {len(out)} of {n} bytes"
        out += got
    return bytes(out)


@contextlib.contextmanager
def _room_for_one_more_descriptor() -> Iterator[None]:
    """This process's open files limit set just past its lowest free descriptor: the next
    descriptor made (the one ATTACH passes, received by the agent's thread) fits, the one
    after (mmap's dup of it) fails EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)  # the lowest free descriptor
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + 1, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_segment_the_agent_has_no_descriptor_to_map_is_refused_for_want_of_descriptors(
    node: InProcessNode, caplog: pytest.LogCaptureFixture
) -> None:
    fd = _sealed_segment()
    attach = MetaWriter().u64(SEGMENT_BYTES).build()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20.0)
            sock.connect(node.unix)
            op, _ = _call(sock, Op.HELLO, MetaWriter().text("").text("open-files").build())
            assert op == Op.HELLO | 0x80
            with (
                caplog.at_level(logging.WARNING, logger="kvctl.agent.dataplane"),
                _room_for_one_more_descriptor(),
            ):
                op, meta = _call(sock, Op.ATTACH, attach, fd)
            assert op == Op.ERROR, op
            code, message = parse_error(meta)
            # refused, the connection kept (the SDK puts over the socket, tries again later)
            assert code == ErrorCode.BAD_REQUEST, (code, message)
            assert "Too many open files" in message and "out of descriptors" in message, message
            lines = [r.getMessage() for r in caplog.records if "staging segment" in r.getMessage()]
            assert len(lines) == 1, lines
            assert "LimitNOFILE=" in lines[0] and "LimitAS=" not in lines[0], lines
            # with descriptors again, the same connection attaches the segment
            op, meta = _call(sock, Op.ATTACH, attach, fd)
            assert op == Op.ATTACH | 0x80, parse_error(meta)
    finally:
        os.close(fd)
