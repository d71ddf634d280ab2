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
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.wire.protocol import ErrorCode, MetaWriter, Op

from .agents import Agent, key, payload
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
