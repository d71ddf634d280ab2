"""What an agent, its GPUs or a link probe reports, checked where it enters the fleet database:
once, before any counter is tracked or any row is built.

An agent is another process on another host, maybe buggy, old or hostile, and JSON as Python
parses it carries NaN and Infinity. Unchecked, one such number ended the collector's loop
(rounding NaN), held every node's rows back on PostgreSQL (NaN or 1e300 in a BIGINT column
refuses the whole batch, retried for ever), stayed in the counters' saved state so every later
increase was NaN, and made the dashboard's fleet sums NaN or infinite; SQLite stored NaN as
NULL where PostgreSQL kept NaN. A value that cannot be true is *rejected*: its field is unknown
(NULL, shown N/A, never 0), named in ``Rejections``, and the rest of the answer is kept.

Cannot be true: a number that is not finite, or not a number at all (a string, a bool); a
count, byte count, duration or power below zero or beyond BIGINT; a ratio outside [0, 1]; a
field the collector needs that is missing. A counter that went *down* is not rejected: it is a
restart, which ``kvctl.counters`` counts from zero.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from sqlalchemy import String

from kvctl.db.models import CacheSample

#: the largest count (or seconds, joules, watts) a row may carry: BIGINT's. Beyond it the
#: database refuses the batch; no real counter gets near it (9.2e18 bytes, joules or seconds)
MAX_MAGNITUDE: Final = 2**63 - 1
#: a counter a sum over it cannot know: ``kvctl.wire.stats.cache_counters`` adds tiers' counters
#: up, and NaN keeps such a sum unknown; rows read any non-finite figure as unknown
UNKNOWN: Final = math.nan
#: the ``tier`` column's width: a longer tier name is refused by PostgreSQL (the whole batch)
TIER_CHARS: Final = cast(String, CacheSample.__table__.c.tier.type).length or 16
#: stands in for tiers whose answer could not be read, so the node's ``all`` figures (sums over
#: every tier) are unknown for that scrape rather than short by that tier
UNREADABLE_TIER: Final = "?"
#: the most tiers an answer may report: an agent has at most five (gpu, cpu, disk, and the
#: remote pool's and peers' counted tiers, ``kvctl.remote.federation``). Each tier is a
#: ``cache_sample`` row and a ``counter_state`` row a scrape: one agent reporting 20,000 had
#: the collector write 40,000 rows a scrape, and the dashboard's fleet page take 10 s
MAX_TIERS: Final = 64
#: characters no text column takes alike: NUL (PostgreSQL refuses it, SQLite keeps it) and
#: lone surrogates (JSON's "\\ud800": neither driver encodes them)
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")
#: a GPU's index is the ``gpu_index`` INTEGER column
_MAX_GPU_INDEX: Final = 2**31 - 1

#: ``/v1/stats`` counters the collector reads (``stats`` of the answer), node-wide and per tier
NODE_COUNTERS: Final = (
    "lookup_chunks",
    "lookup_tokens",
    "hit_chunks",
    "hit_tokens",
    "reuse_hits",
    "sharing_hits",
    "drops",
)
TIER_COUNTERS: Final = (
    "hits",
    "hit_tokens",
    "reuse_hits",
    "sharing_hits",
    "promotions",
    "demotions",
    "bytes_read",
    "bytes_written",
)
USAGE_GAUGES: Final = ("used_bytes", "capacity_bytes", "pinned_bytes", "chunks")
#: tier counters the node's ``all`` figures sum over its tiers (``kvctl.wire.stats.cache_counters``)
TIER_SUMS: Final = ("promotions", "demotions", "bytes_read", "bytes_written")
PLAN_COUNTERS: Final = ("recompute_s", "fetch_s", "fetch_chunks", "recompute_chunks")
#: the data plane's read counts (``dataplane`` of the answer): optional, an older agent has none
READ_COUNTERS: Final = ("read_chunks", "read_missing_chunks")
#: PUT chunks the data plane refused (damaged on the way; no tier could take them): optional,
#: shown by `kvctl agent status`, not recorded
PUT_REFUSALS: Final = ("corrupt_puts", "no_room_puts")
GPU_COUNTS: Final = ("power_w", "energy_j", "memory_used_bytes", "memory_total_bytes")
PROBE_COUNTS: Final = ("rtt_s", "bandwidth_bytes_per_s")


@dataclass(slots=True)
class Rejections:
    """Fields of one answer rejected, by where they were in it (``stats.drops``,
    ``gpus[0].power_w``), with why; never the value, which may be large or hostile."""

    fields: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, why: str) -> None:
        self.fields[where] = why

    def __len__(self) -> int:
        return len(self.fields)

    def summary(self, most: int = 5) -> str:
        """The first ``most`` fields and why, for a report line or a log line."""
        shown = [f"{w} ({why})" for w, why in list(self.fields.items())[:most]]
        more = len(self.fields) - most
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def number(
    value: object,
    where: str,
    rejections: Rejections,
    *,
    high: float = MAX_MAGNITUDE,
    why_high: str = "beyond BIGINT",
) -> int | float | None:
    """``value`` if it is a finite number in [0, ``high``]; else None, and it is rejected.
    None (not reported) passes as None, rejecting nothing."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        rejections.add(where, "not a number")
        return None
    # an int past float's range would raise in isfinite: ints are compared, never converted
    if isinstance(value, float) and not math.isfinite(value):
        rejections.add(where, "not finite")
        return None
    if value < 0:
        rejections.add(where, "negative")
        return None
    if value > high:
        rejections.add(where, why_high)
        return None
    return value


