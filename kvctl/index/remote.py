"""The index behind a router, over HTTP: what an agent asks instead of probing every peer.

Read-only (``holders`` and ``nodes``): the router's followers are the index's only writers.
Every failure raises ``IndexUnavailable``, so a caller falls back to probing its peers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvctl import json_text
from kvctl.bearer import bearer_headers, token_problem
from kvctl.errors import KvctlError
from kvctl.index.events import MAX_COUNT, ChunkEvent
from kvctl.index.model import Holding, NodeCheck

#: an agent asks on a lookup's path: a slow router must cost it little. One read waits this
#: long at most, and a whole call (every request of it: headers and body, each of its
#: ``MAX_KEYS`` parts) ``DEFAULT_DEADLINE_S``: a router trickling its answer a byte at a time,
#: each within the read timeout, must not hold a lookup for as long as it trickles
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_DEADLINE_S = 0.5
#: the longest answer read (a holders answer of MAX_KEYS keys, each held by a few nodes and
#: tiers, is well under 1 MiB); a longer one is the index's failure, not read on
MAX_ANSWER_BYTES = 32 << 20
#: keys per request (the router's limit too)
MAX_KEYS = 4096


class IndexUnavailable(KvctlError):
    """The router did not answer, or answered something that is not an index answer."""


class IndexClient:
    """``FleetIndex``'s read side at a router's URL (``/v1/index/holders``, ``/v1/index``)."""

    kind = "remote"

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        import httpx  # only an agent configured with an index needs it

        from kvctl.deadline_transport import BoundedTransport
        from kvctl.redact import redact_url

        self.url = url.rstrip("/")
        #: what errors name: the URL may carry a password (``http://user:PASSWORD@router``)
        self._shown = redact_url(self.url)
        self._token_problem = token_problem(token, "the index token")
        self._httpx = httpx
        self.deadline_s = float(deadline_s)
        transport = BoundedTransport(
            deadline_s=self.deadline_s,
            max_answer_bytes=MAX_ANSWER_BYTES,
            verify=self.url.startswith("https://"),
        )
        self._http = httpx.Client(
            base_url=self.url,
            headers=bearer_headers(token),
            timeout=timeout_s,
            transport=transport,
        )

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        if self._token_problem:
            raise IndexUnavailable(f"index at {self._shown}: {self._token_problem}")
        try:
            r = self._http.request(method, path, **kw)
        except self._httpx.HTTPError as exc:
            raise IndexUnavailable(f"index at {self._shown} did not answer: {exc}") from exc
        except KvctlError as exc:  # the transport's AnswerTooLarge
            raise IndexUnavailable(f"index at {self._shown}: {exc}") from exc
        if r.status_code != 200:
            said = r.text[:200]
            raise IndexUnavailable(f"index at {self._shown} answered {r.status_code}: {said}")
        try:
            return json_text.loads(r.content)
        except ValueError as exc:
            raise IndexUnavailable(f"index at {self._shown} sent no JSON") from exc

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        """Each key's holders; all of them within ``deadline_s`` (``IndexUnavailable`` past
        it, as for any failure)."""
        from kvctl.deadline_transport import within

        with within(self.deadline_s):
            return self._holders(keys, tenant=tenant)

    def _holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        out: list[list[Holding]] = []
        for start in range(0, len(keys), MAX_KEYS):
            part = keys[start : start + MAX_KEYS]
            body = {"keys": [k.hex() for k in part], "tenant": tenant}
            reply = self._json("POST", "/v1/index/holders", json=body)
            try:
                rows = reply["holders"]
                if len(rows) != len(part):
                    raise ValueError(f"{len(rows)} answers for {len(part)} keys")
                out.extend(
                    [
                        Holding(
                            str(h["node"]),
                            str(h["tier"]),
                            _count(h["size_bytes"]),
                            _count(h["tokens"]),
                        )
                        for h in row
                    ]
                    for row in rows
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise IndexUnavailable(f"index at {self._shown} sent a bad answer: {exc}") from exc
        return out

    def nodes(self) -> dict[str, int]:
        reply = self._json("GET", "/v1/index")
        try:
            return {str(k): _count(v) for k, v in reply["nodes"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexUnavailable(f"index at {self._shown} sent a bad answer: {exc}") from exc

    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def drop(self, node: str) -> int:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def marker(self, node: str) -> str | None:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def purge(self, node: str) -> int:
        raise IndexUnavailable("a remote index is read-only: its router's followers write it")

    def close(self) -> None:
        self._http.close()


def _count(value: object) -> int:
    """A count of the router's answer as the index holds them (0 to an int64's, JSON's own
    integers): int() took "16", true and 2.5, a negative one as it came, and raised
    OverflowError for 1e400, out of the agent's lookup."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"not a count: {value!r:.40}")
    return value
