"""A staging segment an agent at its open files limit takes, but cannot map: mapping takes a
descriptor of its own (Python's mmap dups the one passed), so EMFILE comes from the mapping
after the kernel found room for the passed one. Found in review: that refusal was logged as
short memory ('raise LimitAS= or MemoryMax='), the wrong remedy; its cause is descriptors
('raise LimitNOFILE='). Served in a child process of its own (``_CHILD``), whose open files limit
is set to leave room for exactly one more descriptor: the one ATTACH passes. Not in the test's
own process: there, a descriptor closed between the limit and the ATTACH (the garbage collector
closing a socket an earlier test leaked, in a full-suite run) gave the agent a lower slot, room
for the dup, and the test failed. The child runs nothing but the agent, its collector off while
the limit holds."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd seals are Linux")

SEGMENT_BYTES = 2 << 20
F_SEAL_FUTURE_WRITE = 0x10
REPO = Path(__file__).resolve().parents[2]

#: the agent (an InProcessNode) in a process of its own, on a Unix socket whose path it prints;
#: each line on stdin is a command, answered "done": "limit" sets its open files limit just past
#: its lowest free descriptor (the next descriptor made fits, the one after fails EMFILE),
#: "unlimit" sets it back. Its log goes to stderr, one record a line: "LOGGER|message".
_CHILD = """
import gc, logging, os, resource, sys
from pathlib import Path
from kvctl.agent.settings import AgentSettings
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.inprocess_node import InProcessNode

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s|%(message)r")
tmp = Path(sys.argv[1])
settings = AgentSettings(name="fds", data_dir=str(tmp), cpu_bytes=16 << 20)
node = InProcessNode(tmp, settings, [CpuTier(16 << 20, shared=True)])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print(node.unix, flush=True)
for line in sys.stdin:
    if line.strip() == "limit":
        gc.collect()
        gc.disable()  # nothing closes a descriptor while the limit holds
        probe = os.open(os.devnull, os.O_RDONLY)
        os.close(probe)  # the lowest free descriptor
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe + 1, hard))
    elif line.strip() == "unlimit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        gc.enable()
    print("done", flush=True)
node.close()
"""


class _Agent:
    def __init__(self, proc: subprocess.Popen[str], unix: str) -> None:
        self.proc, self.unix = proc, unix

    def command(self, what: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer == "done\n", (what, answer, self.proc.poll())


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[_Agent]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "agent.log", "w") as log:  # the child's stderr (it keeps its own)
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert proc.stdout is not None
        unix = proc.stdout.readline().strip()
        assert unix, (tmp_path / "agent.log").read_text()
        yield _Agent(proc, unix)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the child's loop ends, and it closes its node
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


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


def test_a_segment_the_agent_has_no_descriptor_to_map_is_refused_for_want_of_descriptors(
    agent: _Agent, tmp_path: Path
) -> None:
    fd = _sealed_segment()
    attach = MetaWriter().u64(SEGMENT_BYTES).build()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20.0)
            sock.connect(agent.unix)
            op, _ = _call(sock, Op.HELLO, MetaWriter().text("").text("open-files").build())
            assert op == Op.HELLO | 0x80
            # after the HELLO: the connection's thread and buffers are the agent's already
            agent.command("limit")
            try:
                op, meta = _call(sock, Op.ATTACH, attach, fd)
            finally:
                agent.command("unlimit")
            assert op == Op.ERROR, op
            code, message = parse_error(meta)
            # refused, the connection kept (the SDK puts over the socket, tries again later)
            assert code == ErrorCode.BAD_REQUEST, (code, message)
            assert "Too many open files" in message and "out of descriptors" in message, message
            # with descriptors again, the same connection attaches the segment
            op, meta = _call(sock, Op.ATTACH, attach, fd)
            assert op == Op.ATTACH | 0x80, parse_error(meta)
    finally:
        os.close(fd)
    log = (tmp_path / "agent.log").read_text()
    lines = [
        line
        for line in log.splitlines()
        if line.startswith("kvctl.agent.dataplane|") and "staging segment" in line
    ]
    assert len(lines) == 1, log
    assert "LimitNOFILE=" in lines[0] and "LimitAS=" not in lines[0], lines
