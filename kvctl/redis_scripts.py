"""Lua scripts by SHA (EVALSHA), sent whole (EVAL) only where that cannot be: one mechanism for
the shared pool (``kvctl.remote.redis_pool``) and the fleet index (``kvctl.index.redis_index``).

An EVALSHA answered NOSCRIPT (a restart, ``SCRIPT FLUSH``, a failover) or NOPERM for the EVALSHA
command itself (a user the ACL allows EVAL only) ran nothing, so it is sent again as EVAL. A
denied user is remembered by its ``ShaGate``: the scripts go as EVAL for ``SHA_RETRY_S`` before
SHA is tried again, so the server's ACL LOG holds one denial, not one per call.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError

#: a Redis user the ACL denies EVALSHA (allowed EVAL only) is sent the scripts whole (EVAL), and
#: asked by SHA again this long after: each denial is an error reply and an ACL LOG entry
SHA_RETRY_S = 600.0


@functools.cache
def sha1(script: str) -> str:
    """The SHA-1 a server names ``script`` by (of its UTF-8 bytes, as redis-py sends it)."""
    return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()


def sent_again(reply: object) -> bool:
    """Whether an EVALSHA's ``reply`` says it ran nothing and the call goes again as EVAL:
    NOSCRIPT, or NOPERM for the EVALSHA command itself (a user allowed EVAL only; not a
    denied key, which EVAL is denied as well)."""
    if isinstance(reply, NoScriptError):
        return True
    return isinstance(reply, NoPermissionError) and "'evalsha'" in str(reply).lower()


class ShaGate:
    """Whether one pool's or index's scripts go by SHA now: not for ``SHA_RETRY_S`` after its
    Redis user was denied EVALSHA. ``what`` names the owner in the warning (read when said: an
    owner may learn its address after making its gate)."""

    def __init__(self, what: Callable[[], str], logger: logging.Logger) -> None:
        self._what = what
        self._log = logger
        self._denied_s: float | None = None

    def by_sha(self) -> bool:
        denied_s = self._denied_s
        return denied_s is None or time.monotonic() - denied_s >= SHA_RETRY_S

    def denied(self) -> None:
        """The server denied this user EVALSHA (NOPERM): the scripts go whole for a while,
        said at warning the first time only."""
        first = self._denied_s is None
        self._denied_s = time.monotonic()
        self._log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: the Redis user may not run EVALSHA (its ACL allows EVAL only?); the scripts "
            "are sent whole instead (asked by SHA again every %.0f s): grant +evalsha",
            self._what(),
            SHA_RETRY_S,
        )

    def call(self, client: Any, script: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One call of ``script`` on ``client`` (a redis-py client or cluster): by its SHA
        unless denied; as EVAL where the server does not hold it (which leaves it cached for
        the next) or the user may not run EVALSHA."""
        if self.by_sha():
            try:
                return client.execute_command("EVALSHA", sha1(script), len(keys), *keys, *args)
            except (NoScriptError, NoPermissionError) as exc:
                if not sent_again(exc):
                    raise
                if isinstance(exc, NoPermissionError):
                    self.denied()
        return client.execute_command("EVAL", script, len(keys), *keys, *args)
