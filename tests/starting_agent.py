"""An agent's control port while it opens its tiers: a loopback socket answered by the agent's
own starting responder, so fleet views can be shown a node that is starting."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from kvctl.agent.starting import StartingResponder


@contextmanager
def starting_url() -> Iterator[str]:
    """The URL of a control port that answers every request "starting" (503, starting: true),
    as an agent does while its tiers open, until exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        with StartingResponder(sock):
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
