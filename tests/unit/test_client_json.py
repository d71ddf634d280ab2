"""The SDK tells an agent's answer from anything else at that URL: a web page, a proxy's text."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvctl.client import AgentClient, RequestError
from tests.not_an_agent import web_page_url


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
