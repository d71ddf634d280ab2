"""A FETCH reply whose items and payload disagree, as a bit flipped on the wire or a rogue
peer would send it: the puller refuses it before allocating what an item claims (a review's
one corrupted size field had an agent commit 2 GiB for a 1 MiB chunk)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.client import AgentError, DataClient
from kvctl.wire.protocol import HEADER, HEADER_BYTES, REPLY_BIT, Op
from tests.functional.agents import key, payload, running_agent
from tests.functional.raw_sockets import recv_exactly

#: where the first item's size sits in a FETCH reply's metadata: after the u32 count and the
#: item's status byte
SIZE_AT = 4 + 1
CLAIMED_BYTES = 2 << 30


@pytest.fixture
def inflating_proxy(tmp_path: Path) -> Iterator[tuple[str, bytes]]:
    """A loopback relay to a real agent that rewrites the first item's size of each FETCH
    reply carrying chunks; (its address, the key of the chunk stored there)."""
    with running_agent(tmp_path / "a") as agent:
        k = key(1, 77)
        with agent.data() as c:
            c.put(k, payload(k, 1 << 20), tenant="t")
        host, port = str(agent.state.data_tcp).rsplit(":", 1)
        listener = socket.create_server(("127.0.0.1", 0))
        stop = threading.Event()

        def upstream(client: socket.socket, server: socket.socket) -> None:
            try:
                while data := client.recv(1 << 16):
                    server.sendall(data)
            except OSError:
                pass

        def downstream(server: socket.socket, client: socket.socket) -> None:
            try:
                while True:
                    head = recv_exactly(server, HEADER_BYTES)
                    _magic, _ver, op, _rid, meta_len, payload_len = HEADER.unpack(head)
                    meta = bytearray(recv_exactly(server, meta_len))
                    if op == Op.FETCH | REPLY_BIT and payload_len:
                        meta[SIZE_AT : SIZE_AT + 8] = struct.pack("<Q", CLAIMED_BYTES)
                    client.sendall(head + bytes(meta))
                    left = payload_len
                    while left:
                        chunk = server.recv(min(left, 1 << 16))
                        if not chunk:
                            return
                        client.sendall(chunk)
                        left -= len(chunk)
            except (OSError, ConnectionError):
                pass

        def serve() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                server = socket.create_connection((host, int(port)))
                threading.Thread(target=upstream, args=(client, server), daemon=True).start()
                threading.Thread(target=downstream, args=(server, client), daemon=True).start()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}", k
        finally:
            stop.set()
            thread.join()
            listener.close()


def test_an_item_claiming_more_than_the_payload_is_refused_before_any_allocation(
    inflating_proxy: tuple[str, bytes],
) -> None:
    address, k = inflating_proxy
    client = DataClient.connect(address, timeout_s=5)
    try:
        metas = client.fetch([k], tenant="t", payload=False)  # metadata alone: untouched
        assert metas[0] is not None and metas[0][0].size_bytes == 1 << 20
        with pytest.raises(AgentError, match=r"larger than the agent.s|items declare"):
            client.fetch([k], tenant="t")
        assert client.closed  # out of step with the stream: never used again
    finally:
        client.close()
