"""The agents' client of a router's index: an index URL may carry a password (the agent's
config says so and never echoes it), so no failure the client raises may show it."""

from __future__ import annotations

import http.server
from collections.abc import Callable

import pytest

from kvctl.index.remote import IndexClient, IndexUnavailable
from tests.functional.agents import closed_port
from tests.hostile_servers import Hostile, handler_class, send_json, trickle
from tests.not_an_agent import answering_url, serving, web_page_url

SECRET = "s3cret-pw"


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://ops:{SECRET}@")


@pytest.mark.parametrize(
    "call",
    [lambda c: c.holders([bytes(16)], tenant="t"), lambda c: c.nodes()],
    ids=["holders", "nodes"],
)
def test_no_failure_shows_the_index_urls_password(call: Callable[[IndexClient], object]) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    with web_page_url() as page, answering_url(500, b"oops") as failing:
        for url in (down, page, failing):
            client = IndexClient(_with_password(url), token="tok")
            try:
                with pytest.raises(IndexUnavailable) as caught:
                    call(client)
            finally:
                client.close()
            assert SECRET not in str(caught.value)
            assert "127.0.0.1" in str(caught.value)  # still says which index


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_trickled_answer_fails_at_the_deadline_not_when_it_ends(where: str) -> None:
    """A router trickling its holders answer a byte every 50 ms (each within the 0.25 s read
    timeout) for 4 s, then whole and valid: the call fails at its deadline, not when the answer
    is done (before, it read on and took the answer after 4 s)."""
    hostile = Hostile()
    body = b'{"holders": [[]]}'

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        return trickle(handler, body, headers_too=where == "headers")

    with serving(handler_class(hostile, answer)) as url:
        client = IndexClient(url)
        try:
            with pytest.raises(IndexUnavailable, match=r"no whole answer within 0\.5 s"):
                client.holders([bytes(16)], tenant="t")
        finally:
            client.close()
    assert hostile.requests == {"/v1/index/holders": 1}


@pytest.mark.parametrize("length", ["declared", "undeclared"])
def test_an_answer_too_long_is_not_read(length: str) -> None:
    """A 40 MiB answer (a valid holders answer padded) is refused, its length declared or not
    (before, it was read whole and taken)."""
    body = b'{"holders": [[]], "pad": "' + b"x" * (40 << 20) + b'"}'

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        if length == "declared":
            return send_json(handler, body)
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        try:
            handler.wfile.write(body)
        except OSError:
            return False
        return True

    with serving(handler_class(Hostile(), answer)) as url:
        # the length is what is checked, not the deadline: 32 MiB read within the default
        # 0.5 s failed a loaded parallel run ('no whole answer within 0.5 s')
        client = IndexClient(url, deadline_s=60.0)
        try:
            with pytest.raises(IndexUnavailable, match="taken"):
                client.holders([bytes(16)], tenant="t")
        finally:
            client.close()


def _holding(**changed: object) -> str:
    import json

    h: dict[str, object] = {"node": "b", "tier": "cpu", "size_bytes": 4096, "tokens": 16}
    return json.dumps({"holders": [[{**h, **changed}]]}).replace("Infinity", "1e400")


@pytest.mark.parametrize(
    "body",
    [
        _holding(size_bytes=float("inf")),  # 1e400: int() raised OverflowError past the agent
        _holding(tokens=-16),  # a negative count taken as it came
        _holding(size_bytes=True),  # int(true): 1
        _holding(tokens="16"),  # int("16"): a string taken for a count
        _holding(tokens=2.5),  # int(2.5): 2
        _holding(tokens=2**64),  # past the index's own bound (an int64)
        '{"holders": [[' * 5_000 + "]]" * 5_000 + "}",  # RecursionError past the agent
    ],
    ids=[
        "size-1e400",
        "tokens-negative",
        "size-true",
        "tokens-text",
        "tokens-2.5",
        "tokens-2**64",
        "nested-deeper-than-json-parses",
    ],
)
def test_a_holders_answer_whose_counts_are_no_counts_is_index_unavailable(body: str) -> None:
    """The router's holders answer was taken with int() of each count: 1e400 raised
    OverflowError and JSON nested past the parser's depth RecursionError, out of the agent's
    lookup (a bug's failure, not the index's); a negative, true, "16" or 2.5 was taken for a
    count (found by a review). Each is a bad answer: IndexUnavailable."""
    with answering_url(200, body.encode(), "application/json") as url:
        client = IndexClient(url)
        try:
            with pytest.raises(IndexUnavailable, match=r"bad answer|no JSON"):
                client.holders([bytes(16)], tenant="t")
        finally:
            client.close()


@pytest.mark.parametrize("count", ["1e400", "-3", "true", '"12"'])
def test_a_nodes_answer_whose_counts_are_no_counts_is_index_unavailable(count: str) -> None:
    body = '{"nodes": {"b": ' + count + "}}"
    with answering_url(200, body.encode(), "application/json") as url:
        client = IndexClient(url)
        try:
            with pytest.raises(IndexUnavailable, match="bad answer"):
                client.nodes()
        finally:
            client.close()
