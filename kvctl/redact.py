"""Secrets out of URLs before they are shown: status lines, listings, logs, error messages.
Pure Python, at the bottom of the layers, so the fleet database's checks use it too."""

from __future__ import annotations

import re

_QUERY_SECRET = re.compile(r"(?i)([?&](?:password|pass|token)=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` with any password (``user:PASSWORD@`` or a ``password=`` query) as ``***``, for
    status lines, listings and logs; without a scheme too (``user:PASSWORD@host:port``, a URL
    given without its ``http://``)."""
    url = _QUERY_SECRET.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url
    auth, _, host = netloc.rpartition("@")
    if ":" not in auth:
        return url
    user = auth.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{host}{slash}{path}"
