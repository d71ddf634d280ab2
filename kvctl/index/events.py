"""One vocabulary for chunk events, whatever published them (an agent, a vLLM engine)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvctl.errors import InvalidArgument

Kind = Literal["stored", "removed", "cleared"]
KINDS: tuple[Kind, ...] = ("stored", "removed", "cleared")
KEY_BYTES = 16
#: the largest size or token count an event may carry (an int64's): JSON carries integers of
#: any size, and one past a float's range (~1.8e308) failed every route over its chunk with
#: OverflowError (the plan divides bytes by bandwidths, multiplies tokens into seconds)
MAX_COUNT = 2**63 - 1

#: an agent's store event type -> what it means for the index (the chunk is now in ``tier``,
#: or gone); other types (fetch plans, ...) say nothing about where chunks are
_AGENT_KINDS: dict[str, Kind] = {
    "store": "stored",
    "demote": "stored",
    "promote": "stored",
    "move": "stored",
    # found in a tier that came online (a disk tier the agent could not open at start)
    "adopt": "stored",
    "evict": "removed",
}


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """A chunk is now held in ``tier`` (stored), is gone (removed), or every chunk of the
    publisher is gone (cleared: ``key`` is empty)."""

    kind: Kind
    key: bytes = b""
    tier: str = ""
    tenant: str = ""
    isolated: bool = False
    size_bytes: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"event kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "cleared":
            if self.key:
                raise InvalidArgument("a cleared event names no key")
            return
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise InvalidArgument(f"event key must be {KEY_BYTES} bytes, got {self.key!r:.60}")
        if self.kind == "stored" and not self.tier:
            raise InvalidArgument("a stored event names its tier")
        for what in ("size_bytes", "tokens"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise InvalidArgument(
                    f"event {what} must be an int from 0 to {MAX_COUNT}, got {value!r:.40}"
                )

    def visible_to(self, tenant: str) -> bool:
        """Whether ``tenant`` may learn that this chunk exists."""
        return not self.isolated or self.tenant == tenant


def from_agent_event(event: Mapping[str, Any]) -> ChunkEvent | None:
    """The index's view of one agent event; None for events about something else.

    Raises ``InvalidArgument`` for a chunk event that is malformed (a follower counts and skips
    it: one bad event must not stop the stream)."""
    kind = _AGENT_KINDS.get(str(event.get("type", "")))
    if kind is None:
        return None
    return _chunk_event(kind, event, "agent event")


def from_listing(item: Mapping[str, Any]) -> ChunkEvent:
    """A chunk of an agent's key listing (``/v1/keys``) as a stored event, for a resync."""
    return _chunk_event("stored", item, "listed chunk")


def _chunk_event(kind: Kind, chunk: Mapping[str, Any], what: str) -> ChunkEvent:
    """A ``kind`` event of the chunk an agent describes (its events and its key listing name
    the fields alike); ``what`` says which, in the error for a missing or malformed key."""
    try:
        key = bytes.fromhex(str(chunk["key"]))
    except (KeyError, ValueError) as exc:
        raise InvalidArgument(f"{what} without a valid key: {chunk!r:.120}") from exc
    return ChunkEvent(
        kind=kind,
        key=key,
        tier=str(chunk.get("tier") or ""),
        tenant=str(chunk.get("tenant") or ""),
        isolated=bool(chunk.get("isolated", False)),
        size_bytes=_count(chunk.get("size_bytes", 0)),
        tokens=_count(chunk.get("tokens", 0)),
    )


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"expected a count, got {value!r:.40}")
    return value