def count(value: object, where: str, rejections: Rejections) -> int | float | None:
    """A counter, byte count, duration, energy or power: finite, at least 0, within BIGINT."""
    return number(value, where, rejections)


def ratio(value: object, where: str, rejections: Rejections) -> float | None:
    """A ratio: finite, in [0, 1]."""
    return number(value, where, rejections, high=1, why_high="above 1")


def _needed(value: object, where: str, rejections: Rejections) -> float:
    """A counter the collector's sums need: UNKNOWN when missing or rejected."""
    if value is None:
        rejections.add(where, "missing")
        return UNKNOWN
    checked = count(value, where, rejections)
    return UNKNOWN if checked is None else checked


def _object(value: object, where: str, rejections: Rejections) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    rejections.add(where, "missing" if value is None else "not an object")
    return {}


def checked_stats(stats: Mapping[str, Any]) -> tuple[dict[str, Any], Rejections]:
    """A copy of an agent's ``/v1/stats`` whose figures the collector reads are each a number
    it can store or UNKNOWN (counters and usage: sums are taken over them) or None (the start
    time, the plans' counters), and what was rejected. Fields the collector does not read are
    copied as they are."""
    rejections = Rejections()
    out = dict(stats)
    raw = _object(stats.get("stats"), "stats", rejections)
    counters: dict[str, Any] = dict(raw)
    for name in NODE_COUNTERS:
        counters[name] = _needed(raw.get(name), f"stats.{name}", rejections)
    tiers: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    before = len(rejections)
    raw_tiers = _object(raw.get("tiers"), "stats.tiers", rejections)
    raw_usage = _object(stats.get("usage"), "usage", rejections)
    for where, many in (("stats.tiers", raw_tiers), ("usage", raw_usage)):
        if len(many) > MAX_TIERS:  # none read: their sums and every counter wait
            rejections.add(where, f"{len(many):,} tiers, more than the {MAX_TIERS} read")
            raw_tiers, raw_usage = {}, {}
    # without its tiers or their usage, the node's totals cannot be summed
    unreadable = len(rejections) > before
    for name, tier in raw_tiers.items():
        where = f"stats.tiers.{shown(name[:TIER_CHARS])}"
        if len(name) > TIER_CHARS:
            rejections.add(f"{where}...", f"tier name longer than {TIER_CHARS} characters")
            unreadable = True
            continue
        if shown(name) != name:  # it names a counter series and rows: neither could be saved
            rejections.add(where, "tier name with a NUL or a lone surrogate")
            unreadable = True
            continue
        if not isinstance(tier, Mapping):
            rejections.add(where, "not an object")
            unreadable = True
            continue
        checked: dict[str, Any] = dict(tier)
        for c in TIER_COUNTERS:
            checked[c] = _needed(tier.get(c), f"{where}.{c}", rejections)
        evictions = tier.get("evictions", {})
        if isinstance(evictions, Mapping):
            checked["evictions"] = {
                k: _needed(v, f"{where}.evictions.{k[:32]}", rejections)
                for k, v in evictions.items()
            }
        else:
            rejections.add(f"{where}.evictions", "not an object")
            checked["evictions"] = {"unknown": UNKNOWN}
        tiers[name] = checked
    for name, gauges in raw_usage.items():
        where = f"usage.{shown(name[:TIER_CHARS])}"
        if len(name) > TIER_CHARS or shown(name) != name or not isinstance(gauges, Mapping):
            why = "not an object"
            if len(name) > TIER_CHARS:
                why = "tier name too long"
            elif shown(name) != name:
                why = "tier name with a NUL or a lone surrogate"
            rejections.add(where, why)
            unreadable = True
            continue
        usage[name] = {g: _needed(gauges.get(g), f"{where}.{g}", rejections) for g in USAGE_GAUGES}
    # each tier's figure fits a BIGINT, their sum (the node's ``all`` row) may not: a row
    # beyond it had the database refuse the cycle's whole batch, or SQLite's driver raise
    for where, parts in (
        *((f"stats.tiers ({c} summed)", [t[c] for t in tiers.values()]) for c in TIER_SUMS),
        *((f"usage ({g} summed)", [u[g] for u in usage.values()]) for g in USAGE_GAUGES),
        *(
            (f"stats.tiers.{name}.evictions (summed)", list(t["evictions"].values()))
            for name, t in tiers.items()
        ),
    ):
        if sum(parts) > MAX_MAGNITUDE:
            rejections.add(where, "beyond BIGINT")
            unreadable = True
    if unreadable:
        # a tier that could not be read still counted in the node's sums: they are unknown
        tiers[UNREADABLE_TIER] = {
            **{c: UNKNOWN for c in TIER_COUNTERS},
            "evictions": {"unknown": UNKNOWN},
        }
        usage[UNREADABLE_TIER] = {g: UNKNOWN for g in USAGE_GAUGES}
    counters["tiers"] = tiers
    out["stats"] = counters
    out["usage"] = usage
    out["started_s"] = count(stats.get("started_s"), "started_s", rejections)
    dataplane = stats.get("dataplane")
    if isinstance(dataplane, Mapping):
        # None where not reported (an older agent) or rejected: those scrapes' reads are NULL
        reads = {c: count(dataplane.get(c), f"dataplane.{c}", rejections) for c in READ_COUNTERS}
        if None not in reads.values() and reads["read_missing_chunks"] > reads["read_chunks"]:
            # of the reads since its start: more missing than read cannot be
            rejections.add("dataplane.read_missing_chunks", "more than dataplane.read_chunks")
            reads = dict.fromkeys(READ_COUNTERS)
        refused = {c: count(dataplane.get(c), f"dataplane.{c}", rejections) for c in PUT_REFUSALS}
        out["dataplane"] = {**dataplane, **reads, **refused}
    elif dataplane is not None:
        rejections.add("dataplane", "not an object")
        out["dataplane"] = None
    plans = stats.get("fetch_plans")
    if isinstance(plans, Mapping) and isinstance(plans.get("plans"), Mapping):
        p = plans["plans"]
        out["fetch_plans"] = {
            **plans,
            "plans": {
                **p,
                **{c: count(p.get(c), f"fetch_plans.plans.{c}", rejections) for c in PLAN_COUNTERS},
            },
        }
    return out, rejections


