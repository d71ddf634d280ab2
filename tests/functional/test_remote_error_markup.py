"""``kvctl agent remote`` shows a source's last error as the source worded it: a peer (or
anything listening at its address) whose error message holds Rich markup must neither make the
command fail nor style, hide or link the operator's view. Before, the error text went into the
console's markup: a stray ``[/]`` failed the command ("closing tag '[/]' ... has nothing to
close"), so an operator could not see the status of any source while that peer was down."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    ErrorCode,
    Op,
    error_meta,
    pack_header,
)
from tests.functional.agents import running_agent
from tests.functional.hung import loopback_server
from tests.functional.raw_sockets import recv_exactly
from tests.functional.test_remote import SMALL, remote
from tests.functional.waiting import wait_until

MESSAGE = "refused [/] [link=https://evil.example]click here[/link] [bold red]FAKE[/]"


@contextlib.contextmanager
def refusing_peer() -> Iterator[str]:
    """A loopback data plane (its address) that answers HELLO as an agent and every other
    request with an ERROR carrying ``MESSAGE``."""
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError):
            while not stop.is_set():
                _, _, op, rid, meta_len, payload_len = HEADER.unpack(
                    recv_exactly(conn, HEADER_BYTES)
                )
                recv_exactly(conn, meta_len + payload_len)
                if op == Op.HELLO:
                    info = json.dumps({"tiers": ["cpu"]}).encode()
                    conn.sendall(pack_header(op | REPLY_BIT, rid, len(info)) + info)
                else:
                    meta = error_meta(ErrorCode.BAD_REQUEST, MESSAGE)
                    conn.sendall(pack_header(Op.ERROR, rid, len(meta)) + meta)

    with loopback_server(serve, stop, "refusing-peer") as address:
        yield address


def test_a_peers_error_text_is_shown_as_it_is(tmp_path: Path) -> None:
    with (
        refusing_peer() as address,
        running_agent(tmp_path / "a", "--peer", f"evil={address}", *SMALL) as a,
    ):

        def noted() -> bool:
            peer = remote(a)["peers"][0]
            return MESSAGE in peer["last_error"] and not peer["up"]

        wait_until("the peer's error noted", noted)
        out = CliRunner().invoke(
            app, ["agent", "remote", "--url", a.state.control_url], env={"COLUMNS": "400"}
        )
    assert out.exit_code == 0, out.output
    assert MESSAGE in out.output  # every bracket shown, none taken for markup
