"""``lineage-chain``: ``lineage-lru2`` that knows a conversation's new turn when it sees one.

``lineage-lru2`` ranks a chunk seen once below every reused chunk. On prefix chains that
misjudges the chunks that matter most: the new tail of a request that extended a reused chain
*end* (the next turn of a conversation) is seen once, yet the turn after will reuse it. On the
Mooncake trace a chain extended one to ten times is extended again 63-90% of the time, against
13% for a chain seen once (turns counted by whole-chain extensions); on the chat generator every
turn but the last is extended. So a chunk stored with no history of its own:

- *extends a chain*, when its parent was reused (has a previous access in the history) and had
  no full child before it: the chunk takes its parent's previous access as its own, as if it had
  been seen with the chain at the conversation's last turn. It then ranks among reused chunks by
  that time (the gap between turns predicts the next one, as LRU-2's previous access does);
- *goes on* a chain that did, when its parent did so in the same way and this is that parent's
  first full child (the rest of the new turn's tail);
- is otherwise seen once, as in ``lineage-lru2``. A new branch under a chunk that already has a
  full child (a new question on a shared document or system prompt) is not an extension: on the
  rag and builtin generators treating it as one cost up to 25 and 32 points of Belady. Nor is a
  chunk stored by another tenant than the chain's end was (a conversation is one tenant's; on
  rag, a prefix that one request ended at and another extends with more documents): without
  that test rag lost up to 1.7 points to ``lineage-lru2`` (at 2%), with it none.

*Partial* chunks (fewer tokens than their parent; a chain's first chunk counts as full, and the
parent's size is remembered with its history) never count as a child, since a longer prompt
never reuses one (its KV changes as the prompt grows: the next turn stores a new chunk at that
position), and go before every full chunk, even one about to be resent whole (the one case that
reuses it). Judged along the chain, not against the largest chunk a tier has held: models with
different ``chunk_tokens`` share an agent's tiers. The agent's engines store full chunks only
(``keys_for``), so there the rule rarely fires; in the simulator a trace's last block is
partial.

The figures below are the simulator's. In the agent the rule needs to see each turn's read of
its chain: an engine that serves a prefix from its own GPU prefix cache (vLLM) without asking
the agent leaves that turn unseen, and its new chunks are then seen once, as in
``lineage-lru2``.

Measured (issue 26; % of Belady's block hit ratio at 1 / 2 / 5 / 10 / 20 / 50% of the unique
blocks, ``kvctl simulate --sweep``, one run; ``lineage-lru2`` in brackets): chat 66.4 / 81.9 /
94.0 / 94.8 / 95.8 / 98.8 (63.0 / 69.8 / 75.2 / 78.2 / 84.0 / 100.0); the ``mix`` generator
67.7 / 65.6 / 77.8 / 89.4 / 94.7 / 99.0 (61.5 / 61.0 / 74.8 / 86.2 / 94.1 / 98.6), the best of
every policy at 1% and 2%; builtin 93.7 / 93.0 / 92.9 / 95.5 / 97.8 / 99.7 (94.2 / 92.8 / 92.0 /
94.1 / 96.8 / 99.5), the best at 2-20%; rag 72.6 / 74.7 / 77.7 / 83.7 / 88.4 / 97.3 (72.6 / 74.7
/ 77.6 / 83.5 / 87.5 / 96.4); on the Mooncake trace at most 0.05 behind it and 0.2 ahead at
20-50% (26.7 / 30.9 / 40.2 / 53.0 / 68.1 / 94.6; the trace has no tenants); level on
system-prompt. Behind ``lineage-lru2`` only on
builtin at 1% (0.55) and chat at 50% (1.2). At the cost of ``lineage-lru2`` (45-100k
decisions/s in the simulator).

On its own not the default (it trails ``lineage-lru`` on chat at 5-50% and ``lineage-arc`` on the
trace at 2-20%), but ``lineage-adaptive``'s first candidate since 2026-11-30, in place of
``lineage-lru2``: see there for what that changed. As a fourth candidate beside
``lineage-lru2`` (a prototype before the tenant test, measured on rag and chat only) it gained
0.2 on chat at 1% and lost 0.7 on chat at 2% and 0.3 on rag at 5%.

Ranking within reused chunks by recency instead (a two-class LRU) measured better on the trace at
2-50% (42.8% of Belady at 5% against 40.2%) but worse on chat at 5-50% (stale reused chunks are
never displaced by new ones: 94.4% at 5% against 98.4% for ``lineage-arc``), on builtin at 1%
(84.5 against 94.2) and rag at 1-5%; ``lineage-lru2``'s order was kept.

Extra state: a full-child count, a token count and the storing tenant per remembered key,
dropped with the key from the history, and the set of partial chunks tracked. Every operation
stays O(log n) or O(1). Deterministic.
"""

from __future__ import annotations

from kvctl.store.index import Entry
from kvctl.store.policies.lru2 import LineageLRU2Policy


class LineageChainPolicy(LineageLRU2Policy):
    """Leaf-first LRU-2 where a new turn's chunks inherit their chain's previous access; see the
    module docstring."""

    name = "lineage-chain"
    accesses_deferrable = True

    def __init__(self, *, history_factor: int = 8, min_history: int = 1024) -> None:
        super().__init__(history_factor=history_factor, min_history=min_history)
        #: remembered keys -> full children stored under them since
        self._full_children: dict[bytes, int] = {}
        #: remembered keys -> their tokens (a child with fewer than its parent is partial)
        self._tokens: dict[bytes, int] = {}
        #: remembered keys -> the tenant that stored them (a conversation is one tenant's)
        self._stored_by: dict[bytes, str] = {}
        #: partial chunks tracked now
        self._partial: set[bytes] = set()

    def _observe(self, entry: Entry) -> None:
        key = entry.key
        new = key not in self._history
        super()._observe(entry)
        self._tokens[key] = entry.tokens
        # who first stored a shared chunk while it is remembered: one stored again by another
        # tenant after an eviction is still a shared prefix, not that tenant's conversation
        # (taking the latest storer cost rag up to 2.0 points of Belady in lineage-adaptive); an
        # isolated chunk is its tenant's alone, and replaces any other tenant's
        if new or entry.isolated:
            self._stored_by[key] = entry.tenant
        parent = entry.parent
        if parent is None:
            return
        # decided along the chain, not against the tier's largest chunk: models with different
        # chunk sizes share a tier, and a client's odd put must not make every chunk partial
        if entry.tokens < self._tokens.get(parent, 0):
            self._partial.add(key)
            return
        record = self._history.get(parent)
        if not new or record is None:
            return
        children = self._full_children.get(parent, 0)
        self._full_children[parent] = children + 1
        # the parent's previous access: its own (reused), or the one it inherited (it goes on
        # a chain extended in this request); none: a chain seen once
        inherited = record[1]
        if children or inherited == self._NEVER:
            return  # a branch under a chunk with a full child, or no reused chain to extend
        if self._stored_by.get(parent) != entry.tenant:
            return  # another tenant's chain: a new question on a shared prefix, not a turn
        self._previous[key] = inherited
        self._history[key] = (self._history[key][0], inherited)

    def _forget(self, key: bytes) -> None:
        self._full_children.pop(key, None)
        self._tokens.pop(key, None)
        self._stored_by.pop(key, None)

    def rank(self, entry: Entry) -> tuple[float, ...]:
        if entry.key in self._partial:
            return (self._NEVER - 1, entry.last_tick)
        return super().rank(entry)

    def on_remove(self, entry: Entry) -> None:
        super().on_remove(entry)
        self._partial.discard(entry.key)