def checked_gpus(gpus: Mapping[str, Any]) -> tuple[dict[str, Any], Rejections]:
    """A copy of an agent's ``/v1/gpus`` whose readings hold only figures that can be true
    (None where rejected, like a reading NVML could not take); a reading without a usable
    index is left out (it has no row to go in)."""
    rejections = Rejections()
    out = dict(gpus)
    if not isinstance(gpus.get("nvml", {}), Mapping):
        rejections.add("gpus.nvml", "not an object")
        out["nvml"] = {}
    readings = gpus.get("gpus", [])
    if not isinstance(readings, list):
        rejections.add("gpus.gpus", "not a list")
        readings = []
    kept = []
    for i, g in enumerate(readings):
        where = f"gpus[{i}]"
        if not isinstance(g, Mapping):
            rejections.add(where, "not an object")
            continue
        index = g.get("index")
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index <= _MAX_GPU_INDEX
        ):
            rejections.add(f"{where}.index", "not a GPU index")
            continue
        reading = dict(g)
        for c in GPU_COUNTS:
            reading[c] = count(g.get(c), f"{where}.{c}", rejections)
        reading["utilization_ratio"] = ratio(
            g.get("utilization_ratio"), f"{where}.utilization_ratio", rejections
        )
        kept.append(reading)
    out["gpus"] = kept
    return out, rejections


#: what of an agent's error text a row keeps
MAX_ERROR_CHARS: Final = 1000


def checked_probe(probe: Mapping[str, Any], rejections: Rejections) -> dict[str, Any]:
    """A link probe's figures (``rtt_s``, ``bandwidth_bytes_per_s``, ``loss_ratio``) and its
    ``error``, None where not reported or rejected. An error that is not text was refused by
    both databases, and with it the whole batch, at every retry."""
    out: dict[str, Any] = {c: count(probe.get(c), f"probe.{c}", rejections) for c in PROBE_COUNTS}
    out["loss_ratio"] = ratio(probe.get("loss_ratio"), "probe.loss_ratio", rejections)
    error = probe.get("error")
    if error is not None and not isinstance(error, str):
        rejections.add("probe.error", "not text")
        error = None
    out["error"] = None if error is None else error[:MAX_ERROR_CHARS]
    return out


def brief(text: str) -> str:
    """An error's text as the collector records and says it: on one line, at most
    ``MAX_ERROR_CHARS`` (an agent's, a proxy's or an engine's error answer is the sender's
    text, of any length: one 500 with a 7 MB detail was stored whole at every scrape)."""
    line = " ".join(text.split())
    if len(line) <= MAX_ERROR_CHARS:
        return line
    kept = MAX_ERROR_CHARS - 40  # room for the note of what was cut
    return f"{line[:kept]}... ({len(line) - kept:,} characters more)"


def shown(text: str) -> str:
    """``text`` as it can be stored and said, alike on both databases: each NUL or lone
    surrogate as U+FFFD. One refused the whole batch at every retry (PostgreSQL), or raised
    out of the collector's cycle (SQLite's driver: UnicodeEncodeError)."""
    return _UNSTORABLE.sub("\ufffd", text)


def known(value: float | None) -> float | None:
    """None for UNKNOWN (or any figure not finite), else the value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value
