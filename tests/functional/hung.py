"""Hung agents for the engines' deadline tests: a real agent process stopped with SIGSTOP (alive,
its sockets still accepting, nothing answered), and a raw loopback server that answers HELLO
and then whatever else only as it is told (never, or a byte at a time)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvctl.wire.protocol import HEADER, HEADER_BYTES, REPLY_BIT, Op, pack_header
from tests.functional.agents import Agent
from tests.functional.raw_sockets import recv_exactly

T = TypeVar("T")

#: a hang guard, never a timing claim: what a hung agent costs with the fixes is about a
#: second or two, without them the connection's socket timeout, which these tests set far above this
HANG_GUARD_S = 60.0
#: the socket timeout the tests' connections get: only an engine's own deadline ends a wait
SOCKET_TIMEOUT_S = 600.0


@contextlib.contextmanager
def stopped(agent: Agent) -> Iterator[None]:
    """The agent process stopped (SIGSTOP) for the block, continued (SIGCONT) after it, also
    when the block fails (so its stop at the test's end can be answered). The block starts
    once every thread of it is stopped: SIGSTOP is delivered asynchronously, and on a busy
    machine a request sent right after the kill could still be answered."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(agent.proc.pid)
        yield
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(_state(pid, tid) in ("T", "t", None) for tid in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.001)


def _state(pid: int, tid: str) -> str | None:
    """A thread's state letter (T: stopped); None when it ended meanwhile."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def guarded(call: Callable[[], T]) -> T:
    """``call()`` on another thread, failing the test after HANG_GUARD_S instead of hanging it
    (the thread is left to end when its agent answers again)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="hang-guard")
    try:
        return pool.submit(call).result(timeout=HANG_GUARD_S)
    finally:
        pool.shutdown(wait=False)


def _answer(conn: socket.socket, op: int, rid: int, meta: bytes, trickle_s: float) -> None:
    frame = pack_header(op | REPLY_BIT, rid, len(meta)) + meta
    if not trickle_s:
        conn.sendall(frame)
        return
    for i in range(len(frame)):  # each byte well within a socket timeout, the whole far beyond
        conn.sendall(frame[i : i + 1])
        time.sleep(trickle_s)


@contextlib.contextmanager
def answering_hello_only(*, trickle_s: float = 0.0, reply_bytes: int = 64) -> Iterator[str]:
    """A loopback TCP server (its address) that answers each connection's HELLO as an agent
    with a cpu tier would, then: with ``trickle_s`` 0, nothing more (it reads and drops what
    it is sent until the client hangs up); else each request's reply (``reply_bytes`` of
    metadata) one byte every ``trickle_s``."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                _, _, op, rid, meta_len, payload_len = HEADER.unpack(
                    recv_exactly(conn, HEADER_BYTES)
                )
                recv_exactly(conn, meta_len + payload_len)
                if op == Op.HELLO:
                    _answer(conn, op, rid, json.dumps({"tiers": ["cpu"]}).encode(), 0.0)
                elif trickle_s:
                    _answer(conn, op, rid, bytes(reply_bytes), trickle_s)
                else:
                    while conn.recv(1 << 16):  # silent: until the client hangs up
                        pass
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True, name="hello-only-agent")
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()
        listener.close()
