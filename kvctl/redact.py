"""Secrets out of URLs before they are shown: status lines, listings, logs, error messages.
Pure Python, at the bottom of the layers, so the fleet database's checks use it too."""

from __future__ import annotations

import re

# any key naming a secret: password, sslpassword (libpq takes both in the query), token,
# api_token, client_secret...
_QUERY_SECRET = re.compile(r"(?i)([?&][^=&#]*(?:pass|token|secret)[^=&#]*=)[^&#]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_AUTHORITY_END = re.compile(r"[/?#]")
# what a URL's authority is when it has no userinfo: a host (or [IPv6]) and a numeric port
_HOST_PORT = re.compile(r"(?:\[[^\]/?#@]*\]|[^:\[\]/?#@]*)(?::[0-9]+)?")
# libpq's keyword/value form ("host=db password=x", what psycopg takes as a DSN), given where a
# URL is wanted: a key naming a secret, its value single-quoted (backslash escapes) and ended
# there, unterminated to the end, else (unquoted, or quoted but running on: 'pa'ss') up to
# the next "key=" after a blank, or the end: a password typed with a blank or a stray quote in
# it is hidden whole, not up to that blank or quote
_KEYWORD_SECRET = re.compile(
    r"(?is)((?:^|(?<=\s))[^\s=]*(?:pass|token|secret)[^\s=]*\s*=\s*)"
    r"(?:'(?:[^'\\]|\\.)*'(?=\s|\Z)|'(?:[^'\\]|\\.)*\Z|.*?(?=\s+[^\s=']+\s*=|\Z))"
)


def redact_url(url: str) -> str:
    """``url`` with any password (``user:PASSWORD@``, or a query key naming a password, token or
    secret: ``password=``, ``sslpassword=``, ``token=``) as ``***``, for
    status lines, listings and logs; without a scheme too (``user:PASSWORD@host:port``, a URL
    given without its ``http://``).

    A password as an operator types it, with a raw ``/``, ``?``, ``#`` or ``@`` (not a valid
    URL: these must be percent-encoded there), is hidden too, up to the last ``@``: a valid URL
    ends its authority at the first ``/``, ``?`` or ``#``, so ``u:pa/ss@host`` would show
    ``pa/ss`` as a host, a bad port and a path. What reads as a valid URL is shown as one
    (``http://host:7070/a@b``): a password of digits up to its ``/`` is such a port."""
    found = _SCHEME.match(url)
    start = found.end() if found else 0
    end_found = _AUTHORITY_END.search(url, start)
    end = end_found.start() if end_found else len(url)
    at = url.rfind("@", start, end)
    if at < 0 and not _HOST_PORT.fullmatch(url, start, end):
        # 'user:pa' is no host:port: the password runs on past a '/', '?' or '#'; to the last
        # '@', as any '@' before it may be the password's own: better a host hidden than that
        at = url.rfind("@", end)
    colon = url.find(":", start, at) if at >= 0 else -1
    if colon >= 0:  # a user alone (no ':') is no secret
        url = f"{url[: colon + 1]}***{url[at:]}"
    # after the userinfo: a password with '?token=' in it is all hidden, not cut there
    return _QUERY_SECRET.sub(r"\1***", url)


def redact_unparsed(text: str) -> str:
    """``text``, which no URL parser read, with its password hidden for the error that says so.
    ``redact_url`` keeps what reads as a valid URL's path (``host/a:b@c``); a text that is no
    URL has no such reading (``postgresql//user:PASSWORD@host/db``, its scheme's ':' left out,
    would show the password), so everything from the first ':' after a scheme to the last '@'
    is hidden: a user or host hidden with it, rather than a password shown. A libpq
    keyword/value string (``host=db password=PASSWORD``) has its secret values hidden too."""
    # the userinfo first: a password holding '&password=' or '?token=' was cut there by the
    # query's redaction, and its head (before the cut) shown as a user's
    found = _SCHEME.match(text)
    start = found.end() if found else 0
    at = text.rfind("@", start)
    colon = text.find(":", start, at) if at >= 0 else -1
    shown = f"{text[: colon + 1]}***{text[at:]}" if colon >= 0 else text
    return _KEYWORD_SECRET.sub(r"\1***", redact_url(shown))
