"""An online model of which chunks a tier will reuse soon, in the spirit of LRB (Learning Relaxed
Belady, Song et al., NSDI'20), for ``lineage-learned-arc`` to pick victims with.

Belady evicts the chunk whose next use is farthest. LRB relaxes that: any chunk whose next use is
beyond a *boundary* (here ``window_factor`` x the tier's capacity in chunks, in accesses) is as
good a victim as the farthest one, and whether a chunk will be used again within the boundary can
be learned from the cache's own past, with no offline labels. The model:

- keeps, per key (in a bounded history that outlives evictions, as ``lineage-lru2`` does), what a
  KV cache knows of a chunk: its last three access ticks and access count, its depth in its prefix
  chain, whether it is a partial block, whether it was the tail of the request that last used it
  (no child followed it), how many distinct children were ever stored under it, its parent's
  access count, and whether several tenants used it;
- turns those into one-hot buckets (log2 of counts, gaps and depth), plus the chunk's age
  (accesses since its last uses) and age x access count at decision time: a generalized additive
  logistic model, whose score for a chunk is a sum of a few weights;
- ``pick`` samples ``sample_size`` leaves (a parent is never a victim while a child is cached; the
  chunk accessed last, the parent of the one being stored, is never picked) with a seeded
  generator, and names, among those the caller wants (``lineage-learned-arc``: those in T1), the
  one least likely to be reused within the boundary (ties: the least recently used); None until
  the first fit, or when none in the sample is wanted;
- records ``train_per_eviction`` of each eviction's sampled candidates, and the victim itself
  (features at that moment), as training samples, labelled 1 if the key is accessed within the
  boundary after the sample, 0 once the boundary passes without it (an evicted key is still seen
  when it comes back);
- refits (a few Newton steps, with backtracking, of L2-regularised logistic regression over the
  distinct feature rows, numpy) every ``retrain_every`` labelled samples over the last
  ``window_samples`` of them.

Fitted on random candidates the model is calibrated on average (AUC 0.74 in sample on the
Mooncake trace), but on its own as a whole policy it lost to ``lineage-lru2`` (34.8-38.1% of
Belady at 5% of the trace against 40.2%, over window factors 0.25-8): the least likely of 64
candidates is reused far more often than its features' average (the candidates of one eviction
are not independent), and it orders reused chunks worse than LRU-2's previous access. Trained
with its own victims among the samples and asked only among chunks seen once, it helps; see
``lineage-learned-arc``.

Deterministic under ``seed``: the same sequence of calls makes the same picks. Cost per pick:
``sample_size`` score look-ups (a cached sum per key, recomputed when the model or the key's
features change, plus four weights for its age); a refit is O(distinct rows x 14^2 + features
seen^3) every ``retrain_every`` samples (14 features a row, a few hundred distinct rows and
features seen on the Mooncake trace).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry

_NEVER = -1
#: keys remembered before the tier's size is known, and at least ever after
_MIN_HISTORY = 1024
# one-hot groups: (name, buckets)
_CNT = 6  # accesses: 1, 2, 3, 4-7, 8-15, 16+
_GAP = 22  # log2 buckets of a gap in accesses (0 = none)
_DEPTH = 10
_PCNT = 5  # parent's accesses: no parent, 1, 2, 3, 4+
_BRANCH = 4  # distinct children ever stored under it: 0, 1, 2, 3+
_AGE = 40  # half-log2 buckets of an age in accesses
_GROUPS = (
    ("bias", 1),
    ("cnt", _CNT),
    ("gap1", _GAP),
    ("gap2", _GAP),
    ("depth", _DEPTH),
    ("partial", 2),
    ("tail", 2),
    ("pcnt", _PCNT),
    ("branch", _BRANCH),
    ("spread", 2),
    ("age", _AGE),
    ("age2", _AGE),
    ("age3", _AGE),
    ("age_cnt", _AGE * _CNT),
)
_OFF: dict[str, int] = {}
_DIM = 0
for _name, _size in _GROUPS:
    _OFF[_name] = _DIM
    _DIM += _size


def _cnt_bucket(n: int) -> int:
    return n - 1 if n <= 3 else min(n.bit_length(), _CNT - 1)  # 4-7: 3, 8-15: 4, 16+: 5


def _hlog(x: int) -> int:
    """Half-log2 bucket of an age: 0 for none (x < 0), else about 2 x log2(x + 1), capped."""
    if x < 0:
        return 0
    x += 1
    n = x.bit_length()
    b = 2 * n - 1 + ((x >> (n - 2)) & 1 if n >= 2 else 0)
    return min(b, _AGE - 1)


def _log_bucket(x: int, size: int) -> int:
    """0 for none (x < 0), else 1 + floor(log2(x + 1)), capped."""
    if x < 0:
        return 0
    return min((x + 1).bit_length(), size - 1)


class _Key:
    """What the model remembers of a key (tracked or not)."""

    __slots__ = ("branch", "count", "last", "pcnt", "prev", "prev2", "static", "tail")

    def __init__(self) -> None:
        self.last = _NEVER
        self.prev = _NEVER
        self.prev2 = _NEVER
        self.count = 0
        self.branch = 0
        self.pcnt = 0
        self.tail = True
        self.static: tuple[int, ...] = ()


class _Sample:
    """One training sample: a key's features at a moment, labelled once its fate is known."""

    __slots__ = ("done", "feats", "tick")

    def __init__(self, tick: int, feats: tuple[int, ...]) -> None:
        self.tick = tick
        self.feats = feats
        self.done = False


