"""The first-frame deadline on an agent without a token bounds how long a connection may stay
silent, not how long its first request takes to serve: found in review, a first frame that was
a GET of a large reply, read at a steady pace, was cut as "no first frame" once the deadline
passed while its reply was still going out (the deadline was cleared only once the first frame
had been served). Served in this process, with a 0.5 s first-frame deadline."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import GET_ITEM, HEADER_BYTES, Op
from tests.functional.agents import key
from tests.functional.test_dataplane_reply_bounds import HANG_GUARD_S, _get_meta, _send

HELLO_TIMEOUT_S = 0.5


def test_a_long_first_request_is_served_past_the_first_frame_deadline(tmp_path: Path) -> None:
    big = 4 << 20
    settings = AgentSettings(name="ff", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    runtime = AgentRuntime(settings, TieredStore([CpuTier(16 << 20, shared=True)]))
    server = DataPlaneServer(runtime, hello_timeout_s=HELLO_TIMEOUT_S)
    address = server.listen_tcp("127.0.0.1", 0)[:2]
    server.start()
    try:
        k = key(4, 64)
        data = os.urandom(big)
        runtime.store.put(k, data)
        n = 8
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            s.settimeout(HANG_GUARD_S)
            s.connect(address)
            _send(s, Op.GET, _get_meta([k] * n))  # its first frame, sent at once
            got = bytearray()
            started_s = time.monotonic()
            while len(got) < HEADER_BYTES + 4 + n * GET_ITEM.size + n * big:
                piece = s.recv(256 << 10)
                assert piece, f"cut off after {len(got)} bytes"
                got += piece
                time.sleep(1 / 32)  # ~8 MiB/s: the 32 MiB reply takes ~4 s to read
            took_s = time.monotonic() - started_s
        assert took_s > HELLO_TIMEOUT_S  # the case in point, not a speed claim
        assert got.endswith(data * n)
    finally:
        server.stop()
        runtime.close()
