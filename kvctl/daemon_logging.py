"""The daemons' log lines (the agent's ``agent.log`` or journald, the router's stderr): one
record, one line.

A record's message can carry text from the other end of a connection: a probed target's error
frame, a peer's or pool's failure, a client's bad input. A newline in it would start what reads
as a record of its own, a forged "CRITICAL" line in the operator's log, and a stray carriage
return or escape sequence can hide text from a terminal. The message's control characters are
written escaped (``\\n``, ``\\x1b``); a traceback the record carries still follows on lines of
its own, as Python writes it.

A URL in a message has its password masked (``kvctl.redact.redact_url``): the router's agent
URLs may carry one, and httpx logs each request's URL whole at debug level.
"""

from __future__ import annotations

import logging
import re

from kvctl.redact import redact_url

#: how a line starts: ``_LOG_LINE`` in ``kvctl.cli.agent`` reads the agent's lines this way
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# C0 and C1 controls but tab, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\r``, ``\\xNN``, ``\\uNNNN``)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or ascii(m[0])[1:-1], text)


# a URL up to the next space or quote: what a log line holds of one
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>]+""")


def without_secrets(text: str) -> str:
    """``text`` with each URL's password (userinfo, or a query key naming one) masked."""
    return _URL.sub(lambda m: redact_url(m[0]), text)


class OneLineFormatter(logging.Formatter):
    """A formatter whose records' messages are one line each (:func:`one_line`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (a message's trailing newline, as some libraries write, starts no record)
        record.message = one_line(without_secrets(record.message.rstrip("\r\n")))
        return super().formatMessage(record)


#: HTTP client libraries that log every request at info: a daemon's own requests (the agent's
#: fleet-index asks, one per lookup; the router's polls, several a second per agent) would
#: write a line each, and their failures are the callers' to report
QUIET_BELOW_DEBUG = ("httpx", "httpcore")


def configure(level: str) -> None:
    """The root logger writing one-line records to stderr at ``level``, as a daemon logs
    (``logging.basicConfig`` with :class:`OneLineFormatter`). Above debug, the HTTP clients'
    request lines (``QUIET_BELOW_DEBUG``) are left out: only their warnings are logged."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LINE_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    root_level = logging.getLogger().getEffectiveLevel()
    if root_level > logging.DEBUG:
        # never below the root's level: a logger's own level is the only one its records are
        # checked against (the root's handlers take what propagates), so WARNING under
        # --log-level error would let the clients' warnings through
        for name in QUIET_BELOW_DEBUG:
            logging.getLogger(name).setLevel(max(logging.WARNING, root_level))
