"""The daemons' log lines (kvctl.daemon_logging): one record a line, and no URL's password,
whatever library logged it."""

from __future__ import annotations

import io
import logging

import pytest

from kvctl.daemon_logging import LINE_FORMAT, OneLineFormatter


@pytest.fixture
def logged() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(LINE_FORMAT))
    logger = logging.getLogger("httpx")  # as httpx logs each request at debug level
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_a_urls_password_is_masked_whoever_logs_it(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    """The router at --log-level debug logged httpx's request lines with its agents' URLs
    whole, credentials included (an adversarial review saw them 5 times a second)."""
    logger, out = logged
    url = "http://bob:AGENTPW@127.0.0.1:19102/v1/events/recent?after=3"
    logger.info('HTTP Request: GET %s "HTTP/1.1 200 OK"', url)
    logger.info("pool at redis://:s3cret@10.0.0.9:6379/0, index https://x/y?token=abc&b=1")
    text = out.getvalue()
    assert "AGENTPW" not in text and "s3cret" not in text and "abc" not in text, text
    assert 'GET http://bob:***@127.0.0.1:19102/v1/events/recent?after=3 "HTTP/1.1 200 OK"' in text
    assert "redis://:***@10.0.0.9:6379/0" in text and "?token=***&b=1" in text


def test_a_record_is_one_line_and_a_traceback_follows_it(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("refused\nFORGED line\x1b[2K\n")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("refused\\nFORGED line\\x1b[2K"), lines[0]
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"
