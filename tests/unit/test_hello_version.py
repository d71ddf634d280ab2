"""The HELLO's ``version`` is kvctl's package version, for people and logs; what a client does
with an agent is decided by the HELLO's capability fields, never by that version: builds with
and without PUT checksums have both reported "0.1.0"."""

from __future__ import annotations

import importlib.metadata
import json
import socket
import threading
from pathlib import Path

import pytest

import kvctl
from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.wire.protocol import HEADER, HEADER_BYTES, PUT_CHECKSUM_NAME, REPLY_BIT, pack_header


def test_an_agents_hello_reports_the_installed_package_version(tmp_path: Path) -> None:
    runtime = AgentRuntime.open(AgentSettings(name="v", data_dir=str(tmp_path), cpu_bytes=1 << 20))
    try:
        info = DataPlaneServer(runtime).hello_info()
    finally:
        runtime.close()
    assert info["version"] == kvctl.__version__
    # the capabilities, beside it (checked before the return below: installed or not)
    assert info["put_checksum"] == PUT_CHECKSUM_NAME
    try:
        installed = importlib.metadata.version("kvctl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return
    assert info["version"] == installed


def _answer_hello(sock: socket.socket, info: dict[str, object]) -> threading.Thread:
    def serve() -> None:
        head = sock.recv(HEADER_BYTES, socket.MSG_WAITALL)
        _m, _v, op, rid, meta_len, _payload_len = HEADER.unpack(head)
        sock.recv(meta_len, socket.MSG_WAITALL)
        meta = json.dumps(info).encode()
        sock.sendall(pack_header(op | REPLY_BIT, rid, len(meta)) + meta)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    ("version", "offers"),
    [("99.0.0", False), ("0.0.1", True), (kvctl.__version__, False), (kvctl.__version__, True)],
)
def test_a_client_decides_by_the_capability_not_the_version(
    pair: tuple[socket.socket, socket.socket], version: str, offers: bool
) -> None:
    info: dict[str, object] = {"version": version, "tiers": ["cpu"], "max_chunk_bytes": 1 << 20}
    if offers:
        info["put_checksum"] = PUT_CHECKSUM_NAME
    answering = _answer_hello(pair[1], info)
    client = DataClient(pair[0], "tcp", use_shm=False)
    answering.join(20)
    assert client.info["version"] == version
    assert client.takes_put_checksums is offers
