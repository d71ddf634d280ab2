"""kvctl.router.client.RouterClient against a real HTTP server that is not a router: whatever it
answers, the client raises RouterClientError (what the collector, `kvctl top` and the CLI catch),
never another exception."""

from __future__ import annotations

import pytest

from kvctl.router.client import RouterClient, RouterClientError
from tests.not_an_agent import answering_url


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # an error list whose "loc" is not a list: TypeError, 'NoneType' object is not iterable
        (422, b'{"detail": [{"loc": null, "msg": "bad"}]}'),
        (422, b'{"detail": [{"loc": 5, "msg": "bad"}]}'),
        # JSON nested past what Python parses: RecursionError out of r.json()
        (200, b"[" * 100_000 + b"]" * 100_000),
        (503, b"[" * 100_000 + b"]" * 100_000),
    ],
    ids=["loc-null", "loc-number", "deep-json-200", "deep-json-503"],
)
def test_an_answer_that_is_not_the_routers_is_a_router_client_error(
    status: int, body: bytes
) -> None:
    with (
        answering_url(status, body, "application/json") as url,
        RouterClient(url, timeout_s=10) as client,
        pytest.raises(RouterClientError),
    ):
        client.stats()


SECRET = "hunter2-router-token"


@pytest.mark.parametrize(
    "token",
    [f"{SECRET}\r", f"{SECRET} ", f"\t{SECRET}", f"{SECRET}\nx", f"{SECRET}\x00", f"{SECRET}é"],
    ids=["cr", "trailing-space", "leading-tab", "newline", "nul", "non-ascii"],
)
def test_a_token_that_cannot_be_sent_is_refused_without_showing_it(token: str) -> None:
    # $KVCTL_ROUTER_TOKEN=$(cat token.txt) of a file saved with CRLF ends in "\r": httpx
    # refused the header with "Illegal header value b'Bearer <the token>\r'", and that became
    # "the router ... did not answer: ..." on the screen and in the collector's log; a non-ASCII
    # one raised UnicodeEncodeError, past every caller's except
    with (
        answering_url(200, b"{}", "application/json") as url,
        pytest.raises(RouterClientError) as raised,
    ):
        RouterClient(url, token=token, timeout_s=10).stats()
    assert SECRET not in str(raised.value)
    assert "token" in str(raised.value)
