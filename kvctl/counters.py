"""Cumulative counters in, exact increases out, across agent and engine restarts.

Agents and engines export counters that only grow until the process restarts. The database
stores the increase since the previous sample, so the sum over any window is exact. A restart
is seen either as a new epoch (the agent's start time) or as a counter going down (within one
epoch, only a fall past half its value); the increase is then the new value itself (counted
from zero). A counter going back a little (to half its value or more) within one epoch is a
correction, not a restart: it counts nothing, and counting goes on from its highest value.
The first sample of a series that kvctl has never seen only sets the baseline: its counts
happened at unknown times and are not attributed; unless its epoch began while the caller
watched (``started_while_watched``: an agent started after the collector did), when
everything it counted is in no earlier sample and the first sample counts from zero too, as
after a restart.
So does the first known value of a counter that was unknown (None: it could not be read) since
the series' baseline: its all-time count is no one interval's increase.
The last raw values live in ``counter_state`` so a restarted collector loses nothing.

Saves are compare-and-set: a series whose saved state moved since this tracker read or
wrote it (a second collector scraping the same node: a `kvctl collect --once` beside the loop)
refuses the save (``CountersMoved``). The caller drops what it computed from the stale state,
reads the saved state again (``rebase``) and counts its samples again from it: the increases
are counted once, from whichever collector saved first. A sample that the other collector's
saved state is newer than counts nothing (``rebase``), and that newer state stays.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from kvctl import json_text
from kvctl.db.models import CounterState

#: the fastest any counter of an agent or engine can grow, per second of the interval between
#: two samples (at least one second): 2**40 (1.1e12 bytes, lookups or joules a second), far past
#: what a node moves (a host link carries ~5e10 bytes/s). An increase beyond it is impossible:
#: a counter bouncing between 2**62 and 0 (a hostile or broken source) made each row fit a
#: BIGINT while a minute's rollup summed past it, and that one failed rollup stopped every
#: series' rollups. The jump is dropped (None, and its value is the new baseline)
MAX_INCREASE_PER_S = float(2**40)


@dataclass(slots=True)
class _Last:
    epoch: float | None
    values: dict[str, float]
    ts_ms: int
    #: counters unknown (None) at every sample since the series' baseline (or its epoch's
    #: start): no value to count from, so the first one read is a baseline
    unread: frozenset[str] = frozenset()


class CountersMoved(Exception):
    """The saved state of some series changed since this tracker read it: another writer, or
    (``gone``: those whose row is no more) the state deleted, as when the database was emptied
    or made anew under a running collector."""

    def __init__(self, series: list[str], gone: list[str] | None = None) -> None:
        self.series = series
        self.gone = gone or []
        if len(self.gone) == len(series):
            super().__init__(
                f"the saved state of {len(series)} counter series is gone, e.g. {series[0]}"
            )
        else:
            super().__init__(
                f"{len(series)} counter series saved by another writer, e.g. {series[0]}"
            )

    @property
    def all_gone(self) -> bool:
        """No series was saved by another writer: their state was deleted."""
        return len(self.gone) == len(self.series)


#: epochs a tracker keeps of those whose restart counts nothing: one a scrape of a node that
#: restarts at every scrape, which needs only its latest
_MAX_NOT_COUNTED = 1024

#: series written per statement (SQLite allows 32,766 bound parameters)
_CHECK_BATCH = 500

_TABLE = CounterState.__tablename__


@dataclass(slots=True)
class CounterTracker:
    _last: dict[str, _Last] = field(default_factory=dict)
    _dirty: set[str] = field(default_factory=set)
    #: each series' ``ts_ms`` in the database before this tracker's last save of it, and the
    #: one that save wrote: the database holds one of the two, as that save's transaction was
    #: committed or rolled back, unless another writer saved it since
    _saved_ts_ms: dict[str, int | None] = field(default_factory=dict)
    _written_ts_ms: dict[str, int] = field(default_factory=dict)
    #: epochs (sources' start times, on their own clocks) known to have begun while the caller
    #: watched, and when on the caller's clock (ms): their first samples count from zero
    _watched: dict[float, int] = field(default_factory=dict)
    #: series whose state another writer saved, read again (``rebase``): their next sample is
    #: checked against that state, which may be newer than the sample
    _rebased: set[str] = field(default_factory=set)
    #: epochs whose restart counts nothing (``restart_not_counted``), the latest few
    _not_counted: dict[float, None] = field(default_factory=dict)

    def restart_not_counted(self, epoch: float) -> None:
        """A restart into ``epoch`` is not believed: a series' first sample under it is a
        baseline (its increases None, unknown), not counted from zero. For a source that says
        it restarted at every sample (``collectors.collector`` tells which): counted from zero
        each time, its whole counters were counted again at every sample."""
        self._not_counted[epoch] = None
        while len(self._not_counted) > _MAX_NOT_COUNTED:
            del self._not_counted[next(iter(self._not_counted))]

    def started_while_watched(self, epoch: float, start_ms: int) -> None:
        """The source whose start time is ``epoch`` (its own clock) started while the caller
        watched, at ``start_ms`` on the caller's clock: every count of that epoch happened
        since, in no earlier sample, so a series' first sample under it counts from zero
        rather than setting a baseline. The caller must know it without comparing the two
        clocks (hosts' clocks differ): say by the source's own uptime against its own."""
        self._watched[epoch] = start_ms

    def increase(
        self,
        series: str,
        values: Mapping[str, float | None],
        *,
        epoch: float | None,
        ts_ms: int,
        missing_means_unread: bool = False,
    ) -> dict[str, float | None]:
        """Increase of each counter since the previous sample of ``series``; None where the
        counter is unknown now (None in ``values``: a reading that could not be taken, or one
        rejected as impossible). An unknown counter keeps its last known value, so its
        increase is counted whole at the next sample that reads it. An increase faster than
        ``MAX_INCREASE_PER_S`` is None too, and is never counted.

        A counter unknown since the series' baseline (or since its restart's samples began)
        has no value to count from: its first known value is a baseline (None), never its
        all-time count as one interval's increase. A counter absent from ``values`` (not
        exposed), then present, is counted from zero (it was created since: a labelled child
        appears at its first increment), unless ``missing_means_unread``: the source leaves
        out counters that keep counting (TensorRT-LLM's JSON stats when idle), so its first
        value is a baseline (None), not an increase.

        The first sample of a series is its baseline (increases 0), unless its ``epoch``
        began while the caller watched (``started_while_watched``): then each counter read
        counts from zero, as after a restart (one unknown still leaves the next its baseline).
        """
        prev = self._last.get(series)
        if series in self._rebased:
            self._rebased.discard(series)
            if prev is not None and _older(prev, values, epoch):
                # another writer read the source after this sample was taken, and counted up
                # to its reading: nothing here is new, and its newer state stays
                return {k: None if v is None else 0.0 for k, v in values.items()}
        restarted = prev is not None and epoch is not None and prev.epoch not in (None, epoch)
        if restarted and epoch in self._not_counted:
            # a baseline under the new epoch: the next sample counts from it
            kept_now = {k: v for k, v in values.items() if v is not None}
            unread_now = frozenset(k for k, v in values.items() if v is None)
            self._last[series] = _Last(epoch, kept_now, ts_ms, unread_now)
            self._dirty.add(series)
            return dict.fromkeys(values)
        # a restart counts every counter from zero, read or not: nothing is left unread
        unread = set() if prev is None or restarted else set(prev.unread)
        out: dict[str, float | None] = {}
        held: dict[str, float] = {}  # counters that went back within a run: their high marks
        began_ms = None if prev is not None or epoch is None else self._watched.get(epoch)
        if prev is not None:
            interval_s = (ts_ms - prev.ts_ms) / 1000
        else:  # since the epoch began, where it began while watched (the caller's clock)
            interval_s = 0.0 if began_ms is None else (ts_ms - began_ms) / 1000
        max_increase = MAX_INCREASE_PER_S * max(interval_s, 1.0)
        for name, value in values.items():
            before = None if prev is None else prev.values.get(name)
            if value is None:
                out[name] = None
                if prev is None:  # unknown at the baseline: nothing to count from, ever
                    unread.add(name)
                continue
            if prev is None:
                out[name] = 0.0 if began_ms is None else value  # counted from zero if watched
            elif name in unread:
                out[name] = None  # its first known value: the baseline
            elif before is None and not restarted and missing_means_unread:
                out[name] = None
            elif (
                before is not None
                and before / 2 <= value < before
                and epoch is not None
                and prev.epoch == epoch
            ):
                # the same run's counter went back a little: no restart (that is a new epoch,
                # or a fall towards zero) but a correction, e.g. an agent moving a hit from
                # reuse to sharing once the copy that arrived named its owner. Counted as a
                # restart it added the counter's whole value again; nothing now, and counting
                # goes on from the high mark, so the run's total stays the agent's. A fall
                # past half is a reset as before: a high mark left by a jump too fast to count
                # (a bouncing counter) must not hold the series for the rest of the run
                out[name] = 0.0
                held[name] = before
            elif restarted or before is None or value < before:
                out[name] = value
            else:
                out[name] = value - before
            counted = prev is not None or began_ms is not None
            if (inc := out[name]) is not None and counted and inc > max_increase:
                out[name] = None  # impossible: not counted now, nor later (the new baseline)
            unread.discard(name)
        kept = {} if prev is None or restarted else dict(prev.values)
        kept.update({k: v for k, v in values.items() if v is not None})
        kept.update(held)
        known_epoch = epoch
        if epoch is None and prev is not None:
            # an epoch unread this once is not a new one: keep the known one, so a restart
            # before the next scrape is still told apart from counting on; unless a counter
            # went back (a restart, counted above): the next epoch read is that restart's
            went_back = any(
                v is not None and (b := prev.values.get(k)) is not None and v < b
                for k, v in values.items()
            )
            known_epoch = None if went_back else prev.epoch
        self._last[series] = _Last(known_epoch, kept, ts_ms, frozenset(unread))
        self._dirty.add(series)
        return out

    def last_ts_ms(self, series: str) -> int | None:
        """When ``series`` was last sampled; None before its first sample."""
        last = self._last.get(series)
        return None if last is None else last.ts_ms

    def load(self, conn: Connection, prefixes: Iterable[str]) -> int:
        """Read saved state for series starting with any of ``prefixes``; returns rows read."""
        wanted = tuple(prefixes)
        n = 0
        for series, state, ts_ms in conn.execute(
            select(CounterState.series, CounterState.state, CounterState.ts_ms)
        ):
            if wanted and not series.startswith(wanted):
                continue
            last = _state_from_json(state, ts_ms)
            if last is None:  # no collector wrote it: the next reading is the baseline
                self._last.pop(series, None)
            else:
                self._last[series] = last
            self._saved_ts_ms[series] = ts_ms  # replaced at the next save, compared as any
            self._written_ts_ms.pop(series, None)
            self._dirty.discard(series)
            n += 1
        return n

    def forget(self) -> None:
        """Drop every series' state (unsaved changes included), keeping the epochs watched:
        the next ``load`` reads the saved state afresh."""
        self._last.clear()
        self._dirty.clear()
        self._saved_ts_ms.clear()
        self._written_ts_ms.clear()
        self._rebased.clear()

    def rebase(self, conn: Connection, moved: Iterable[str]) -> None:
        """After ``CountersMoved``: every series' state as saved (what this tracker computed
        since its last save is dropped, to be computed again from it), ``moved`` being those
        another writer saved. The next sample of each of those is checked against that state:
        one the other writer's reading is newer than (an earlier epoch; where the epochs do not
        say a restart, any counter below the state's) counts nothing and leaves the state as
        saved, never read as a restart that counts it all again."""
        self.forget()
        self.load(conn, ())
        self._rebased = set(moved)

    def save(self, conn: Connection) -> int:
        """Write the state of series changed since the last save; returns rows written.

        Each series is compared and set in one statement: an existing one's row is updated
        only where it still holds the state this tracker read or wrote (``ts_ms``), a new one
        inserted only where no row exists yet. Any series missed (another writer saved it
        since, or saves it now: PostgreSQL's row or key lock makes this one wait for that
        writer's commit, SQLite's write lock serialises the two) refuses the save
        (``CountersMoved``, naming every one missed); the caller rolls the transaction back.
        A check read apart from its write let two savers both pass it and both write: SQLite
        ignores ``FOR UPDATE`` and is not in a transaction before the first write, and a
        series with no row yet had nothing to lock."""
        if not self._dirty:
            return 0
        dirty = sorted(self._dirty)
        state = {s: (_state_json(self._last[s]), self._last[s].ts_ms) for s in dirty}
        # what the database held before this save, as this tracker expects it: the state its
        # last save wrote (its transaction committed), else the one before it (rolled back, or
        # read by ``load``); None: no row
        old: dict[str, int | None] = {}
        first = {
            s: w if (w := self._written_ts_ms.get(s)) is not None else self._saved_ts_ms.get(s)
            for s in dirty
        }
        for s in self._update(conn, state, {s: ts for s, ts in first.items() if ts is not None}):
            old[s] = first[s]
        before = {
            s: ts
            for s in dirty
            if s not in old and s in self._written_ts_ms
            and (ts := self._saved_ts_ms.get(s)) is not None
        }  # fmt: skip
        for s in self._update(conn, state, before):
            old[s] = before[s]
        no_row = [s for s in dirty if s not in old and self._saved_ts_ms.get(s) is None]
        for s in self._insert(conn, state, no_row):
            old[s] = None
        moved = [s for s in dirty if s not in old]
        if moved:
            raise CountersMoved(moved, self._without_row(conn, moved))
        for s in dirty:
            self._saved_ts_ms[s] = old[s]
            self._written_ts_ms[s] = state[s][1]
        self._dirty.clear()
        return len(dirty)

    @staticmethod
    def _without_row(conn: Connection, series: list[str]) -> list[str]:
        """Those of ``series`` with no saved state at all (deleted, not saved anew)."""
        found: set[str] = set()
        for i in range(0, len(series), _CHECK_BATCH):
            part = series[i : i + _CHECK_BATCH]
            params = {f"s{n}": sid for n, sid in enumerate(part)}
            names = ", ".join(f":s{n}" for n in range(len(part)))
            stmt = text(f"SELECT series FROM {_TABLE} WHERE series IN ({names})")
            found.update(conn.execute(stmt, params).scalars())
        return [sid for sid in series if sid not in found]

    @staticmethod
    def _update(
        conn: Connection, state: dict[str, tuple[str, int]], expected: dict[str, int]
    ) -> set[str]:
        """Write ``state`` of each series in ``expected`` whose row's ``ts_ms`` is still the
        one expected; returns the series written."""
        written: set[str] = set()
        series = sorted(expected)
        for i in range(0, len(series), _CHECK_BATCH):
            part = series[i : i + _CHECK_BATCH]
            params: dict[str, Any] = {}
            rows = []
            for n, s in enumerate(part):
                params.update({f"s{n}": s, f"j{n}": state[s][0], f"t{n}": state[s][1]})
                params[f"e{n}"] = expected[s]
                rows.append(
                    f"(CAST(:s{n} AS VARCHAR(255)), CAST(:j{n} AS TEXT), "
                    f"CAST(:t{n} AS BIGINT), CAST(:e{n} AS BIGINT))"
                )
            stmt = text(
                f"WITH v(sid, new_state, new_ts, expected) AS (VALUES {', '.join(rows)}) "
                f"UPDATE {_TABLE} SET state = v.new_state, ts_ms = v.new_ts FROM v "
                f"WHERE {_TABLE}.series = v.sid AND {_TABLE}.ts_ms = v.expected "
                "RETURNING series"
            )
            written.update(conn.execute(stmt, params).scalars())
        return written

    @staticmethod
    def _insert(conn: Connection, state: dict[str, tuple[str, int]], series: list[str]) -> set[str]:
        """Insert ``state`` of each of ``series`` that has no row; returns those inserted."""
        insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        written: set[str] = set()
        for i in range(0, len(series), _CHECK_BATCH):
            rows = [
                {"series": s, "state": state[s][0], "ts_ms": state[s][1]}
                for s in series[i : i + _CHECK_BATCH]
            ]
            stmt = (
                insert(CounterState).values(rows).on_conflict_do_nothing(index_elements=["series"])
            )
            written.update(conn.execute(stmt.returning(CounterState.series)).scalars())
        return written


def _older(prev: _Last, values: Mapping[str, float | None], epoch: float | None) -> bool:
    """Whether a sample (``values`` under ``epoch``) was read before ``prev``, another
    writer's state of the same series. Where both epochs are known and differ, the earlier
    run's sample is the older (a source's start times are on its own clock: comparable).
    Otherwise (the same epoch, or either unknown: GPU energy and engines without a start time
    have none) some counter below the state's says the sample is older: counters only grow
    within a run, and a restart between the two readings is counted from the next sample.
    The collectors' stamps (each one's cycle start, on its own host's clock, not when it read
    the node) never decide: misordered, a sample read earlier but stamped later was read as a
    reset, and counted its whole value (a GPU's all-time energy) as one interval's."""
    if epoch is not None and prev.epoch is not None and epoch != prev.epoch:
        return epoch < prev.epoch
    return any(
        v is not None and (before := prev.values.get(k)) is not None and v < before
        for k, v in values.items()
    )


def _number(v: object) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range ('1' and 400 zeros): no count of ours
        return False


def _state_from_json(state: str, ts_ms: int) -> _Last | None:
    """A series' saved state as ``_state_json`` wrote it; None for anything else (a row by
    hand, an import, a broken export: not JSON, JSON nested too deep to parse, other types),
    which would otherwise fail every load of the counters' state, each cycle."""
    try:
        data = json_text.loads(state)
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict):
        return None
    epoch, values, unread = data.get("epoch"), data.get("values", {}), data.get("unread", [])
    if epoch is not None and not _number(epoch):
        return None
    if not isinstance(values, dict) or not all(_number(v) for v in values.values()):
        return None
    if not isinstance(unread, list) or not all(isinstance(k, str) for k in unread):
        return None
    return _Last(epoch, dict(values), ts_ms, frozenset(unread))


def _state_json(last: _Last) -> str:
    state: dict[str, Any] = {"epoch": last.epoch, "values": last.values}
    if last.unread:  # left out when empty: the state older collectors wrote and read
        state["unread"] = sorted(last.unread)
    return json.dumps(state)