class ReuseModel:
    """Fed a policy's calls (``on_insert`` ... ``on_victim``); ``pick`` names a victim. See the
    module docstring."""

    def __init__(
        self,
        *,
        seed: int = 0,
        sample_size: int = 64,
        window_factor: float = 1.0,
        train_per_eviction: int = 2,
        window_samples: int = 20_000,
        retrain_every: int = 5_000,
        min_samples: int = 1_000,
        l2: float = 10.0,
        newton_steps: int = 4,
        history_factor: int = 8,
    ) -> None:
        if sample_size < 1 or window_samples < 1 or retrain_every < 1 or train_per_eviction < 0:
            raise InvalidArgument(
                "sample_size, window_samples and retrain_every must be >= 1, "
                "train_per_eviction >= 0"
            )
        if not window_factor > 0 or not l2 > 0:
            raise InvalidArgument(
                f"window_factor and l2 must be positive, got {window_factor} and {l2}"
            )
        self.sample_size = sample_size
        self.window_factor = window_factor
        self.train_per_eviction = train_per_eviction
        self.retrain_every = retrain_every
        self.min_samples = min_samples
        self.l2 = l2
        self.newton_steps = newton_steps
        self.history_factor = history_factor
        self._rng = random.Random(seed)
        self._hist: OrderedDict[bytes, _Key] = OrderedDict()
        self._entries: dict[bytes, Entry] = {}
        self._leaves: list[bytes] = []
        self._leaf_pos: dict[bytes, int] = {}
        self._peak = 0
        #: the tier's capacity in chunks: the most tracked when the store asked for victims
        self._capacity = 0
        self._newest_tick = 0
        self._max_tokens = 0
        self._last_key: bytes | None = None
        self._w: list[float] | None = None
        self._version = 0
        self._score_cache: dict[bytes, tuple[int, float, tuple[int, ...]]] = {}
        self._pending: deque[tuple[bytes, _Sample]] = deque()
        self._pending_by_key: dict[bytes, list[_Sample]] = {}
        self._labelled: deque[tuple[tuple[int, ...], float]] = deque(maxlen=window_samples)
        self._since_fit = 0
        self._last_candidates: list[bytes] = []
        #: refits so far
        self.fits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def note_full(self) -> None:
        """The store asks for victims: the tier is full, so what is tracked is its capacity."""
        self._capacity = max(self._capacity, len(self._entries))

    # --- what the store tells the policy -------------------------------------------------------
    def on_insert(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._observe(entry)
        if entry.children == 0:
            self._add_leaf(entry.key)
        self._peak = max(self._peak, len(self._entries))

    def on_access(self, entry: Entry) -> None:
        if entry.key in self._entries:
            self._observe(entry)

    def on_remove(self, entry: Entry) -> None:
        if self._entries.pop(entry.key, None) is not None:
            self._drop_leaf(entry.key)
            self._score_cache.pop(entry.key, None)  # only tracked keys are scored: bounded

    def on_children_changed(self, entry: Entry) -> None:
        if entry.key not in self._entries:
            return
        if entry.children == 0:
            self._add_leaf(entry.key)
        else:
            self._drop_leaf(entry.key)

    def on_victim(self, entry: Entry) -> None:
        """Training samples: ``train_per_eviction`` of the last pick's candidates, with their
        features now, and the victim. The candidates are kept until the next pick, so a victim
        the pick did not choose (ARC's T2, or a second victim of one eviction) also samples
        them again: dropping them once used measured worse on the Mooncake trace (29.5 / 42.8 /
        55.9% of Belady at 2 / 5 / 10% against 30.7 / 43.1 / 55.7%): fewer samples."""
        cands = self._last_candidates
        if not self.train_per_eviction or not self._capacity or not cands:
            return
        now = self._newest_tick
        picked = self._rng.sample(cands, min(self.train_per_eviction, len(cands)))
        if entry.key not in picked:
            picked.append(entry.key)
        for key in picked:
            rec = self._hist.get(key)
            if rec is None or not rec.static:
                continue
            s = _Sample(now, rec.static + self._dynamic(rec, now))
            self._pending.append((key, s))
            self._pending_by_key.setdefault(key, []).append(s)

    # --- the victim ----------------------------------------------------------------------------
    def pick(self, wanted: Callable[[bytes], bool]) -> Entry | None:
        """The least likely to be reused among a sample of the leaves ``wanted`` accepts (never
        the chunk accessed last), or None (no such leaf in the sample, or no model yet)."""
        leaves = self._leaves
        now = self._newest_tick
        sample = (
            leaves
            if len(leaves) <= self.sample_size
            else self._rng.sample(leaves, self.sample_size)
        )
        cands = [k for k in sample if wanted(k) and self._entries[k].last_tick < now]
        self._last_candidates = cands
        if self._w is None or not cands:
            return None
        return self._entries[
            min(cands, key=lambda k: (self._score(k, now), self._entries[k].last_tick))
        ]

    def _score(self, key: bytes, now: int) -> float:
        """Log-odds of a reuse within the boundary (lower: a better victim)."""
        rec = self._hist.get(key)
        w = self._w
        if rec is None or w is None:
            return -math.inf
        c = self._score_cache.get(key)
        if c is None or c[0] != self._version or c[2] is not rec.static:
            c = (self._version, sum(w[i] for i in rec.static), rec.static)
            self._score_cache[key] = c
        a, b, d, e = self._dynamic(rec, now)
        return c[1] + w[a] + w[b] + w[d] + w[e]

    # --- features ------------------------------------------------------------------------------
    def _static(self, rec: _Key, entry: Entry) -> tuple[int, ...]:
        """The features that change only when the key is accessed (or its parent's tail flag)."""
        gap1 = rec.last - rec.prev if rec.prev != _NEVER else -1
        gap2 = rec.prev - rec.prev2 if rec.prev2 != _NEVER else -1
        return (
            0,
            _OFF["cnt"] + _cnt_bucket(min(rec.count, 1 << 20)),
            _OFF["gap1"] + _log_bucket(gap1, _GAP),
            _OFF["gap2"] + _log_bucket(gap2, _GAP),
            _OFF["depth"] + min(entry.depth.bit_length(), _DEPTH - 1),
            _OFF["partial"] + (1 if entry.tokens < self._max_tokens else 0),
            _OFF["tail"] + (1 if rec.tail else 0),
            _OFF["pcnt"] + min(rec.pcnt, _PCNT - 1),
            _OFF["branch"] + min(rec.branch, _BRANCH - 1),
            _OFF["spread"] + (1 if len(entry.tenants) > 1 else 0),
        )

    def _dynamic(self, rec: _Key, now_tick: int) -> tuple[int, int, int, int]:
        """The features that age: accesses since each of the last three uses."""
        age = _hlog(now_tick - rec.last)
        return (
            _OFF["age"] + age,
            _OFF["age2"] + (_hlog(now_tick - rec.prev) if rec.prev != _NEVER else 0),
            _OFF["age3"] + (_hlog(now_tick - rec.prev2) if rec.prev2 != _NEVER else 0),
            _OFF["age_cnt"] + age * _CNT + _cnt_bucket(min(rec.count, 1 << 20)),
        )

    def _observe(self, entry: Entry) -> None:
        key, tick = entry.key, entry.last_tick
        self._newest_tick = max(self._newest_tick, tick)
        self._max_tokens = max(self._max_tokens, entry.tokens)
        rec = self._hist.pop(key, None)
        new_key = rec is None
        if rec is None:
            rec = _Key()
        elif rec.last == tick:  # moved or unpinned: not a new access
            self._hist[key] = rec
            return
        self._hist[key] = rec
        rec.prev2, rec.prev, rec.last = rec.prev, rec.last, tick
        rec.count += 1
        rec.tail = True
        parent = self._hist.get(entry.parent) if entry.parent is not None else None
        rec.pcnt = 0 if parent is None else min(parent.count, 3) + 1
        if parent is not None:
            if new_key:
                parent.branch += 1
            if entry.parent == self._last_key and parent.tail:  # the request went on past it
                parent.tail = False
                pe = self._entries.get(entry.parent)  # type: ignore[arg-type]
                if pe is not None:
                    parent.static = self._static(parent, pe)
        self._last_key = key
        rec.static = self._static(rec, entry)
        pending = self._pending_by_key.pop(key, None)
        horizon = self.window_factor * self._capacity
        for s in pending or ():
            if not s.done:
                s.done = True
                # back within the boundary: reused. A model that sees few accesses (a lower
                # tier's) may not have expired a sample whose boundary passed before this one
                self._label(s.feats, 1.0 if tick <= s.tick + horizon else 0.0)
        self._expire(tick)
        limit = max(self.history_factor * self._peak, _MIN_HISTORY)
        while len(self._hist) > limit:
            self._hist.popitem(last=False)

    # --- training ------------------------------------------------------------------------------
    def _expire(self, now: int) -> None:
        """Samples whose boundary passed without a reuse are labelled 0."""
        if not self._capacity:
            return
        horizon = self.window_factor * self._capacity
        pending = self._pending
        while pending and pending[0][1].tick + horizon < now:
            key, s = pending.popleft()
            same = self._pending_by_key.get(key)
            if same is not None:
                with contextlib.suppress(ValueError):
                    same.remove(s)
                if not same:
                    del self._pending_by_key[key]
            if not s.done:
                s.done = True
                self._label(s.feats, 0.0)

    def _label(self, feats: tuple[int, ...], y: float) -> None:
        self._labelled.append((feats, y))
        self._since_fit += 1
        if self._since_fit >= self.retrain_every and len(self._labelled) >= self.min_samples:
            self._fit()

    def _fit(self) -> None:
        """Newton steps of L2-regularised logistic regression over the window, on its distinct
        feature rows (weighted by how often each occurs, and how often with label 1)."""
        self._since_fit = 0
        agg: dict[tuple[int, ...], list[float]] = {}
        for f, y in self._labelled:
            a = agg.get(f)
            if a is None:
                agg[f] = [1.0, y]
            else:
                a[0] += 1.0
                a[1] += y
        self._fit_rows(agg)

    def _fit_rows(self, agg: Mapping[tuple[int, ...], Sequence[float]]) -> None:
        """The fit over distinct feature rows, each with its count and its count of label 1
        (``_fit``'s window aggregated; ``oracles.TableReuseModel``'s every recorded sample)."""
        rows = list(agg)
        m = len(rows)
        idx = np.array(rows, dtype=np.int64).reshape(m, len(rows[0]))
        cnt = np.array([agg[r][0] for r in rows], dtype=np.float64)
        pos = np.array([agg[r][1] for r in rows], dtype=np.float64)
        # Only the features some row has: a feature no row has starts at 0 with a gradient and
        # Hessian row of its L2 term alone, so it stays 0; the system to solve shrinks to the n
        # features seen. Each row is one-hot per group (distinct columns), so x @ v, x.T @ r
        # and the Hessian are sums over a row's columns: bincounts, with no dense rows x _DIM
        # matrix nor BLAS product (the same weights to ~1e-14; the refits of the Mooncake
        # trace at 1% took 14 ms median against 45 ms dense, on the loaded 2-core VM).
        cols, inv = np.unique(idx, return_inverse=True)
        n, width = len(cols), idx.shape[1]
        inv = inv.reshape(m, width)
        flat = inv.ravel()
        pairs = (inv[:, :, None] * n + inv[:, None, :]).ravel()
        l2 = self.l2

        def xv(v: np.ndarray) -> np.ndarray:
            return np.asarray(v[inv].sum(axis=1))

        def loss(v: np.ndarray) -> float:
            z = xv(v)
            return float(cnt @ np.logaddexp(0.0, z) - pos @ z + 0.5 * l2 * v @ v)

        v = np.zeros(n)
        v[0] = math.log((pos.sum() + 1.0) / (cnt.sum() - pos.sum() + 1.0))  # cols[0]: the bias
        cur = loss(v)
        for _ in range(self.newton_steps):
            p = 1.0 / (1.0 + np.exp(-xv(v)))
            g = np.bincount(flat, weights=np.repeat(cnt * p - pos, width), minlength=n) + l2 * v
            s = np.repeat(cnt * p * (1 - p), width * width)
            h = np.asarray(np.bincount(pairs, weights=s, minlength=n * n), np.float64)
            h = h.reshape(n, n) + l2 * np.eye(n)
            step = np.linalg.solve(h, g)
            t = 1.0
            while t > 1e-3:
                nxt = loss(v - t * step)
                if nxt <= cur:
                    break
                t *= 0.5
            else:
                break
            v, cur = v - t * step, nxt
        w = np.zeros(_DIM)
        w[cols] = v
        self._w = w.tolist()
        self._version += 1
        self.fits += 1

    # --- leaves --------------------------------------------------------------------------------
    def _add_leaf(self, key: bytes) -> None:
        if key in self._leaf_pos:
            return
        self._leaf_pos[key] = len(self._leaves)
        self._leaves.append(key)

    def _drop_leaf(self, key: bytes) -> None:
        i = self._leaf_pos.pop(key, None)
        if i is None:
            return
        last = self._leaves.pop()
        if i < len(self._leaves):
            self._leaves[i] = last
            self._leaf_pos[last] = i
