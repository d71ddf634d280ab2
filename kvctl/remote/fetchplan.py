"""Fetch or recompute: which of a request's chunks beyond the local prefix to fetch, and from where.

The candidates are the chain's chunks right after the locally cached prefix, in chain order. KV is
reusable only for an exact prefix, so chunk i helps only if every chunk before it is used too: a
plan fetches the first k candidates (each from one source) and recomputes the rest.

- A chunk's usable sources are those named in ``links`` whose override is not ``recompute`` and
  whose figures are known (an uncosted link is usable only when overridden ``fetch``). The
  candidate range (K chunks) ends at the first chunk with no usable source.
- Per chunk, the source with the smallest transfer time (bytes / bandwidth) wins; ties go to the
  smaller RTT, then the name. A forced uncosted link is chosen only where no costed one serves
  the chunk, since its cost cannot be compared.
- Links are fetched in parallel, one batched request each, so
  ``fetch_s(k) = max over links used in the first k of (rtt + bytes_from_link / bandwidth)`` and
  ``recompute_s(k) = tokens of the first k / prefill tokens per second``.
- k maximises ``saved_s(k) = recompute_s(k) - fetch_s(k)``; ties go to the larger k, and k = 0
  unless some k saves time (> 0). Operator override: the leading chunks whose chosen source is
  overridden ``fetch`` are always fetched (all K when every chunk's is), and k grows past them
  only where that saves more than stopping there.

For a single chunk this is the design's rule (design.md section 3, ``kvctl.workload.plan``):
fetch when ``rtt + chunk_bytes / bandwidth < chunk_tokens / prefill_tokens_per_second``. Over a
batch the RTT is paid once per link, so several chunks can be worth fetching where one is not.

O(K + total sources): the sums are incremental and, since a link's time only grows as chunks
are added, the max over links is kept incrementally too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvctl.remote.links import Link
from kvctl.store.errors import InvalidArgument

if TYPE_CHECKING:
    from kvctl.workload.profiles import ModeledInputs

Reason = Literal[
    "fetch",  # the chosen k saves time
    "override",  # chunks fetched because the operator forces their links
    "no-candidates",  # nothing beyond the local prefix
    "no-source",  # the first candidate is available from no known link
    "slower-than-recompute",  # no k saves time: everything is recomputed
    "unknown-link",  # the first candidate's links cannot be costed yet
]


@dataclass(frozen=True)
class Candidate:
    """A chunk of the request's chain beyond the local prefix, and where it can be fetched."""

    #: position in the request's chain
    index: int
    size_bytes: int
    tokens: int
    #: link names where this chunk is available; empty: nowhere
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for what, value in (
            ("index", self.index),
            ("size_bytes", self.size_bytes),
            ("tokens", self.tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"candidate {what} must be an int >= 0, got {value!r}")
        if isinstance(self.sources, str):  # a bare name would be iterated letter by letter
            raise InvalidArgument(f"candidate sources must be a tuple of names: {self.sources!r}")
        object.__setattr__(self, "sources", tuple(self.sources))


@dataclass(frozen=True)
class PrefillRate:
    """How fast this node recomputes: prefill tokens per second, and where the figure came from."""

    tokens_per_s: float
    #: e.g. "modeled: llama-3.1-8b on h100 at MFU 0.5", "measured", "configured"
    basis: str

    def __post_init__(self) -> None:
        rate = self.tokens_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise InvalidArgument(f"prefill tokens_per_s must be a number, got {rate!r}")
        if not math.isfinite(rate) or rate <= 0:
            raise InvalidArgument(f"prefill tokens_per_s must be finite and > 0, got {rate!r}")

    @classmethod
    def modeled(cls, inputs: ModeledInputs) -> PrefillRate:
        return cls(
            inputs.prefill_tokens_per_second,
            f"modeled: {inputs.model.name} on {inputs.gpu.name} at MFU {inputs.mfu:g}",
        )

    def as_dict(self) -> dict[str, object]:
        return {"tokens_per_s": self.tokens_per_s, "basis": self.basis}


@dataclass(frozen=True)
class FetchPlan:
    """The decision for one request, with the inputs it was made from."""

    #: (chain index, link name) of each chunk to fetch, in chain order: always a prefix
    fetch: tuple[tuple[int, str], ...]
    #: candidates not fetched (recomputed)
    recompute: int
    #: modeled time to fetch the chosen chunks (parallel links, one batch each)
    fetch_s: float
    #: modeled time recomputing the chosen chunks would have taken
    recompute_s: float
    saved_s: float
    reason: Reason
    #: Link.as_dict() of each link the candidates named
    links: dict[str, dict[str, object]]
    #: tokens_per_s and basis
    prefill: dict[str, object]
    per_link_bytes: dict[str, int]
    #: modeled time of each link's batch in the plan (the fetch is their max)
    per_link_s: dict[str, float] = field(default_factory=dict)
    #: candidates that had a usable source (K): the plan could fetch at most this many
    usable: int = 0
    #: why the usable range ended before the last candidate ("no-source", "unknown-link",
    #: "override"); None when every candidate was usable
    stopped_by: Reason | None = None
    #: links in the plan whose figures are unknown (forced by override; they count 0 s)
    uncosted_links: tuple[str, ...] = ()

    @property
    def fetched_indices(self) -> tuple[int, ...]:
        return tuple(index for index, _ in self.fetch)

    @property
    def source_by_index(self) -> dict[int, str]:
        return dict(self.fetch)

    def as_dict(self) -> dict[str, object]:
        return {
            "fetch": [{"index": index, "link": name} for index, name in self.fetch],
            "recompute": self.recompute,
            "fetch_s": self.fetch_s,
            "recompute_s": self.recompute_s,
            "saved_s": self.saved_s,
            "reason": self.reason,
            "usable": self.usable,
            "stopped_by": self.stopped_by,
            "uncosted_links": list(self.uncosted_links),
            "links": {name: dict(d) for name, d in self.links.items()},
            "prefill": dict(self.prefill),
            "per_link_bytes": dict(self.per_link_bytes),
            "per_link_s": dict(self.per_link_s),
        }


def _usable(link: Link) -> bool:
    if link.override == "recompute":
        return False
    return link.costed or link.override == "fetch"


def _choose(candidate: Candidate, links: Mapping[str, Link]) -> str | None:
    """The chunk's cheapest usable source, or None when it has none."""
    best: tuple[int, float, float, str] | None = None
    for name in candidate.sources:
        link = links.get(name)
        if link is None or not _usable(link):
            continue
        transfer_s = link.transfer_s(candidate.size_bytes)
        if transfer_s is not None and link.rtt_s is not None:
            key = (0, transfer_s, link.rtt_s, name)
        else:  # forced but uncosted: only where nothing comparable serves the chunk
            key = (1, 0.0, 0.0, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[3]


def _blocked_by(candidate: Candidate, links: Mapping[str, Link]) -> Reason:
    """Why a chunk has no usable source. An override is the operator's deliberate choice, so it
    is named before an unknown link."""
    known = [links[name] for name in candidate.sources if name in links]
    if any(link.override == "recompute" for link in known):
        return "override"
    if known:
        return "unknown-link"
    return "no-source"


def plan_fetch(
    candidates: Sequence[Candidate], links: Mapping[str, Link], prefill: PrefillRate
) -> FetchPlan:
    """Decide which prefix of ``candidates`` to fetch and from which links (see the module)."""
    previous: int | None = None
    for candidate in candidates:
        # a gap would make a later chunk look usable without the one before it
        if previous is not None and candidate.index != previous + 1:
            raise InvalidArgument(
                f"candidates must be consecutive chain positions in order: {candidate.index} "
                f"follows {previous}"
            )
        previous = candidate.index
    for name, link in links.items():
        if link.name != name:
            raise InvalidArgument(f"link {link.name!r} is filed under {name!r}")

    named = {name for candidate in candidates for name in candidate.sources if name in links}
    link_dicts = {name: links[name].as_dict() for name in sorted(named)}
    prefill_dict = prefill.as_dict()

    # One pass over the usable range: chosen sources, per-link bytes and times, the running max.
    chosen: list[str] = []
    link_bytes: dict[str, int] = {}
    fetch_s = 0.0
    tokens = 0
    forced_floor = 0  # leading chunks whose chosen link is overridden "fetch"
    floor_saved_s = 0.0
    best_k, best_saved_s, best_fetch_s, best_recompute_s = 0, 0.0, 0.0, 0.0
    stopped_by: Reason | None = None
    for k, candidate in enumerate(candidates, start=1):
        name = _choose(candidate, links)
        if name is None:
            stopped_by = _blocked_by(candidate, links)
            break
        link = links[name]
        chosen.append(name)
        link_bytes[name] = link_bytes.get(name, 0) + candidate.size_bytes
        link_s = link.fetch_s(link_bytes[name])
        if link_s is not None:  # an uncosted (forced) link counts 0 s: flagged in the plan
            fetch_s = max(fetch_s, link_s)
        tokens += candidate.tokens
        recompute_s = tokens / prefill.tokens_per_s
        saved_s = recompute_s - fetch_s
        if forced_floor == k - 1 and link.override == "fetch":
            forced_floor = k
            floor_saved_s = saved_s
            best_k, best_saved_s, best_fetch_s, best_recompute_s = k, saved_s, fetch_s, recompute_s
        elif saved_s > floor_saved_s and saved_s >= best_saved_s:
            best_k, best_saved_s, best_fetch_s, best_recompute_s = k, saved_s, fetch_s, recompute_s
    usable = len(chosen)

    fetch = tuple((candidates[i].index, chosen[i]) for i in range(best_k))
    per_link_bytes: dict[str, int] = {}
    for i in range(best_k):
        name = chosen[i]
        per_link_bytes[name] = per_link_bytes.get(name, 0) + candidates[i].size_bytes
    per_link_s: dict[str, float] = {}
    for name, nbytes in per_link_bytes.items():
        link_s = links[name].fetch_s(nbytes)
        per_link_s[name] = 0.0 if link_s is None else link_s
    uncosted = tuple(sorted(name for name in per_link_bytes if not links[name].costed))

    reason: Reason
    if not candidates:
        reason = "no-candidates"
    elif usable == 0:
        reason = stopped_by or "no-source"
    elif best_k == 0:
        reason = "slower-than-recompute"
    elif best_k == forced_floor:
        reason = "override"
    else:
        reason = "fetch"
    return FetchPlan(
        fetch=fetch,
        recompute=len(candidates) - best_k,
        fetch_s=best_fetch_s,
        recompute_s=best_recompute_s,
        saved_s=best_saved_s,
        reason=reason,
        links=link_dicts,
        prefill=prefill_dict,
        per_link_bytes=per_link_bytes,
        per_link_s=per_link_s,
        usable=usable,
        stopped_by=stopped_by,
        uncosted_links=uncosted,
    )
