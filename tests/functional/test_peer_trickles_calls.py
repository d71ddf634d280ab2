"""A peer or pool agent that trickles its answers to the calls other than a pull (its HELLO, a
PING, a PUT), a byte at a time, each byte well within the socket's timeout: each such call is
bounded in all, as a pull is, so the source costs a counted failure, never a hang. Before,
only each wait was bounded: a peer trickling its HELLO held a real agent's read (the pull's
connection is made before the pull's deadline is watched) for as long as it trickled; one
trickling its PINGs held the link monitor, so no other link was measured; and a pool agent
trickling its PUT answers held the node's one pool writer, every later chunk dropped with
nothing failed, its breaker closed and no error shown."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.remote.probe import probe_link
from kvctl.wire.protocol import (
    FETCH_ITEM,
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    pack_header,
)
from tests.functional.agents import running_agent
from tests.functional.hung import HANG_GUARD_S, guarded, loopback_server
from tests.functional.raw_sockets import recv_exactly
from tests.functional.test_remote import SMALL, chain, link_costed, put_chain, remote
from tests.functional.waiting import wait_until

#: a byte of a trickled answer every this long: well within any wait's timeout (0.5 s for
#: reads), while the whole answer (``TRICKLED_META_BYTES``) would take far past the hang guard
TRICKLE_EVERY_S = 0.1
TRICKLED_META_BYTES = 4000


@contextlib.contextmanager
def trickling_agent(*trickled: Op) -> Iterator[str]:
    """A loopback data plane (its address) that answers the ops in ``trickled`` a byte at a
    time, until the caller hangs up, and the others as an agent holding nothing would: HELLO,
    PING, a FETCH with every chunk missing (anything else: the connection is dropped)."""
    stop = threading.Event()

    def answer(conn: socket.socket, op: int, rid: int, meta: bytes) -> None:
        if op not in trickled:
            conn.sendall(pack_header(op | REPLY_BIT, rid, len(meta)) + meta)
            return
        frame = pack_header(op | REPLY_BIT, rid, TRICKLED_META_BYTES)
        frame += b" " * TRICKLED_META_BYTES
        for i in range(len(frame)):
            if stop.is_set():
                return
            conn.sendall(frame[i : i + 1])  # fails once the caller hung up
            time.sleep(TRICKLE_EVERY_S)

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            while not stop.is_set():
                _, _, op, rid, meta_len, payload_len = HEADER.unpack(
                    recv_exactly(conn, HEADER_BYTES)
                )
                meta = recv_exactly(conn, meta_len + payload_len)[:meta_len]
                if op == Op.HELLO:
                    info = {"tiers": ["cpu"], "version": "trickler"}
                    answer(conn, op, rid, json.dumps(info).encode())
                elif op == Op.PING:
                    answer(conn, op, rid, b"")
                elif op == Op.FETCH:
                    r = MetaReader(meta)
                    r.text(), r.u8()
                    keys = r.keys()
                    w = MetaWriter().u32(len(keys))
                    for _ in keys:
                        w.raw(FETCH_ITEM.pack(Status.MISSING, 0, 0, 0, 0, bytes(16), 0.0))
                        w.text("")
                    answer(conn, op, rid, w.build())
                elif op == Op.PUT and op in trickled:
                    answer(conn, op, rid, b"")
                else:
                    return

    with loopback_server(serve, stop, "trickling-agent") as address:
        yield address


def test_a_peer_trickling_its_hello_costs_a_read_a_miss_not_a_hang(tmp_path: Path) -> None:
    keys = chain(2, seed=301)
    with trickling_agent(Op.HELLO) as address:
        args = ["--peer", f"slow={address}", "--link", "slow:override=fetch", *SMALL]
        with running_agent(tmp_path / "a", *args) as a, a.data() as d:

            def read() -> list[object]:
                d.lookup(keys, tenant="t1")
                return d.get_many(keys, tenant="t1")  # type: ignore[return-value]

            assert guarded(read) == [None, None]
            peer = remote(a)["peers"][0]
            assert "did not answer HELLO within 0.5 s" in peer["last_error"]


def test_a_peer_trickling_its_pings_does_not_hold_the_link_monitor(tmp_path: Path) -> None:
    """The monitor measures each source in turn: the trickling one, configured first, must
    not keep the good one from ever being measured."""
    with running_agent(tmp_path / "good", *SMALL) as good, trickling_agent(Op.PING) as address:
        args = ["--peer", f"slow={address}", "--peer", f"good={good.state.data_tcp}", *SMALL]
        with running_agent(tmp_path / "a", *args) as a:
            wait_until("the good peer's link measured", link_costed(a, "good"), HANG_GUARD_S)
            slow = remote(a)["peers"][0]
            assert slow["name"] == "slow" and "did not answer PING" in slow["last_error"]


def test_a_pool_agent_trickling_its_put_answers_fails_the_writes(tmp_path: Path) -> None:
    keys = chain(2, seed=302)
    with (
        trickling_agent(Op.PUT) as address,
        running_agent(tmp_path / "a", "--pool", f"kvctl://{address}", *SMALL) as a,
    ):
        # the link monitor's bandwidth probe fails too (the stand-in drops a PROBE), and
        # replaces the pool's last_error; when it comes first (a loaded machine), the
        # breaker it opened turns writes away unsent: chains are written until one write
        # was sent and failed as trickled
        seeds = iter(range(303, 10_000))

        def a_write_said_to_trickle() -> bool:
            if "did not answer PUT within" in remote(a)["write"]["last_error"]:
                return True
            put_chain(a, chain(2, seed=next(seeds)), tenant="t1")
            return False

        put_chain(a, keys, tenant="t1")
        wait_until("a pool write said to trickle", a_write_said_to_trickle, HANG_GUARD_S, 1.0)
        write = remote(a)["write"]
        assert write["failed"] >= 1
        assert write["written"] == 0
        out = CliRunner().invoke(
            app, ["agent", "remote", "--url", a.state.control_url], env={"COLUMNS": "400"}
        )
    assert out.exit_code == 0, out.output
    assert "(last failure: write: " in out.output and "did not answer PUT within" in out.output


def test_a_link_probe_of_a_target_trickling_its_answers_ends_as_a_failed_probe() -> None:
    """``kvctl agent probe`` (``POST /v1/probe``): its HELLO and each ping are bounded in all
    by the probe's ``timeout_s``, so a trickling target is a failed probe saying why."""
    for trickled in (Op.HELLO, Op.PING):
        with trickling_agent(trickled) as address:
            got = guarded(
                lambda address=address: probe_link(
                    address, token="", pings=3, size_bytes=0, timeout_s=0.5
                )
            )
        assert not got["ok"]
        assert f"did not answer {trickled.name} within 0.5 s" in str(got["error"])
