"""Link probes between DCs over a window (figures and RTT series), and design.md's
fetch-or-recompute rule over each measured link."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from kvctl.db.analytics.inventory import Inventory, pair
from kvctl.db.analytics.values import as_float, as_int
from kvctl.db.analytics.windows import Window, bucket_starts, bucketed_rows
from kvctl.db.models import LinkSample
from kvctl.db.rollup import buckets, series, window
from kvctl.profiles import FIBER_SECONDS_PER_KM, ModeledInputs
from kvctl.ratios import ratio

DEFAULT_CHUNK_TOKENS: Final = 256


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """One DC pair (a == b: between nodes of one DC) over a window."""

    dc_a: str
    dc_b: str
    distance_km: float | None
    probes: int
    ok_probes: int
    rtt_mean_s: float | None
    rtt_max_s: float | None
    bandwidth_bytes_per_s: float | None
    loss_ratio: float | None

    @property
    def ok_ratio(self) -> float | None:
        return ratio(self.ok_probes, self.probes)

    @property
    def fiber_rtt_s(self) -> float | None:
        """Modeled: the round trip light needs over the link's fiber."""
        return None if self.distance_km is None else 2 * FIBER_SECONDS_PER_KM * self.distance_km

    def as_dict(self) -> dict[str, Any]:
        return {
            "dc_a": self.dc_a,
            "dc_b": self.dc_b,
            "distance_km": self.distance_km,
            "probes": self.probes,
            "ok_probes": self.ok_probes,
            "ok_ratio": self.ok_ratio,
            "rtt_mean_s": self.rtt_mean_s,
            "rtt_max_s": self.rtt_max_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "loss_ratio": self.loss_ratio,
            "fiber_rtt_s": self.fiber_rtt_s,
        }


