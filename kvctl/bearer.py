"""The ``Authorization: Bearer`` header the HTTP clients (agent, router, index) send, and why a
token cannot be sent. httpx refuses a header value with control characters by quoting it
(``Illegal header value b'Bearer <the token>\\r'``), so a token read with ``$(cat file)`` from a
file saved with CRLF reached screens and logs in full; a non-ASCII one raised
UnicodeEncodeError past every caller's except. The clients check first and say why without it."""

from __future__ import annotations


def token_problem(token: str | None, what: str) -> str | None:
    """Why ``token`` cannot be sent as a bearer token, never quoting it (``what``: whose token
    it is, e.g. "the router token (KVCTL_ROUTER_TOKEN)"), or None."""
    if token and not (token.isascii() and token.isprintable() and token == token.strip()):
        return (
            f"{what} cannot be sent: it has non-ASCII characters, control characters (a CR "
            "from a file saved with CRLF?) or whitespace at either end"
        )
    return None


def bearer_headers(token: str | None) -> dict[str, str]:
    """The headers that carry ``token`` (none without one, or when ``token_problem`` says it
    cannot be sent: the client raises that instead of sending a request)."""
    if not token or token_problem(token, "") is not None:
        return {}
    return {"Authorization": f"Bearer {token}"}
