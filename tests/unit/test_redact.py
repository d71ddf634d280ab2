"""Secrets never shown: a URL's password, in messages that echo a URL refused for another
reason too (the inventory's checks: a bad port, no scheme)."""

from __future__ import annotations

import re
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

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
    ("url", "shown"),
    [
        # a password as typed, not percent-encoded: not a valid URL, hidden all the same
        ("postgresql://u:pa/ss@host/db", "postgresql://u:***@host/db"),
        ("postgresql://u:pa?ss@host/db", "postgresql://u:***@host/db"),
        ("postgresql://u:pa#ss@host/db", "postgresql://u:***@host/db"),
        ("http://u:p@ss@host:7070/v1", "http://u:***@host:7070/v1"),
        ("redis://:pa/ss@h:6379/0", "redis://:***@h:6379/0"),
        ("u:pa/ss@host:7070", "u:***@host:7070"),
        ("http://u:p/w@[::1]:5432/db", "http://u:***@[::1]:5432/db"),
        ("http://u:pa?token=x@host", "http://u:***@host"),  # not cut at its '?token='
        # the last '@' ends it: a host hidden rather than a password's tail shown
        ("http://u:pa/ss@host/db?x=a@b", "http://u:***@b"),
        # valid URLs with '@' past the authority are shown as they are
        ("http://[::1]/a@b", "http://[::1]/a@b"),
        ("http://[::1]:7070/a@b", "http://[::1]:7070/a@b"),
        ("http://host/?email=a@b.example", "http://host/?email=a@b.example"),
        ("http://u:pw@host/a@b", "http://u:***@host/a@b"),
    ],
)
def test_redact_url_typed_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


_SCHEMES = st.sampled_from(["", "http://", "https://", "postgresql://", "redis://"])
_HOSTS = st.sampled_from(["host", "db.example", "10.0.0.1", "[::1]", "[fd00::7]"])
_PORTS = st.sampled_from(["", ":1", ":5432", ":7070"])
_USERS = st.text(st.sampled_from("abcXYZ09._-~"), max_size=6)
_PATHS = st.text(st.sampled_from("abz09/._-~=&@:"), max_size=12).map(lambda p: "/" + p)
_TAILS = st.one_of(st.just(""), _PATHS)


@given(
    scheme=_SCHEMES,
    user=_USERS,
    # starts with a letter: a password of digits up to a '/' reads as a port, a valid URL; one
    # with an '@' before its first '/', '?' or '#' ends there as a valid URL does
    password=st.text(st.sampled_from("aZ9/?#@:!$%&+,;=*"), max_size=12).map(lambda p: "q" + p),
    host=_HOSTS,
    port=_PORTS,
    tail=_TAILS,
)
def test_a_typed_password_is_never_shown(
    scheme: str, user: str, password: str, host: str, port: str, tail: str
) -> None:
    assume(not re.search("@.*[/?#]", password))
    # a tail with an '@' after a password running past a '/': the host is hidden too
    assume("@" not in tail or not any(c in password for c in "/?#"))
    url = f"{scheme}{user}:{password}@{host}{port}{tail}"
    assert redact_url(url) == f"{scheme}{user}:***@{host}{port}{tail}"


@given(
    scheme=_SCHEMES.filter(bool),
    user=_USERS,
    password=st.one_of(st.none(), st.text(max_size=8)),
    host=_HOSTS,
    port=_PORTS,
    tail=_TAILS,
)
def test_a_valid_url_is_shown_but_for_its_password(
    scheme: str, user: str, password: str | None, host: str, port: str, tail: str
) -> None:
    """Percent-encoded userinfo (a valid URL): shown exactly, its password as ***; a URL
    without one (an '@' in its path) unchanged."""
    if password is None:
        auth = f"{user}@" if user else ""
        url = f"{scheme}{auth}{host}{port}{tail}"
        assert redact_url(url) == url
        return
    url = f"{scheme}{user}:{quote(password, safe='')}@{host}{port}{tail}"
    assert urlsplit(url).password == quote(password, safe="")
    assert redact_url(url) == f"{scheme}{user}:***@{host}{port}{tail}"


@pytest.mark.parametrize(
    "url",
    [
        f"http://ops:{SECRET}@host:99999",  # bad port
        f"http://ops:{SECRET}@host:0",
        f"ftp://ops:{SECRET}@host:7070",  # not http
        f"ops:{SECRET}@host:7070",  # no scheme
        f"http://ops:{SECRET}@host:7070",  # sound but for the password
        f"http://ops:{SECRET}/x@host:7070",  # typed, not encoded: 'ops:hunter2' reads as host:port
        f"http://ops:{SECRET}#x@host:7070",
        f"http://ops:x/{SECRET}@host:7070",
    ],
)
def test_the_inventory_never_echoes_a_password(url: str) -> None:
    problem = url_problem(url)
    assert problem is not None and SECRET not in problem, problem


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://h/db?sslpassword=hunter2", "postgresql://h/db?sslpassword=***"),
        ("http://h/?api_token=hunter2&x=1", "http://h/?api_token=***&x=1"),
        ("http://h/?client_secret=hunter2", "http://h/?client_secret=***"),
        ("http://h/?PassWord=hunter2#f", "http://h/?PassWord=***#f"),
        ("http://h/?sslmode=prefer&x=hunter", "http://h/?sslmode=prefer&x=hunter"),
    ],
)
def test_query_keys_naming_a_secret_are_hidden(url: str, shown: str) -> None:
    assert redact_url(url) == shown
