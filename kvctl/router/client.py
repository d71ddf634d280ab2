"""A small client of the router's API, for the CLI and for schedulers that ask it where to send
a request. (Agents read the index through ``kvctl.index.remote.IndexClient``.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvctl import json_text
from kvctl.bearer import bearer_headers, token_problem
from kvctl.errors import KvctlError
from kvctl.redact import redact_url

if TYPE_CHECKING:
    import httpx

DEFAULT_URL = "http://127.0.0.1:9480"
DEFAULT_TIMEOUT_S = 5.0


class RouterClientError(KvctlError):
    """The router did not answer, refused the request (the reason is its ``detail``), or sent
    something that is not the router's answer."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        #: the HTTP status when the router answered (None: it did not)
        self.status = status


class RouterTokenError(RouterClientError):
    """The token cannot be sent (``kvctl.bearer.token_problem``): the router was not asked."""


class RouterWrongAnswer(RouterClientError):
    """An answer in JSON that is not the router's (another API at the URL): not a router that
    did not answer."""


class RouterNotTls(RouterClientError):
    """An https:// URL whose server answered in plain HTTP (a router, or something else): up,
    at the wrong scheme, not a router that did not answer."""


def _first_line(text: str, limit: int = 200) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


class RouterClient:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport``: httpx's transport for the requests (the collector's shuts down the
        connection of a request it gave up on); its TLS settings are its own."""
        import httpx

        self.url = url.rstrip("/")
        #: what errors show: the URL without its password (user:***@host)
        self.shown_url = redact_url(self.url)
        #: raised by every request (a RouterClientError, as callers catch): httpx's own refusal
        #: of such a header quotes it, token and all, and a non-ASCII one raised past callers
        self._token_problem = token_problem(token, "the router token")
        headers = bearer_headers(token)
        self._httpx = httpx
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        if self._token_problem:
            raise RouterTokenError(self._token_problem)
        try:
            r = self._http.request(method, path, **kw)
        except self._httpx.HTTPError as exc:
            from kvctl.client import plain_http_answer

            if plain_http_answer(exc):  # up, speaking HTTP: "did not answer, start it" misleads
                plain = "http://" + self.shown_url.removeprefix("https://")
                raise RouterNotTls(
                    f"{self.shown_url} answered in plain HTTP, not TLS: the router serves plain "
                    f"HTTP, so give {plain} (https:// only through a TLS proxy in front of it)"
                ) from exc
            # httpx's message may quote the URL, user info and all
            text = str(exc).replace(self.url, self.shown_url)
            raise RouterClientError(
                f"the router at {self.shown_url} did not answer: {text}"
            ) from exc
        try:
            body = json_text.loads(r.content)
        except ValueError:
            body = None
        if r.status_code != 200:
            detail = body.get("detail") if isinstance(body, dict) else None
            if isinstance(detail, list):  # a validation error: name the first bad field
                first = detail[0] if detail and isinstance(detail[0], dict) else {}
                where = first.get("loc")  # a list from the router; anything from something else
                parts: list[Any] = where if isinstance(where, list) else []
                loc = ".".join(str(p) for p in parts if p != "body")
                detail = f"{loc}: {first.get('msg', '')}" if loc else first.get("msg")
            # a web page's first line, not 200 characters of it over many lines
            text = detail if detail else _first_line(r.text) or "empty body"
            raise RouterClientError(
                f"the router answered {r.status_code}: {text}", status=r.status_code
            )
        if not isinstance(body, dict):
            raise RouterClientError(
                f"{self.shown_url} did not answer as a kvctl router (no JSON object)"
            )
        return body

    def route(
        self,
        *,
        tenant: str = "",
        keys: Sequence[bytes | str] | None = None,
        tokens: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
        origin_dc: str | None = None,
        policy: str = "cost",
        session: str | None = None,
        explain: bool = False,
    ) -> dict[str, Any]:
        """The router's decision for a prompt given as chunk keys or as token ids."""
        body: dict[str, Any] = {"tenant": tenant, "policy": policy, "explain": explain}
        if keys is not None:
            body["keys"] = [k.hex() if isinstance(k, bytes) else k for k in keys]
        if tokens is not None:
            body["tokens"] = list(tokens)
        for name, value in (
            ("prompt_tokens", prompt_tokens),
            ("origin_dc", origin_dc),
            ("session", session),
        ):
            if value is not None:
                body[name] = value
        return self._having(self._json("POST", "/v1/route", json=body), "/v1/route", "node")

    def stats(self) -> dict[str, Any]:
        return self._having(self._json("GET", "/v1/stats"), "/v1/stats", "decisions")

    def index(self) -> dict[str, Any]:
        return self._having(self._json("GET", "/v1/index"), "/v1/index", "nodes", "followers")

    def _having(self, answer: dict[str, Any], path: str, *keys: str) -> dict[str, Any]:
        """``answer``, which names ``keys`` as the router's does; else RouterWrongAnswer:
        another JSON API's answer failed as "a bug in kvctl" (a KeyError) where rendered."""
        missing = [key for key in keys if key not in answer]
        if missing:
            raise RouterWrongAnswer(
                f"{self.shown_url}{path} did not answer as a kvctl router does (no "
                f"{', '.join(missing)})"
            )
        return answer

    def forget(self, node: str) -> dict[str, Any]:
        """Drop a node's index entries (``Router.forget``): {node, dropped: {name: entries},
        entries}."""
        return self._json("POST", "/v1/index/forget", json={"node": node})

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/health")

    def info(self) -> dict[str, Any]:
        return self._json("GET", "/v1/info")