def link_figures(conn: Connection, start_ms: int, end_ms: int, inv: Inventory) -> list[LinkFigures]:
    """Probe figures per DC pair (inventory links first, then any pair that was probed)."""
    dc_of = inv.dc_of_nodes()
    acc: dict[tuple[str, str], list[float]] = {}
    q = window(
        conn,
        series("link_sample"),
        start_ms,
        end_ms,
        columns=["ok", "rtt_s", "bandwidth_bytes_per_s", "loss_ratio"],
    )
    for r in conn.execute(q):
        m = r._mapping
        a, b = dc_of.get(m["src_node_id"]), dc_of.get(m["dst_node_id"])
        if a is None or b is None:
            continue
        v = acc.setdefault(pair(a, b), [0, 0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0])
        v[0] += as_int(m["samples"])
        v[1] += as_int(m["ok"])
        v[2] += as_float(m["rtt_s_sum"])
        v[3] += as_int(m["rtt_s_n"])
        v[4] = max(v[4], as_float(m["rtt_s_max"]))
        v[5] += as_float(m["bandwidth_bytes_per_s_sum"])
        v[6] += as_int(m["bandwidth_bytes_per_s_n"])
        v[7] += as_float(m["loss_ratio_sum"])
        v[8] += as_int(m["loss_ratio_n"])
    out = []
    for key in [*sorted(inv.links_km), *sorted(set(acc) - set(inv.links_km))]:
        v = acc.get(key, [0, 0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0])
        out.append(
            LinkFigures(
                dc_a=key[0],
                dc_b=key[1],
                distance_km=inv.links_km.get(key),
                probes=int(v[0]),
                ok_probes=int(v[1]),
                rtt_mean_s=ratio(v[2], v[3]),
                rtt_max_s=v[4] if v[3] else None,
                bandwidth_bytes_per_s=ratio(v[5], v[6]),
                loss_ratio=ratio(v[7], v[8]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class LinkSeries:
    bucket_ms: list[int]
    #: per DC pair: mean RTT in each bucket (None: no successful probe)
    rtt_s: dict[tuple[str, str], list[float | None]]


def link_series(conn: Connection, win: Window, inv: Inventory) -> LinkSeries:
    dc_of = inv.dc_of_nodes()
    starts = bucket_starts(win)
    sums: dict[tuple[str, str], list[list[float]]] = {}
    q = buckets(
        conn, series("link_sample"), win.start_ms, win.end_ms, win.step_ms, columns=["rtt_s"]
    )
    for i, m in bucketed_rows(conn, q, starts):
        a, b = dc_of.get(m["src_node_id"]), dc_of.get(m["dst_node_id"])
        if a is None or b is None:
            continue
        acc = sums.setdefault(pair(a, b), [[0.0, 0] for _ in starts])
        acc[i][0] += as_float(m["rtt_s_sum"])
        acc[i][1] += as_int(m["rtt_s_n"])
    return LinkSeries(starts, {k: [ratio(s, n) for s, n in v] for k, v in sorted(sums.items())})


@dataclass(frozen=True, slots=True)
class RttBasis:
    """What one DC pair's probed RTTs were in a window: successful probes per basis
    ("measured", or "emulated" when the probing agent adds a configured delay on that link,
    included in the RTT), and the emulated delays seen."""

    probes: dict[str, int]
    emulated_delay_min_s: float | None
    emulated_delay_max_s: float | None

    @property
    def emulated(self) -> bool:
        return "emulated" in self.probes


def rtt_bases(
    conn: Connection, start_ms: int, end_ms: int, inv: Inventory
) -> dict[tuple[str, str], RttBasis]:
    """The basis of each DC pair's successful probes over [start, end), from raw samples
    (kept 2 days; a basis is not rolled up). A probe from before the basis was recorded
    (NULL) was measured."""
    dc_of = inv.dc_of_nodes()
    basis = func.coalesce(LinkSample.rtt_basis, "measured")
    q = (
        select(
            LinkSample.src_node_id,
            LinkSample.dst_node_id,
            basis.label("basis"),
            func.count().label("probes"),
            func.min(LinkSample.emulated_delay_s).label("delay_min"),
            func.max(LinkSample.emulated_delay_s).label("delay_max"),
        )
        .where(
            LinkSample.ts_ms >= start_ms,
            LinkSample.ts_ms < end_ms,
            LinkSample.ok.is_(True),
            LinkSample.rtt_s.is_not(None),
        )
        .group_by(LinkSample.src_node_id, LinkSample.dst_node_id, basis)
    )
    acc: dict[tuple[str, str], tuple[dict[str, int], list[float]]] = {}
    for r in conn.execute(q):
        a, b = dc_of.get(r.src_node_id), dc_of.get(r.dst_node_id)
        if a is None or b is None:
            continue
        probes, delays = acc.setdefault(pair(a, b), ({}, []))
        probes[r.basis] = probes.get(r.basis, 0) + int(r.probes)
        delays += [float(d) for d in (r.delay_min, r.delay_max) if d is not None]
    return {
        key: RttBasis(
            dict(sorted(probes.items())), min(delays, default=None), max(delays, default=None)
        )
        for key, (probes, delays) in sorted(acc.items())
    }


@dataclass(frozen=True, slots=True)
class BreakEven:
    """design.md's fetch-or-recompute rule for one chunk over one measured link (modeled
    compute, measured RTT and bandwidth)."""

    link: LinkFigures
    chunk_tokens: int
    chunk_bytes: int
    recompute_s: float
    fetch_s: float | None

    @property
    def worth_fetching(self) -> bool | None:
        return None if self.fetch_s is None else self.fetch_s < self.recompute_s

    @property
    def fetch_never_wins(self) -> bool:
        """The chunk's bytes alone, at the measured bandwidth and no RTT at all, take as long
        as recomputing it: no RTT is short enough for fetching to win."""
        bw = self.link.bandwidth_bytes_per_s
        if not bw:  # unmeasured: unknown, not never
            return False
        return self.chunk_bytes / bw >= self.recompute_s

    @property
    def max_rtt_s(self) -> float | None:
        """The largest RTT at which fetching still wins at the measured bandwidth; None when
        the bandwidth is unmeasured or when no RTT wins (:attr:`fetch_never_wins`): a break-even
        of 0 s would read as a figure, where there is none."""
        bw = self.link.bandwidth_bytes_per_s
        if not bw or self.fetch_never_wins:
            return None
        return self.recompute_s - self.chunk_bytes / bw


def break_even(
    links: Iterable[LinkFigures], inputs: ModeledInputs, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> list[BreakEven]:
    chunk_bytes = chunk_tokens * inputs.model.kv_bytes_per_token
    recompute = inputs.prefill_seconds(chunk_tokens)
    out = []
    for link in links:
        fetch = None
        if link.rtt_mean_s is not None and link.bandwidth_bytes_per_s:
            fetch = link.rtt_mean_s + chunk_bytes / link.bandwidth_bytes_per_s
        out.append(BreakEven(link, chunk_tokens, chunk_bytes, recompute, fetch))
    return out
