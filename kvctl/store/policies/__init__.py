"""Eviction and admission policies, pluggable per tier, one module each.

A policy tracks the unpinned entries of one tier and names the next victim; the store does the
moving. Pinned entries are withdrawn from their policy while pinned, so no policy can pick them.

Eviction policies:
- ``lru``: least recently used. The baseline.
- ``lineage-lru``: leaf-first LRU. A chunk is only reachable through its whole prefix, so a parent
  is never chosen while one of its children is cached; among leaves, least recently used first.
- ``priority``: lowest retention priority first (0..100, like TensorRT-LLM's KV retention config),
  LRU within a priority; a priority given with a retention duration reverts to the default (35)
  when the duration ends.
- ``lineage-gdsf``: our own. Leaf-first Greedy-Dual-Size-Frequency: a leaf's value is
  ``L + frequency x recompute_cost / size`` where ``L`` rises to each victim's value (so old
  popularity ages out), the recompute cost grows with prefix depth (attention over a longer
  prefix), and chunks hit by several tenants get a spread bonus. See ``LineageGDSFPolicy``.
- ``lineage-lru2``: our own, the agent's default until ``lineage-adaptive`` took over (and still
  its cheaper choice). Leaf-first LRU-2: a leaf ranks by the time of its previous access (its
  second-to-last), so chunks used only once (within
  a remembered history of recently seen keys, evicted ones included) go before any reused chunk,
  and among reused chunks the one whose previous use is oldest goes first. A long scan of new
  chunks therefore cannot flush the reused working set. See ``LineageLRU2Policy``.
- ``lineage-arc``: our own. Leaf-first ARC: chunks seen once and chunks seen again in two lists,
  the split between them moved by ghost hits (a chunk that comes back soon after one list evicted
  it says that list should have been larger), so the balance of recency and frequency follows the
  workload. Never takes the chunk stored last while another leaf is left. On the whole Mooncake
  trace it leads ``lineage-lru2`` from 2% to 20% of the unique blocks (42.1% of Belady against
  40.2% at 5%, 55.0% against 52.9% at 10%) and ties at 50%, but trails it at 1% and on some
  generators (rag at 5-10%, builtin at 1%) and trails ``lineage-lru`` on chat at 2-20%, so it is
  not the default. See ``LineageARCPolicy``.
- ``lineage-adaptive``: our own. Runs ``lineage-chain``, ``lineage-arc`` and ``lineage-lru`` on
  metadata-only shadow caches of the tier's size fed the same accesses, and the tier follows the
  candidate whose shadow leads the current one by a significant number of hits where they differ
  (evicting first what that shadow already dropped, so it converges to it after a switch). More
  robust than any one policy across workloads: level with the best of its candidates on the
  builtin and rag generators at every size, within 1.3 points on chat and 0.5 on the
  multi-tenant mix (up to 4.1 behind on the tiny system-prompt one, 501 unique blocks; the
  research ``lineage-learned-arc`` leads it by up to 1.5, on rag at 20%), far ahead of
  ``lineage-lru2`` on chat (99.6% of Belady against 78.2% at 10%). But a switch costs hits while
  the tier's content turns over: on the Mooncake trace it trails ``lineage-lru2`` by 0.7 at 1%
  and ``lineage-chain`` by 1.1 at 10% (42.1% of Belady at 5%, against 43.3% for
  ``lineage-learned-arc``). It costs 2 x 3 policy updates per access (in the simulator 6-12k
  decisions/s on the trace against 36-58k for ``lineage-lru2``; in the agent about 1.4 ms against
  0.3 ms per 64-chunk lookup and lease, measured with ``lineage-lru2`` as its first candidate,
  which costs the same). The agent's default: where it trails, it trails least. See
  ``LineageAdaptivePolicy``.
- ``lineage-learned-arc``: our own, research (issue 26). ``lineage-arc`` whose victim among
  chunks seen once is picked by a reuse model trained online from the tier's own history
  (LRB-style: a logistic model over bucketed features a KV cache knows, such as access count,
  gaps, age, depth, whether the request went on past the chunk, children, the parent's reuse;
  seeded samples of 64 leaves). On the Mooncake trace the best policy from 5% to 50% of the
  unique blocks (43.3% of Belady at 5% against 42.1% for ``lineage-arc``, 56.2% against 55.0%
  at 10%), at or above ``lineage-arc`` nearly everywhere on the generators, but it keeps
  ``lineage-arc``'s losses (1% of the trace and of builtin, chat at 5-20%): not the default.
  See ``LineageLearnedARCPolicy``.
- ``lineage-chain``: our own, research (issue 26). ``lineage-lru2`` that tells a conversation's
  next turn from a new prompt: a chunk stored under a reused chain's end (its parent reused and
  with no full child before) takes the parent's previous access as its own, as do the chunks
  after it in that request, so a new turn ranks with its chain instead of with chunks seen once;
  a new branch under a chunk that has a full child (a new question on a shared prefix), or one
  stored by another tenant than the chain's end, does not. Partial chunks go first and are never
  a chain's child. Far ahead of ``lineage-lru2`` on chat (94.0% of Belady against 75.2% at 5%)
  and the multi-tenant ``mix`` (the best policy there at 1-2%), at or above it on rag, at most
  0.05 behind on the Mooncake trace, behind it on builtin at 1% (0.55) and chat at 50% (1.2).
  Not the default on its own (``lineage-lru`` leads it on chat at 5-50%, ``lineage-arc`` on the
  trace at 2-20%) but ``lineage-adaptive``'s first candidate. See ``LineageChainPolicy``.
- ``belady``: the offline optimum (farthest next use first, with bypass), for simulation only: it
  needs an oracle of future accesses.

Admission policies gate a lower tier (``disk``): ``all`` admits everything, ``frequency`` admits a
chunk only once it was accessed at least ``min_accesses`` times (counting accesses from before an
earlier drop), so one-hit chunks do not wear the SSD.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import DEFAULT_PRIORITY
from kvctl.store.policies.adaptive import LineageAdaptivePolicy
from kvctl.store.policies.admission import AdmissionPolicy, FrequencyAdmission
from kvctl.store.policies.arc import LineageARCPolicy
from kvctl.store.policies.base import EvictionPolicy, HeapPolicy
from kvctl.store.policies.belady import BeladyPolicy
from kvctl.store.policies.chain import LineageChainPolicy
from kvctl.store.policies.gdsf import LineageGDSFPolicy
from kvctl.store.policies.learned_arc import LineageLearnedARCPolicy
from kvctl.store.policies.lru import LineageLRUPolicy, LRUPolicy
from kvctl.store.policies.lru2 import LineageLRU2Policy
from kvctl.store.policies.priority import PriorityPolicy

T = TypeVar("T")

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        LRUPolicy,
        LineageLRUPolicy,
        PriorityPolicy,
        LineageGDSFPolicy,
        LineageLRU2Policy,
        LineageARCPolicy,
        LineageAdaptivePolicy,
        LineageLearnedARCPolicy,
        LineageChainPolicy,
    )
}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (AdmissionPolicy, FrequencyAdmission)
}


def _make(registry: Mapping[str, type[T]], kind: str, name: str) -> T:
    try:
        return registry[name]()
    except KeyError:
        raise InvalidArgument(
            f"unknown {kind} policy {name!r}; choose from {', '.join(registry)}"
        ) from None


def make_eviction_policy(name: str) -> EvictionPolicy:
    return _make(EVICTION_POLICIES, "eviction", name)


def make_admission_policy(name: str) -> AdmissionPolicy:
    return _make(ADMISSION_POLICIES, "admission", name)


__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_PRIORITY",
    "EVICTION_POLICIES",
    "AdmissionPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FrequencyAdmission",
    "HeapPolicy",
    "LRUPolicy",
    "LineageARCPolicy",
    "LineageAdaptivePolicy",
    "LineageChainPolicy",
    "LineageGDSFPolicy",
    "LineageLRU2Policy",
    "LineageLRUPolicy",
    "LineageLearnedARCPolicy",
    "PriorityPolicy",
    "make_admission_policy",
    "make_eviction_policy",
]
