"""Partial oracles, for simulation only: what an online policy could reach if it knew one thing
about the future, to tell which knowledge closes the gap to Belady.

``belady`` knows every block's next use. These know less:

- ``oracle-popularity`` knows how many more times each block will be used (not when): it evicts
  the block with the fewest uses left, least recently used first among equals. It is the
  ceiling of frequency-based policies (LFU, GDSF, any popularity estimate) on the workload.
- ``oracle-reuse`` knows only whether each block is used again within ``horizon_factor`` x the
  tier's capacity in block accesses: it evicts blocks that are not first, least recently used
  first within each group. It is the ceiling of a policy that predicts reuse within a horizon
  (LRB's relaxed Belady, ``lineage-learned-arc``'s model) with a perfect classifier. 4 x the
  capacity measured best on the Mooncake trace at 5% (82% of Belady against 54% at 2x and 68% at
  8x, in a replay outside the store).

Neither bypasses a newcomer (Belady does) nor follows lineage: a block is used whenever a
deeper block of its chain is, so its uses left and its next use are never behind its
children's, and both already keep a prefix before its extensions. Both rank a block when it is
accessed; the simulator updates ``future`` just before each access.

- ``oracle-features`` knows, for each of ``lineage-learned-arc``'s feature rows (a chunk's
  one-hot buckets of counts, gaps, depth, ... and ages, ``reuse_model``), how often a chunk with
  that row was reused within the model's boundary on this very replay: it is
  ``lineage-learned-arc`` whose model scores a candidate by that rate instead of its online
  logistic fit, the ceiling of a perfect model of those features (a learning problem solved
  exactly), where ``oracle-reuse`` is the ceiling of a perfect classifier of any features. The
  simulator runs it in two passes over the same requests and tiers: ``lineage-learned-arc`` with
  a ``RecordingReuseModel`` (the same decisions; it keeps every labelled sample, per distinct
  row), then ``FeatureOraclePolicy``, whose ``TableReuseModel`` scores a row seen at least
  ``FEATURE_MIN_COUNT`` times by the smoothed log-odds of its samples, log((reused + 0.5) /
  (not reused + 0.5)), and any other row by logistic weights fitted once on every recorded
  sample; it does not train. The rates come from the first pass's evictions, which the second
  pass's differ from after its first different pick, so it is near the ceiling, not exactly it.
  Measured on the Mooncake trace (issue 26, ``kvctl simulate --sweep``, one run): 23.7 / 32.0 /
  44.3 / 56.8 / 69.6 / 95.6% of Belady at 1 / 2 / 5 / 10 / 20 / 50%, against 23.4 / 30.0 / 43.3 /
  56.2 / 69.2 / 94.6 for ``lineage-learned-arc`` (before its model's boundary fix: 44.6 and 56.2
  at 5 and 10% against 43.1 and 55.7; a logistic fitted on every sample, in a replay outside
  the store, 43.4 and 54.8): its features, not its learning, hold it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvctl.store.index import Entry
from kvctl.store.policies.base import HeapPolicy
from kvctl.store.policies.learned_arc import LineageLearnedARCPolicy
from kvctl.store.policies.reuse_model import ReuseModel

#: ``oracle-reuse``'s horizon, in multiples of the tier's capacity in blocks
REUSE_HORIZON_FACTOR = 4.0
#: ``oracle-features``: a feature row is scored from its own samples when it has this many
FEATURE_MIN_COUNT = 5

#: a reuse model's feature row
Row = tuple[int, ...]


class FutureUse(NamedTuple):
    """What the oracles may know of a block at an access: the block accesses until its next
    use (``math.inf``: none), and how many uses it has left."""

    gap: float
    uses_left: int


class PopularityOraclePolicy(HeapPolicy):
    """Fewest uses left goes first; see the module docstring."""

    name = "oracle-popularity"

    def __init__(self, future: Mapping[bytes, FutureUse]) -> None:
        super().__init__()
        self._future = future

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (self._future[entry.key].uses_left, entry.last_tick)


class ReuseOraclePolicy(HeapPolicy):
    """Blocks not used again within ``horizon_blocks`` accesses go first; see the module
    docstring."""

    name = "oracle-reuse"

    def __init__(self, future: Mapping[bytes, FutureUse], horizon_blocks: float) -> None:
        super().__init__()
        self._future = future
        self.horizon_blocks = horizon_blocks

    def rank(self, entry: Entry) -> tuple[float, ...]:
        soon = self._future[entry.key].gap <= self.horizon_blocks
        return (1 if soon else 0, entry.last_tick)


class RecordingReuseModel(ReuseModel):
    """A ``ReuseModel`` that also keeps every sample it labels, as ``samples``: per distinct
    feature row, [samples, samples labelled 1] (first seen first). Its decisions are the plain
    model's."""

    def __init__(self, **model: Any) -> None:
        super().__init__(**model)
        self.samples: dict[Row, list[float]] = {}

    def _label(self, feats: Row, y: float) -> None:
        a = self.samples.get(feats)
        if a is None:
            self.samples[feats] = [1.0, y]
        else:
            a[0] += 1.0
            a[1] += y
        super()._label(feats, y)


def reuse_table(
    samples: Mapping[Row, Sequence[float]], min_count: int = FEATURE_MIN_COUNT
) -> dict[Row, float]:
    """The smoothed log-odds of reuse, log((reused + 0.5) / (not reused + 0.5)) (the rate
    (reused + 0.5) / (samples + 1)), of each row with at least ``min_count`` samples."""
    return {
        row: math.log((pos + 0.5) / (n - pos + 0.5))
        for row, (n, pos) in samples.items()
        if n >= min_count
    }


class TableReuseModel(ReuseModel):
    """A ``ReuseModel`` that scores a candidate by its feature row's recorded reuse
    (``reuse_table``), or, for a row with fewer than ``min_count`` samples, by logistic weights
    fitted once on all of ``samples`` (the model's own fit, over every sample at once). It never
    trains; with no samples it never picks (``lineage-learned-arc`` then is ``lineage-arc``)."""

    def __init__(
        self,
        samples: Mapping[Row, Sequence[float]],
        *,
        min_count: int = FEATURE_MIN_COUNT,
        **model: Any,
    ) -> None:
        super().__init__(**model)
        self.table = reuse_table(samples, min_count)
        if samples:
            self._fit_rows(samples)

    def _label(self, feats: Row, y: float) -> None:
        """No training: the table and the weights are fixed."""

    def _score(self, key: bytes, now: int) -> float:
        rec = self._hist.get(key)
        if rec is not None and self._w is not None:
            s = self.table.get(rec.static + self._dynamic(rec, now))
            if s is not None:
                return s
        return super()._score(key, now)


class FeatureOraclePolicy(LineageLearnedARCPolicy):
    """``lineage-learned-arc`` scored by a ``TableReuseModel`` of ``samples`` (a
    ``RecordingReuseModel``'s, from a replay of the same requests); see the module docstring."""

    name = "oracle-features"

    def __init__(
        self,
        samples: Mapping[Row, Sequence[float]],
        *,
        min_count: int = FEATURE_MIN_COUNT,
        **model: Any,
    ) -> None:
        super().__init__(reuse_model=TableReuseModel(samples, min_count=min_count, **model))
