"""JSON read from anything kvctl does not control (an answer, a file, a Redis value, a row), where
every way it can fail is a ``ValueError``.

``json.loads`` raises ``RecursionError`` on text nested a few thousand deep (``[[[[...``), which
is not a ``ValueError``: it escaped each caller's ``except ValueError`` as a traceback, so every
caller caught both, in a dozen places. Here it becomes :class:`NestedTooDeep`, a ``ValueError``
that still says which fault it was, for messages that tell the two apart.
"""

from __future__ import annotations

import json
from typing import Any


class NestedTooDeep(ValueError):
    """Valid-looking JSON nested deeper than Python's parser reads."""

    def __init__(self) -> None:
        super().__init__("nested too deep to read")


def loads(text: str | bytes | bytearray) -> Any:
    """``json.loads``, whose failures are all ``ValueError``s: invalid JSON
    (``json.JSONDecodeError``), bytes that are not UTF-8 (``UnicodeDecodeError``) or text nested
    too deep (:class:`NestedTooDeep`)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise NestedTooDeep from None
