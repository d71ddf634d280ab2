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


_REQUEST_THEN_WARN = """
import http.server, logging, sys, threading
import httpx
from kvctl import daemon_logging

daemon_logging.configure(sys.argv[1])
server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
server.RequestHandlerClass.log_message = lambda *a: None
threading.Thread(target=server.serve_forever, daemon=True).start()
httpx.get(f"http://127.0.0.1:{server.server_port}/nothing-here")
logging.getLogger("httpx").warning("a warning of the client's")
logging.getLogger("kvctl.agent").info("the daemon's own line")
server.shutdown()
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_daemon_logs_no_line_per_http_request_above_debug(level: str) -> None:
    """A soak review found an agent with --index-url writing httpx's 'HTTP Request: POST
    .../v1/index/holders' at info for every lookup it asked the index about: ~600 lines a
    minute per agent under load, the whole of its log (the router quieted its own polls, the
    agent did not). Above debug a daemon keeps the clients' warnings and its own lines; at
    debug the request lines are back."""
    log = _daemon_log(_REQUEST_THEN_WARN, level)
    assert "a warning of the client's" in log and "the daemon's own line" in log, log
    assert ("HTTP Request: GET" in log) == (level == "debug"), log


_CLIENT_WARNS_AND_ERRS = """
import logging, sys
from kvctl import daemon_logging

daemon_logging.configure(sys.argv[1])
for name in daemon_logging.QUIET_BELOW_DEBUG:
    logging.getLogger(name).warning("a warning of %s", name)
    logging.getLogger(name).error("an error of %s", name)
logging.getLogger("kvctl.agent").warning("the daemon's own warning")
"""


def test_quieting_the_http_clients_never_lets_through_what_the_level_leaves_out() -> None:
    """At --log-level error a daemon writes errors only, the HTTP clients' too: quieting them
    to WARNING had lowered their threshold below the root's (a logger's records are checked
    against its own level only), so their warnings were written at error."""
    log = _daemon_log(_CLIENT_WARNS_AND_ERRS, "error")
    assert "an error of httpx" in log and "an error of httpcore" in log, log
    assert "a warning of" not in log and "the daemon's own warning" not in log, log


def _daemon_log(script: str, level: str) -> str:
    """What ``script`` (a daemon's logging configured at ``level``, its argv[1]) writes to
    stderr, run in a process of its own: logging's set-up is per process."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, level],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stderr
