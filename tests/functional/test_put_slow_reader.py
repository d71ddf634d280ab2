"""A call under ``DataClient.timeout`` is bounded in all while its request is sent too, not only
while its answer is read: an agent (a kvctl:// pool, a peer) that takes a PUT's payload a
little at a time, each piece well within the socket's wait, held the sender (a node's one
pool writer) for as long as it kept reading slowly, whatever the call's deadline."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvctl.client import AgentTimeout, DataClient
from kvctl.wire.protocol import HEADER, HEADER_BYTES, REPLY_BIT, pack_header
from tests.functional.hung import guarded, loopback_server
from tests.functional.raw_sockets import recv_exactly

#: the slow reader takes this much of a payload every READ_EVERY_S (4 MiB/s): often enough that
#: no wait of the sender's is long, while the payload below would take minutes in all, far past
#: the hang guard
READ_PIECE_BYTES = 2 << 20
READ_EVERY_S = 0.5
PAYLOAD_BYTES = 512 << 20


@contextlib.contextmanager
def slow_reader() -> Iterator[str]:
    """A loopback data plane (its address) that answers HELLO, then reads whatever comes next
    a piece at a time, until the caller hangs up."""
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            _, _, op, rid, meta_len, payload_len = HEADER.unpack(recv_exactly(conn, HEADER_BYTES))
            recv_exactly(conn, meta_len + payload_len)
            info = json.dumps({"tiers": ["cpu"], "version": "slow-reader"}).encode()
            conn.sendall(pack_header(op | REPLY_BIT, rid, len(info)) + info)
            piece = bytearray(READ_PIECE_BYTES)
            while not stop.is_set() and conn.recv_into(piece):
                time.sleep(READ_EVERY_S)

    with loopback_server(serve, stop, "slow-reader") as address:
        yield address


def test_a_put_to_an_agent_reading_it_slowly_ends_at_the_calls_deadline() -> None:
    with slow_reader() as address:
        client = DataClient.connect(address, token="", timeout_s=30.0, use_shm=False)
        try:

            def put() -> None:
                with client.timeout(2.0):
                    client.put(bytes(16), bytes(PAYLOAD_BYTES), tenant="t1")

            with pytest.raises(AgentTimeout, match="did not answer PUT within 2 s"):
                guarded(put)
            assert client.closed
        finally:
            client.close()
