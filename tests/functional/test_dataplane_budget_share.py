"""One client cannot hold the whole put budget with slow puts (adversarial review: four
connections each declared a 256 MiB chunk and sent it at ~1.25 MiB/s, just above the stall
floor, so the whole 1 GiB budget was reserved for minutes and every other client's put over
1 MiB waited 30 s, then got BUSY). A TCP source holds at most ``BUDGET_SHARE_PER_SOURCE`` of
the budget (at least one largest chunk): its further puts wait for its own; everyone else's
still fit.

Served in this process by a real ``DataPlaneServer`` over a real store, with a small budget.
The slow client is 127.0.0.2, a source address of its own on Linux's loopback; the others
connect from 127.0.0.1."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import HEADER, HEADER_BYTES, MetaWriter, Op, pack_header, put_item
from tests.functional.agents import key, payload
from tests.functional.inprocess_node import InProcessNode
from tests.functional.raw_sockets import recv_exactly
from tests.functional.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is Linux's loopback")

TOKEN = "t0ken-for-the-budget-share-test"
CHUNK = 4 << 20
#: the budget is raised to one largest chunk plus the largest metadata (8 MiB): 24 MiB here
BUDGET = 24 << 20
#: the share of it one source may hold (BUDGET_SHARE_PER_SOURCE)
SHARE = BUDGET // 2
SLOW = "127.0.0.2"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(
        name="share",
        data_dir=str(tmp_path),
        cpu_bytes=64 << 20,
        token=TOKEN,
        max_chunk_bytes=CHUNK,
        data_put_budget_bytes=BUDGET,
    )
    n = InProcessNode(tmp_path, settings, [CpuTier(64 << 20, shared=True)])
    yield n
    n.close()


def _declare_a_put(node: InProcessNode, k: bytes) -> socket.socket:
    """A connection from SLOW that declares one chunk of CHUNK bytes, then sends none of it
    (within the frame timeout, 30 s: it holds its reservation that long)."""
    sock = socket.create_connection(node.tcp, timeout=10, source_address=(SLOW, 0))
    hello = MetaWriter().text(TOKEN).text("slow").build()
    sock.sendall(pack_header(Op.HELLO, 1, len(hello)) + hello)
    _magic, _version, _op, _rid, meta_len, payload_len = HEADER.unpack(
        recv_exactly(sock, HEADER_BYTES)
    )
    recv_exactly(sock, meta_len + payload_len)
    meta = MetaWriter().text("slow").u32(1).raw(put_item(k, CHUNK)).build()
    sock.sendall(pack_header(Op.PUT, 2, len(meta), CHUNK) + meta)
    return sock


def test_a_slow_client_holds_its_share_of_the_put_budget_not_all(node: InProcessNode) -> None:
    budget = node.server.budget
    assert budget.total_bytes == BUDGET
    # as many slow puts as the whole budget takes (and one more)
    slow = [_declare_a_put(node, key(i, 1)) for i in range(BUDGET // CHUNK + 1)]
    wait_until("the slow puts to reserve", lambda: budget.free_bytes <= BUDGET - SHARE, 10)
    # another client's put over 1 MiB is served at once (before: it waited for the frame
    # timeout, then got BUSY: the slow ones held the whole budget)
    with DataClient.connect(f"{node.tcp[0]}:{node.tcp[1]}", token=TOKEN, timeout_s=10) as c:
        for i in range(3):
            k = key(i, 2)
            assert c.put(k, payload(k, CHUNK), tenant="t") == "cpu"
            assert c.get(k, tenant="t") == payload(k, CHUNK)
    assert budget.holder_bytes == SHARE
    assert budget.held(SLOW) == SHARE
    for sock in slow:
        sock.close()
    wait_until("the budget to be free", lambda: budget.free_bytes == BUDGET, 10)
    assert budget.held(SLOW) == 0
