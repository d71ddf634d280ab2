"""Where a prompt's chunks are cached: each node's agent computes the prompt's keys for its own
model and says which tier holds each one, counting nothing in its hit statistics."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvctl.client import AgentClient, NotAnAgent, first_line
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.fanout import NodeResult, fan_out, read_deadline_s


@dataclass(frozen=True, slots=True)
class NodeLookup:
    node: str
    dc: str
    ok: bool
    error: str | None
    total_chunks: int
    matched_chunks: int
    matched_tokens: int
    #: (key, tier or None) for every chunk of the prompt, in order
    chunks: tuple[tuple[str, str | None], ...]

    @property
    def cached_chunks(self) -> int:
        """Chunks held anywhere, also past the usable prefix."""
        return sum(tier is not None for _key, tier in self.chunks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "dc": self.dc,
            "ok": self.ok,
            "error": self.error,
            "total_chunks": self.total_chunks,
            "matched_chunks": self.matched_chunks,
            "matched_tokens": self.matched_tokens,
            "cached_chunks": self.cached_chunks,
            "chunks": [{"index": i, "key": k, "tier": t} for i, (k, t) in enumerate(self.chunks)],
        }


def lookup_prompt(
    nodes: Sequence[NodeInfo],
    tokens: Sequence[int] | None = None,
    *,
    keys: Sequence[str] | None = None,
    model: str | None = None,
    tenant: str = "",
    token: str | None = None,
    timeout_s: float = 5.0,
    on_result: Callable[[NodeResult[dict[str, Any]]], None] | None = None,
) -> list[NodeLookup]:
    """Ask every node at once about a prompt's chunks (``tokens``: each node keys them for its
    model) or a chain of ``keys`` as given; a node that does not answer is reported with its
    error."""
    if (tokens is None) == (keys is None):
        raise ValueError("give tokens or keys, not both")
    ids = None if tokens is None else list(tokens)
    chain = None if keys is None else list(keys)

    def ask(c: AgentClient) -> dict[str, Any]:
        answer = c.lookup(tokens=ids, keys=chain, model=model, tenant=tenant, count=False)
        return _checked(c.url, answer)

    results = fan_out(
        nodes,
        ask,
        token=token,
        timeout_s=timeout_s,
        on_result=on_result,
        deadline_s=read_deadline_s(timeout_s),
    )
    out = []
    for r in results:
        v = r.value or {}
        out.append(
            NodeLookup(
                r.node.name,
                r.node.dc,
                r.ok,
                r.error,
                v.get("total_chunks", 0),
                v.get("matched_chunks", 0),
                v.get("matched_tokens", 0),
                tuple((c["key"], c["tier"]) for c in v.get("chunks", [])),
            )
        )
    return out


def _checked(url: str, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` if it is an agent's lookup answer (its counts, and a key and a tier or null
    for every chunk). Checked in the node's call, so another answer is that node's failure:
    ``{}`` passed as a node holding nothing, and a chunk without its tier crashed the command
    for every node asked."""

    def count(v: Any) -> bool:
        return type(v) is int and v >= 0  # (a bool is no count)

    chunks = answer.get("chunks")
    if not (
        all(count(answer.get(k)) for k in ("total_chunks", "matched_chunks", "matched_tokens"))
        and isinstance(chunks, list)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("key"), str)
            and "tier" in c
            and (c["tier"] is None or isinstance(c["tier"], str))
            for c in chunks
        )
    ):
        shown = first_line(json.dumps(answer, default=str))[:120]
        raise NotAnAgent(f"{url} answered a lookup with {shown}: not a kvctl agent's answer")
    return answer
