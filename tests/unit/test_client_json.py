"""The SDK tells an agent's answer from anything else at that URL: a web page, a proxy's text."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvctl.client import (
    AgentClient,
    AgentError,
    AgentUnreachable,
    AuthError,
    ChunkNotFound,
    NoHttpAnswer,
    NotAnAgent,
    RequestError,
)
from tests.not_an_agent import answering_url, hang_up_url, web_page_url

JSON = "application/json"


@pytest.fixture
def web_url() -> Iterator[str]:
    with web_page_url() as url:
        yield url


@pytest.mark.parametrize("call", ["health", "info", "stats", "remote", "gpus"])
def test_a_page_that_is_not_json_is_refused_not_returned(web_url: str, call: str) -> None:
    client = AgentClient(web_url, timeout_s=5.0)
    try:
        with pytest.raises(RequestError, match="did not answer with JSON"):
            getattr(client, call)()
    finally:
        client.close()


# --- what an answer that is not an agent's reads like -------------------------------------------

PAGE = b"<!DOCTYPE HTML>\n<html><head><title>Error response</title></head>\n" + b"x" * 5000


def _error_of(url: str, call: str, *args: str, token: str = "") -> AgentError:
    """The error ``AgentClient(url).call(*args)`` raises."""
    with AgentClient(url, token=token, timeout_s=5.0) as client:
        try:
            getattr(client, call)(*args)
        except AgentError as exc:
            return exc
    raise AssertionError(f"{call} raised nothing")


@pytest.mark.parametrize(
    ("status", "body", "shown"),
    [
        (404, PAGE, "(<!DOCTYPE HTML>)"),  # python -m http.server: its page's first line only
        (404, b"", "(empty body)"),  # was an empty reason (every 404 became ChunkNotFound)
        (405, b"Method Not Allowed\nfrom the proxy", "(Method Not Allowed)"),
    ],
)
def test_an_error_page_is_one_short_line_naming_the_url(
    status: int, body: bytes, shown: str
) -> None:
    with answering_url(status, body) as url:
        error = _error_of(url, "info")
    assert isinstance(error, NotAnAgent) and error.code == status
    message = str(error)
    assert message.startswith(f"HTTP {status} from {url}/v1/info {shown}")
    assert "not a kvctl agent's control API?" in message
    assert "\n" not in message and len(message) < 200


def test_a_5xx_page_is_a_short_request_error_not_a_verdict_on_the_server() -> None:
    # an agent's own unhandled failure is a text 500 too: it is not "not an agent"
    with answering_url(500, b"Internal Server Error\n" + PAGE, "text/plain") as url:
        error = _error_of(url, "info")
    assert type(error) is RequestError and error.code == 500
    assert str(error) == f"HTTP 500 from {url}/v1/info (Internal Server Error)"


def test_an_unknown_endpoint_is_not_an_agent_404_not_a_missing_chunk() -> None:
    with answering_url(404, json.dumps({"detail": "Not Found"}).encode(), JSON) as url:
        error = _error_of(url, "top_keys")
    assert isinstance(error, NotAnAgent) and "no such endpoint" in str(error)
    assert error.code == 404  # what a caller tells an agent too old for the call by


def test_an_agents_own_404_is_still_a_missing_chunk() -> None:
    with answering_url(404, json.dumps({"detail": "chunk 00ff is corrupt"}).encode(), JSON) as url:
        error = _error_of(url, "info")
    assert isinstance(error, ChunkNotFound) and str(error) == "chunk 00ff is corrupt"


def test_a_port_that_hangs_up_is_named_as_maybe_the_data_port() -> None:
    with hang_up_url() as url:
        error = _error_of(url, "info")
    # or an agent that went away mid-request: callers that tell "down" by AgentUnreachable
    # still do
    assert isinstance(error, NoHttpAnswer)
    assert isinstance(error, NotAnAgent) and isinstance(error, AgentUnreachable)
    assert url in str(error) and "data-plane port" in str(error) and "--listen" in str(error)


def test_a_validation_error_is_one_line_of_fields_and_messages() -> None:
    errors = [
        {
            "type": "value_error",
            "loc": ["body", "target"],
            "msg": "Value error, target must be a data-plane TCP address HOST:PORT, got 'x'",
            "input": "x",
        },
        {"type": "greater_than_equal", "loc": ["body", "tokens", 0], "msg": "must be >= 0"},
    ]
    with answering_url(422, json.dumps({"detail": errors}).encode(), JSON) as url:
        error = _error_of(url, "probe", "x")
    assert isinstance(error, RequestError) and error.code == 422
    assert str(error) == (
        "422: target: target must be a data-plane TCP address HOST:PORT, got 'x'; "
        "tokens.0: must be >= 0"
    )


@pytest.mark.parametrize(
    ("token", "said"), [("", "needs a token and none was sent"), ("wrong", "refused the token")]
)
def test_a_401_says_the_agent_is_up_and_what_to_set(token: str, said: str) -> None:
    with answering_url(401, b"", JSON) as url:
        error = _error_of(url, "info", token=token)
    assert isinstance(error, AuthError)
    assert (
        str(error) == f"the agent at {url} is up but {said}: set KVCTL_TOKEN to the agent's token"
    )
