"""The collector's HTTP answers, read up to a cap: an agent's (router's, engine's) answer longer
than ``MAX_ANSWER_BYTES`` fails that one request, read no further.

httpx reads a whole answer into memory before the SDK parses it: a 200 MB ``/v1/stats``
(an adversarial review's agent) was mostly read and parsed within the scrape's 4 s deadline,
and ``kvctl collect --once`` peaked at 1.57 GB. The deadline bounds the time, not the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import httpx

from kvctl.deadline_transport import answer_framing

#: the longest answer the collector reads. An agent's /v1/stats is a few KB (five tiers at
#: most), its /v1/gpus and /v1/info smaller, a router's /v1/stats about 100 bytes a node, an
#: engine's /metrics page tens to hundreds of KB (vLLM with many models' labels: a few MB)
MAX_ANSWER_BYTES: Final = 8 << 20


class AnswerTooLong(httpx.DecodingError):
    """An answer longer than the cap, or compressed though asked for plain (its size once
    decoded is not the size read). A ``DecodingError``: the agent answered, but not with
    something the collector reads, and every caller reports it so (the SDKs let it out as
    is, and the collector takes it for an unreadable answer; a router's client and the
    engine scrape say what their request got)."""


class _CappedStream(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, cap: int, request: httpx.Request) -> None:
        self._inner = inner
        self._cap = cap
        self._request = request

    def __iter__(self) -> Iterator[bytes]:
        size = 0
        for part in self._inner:
            size += len(part)
            if size > self._cap:
                raise AnswerTooLong(
                    f"answer longer than the {self._cap:,} bytes read: not read",
                    request=self._request,
                )
            yield part

    def close(self) -> None:
        self._inner.close()


class CappedTransport(httpx.BaseTransport):
    """``inner``'s answers, at most ``max_bytes`` of body each (``AnswerTooLong`` past it,
    the connection closed). Answers are asked for unencoded, and one encoded all the same is
    refused: a small compressed answer can decode to gigabytes."""

    def __init__(self, inner: httpx.BaseTransport, max_bytes: int = MAX_ANSWER_BYTES) -> None:
        self._inner = inner
        self.max_bytes = max_bytes

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = self._inner.handle_request(request)
        cap = self.max_bytes
        encoding, declared = answer_framing(response)
        problem = None
        if encoding is not None:
            problem = f"answer encoded {encoding!r} though asked for plain: not read"
        elif declared is not None and declared > cap:
            problem = f"answer of {declared:,} bytes, longer than the {cap:,} read: not read"
        if problem is not None:
            response.close()
            raise AnswerTooLong(problem, request=request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _CappedStream(response.stream, cap, request)
        return response

    def close(self) -> None:
        self._inner.close()
