"""One place that turns an index setting (a config value, a CLI option) into a FleetIndex."""

from __future__ import annotations

from kvctl.errors import InvalidArgument
from kvctl.index.model import EmbeddedIndex, FleetIndex

#: what ``open_index`` accepts, for help texts and errors
FORMS = "'embedded', redis://HOST[:PORT][/DB], rediss://..., unix:///PATH[?db=N] (or valkey[s]://)"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def open_index(spec: str, *, prefix: str | None = None) -> FleetIndex:
    """``"embedded"``: an ``EmbeddedIndex`` of this process; a Redis URL: a ``RedisIndex``
    there, under ``prefix`` (``redis_index.DEFAULT_PREFIX`` when None). InvalidArgument for
    anything else."""
    if not isinstance(spec, str):
        raise InvalidArgument(f"index must be {FORMS}, got {spec!r:.60}")
    if spec.strip().lower() == "embedded":
        return EmbeddedIndex()
    if spec.lower().startswith(_REDIS_SCHEMES):
        # imported here: an embedded index needs no Redis client
        from kvctl.index.redis_index import DEFAULT_PREFIX, RedisIndex

        return RedisIndex(spec, prefix=DEFAULT_PREFIX if prefix is None else prefix)
    from kvctl.redact import redact_url

    raise InvalidArgument(f"index must be {FORMS}, got {redact_url(spec)!r}")
