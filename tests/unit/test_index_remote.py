"""The agents' client of a router's index: an index URL may carry a password (the agent's
config says so and never echoes it), so no failure the client raises may show it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvctl.index.remote import IndexClient, IndexUnavailable
from tests.functional.agents import closed_port
from tests.not_an_agent import answering_url, web_page_url

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
