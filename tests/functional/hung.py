"""Hung agents for the engines' deadline tests: a real agent process stopped with SIGSTOP (alive,
its sockets still accepting, nothing answered), and a raw loopback server that answers HELLO
and then whatever else only as it is told (never, or a byte at a time). For the CLI's Ctrl-C
tests: a control API that takes each request and answers none, and a command run as a
subprocess that gets a SIGINT once the stand-in is asked."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

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


class HungHttp:
    """A loopback stand-in for a hung agent's control API: it takes each request and answers
    none until ``release`` is set; ``asked`` is set when a request arrives."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        hung = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _hang(self) -> None:
                hung.asked.set()
                hung.release.wait(HANG_GUARD_S * 2)

            do_GET = do_POST = _hang

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextlib.contextmanager
def hung_http_agent() -> Iterator[HungHttp]:
    hung = HungHttp()
    threading.Thread(target=hung.server.serve_forever, daemon=True).start()
    try:
        yield hung
    finally:
        hung.release.set()
        hung.server.shutdown()
        hung.server.server_close()


def ctrl_c(argv: Sequence[str], asked: threading.Event | None) -> tuple[int, str, bytes]:
    """Run ``python`` with ``argv`` (no KVCTL_* settings), send it a SIGINT once ``asked`` is
    set (None: it takes its own, see :data:`SIGINT_ONCE_ASLEEP`): its exit code, its stderr on
    one line, its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        if asked is not None:
            assert asked.wait(HANG_GUARD_S)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, " ".join(err.decode().split()), out


#: ``python -c`` this, then the name of a function and kvctl's arguments: kvctl, taking a SIGINT
#: once its main thread sleeps in a lock wait under that function (and still does a moment
#: later). The SIGINT is caught on another thread: Python's C handler runs there and wakes no
#: sleeper, as it does on the main thread when the SIGINT comes after the thread let go of the
#: GIL to sleep and before it slept (a window a loaded machine holds open for milliseconds).
#: Either way only the thread's next wake-up raises the KeyboardInterrupt.
SIGINT_ONCE_ASLEEP = """
import runpy, signal, sys, threading, time

under = sys.argv.pop(1)


def asleep():
    frame = sys._current_frames().get(threading.main_thread().ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    # asleep in threading's Condition.wait, or in kvctl.interrupts.wait_interruptibly's lock
    return names[:1] in (["wait"], ["wait_interruptibly"]) and under in names


def take_sigint():
    deadline = time.monotonic() + 60
    while not (asleep() and (time.sleep(0.2) or asleep())):
        if time.monotonic() > deadline:
            return  # never got there: no "interrupted" for the test to see
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


threading.Thread(target=take_sigint, daemon=True).start()
runpy.run_module("kvctl", run_name="__main__", alter_sys=True)
"""


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
def loopback_server(
    serve: Callable[[socket.socket], None], stop: threading.Event, name: str
) -> Iterator[str]:
    """A loopback TCP server (its address) running ``serve`` on a thread of its own for each
    connection, until the block ends: then ``stop`` is set and its connections closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    conns: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True, name=name)
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


@contextlib.contextmanager
def answering_hello_only(
    *, trickle_s: float = 0.0, reply_bytes: int = 64, hello: dict[str, Any] | None = None
) -> Iterator[str]:
    """A loopback TCP server (its address) that answers each connection's HELLO as an agent
    with a cpu tier would (or with ``hello``), then: with ``trickle_s`` 0, nothing more (it
    reads and drops what it is sent until the client hangs up); else each request's reply
    (``reply_bytes`` of metadata) one byte every ``trickle_s``."""
    said = json.dumps(hello if hello is not None else {"tiers": ["cpu"]}).encode()
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                _, _, op, rid, meta_len, payload_len = HEADER.unpack(
                    recv_exactly(conn, HEADER_BYTES)
                )
                recv_exactly(conn, meta_len + payload_len)
                if op == Op.HELLO:
                    _answer(conn, op, rid, said, 0.0)
                elif trickle_s:
                    _answer(conn, op, rid, bytes(reply_bytes), trickle_s)
                else:
                    while conn.recv(1 << 16):  # silent: until the client hangs up
                        pass
                    return

    with loopback_server(serve, stop, "hello-only-agent") as address:
        yield address
