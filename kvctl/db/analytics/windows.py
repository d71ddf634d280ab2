"""Windows of time the read model reports over: the dashboard's named windows, the window fitted
to the data (its default), any duration the CLI is given (``15m``, ``1h``, ``7d``), and the
buckets of their time series."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import ColumnElement, Select, Table, func, select, union_all
from sqlalchemy.engine import Connection, RowMapping

from kvctl.db.inventory import counted_since
from kvctl.db.models import ROLLUPS, Node, RemovedNode, raw_table
from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS
from kvctl.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    start_ms: int
    end_ms: int
    #: bucket width of the window's time series
    step_ms: int
    #: chosen to fit the data (the dashboard's default), not picked by name
    fitted: bool = False

    @property
    def span_ms(self) -> int:
        return self.end_ms - self.start_ms

    def as_dict(self) -> dict[str, str | int | bool]:
        return {
            "name": self.name,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "fitted": self.fitted,
        }


#: the window picker: name -> (span, time-series bucket); buckets are whole rollup widths so
#: long windows read coarse rollups
WINDOWS: Final = {
    "15m": (15 * MINUTE_MS, MINUTE_MS),
    "1h": (HOUR_MS, MINUTE_MS),
    "24h": (DAY_MS, 15 * MINUTE_MS),
    "7d": (7 * DAY_MS, HOUR_MS),
    "30d": (30 * DAY_MS, 6 * HOUR_MS),
}
#: the window a dashboard opens on: fitted to the data it has (see :func:`fitted_window`)
FIT: Final = "fit"
DEFAULT_WINDOW: Final = FIT
#: the named window shown when there is nothing to fit to
EMPTY_WINDOW: Final = "1h"
#: the spans a fitted window may take, shortest first: name -> (span, time-series bucket).
#: Buckets give a few dozen points; those of a day and more are whole rollup widths, so long
#: windows read rollups, while short ones read raw samples (kept two days)
FIT_SPANS: Final = {
    "2m": (2 * MINUTE_MS, 5_000),
    "5m": (5 * MINUTE_MS, 10_000),
    "15m": (15 * MINUTE_MS, 30_000),
    "1h": (HOUR_MS, MINUTE_MS),
    "6h": (6 * HOUR_MS, 10 * MINUTE_MS),
    "24h": (DAY_MS, 30 * MINUTE_MS),
    "7d": (7 * DAY_MS, 4 * HOUR_MS),
    "30d": (30 * DAY_MS, DAY_MS),
}

_UNIT_MS: Final = {"s": 1000, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def window_for(name: str, now_ms: int) -> Window:
    """The window ``name`` (a key of :data:`WINDOWS`) ending at ``now_ms``."""
    try:
        span, step = WINDOWS[name]
    except KeyError:
        raise ValueError(f"unknown window {name!r}; choose from {', '.join(WINDOWS)}") from None
    return Window(name, now_ms - span, now_ms, step)


#: the shortest pause in the samples that starts a new stretch of data: shorter ones (a
#: collector restarting, a slow scrape) leave the window spanning both sides
STRETCH_GAP_MS: Final = 10 * MINUTE_MS

HasData = Callable[[int, int], bool]
Latest = Callable[[int, int], int | None]


def fit_window(has_data: HasData, latest: Latest, now_ms: int) -> Window:
    """The shortest span of :data:`FIT_SPANS` that holds the latest stretch of data: the next
    longer span would add nothing, nor would the :data:`STRETCH_GAP_MS` before it
    (``has_data(start, end)``: any sample in [start, end)). So two minutes of a demo show in
    the 2-minute window, a fleet collected for three hours in the 6-hour one, and an earlier
    run days ago does not stretch today's.

    The window ends now while samples arrive (one within the shortest span); when they stopped
    earlier, it ends just after the last one (``latest(start, end)``: the newest sample's time
    in [start, end)), so a demo looked at later still fills its plots. With no data within the
    longest span: the :data:`EMPTY_WINDOW`, not fitted."""
    spans = list(FIT_SPANS.values())
    first = next((i for i, (span, _) in enumerate(spans) if has_data(now_ms - span, now_ms)), None)
    if first is None:
        return window_for(EMPTY_WINDOW, now_ms)
    end_ms = now_ms
    if first > 0:
        last = latest(now_ms - spans[first][0], now_ms - spans[first - 1][0])
        end_ms = now_ms if last is None else min(now_ms, last + 1)
    names = list(FIT_SPANS)
    for i, (span, step) in enumerate(spans):
        if i + 1 == len(spans):
            break
        # a gap shorter than STRETCH_GAP_MS (a collector restarting) does not end a stretch
        before = max(spans[i + 1][0], span + STRETCH_GAP_MS)
        if not has_data(end_ms - before, end_ms - span):
            return Window(names[i], end_ms - span, end_ms, step, fitted=True)
    span, step = spans[-1]
    return Window(names[-1], end_ms - span, end_ms, step, fitted=True)


def sampled_between(conn: Connection, start_ms: int, end_ms: int) -> bool:
    """Whether the collector recorded any of the inventory's nodes (or removed ones) in
    [start, end): a raw scrape (kept two days), or an hourly rollup overlapping it (kept a
    year)."""
    raw = raw_table("node_sample")
    if _newest(conn, raw, raw.c.ts_ms, start_ms, end_ms) is not None:
        return True
    hourly = ROLLUPS["node_sample", "1h"]
    return _newest(conn, hourly, hourly.c.bucket_ms, start_ms - HOUR_MS + 1, end_ms) is not None


def last_sampled(conn: Connection, start_ms: int, end_ms: int) -> int | None:
    """The newest scrape's time in [start, end): a raw sample's, else the end of the newest
    hourly rollup overlapping it (capped at ``end``); None without any."""
    raw = raw_table("node_sample")
    newest = _newest(conn, raw, raw.c.ts_ms, start_ms, end_ms)
    if newest is not None:
        return newest
    hourly = ROLLUPS["node_sample", "1h"]
    bucket = _newest(conn, hourly, hourly.c.bucket_ms, start_ms - HOUR_MS + 1, end_ms)
    return None if bucket is None else min(bucket + HOUR_MS - 1, end_ms - 1)


def _newest(
    conn: Connection, table: Table, time: ColumnElement[int], start_ms: int, end_ms: int
) -> int | None:
    """The newest ``time`` in [start, end) of ``table``'s rows of the inventory's nodes and
    the removed ones', read as one probe of the table's (node_id, time) primary key per node
    (a removed node's samples count in the windows that hold them). A time-range query would
    read PostgreSQL's BRIN time index, which finds no row of a recent range without scanning
    most of the table (2.7 s per fitted window on 1,000 nodes' two days of raw scrapes, 13 s
    once collection had stopped three days before). Removed nodes as the window's totals count
    them (``removed_nodes``: removed since ``start_ms`` less the margin), so a window is never
    fitted to samples its pages leave out, and the probes do not grow with every node ever
    removed."""
    gone = select(RemovedNode.id.label("id")).where(counted_since(start_ms))
    node = union_all(select(Node.id.label("id")), gone).subquery()
    per_node = (
        select(func.max(time))
        .where(table.c.node_id == node.c.id, time >= start_ms, time < end_ms)
        .scalar_subquery()
    )
    newest = conn.execute(select(func.max(per_node)).select_from(node)).scalar()
    return None if newest is None else int(newest)


def collection_stopped(conn: Connection, now_ms: int) -> int | None:
    """When collection stopped: the last scrape's time, where there is none in the last
    :data:`STRETCH_GAP_MS` but one in the longest fitted span; None while scrapes arrive (or
    there never were any: nothing to be stale)."""
    if sampled_between(conn, now_ms - STRETCH_GAP_MS, now_ms + 1):
        return None
    longest_ms = max(span for span, _ in FIT_SPANS.values())
    return last_sampled(conn, now_ms - longest_ms, now_ms + 1)


def fitted_window(conn: Connection, now_ms: int) -> Window:
    """:func:`fit_window` over what the collector recorded in the database."""
    return fit_window(
        lambda a, b: sampled_between(conn, a, b), lambda a, b: last_sampled(conn, a, b), now_ms
    )


def duration_ms(text: str) -> int:
    """``15m``, ``1h``, ``90s``, ``1.5d``: a whole number of milliseconds, above zero."""
    m = _DURATION.fullmatch(text.strip().lower())
    span = round(float(m[1]) * _UNIT_MS[m[2]]) if m else 0
    if span <= 0:
        raise InvalidArgument(f"not a duration: {text!r} (e.g. 90s, 15m, 1h, 7d)")
    return span


def window_of(text: str, now_ms: int) -> Window:
    """The last ``text`` (a duration) up to ``now_ms``, bucketed like the shortest named window
    at least as long. One reaching back before 1970, when nothing was recorded, starts there:
    3000000d reached before year 1 (no date shows it) and 1e17 days past any database integer."""
    span = duration_ms(text)
    step = next((s for w, s in WINDOWS.values() if w >= span), WINDOWS["30d"][1])
    return Window(text.strip(), max(0, now_ms - span), now_ms, step)


def bucket_starts(win: Window) -> list[int]:
    """Start of every time-series bucket of the window, the first one holding its start."""
    return list(range(win.start_ms - win.start_ms % win.step_ms, win.end_ms, win.step_ms))


def bucketed_rows(
    conn: Connection, query: Select[Any], starts: Sequence[int]
) -> Iterator[tuple[int, RowMapping]]:
    """Each row of ``query`` (a ``rollup.buckets`` time series) with the index in ``starts``
    (``bucket_starts``) of its bucket; a row of a bucket not among them is passed over."""
    pos = {b: i for i, b in enumerate(starts)}
    for r in conn.execute(query):
        m = r._mapping
        i = pos.get(int(m["bucket_ms"]))
        if i is not None:
            yield i, m
