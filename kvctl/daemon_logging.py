"""The daemons' log lines (the agent's ``agent.log`` or journald, the router's stderr): one
record, one line.

A record's message can carry text from the other end of a connection: a probed target's error
frame, a peer's or pool's failure, a client's bad input. A newline in it would start what reads
as a record of its own, a forged "CRITICAL" line in the operator's log, and a stray carriage
return or escape sequence can hide text from a terminal. The message's control characters are
written escaped (``\\n``, ``\\x1b``); a traceback the record carries still follows on lines of
its own, as Python writes it.
"""

from __future__ import annotations

import logging
import re

#: how a line starts: ``_LOG_LINE`` in ``kvctl.cli.agent`` reads the agent's lines this way
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# C0 and C1 controls but tab, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\r``, ``\\xNN``, ``\\uNNNN``)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m[0]) or ascii(m[0])[1:-1], text)


class OneLineFormatter(logging.Formatter):
    """A formatter whose records' messages are one line each (:func:`one_line`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (a message's trailing newline, as some libraries write, starts no record)
        record.message = one_line(record.message.rstrip("\r\n"))
        return super().formatMessage(record)


def configure(level: str) -> None:
    """The root logger writing one-line records to stderr at ``level``, as a daemon logs
    (``logging.basicConfig`` with :class:`OneLineFormatter`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LINE_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
