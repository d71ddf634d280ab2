"""Secrets never shown: a URL's password, in messages that echo a URL refused for another
reason too (the inventory's checks: a bad port, no scheme)."""

from __future__ import annotations

import pytest

from kvctl.db.inventory import url_problem
from kvctl.redact import redact_url

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://ops:hunter2@host:7070/v1", "http://ops:***@host:7070/v1"),
        ("ops:hunter2@host:7070", "ops:***@host:7070"),  # no scheme: a password all the same
        ("http://host:7070/?token=hunter2&x=1", "http://host:7070/?token=***&x=1"),
        ("http://ops@host:7070", "http://ops@host:7070"),  # a user alone is no secret
        ("http://host:7070/a@b", "http://host:7070/a@b"),  # '@' in the path, not userinfo
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        f"http://ops:{SECRET}@host:99999",  # bad port
        f"http://ops:{SECRET}@host:0",
        f"ftp://ops:{SECRET}@host:7070",  # not http
        f"ops:{SECRET}@host:7070",  # no scheme
        f"http://ops:{SECRET}@host:7070",  # sound but for the password
    ],
)
def test_the_inventory_never_echoes_a_password(url: str) -> None:
    problem = url_problem(url)
    assert problem is not None and SECRET not in problem, problem
