"""``DataClient.timeout``: a call must be answered in full within its deadline, or it raises
AgentTimeout with the connection closed; its bound is the whole call, not each wait (a reply
that trickles is cut off too); a HELLO can have its own shorter bound. Against raw servers that
take the connection and then never answer, or answer a byte at a time."""

from __future__ import annotations

import socket

import pytest

from kvctl.client import AgentTimeout, AgentUnreachable, DataClient
from tests.functional.agents import key
from tests.functional.hung import SOCKET_TIMEOUT_S, answering_hello_only, guarded


def test_a_call_that_is_never_answered_ends_at_its_deadline_and_closes_the_connection() -> None:
    with answering_hello_only() as address:
        client = DataClient.connect(address, timeout_s=SOCKET_TIMEOUT_S)

        def lookup() -> None:
            with client.timeout(0.3):
                client.lookup([key(1)], tenant="t")

        with pytest.raises(AgentTimeout, match=r"did not answer LOOKUP within 0\.3 s") as got:
            guarded(lookup)
        assert isinstance(got.value, AgentUnreachable)  # the kind callers already handle
        assert client.closed  # a late reply would come out of step


def test_a_reply_that_trickles_is_cut_off_at_the_calls_deadline() -> None:
    """Each byte comes 50 ms after the last, well within any wait's timeout: only a bound on
    the whole call ends it (the reply would take about 4 s)."""
    with answering_hello_only(trickle_s=0.05) as address:
        client = DataClient.connect(address, timeout_s=SOCKET_TIMEOUT_S)

        def ping() -> None:
            with client.timeout(0.5):
                client.ping()

        with pytest.raises(AgentTimeout, match="did not answer PING"):
            guarded(ping)
        assert client.closed


def test_a_hello_that_is_never_answered_ends_at_its_own_deadline() -> None:
    # the kernel completes the connection (the listen backlog); nothing ever reads or answers
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(AgentTimeout, match=r"did not answer HELLO within 0\.3 s"):
            guarded(
                lambda: DataClient.connect(address, timeout_s=SOCKET_TIMEOUT_S, hello_timeout_s=0.3)
            )


def test_a_deadline_must_be_a_positive_number_of_seconds() -> None:
    with answering_hello_only() as address, DataClient.connect(address) as client:
        for bad in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="positive"), client.timeout(bad):
                pass
