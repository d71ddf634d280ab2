"""Agents for the hostile-client and fuzz tests of the data plane: a real ``kvctl agent start``
process whose data-plane limits (stall timeout, in-flight put budget) are set small, so a test
sees a stalled sender cut off in seconds rather than the production 30 s. The limits are the
agent's settings ``data_frame_timeout_seconds`` and ``data_put_budget_bytes``, given through
their environment variables.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvctl.agent.daemon import AgentState
from kvctl.wire.protocol import HEADER, HEADER_BYTES, MetaWriter, Op, pack_header, parse_error

from .agents import EPHEMERAL, Agent

_LAUNCH = """
import sys
sys.argv = ["kvctl", *sys.argv[1:]]
from kvctl.cli.main import main
main()
"""


def start_hostile_agent(
    data_dir: Path,
    *args: str,
    frame_timeout_s: float = 2.0,
    put_budget_bytes: int = 0,
    timeout_s: float = 60.0,
) -> Agent:
    """``kvctl agent start`` in a child process with the data plane's stall timeout (and, when
    not 0, its in-flight put budget) set; waits until it serves."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(data_dir / "xdg")
    env["KVCTL_DATA_FRAME_TIMEOUT_SECONDS"] = str(frame_timeout_s)
    if put_budget_bytes:
        env["KVCTL_DATA_PUT_BUDGET"] = str(put_budget_bytes)
    argv = ["agent", "start", "--data-dir", str(data_dir), *EPHEMERAL, *args]
    with open(data_dir / "agent.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = AgentState.read(data_dir)
        if state is not None and state.pid == proc.pid and _answers(state.control_url):
            # serving HTTP: its SIGTERM handling is in place (the state file comes before)
            return Agent(data_dir, proc, state, "", list(args))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    tail = (data_dir / "agent.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the agent did not start (exit {proc.poll()}):\n{tail}")


@contextlib.contextmanager
def hostile_agent(data_dir: Path, *args: str, **kw: float) -> Iterator[Agent]:
    agent = start_hostile_agent(data_dir, *args, **kw)  # type: ignore[arg-type]
    try:
        yield agent
    finally:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
            code = agent.proc.wait(30)
            assert code == 0, f"agent exited {code} on SIGTERM:\n{agent.log()[-3000:]}"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def exit_description(agent: Agent) -> str:
    """What became of the agent process, for assertion messages."""
    code = agent.proc.poll()
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited {code}"


class RawConn:
    """A hand-driven data-plane connection: frames built and read byte by byte, so a test can
    send what the SDK never would."""

    def __init__(self, agent: Agent, transport: str = "unix", timeout_s: float = 20.0) -> None:
        if transport == "unix":
            assert agent.state.data_unix is not None
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: object = agent.state.data_unix
        else:
            assert agent.state.data_tcp is not None
            host, port = agent.state.data_tcp.rsplit(":", 1)
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = (host, int(port))
        self.sock.settimeout(timeout_s)
        self.sock.connect(target)  # type: ignore[arg-type]
        self.rid = 0

    def send(self, op: int, meta: bytes, payload: bytes = b"", fds: list[int] | None = None) -> int:
        self.rid += 1
        frame = pack_header(op, self.rid, len(meta), len(payload)) + meta + payload
        if fds:
            self.sock.sendmsg(
                [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
            )
        else:
            self.sock.sendall(frame)
        return self.rid

    def read_frame(self) -> tuple[int, int, bytes, bytes]:
        """(op, request id, meta, payload) of the next frame; ConnectionError at EOF."""
        head = self._exactly(HEADER_BYTES)
        _magic, _version, op, rid, meta_len, payload_len = HEADER.unpack(head)
        return op, rid, self._exactly(meta_len), self._exactly(payload_len)

    def call(self, op: int, meta: bytes, payload: bytes = b"", fds: list[int] | None = None):  # type: ignore[no-untyped-def]
        self.send(op, meta, payload, fds)
        return self.read_frame()

    def hello(self) -> None:
        op, _, _, _ = self.call(Op.HELLO, MetaWriter().text("").text("hostile-test").build())
        assert op == Op.HELLO | 0x80

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += got
        return bytes(out)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def error_of(frame: tuple[int, int, bytes, bytes]) -> tuple[int, str]:
    """(code, message) of an ERROR frame; AssertionError for any other frame."""
    op, _rid, meta, _payload = frame
    assert op == Op.ERROR, f"expected an ERROR frame, got op {op}"
    return parse_error(meta)
