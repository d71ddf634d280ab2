"""Counter increases across restarts: the sum of increases equals what really happened."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from kvctl.counters import CounterTracker


def test_first_sample_is_a_baseline() -> None:
    t = CounterTracker()
    assert t.increase("s", {"hits": 500.0}, epoch=1.0, ts_ms=0) == {"hits": 0.0}
    assert t.increase("s", {"hits": 520.0}, epoch=1.0, ts_ms=10) == {"hits": 20.0}


def test_new_epoch_means_counted_from_zero() -> None:
    t = CounterTracker()
    t.increase("s", {"hits": 500.0}, epoch=1.0, ts_ms=0)
    # the agent restarted and has already counted 700 since: more than before, still a reset
    assert t.increase("s", {"hits": 700.0}, epoch=2.0, ts_ms=10) == {"hits": 700.0}
    assert t.increase("s", {"hits": 710.0}, epoch=2.0, ts_ms=20) == {"hits": 10.0}


def test_a_scrape_without_its_epoch_keeps_the_known_one() -> None:
    # an agent whose start time was unreadable once: the restart after it must still be seen
    # (the unknown epoch used to replace the known one, and 150 after 110 counted 40)
    t = CounterTracker()
    t.increase("s", {"hits": 100.0}, epoch=1.0, ts_ms=0)
    assert t.increase("s", {"hits": 110.0}, epoch=None, ts_ms=10) == {"hits": 10.0}
    assert t.increase("s", {"hits": 150.0}, epoch=2.0, ts_ms=20) == {"hits": 150.0}


def test_a_restart_seen_without_its_epoch_is_not_counted_again_at_the_next_epoch() -> None:
    # the agent restarted and its start time was unreadable that once: the drop to 5 is the
    # restart (counted whole); the new epoch at the next scrape is that same restart, so 8
    # adds 3, not 8 again (the kept old epoch made it a second restart: 13 counted for 8)
    t = CounterTracker()
    t.increase("s", {"hits": 100.0}, epoch=1.0, ts_ms=0)
    assert t.increase("s", {"hits": 5.0}, epoch=None, ts_ms=10) == {"hits": 5.0}
    assert t.increase("s", {"hits": 8.0}, epoch=2.0, ts_ms=20) == {"hits": 3.0}


def test_an_impossibly_fast_increase_is_dropped_for_good() -> None:
    # a counter bouncing between 2**62 and 0 (a hostile or broken source): each row fit a
    # BIGINT, but a minute's rollup summed past it and stopped every series' rollups
    t = CounterTracker()
    t.increase("s", {"bytes": 0.0, "hits": 5.0}, epoch=1.0, ts_ms=0)
    big = float(2**62)
    assert t.increase("s", {"bytes": big, "hits": 6.0}, epoch=1.0, ts_ms=1000) == {
        "bytes": None,
        "hits": 1.0,
    }
    # a fall towards zero is a reset even within the run (a correction is a small step back):
    # counted from zero, and the bounce back up is again too fast to count
    assert t.increase("s", {"bytes": 0.0}, epoch=1.0, ts_ms=2000) == {"bytes": 0.0}
    assert t.increase("s", {"bytes": big}, epoch=1.0, ts_ms=3000) == {"bytes": None}
    # the jump is the new baseline: counting goes on from it, the jump is never counted
    assert t.increase("s", {"bytes": big + 5e10}, epoch=1.0, ts_ms=4000) == {"bytes": 5e10}
    # a real node's fastest counters pass: 50 GB/s over a 10 s interval, and a restart's count
    t.increase("r", {"bytes": 0.0}, epoch=1.0, ts_ms=0)
    assert t.increase("r", {"bytes": 5e11}, epoch=1.0, ts_ms=10_000) == {"bytes": 5e11}
    assert t.increase("r", {"bytes": 4e10}, epoch=2.0, ts_ms=11_000) == {"bytes": 4e10}
    assert t.increase("r", {"bytes": big}, epoch=3.0, ts_ms=12_000) == {"bytes": None}


def test_a_counter_going_back_within_a_run_is_a_correction_not_a_restart() -> None:
    """An agent moves a hit from reuse to sharing once the copy that arrived names its owner
    (RemoteTierCounts.recount_owner): reuse_hits goes back by one under the same start time.
    Read as a restart it counted reuse_hits' whole value again (and the hits-beyond-lookups
    check then dropped the interval's hits). Now: nothing counted, and the run's total is the
    agent's own once the counter passes its high mark."""
    t = CounterTracker()
    t.increase("s", {"reuse": 100.0, "sharing": 40.0}, epoch=1.0, ts_ms=0)
    assert t.increase("s", {"reuse": 105.0, "sharing": 40.0}, epoch=1.0, ts_ms=10) == {
        "reuse": 5.0,
        "sharing": 0.0,
    }
    # one of those 5 was the other owner's: moved to sharing
    assert t.increase("s", {"reuse": 104.0, "sharing": 41.0}, epoch=1.0, ts_ms=20) == {
        "reuse": 0.0,
        "sharing": 1.0,
    }
    assert t.increase("s", {"reuse": 110.0, "sharing": 41.0}, epoch=1.0, ts_ms=30) == {
        "reuse": 5.0,  # from the high mark, 105: 5 + 0 + 5 = 110 - 100, the run's own
        "sharing": 0.0,
    }
    # a restart is still one: a new start time counts from zero
    assert t.increase("s", {"reuse": 3.0, "sharing": 1.0}, epoch=2.0, ts_ms=40) == {
        "reuse": 3.0,
        "sharing": 1.0,
    }


def test_a_counter_going_down_is_a_reset_without_an_epoch() -> None:
    t = CounterTracker()
    t.increase("e", {"tokens": 1000.0}, epoch=None, ts_ms=0)
    assert t.increase("e", {"tokens": 30.0}, epoch=None, ts_ms=10) == {"tokens": 30.0}


def test_absent_reading_is_none_and_resumes_later() -> None:
    t = CounterTracker()
    t.increase("e", {"a": 10.0, "b": 5.0}, epoch=None, ts_ms=0)
    assert t.increase("e", {"a": 12.0, "b": None}, epoch=None, ts_ms=10) == {"a": 2.0, "b": None}
    assert t.increase("e", {"a": 12.0, "b": 9.0}, epoch=None, ts_ms=20) == {"a": 0.0, "b": 4.0}


def test_a_counter_first_shown_late_is_counted_from_zero_or_is_a_baseline() -> None:
    t = CounterTracker()
    t.increase("e", {"a": 10.0}, epoch=None, ts_ms=0)
    # created since (a labelled child at its first increment): all of it is new
    assert t.increase("e", {"a": 11.0, "b": 7.0}, epoch=None, ts_ms=10) == {"a": 1.0, "b": 7.0}
    u = CounterTracker()
    u.increase("e", {"a": 10.0}, epoch=None, ts_ms=0, missing_means_unread=True)
    # hidden before though counting: its first value is a baseline, then increases
    got = u.increase("e", {"a": 11.0, "b": 7.0}, epoch=None, ts_ms=10, missing_means_unread=True)
    assert got == {"a": 1.0, "b": None}
    got = u.increase("e", {"a": 11.0, "b": 9.0}, epoch=None, ts_ms=20, missing_means_unread=True)
    assert got == {"a": 0.0, "b": 2.0}
    # a restart (the counters fell) still counts everything from zero
    got = u.increase("e", {"a": 3.0, "b": 4.0}, epoch=None, ts_ms=30, missing_means_unread=True)
    assert got == {"a": 3.0, "b": 4.0}


def test_a_counter_unknown_since_the_baseline_is_a_baseline_when_first_read() -> None:
    """b could not be read at the series' first sample nor the next (None): its first known
    value is its baseline, not 9 M counted in one interval. Before, it was counted from zero,
    a spike of its all-time count; every user of the tracker saw it (the collector's engine
    rows among them)."""
    t = CounterTracker()
    assert t.increase("e", {"a": 10.0, "b": None}, epoch=1.0, ts_ms=0) == {"a": 0.0, "b": None}
    assert t.increase("e", {"a": 12.0, "b": None}, epoch=1.0, ts_ms=10) == {"a": 2.0, "b": None}
    got = t.increase("e", {"a": 13.0, "b": 9e6}, epoch=1.0, ts_ms=20)
    assert got == {"a": 1.0, "b": None}
    assert t.increase("e", {"a": 13.0, "b": 9e6 + 5}, epoch=1.0, ts_ms=30) == {"a": 0.0, "b": 5.0}


def test_a_counter_unknown_after_a_restart_counts_from_zero_when_read() -> None:
    """A restart counts every counter from zero: one unknown at the restart's first sample
    has its value since the restart when read, not a baseline (and not unread for ever)."""
    t = CounterTracker()
    t.increase("e", {"a": 10.0, "b": None}, epoch=1.0, ts_ms=0)
    assert t.increase("e", {"a": 3.0, "b": None}, epoch=2.0, ts_ms=10) == {"a": 3.0, "b": None}
    assert t.increase("e", {"a": 4.0, "b": 6.0}, epoch=2.0, ts_ms=20) == {"a": 1.0, "b": 6.0}


def test_a_counter_unknown_since_the_baseline_stays_so_across_a_collector_restart(db) -> None:  # type: ignore[no-untyped-def]
    first = CounterTracker()
    first.increase("engine:1", {"a": 10.0, "b": None}, epoch=1.0, ts_ms=0)
    with db.begin() as conn:
        first.save(conn)
    second = CounterTracker()
    with db.connect() as conn:
        second.load(conn, ["engine:"])
    got = second.increase("engine:1", {"a": 12.0, "b": 9e6}, epoch=1.0, ts_ms=10)
    assert got == {"a": 2.0, "b": None}


def test_series_are_independent() -> None:
    t = CounterTracker()
    t.increase("x", {"n": 1.0}, epoch=1.0, ts_ms=0)
    assert t.increase("y", {"n": 100.0}, epoch=1.0, ts_ms=0) == {"n": 0.0}
    assert t.increase("x", {"n": 3.0}, epoch=1.0, ts_ms=10) == {"n": 2.0}


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 1000)),  # (restart before this step, events)
        min_size=1,
        max_size=40,
    )
)
def test_sum_of_increases_is_exact_across_restarts(steps: list[tuple[bool, int]]) -> None:
    """Events after the baseline are all counted, however the process restarts, provided each
    restart is followed by a scrape (what happens between a scrape and a restart is lost)."""
    t = CounterTracker()
    epoch, counter = 0, 0
    t.increase("s", {"n": float(counter)}, epoch=float(epoch), ts_ms=0)
    total = 0.0
    for i, (restart, events) in enumerate(steps, 1):
        if restart:
            epoch, counter = epoch + 1, 0
        counter += events
        inc = t.increase("s", {"n": float(counter)}, epoch=float(epoch), ts_ms=i)["n"]
        assert inc is not None and inc >= 0
        total += inc
    assert total == sum(events for _r, events in steps)


def test_state_survives_a_collector_restart(db) -> None:  # type: ignore[no-untyped-def]
    first = CounterTracker()
    first.increase("cache:1:all", {"hits": 100.0}, epoch=5.0, ts_ms=0)
    with db.begin() as conn:
        assert first.save(conn) == 1
        assert first.save(conn) == 0  # nothing changed since
    first.increase("cache:1:all", {"hits": 130.0}, epoch=5.0, ts_ms=10)
    with db.begin() as conn:
        first.save(conn)
    second = CounterTracker()
    with db.connect() as conn:
        assert second.load(conn, ["cache:1:"]) == 1
        assert second.load(conn, ["cache:2:"]) == 0
    assert second.increase("cache:1:all", {"hits": 150.0}, epoch=5.0, ts_ms=20) == {"hits": 20.0}


@pytest.mark.parametrize(
    "state",
    [
        "not json",
        "[" * 100_000,  # nested too deep for Python's parser: RecursionError
        "[1, 2]",
        '{"epoch": "x", "values": {"hits": 1}}',
        '{"epoch": 5, "values": {"hits": "many"}}',
        '{"epoch": 5, "values": [1]}',
        '{"epoch": 5, "values": {"hits": 1}, "unread": [3]}',
        '{"epoch": true, "values": {"hits": 1}}',
        # an integer past float's range: math.isfinite raised OverflowError
        pytest.param('{"epoch": 1' + "0" * 400 + ', "values": {"hits": 1}}', id="epoch-1e400-int"),
        pytest.param('{"epoch": 5, "values": {"hits": 1' + "0" * 400 + "}}", id="value-1e400-int"),
    ],
)
def test_a_saved_state_no_collector_wrote_is_a_baseline_and_replaced(db, state: str) -> None:  # type: ignore[no-untyped-def]
    """A state row by hand, an import or a broken export failed every load (each collector
    cycle rereads the counters' state): the series' next reading is its baseline instead, and
    the next save replaces the row; the other series load as saved."""
    good = CounterTracker()
    good.increase("cache:1:all", {"hits": 100.0}, epoch=5.0, ts_ms=0)
    good.increase("cache:2:all", {"hits": 7.0}, epoch=5.0, ts_ms=0)
    with db.begin() as conn:
        assert good.save(conn) == 2
        conn.execute(
            text("UPDATE counter_state SET state = :s WHERE series = 'cache:1:all'"), {"s": state}
        )
    second = CounterTracker()
    with db.connect() as conn:
        assert second.load(conn, ()) == 2
    assert second.increase("cache:1:all", {"hits": 150.0}, epoch=5.0, ts_ms=20) == {"hits": 0.0}
    assert second.increase("cache:2:all", {"hits": 9.0}, epoch=5.0, ts_ms=20) == {"hits": 2.0}
    with db.begin() as conn:
        assert second.save(conn) == 2  # the row replaced, not taken for another writer's
    third = CounterTracker()
    with db.connect() as conn:
        third.load(conn, ())
    assert third.increase("cache:1:all", {"hits": 160.0}, epoch=5.0, ts_ms=30) == {"hits": 10.0}


def test_a_save_over_another_writers_state_is_refused(db) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from kvctl.counters import CountersMoved

    a, b = CounterTracker(), CounterTracker()
    a.increase("cache:1:all", {"hits": 100.0}, epoch=5.0, ts_ms=0)
    with db.begin() as conn:
        a.save(conn)
    with db.connect() as conn:
        b.load(conn, ())
    assert b.increase("cache:1:all", {"hits": 120.0}, epoch=5.0, ts_ms=10) == {"hits": 20.0}
    with db.begin() as conn:
        b.save(conn)
    # a counts the same 20 again from its own state: its save must not land
    assert a.increase("cache:1:all", {"hits": 125.0}, epoch=5.0, ts_ms=20) == {"hits": 25.0}
    with pytest.raises(CountersMoved) as moved, db.begin() as conn:
        a.save(conn)
    assert moved.value.series == ["cache:1:all"]
    assert moved.value.gone == [] and not moved.value.all_gone


def test_a_save_over_a_deleted_state_says_it_is_gone_not_another_writer(db) -> None:  # type: ignore[no-untyped-def]
    """The database emptied or made anew under a running collector: the save is refused (its
    state is not there), and the refusal says the state is gone, not that another collector
    saved it (an operator would look for a collector that does not exist)."""
    import pytest
    from sqlalchemy import delete

    from kvctl.counters import CountersMoved
    from kvctl.db.models import CounterState

    a = CounterTracker()
    for ts_ms, hits in ((0, 100.0), (10, 110.0)):  # saved twice: a row it wrote and updated
        a.increase("cache:1:all", {"hits": hits}, epoch=5.0, ts_ms=ts_ms)
        with db.begin() as conn:
            a.save(conn)
    with db.begin() as conn:
        conn.execute(delete(CounterState))
    a.increase("cache:1:all", {"hits": 120.0}, epoch=5.0, ts_ms=20)
    with pytest.raises(CountersMoved) as moved, db.begin() as conn:
        a.save(conn)
    assert moved.value.series == moved.value.gone == ["cache:1:all"]
    assert moved.value.all_gone and "is gone" in str(moved.value)


def test_a_save_whose_transaction_rolled_back_is_not_another_writer(db) -> None:  # type: ignore[no-untyped-def]
    t = CounterTracker()
    t.increase("cache:1:all", {"hits": 100.0}, epoch=5.0, ts_ms=0)
    with db.begin() as conn:
        t.save(conn)
    t.increase("cache:1:all", {"hits": 110.0}, epoch=5.0, ts_ms=10)
    conn = db.connect()
    trans = conn.begin()
    t.save(conn)
    trans.rollback()  # as when the batch's inserts failed
    conn.close()
    t.increase("cache:1:all", {"hits": 120.0}, epoch=5.0, ts_ms=20)
    with db.begin() as conn:
        assert t.save(conn) == 1


def _rebased_after_other_saved(db, series: str, first: dict[str, float], epoch: float | None):  # type: ignore[no-untyped-def]
    """Trackers ``mine`` and ``other``, both from ``first`` as saved at ts 1000."""
    mine, other = CounterTracker(), CounterTracker()
    with db.begin() as conn:
        mine.load(conn, ())
        mine.increase(series, first, epoch=epoch, ts_ms=1000)
        mine.save(conn)
    with db.begin() as conn:
        other.load(conn, ())
    return mine, other


def _save_refused_then_rebase(db, t: CounterTracker) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from kvctl.counters import CountersMoved

    with pytest.raises(CountersMoved) as moved, db.begin() as conn:
        t.save(conn)
    with db.connect() as conn:
        t.rebase(conn, moved.value.series)


def test_a_rebased_sample_without_an_epoch_is_ordered_by_its_values_not_the_stamps(db) -> None:  # type: ignore[no-untyped-def]
    # GPU energy has no epoch: the other collector's cycle began first (earlier stamp) but read
    # the GPU last; this one's sample, stamped later, was read earlier (lower). Read as a
    # reset by the stamps, it counted the GPU's all-time energy (1,000,200 J) for 300 J
    s = "power:1:0"
    mine, other = _rebased_after_other_saved(db, s, {"energy_j": 1_000_000.0}, None)
    assert other.increase(s, {"energy_j": 1_000_300.0}, epoch=None, ts_ms=60_000) == {
        "energy_j": 300.0
    }
    with db.begin() as conn:
        other.save(conn)
    assert mine.increase(s, {"energy_j": 1_000_200.0}, epoch=None, ts_ms=60_100) == {
        "energy_j": 200.0
    }
    _save_refused_then_rebase(db, mine)
    again = mine.increase(s, {"energy_j": 1_000_200.0}, epoch=None, ts_ms=60_100)
    assert again == {"energy_j": 0.0}  # the other's newer state stays
    with db.begin() as conn:
        mine.save(conn)
    # counting goes on from the other's reading: 300 + 0 + 100, the GPU's own 400
    assert mine.increase(s, {"energy_j": 1_000_400.0}, epoch=None, ts_ms=120_000) == {
        "energy_j": 100.0
    }


def test_a_rebased_sample_from_before_a_restart_counts_nothing_whatever_its_stamp(db) -> None:  # type: ignore[no-untyped-def]
    # the other collector read the agent after its restart (epoch 2) though its cycle was
    # stamped first; this one read it before the restart (epoch 1), stamped later. By the
    # stamps, the sample was newer and a restart back into epoch 1: its 150 counted whole
    s = "cache:1:all"
    mine, other = _rebased_after_other_saved(db, s, {"hits": 100.0}, 1.0)
    assert other.increase(s, {"hits": 30.0}, epoch=2.0, ts_ms=60_000) == {"hits": 30.0}
    with db.begin() as conn:
        other.save(conn)
    mine.increase(s, {"hits": 150.0}, epoch=1.0, ts_ms=60_100)
    _save_refused_then_rebase(db, mine)
    assert mine.increase(s, {"hits": 150.0}, epoch=1.0, ts_ms=60_100) == {"hits": 0.0}
    # and the restart's counts are counted once, by the other: this one goes on from its 30
    assert mine.increase(s, {"hits": 45.0}, epoch=2.0, ts_ms=120_000) == {"hits": 15.0}


def test_a_rebased_sample_from_after_a_restart_counts_from_zero_whatever_its_stamp(db) -> None:  # type: ignore[no-untyped-def]
    # the other way round: this one's sample is under the newer epoch though stamped first
    s = "cache:1:all"
    mine, other = _rebased_after_other_saved(db, s, {"hits": 100.0}, 1.0)
    assert other.increase(s, {"hits": 150.0}, epoch=1.0, ts_ms=60_100) == {"hits": 50.0}
    with db.begin() as conn:
        other.save(conn)
    mine.increase(s, {"hits": 30.0}, epoch=2.0, ts_ms=60_000)
    _save_refused_then_rebase(db, mine)
    assert mine.increase(s, {"hits": 30.0}, epoch=2.0, ts_ms=60_000) == {"hits": 30.0}
    assert mine.increase(s, {"hits": 45.0}, epoch=2.0, ts_ms=120_000) == {"hits": 15.0}


@pytest.mark.parametrize("existing", [True, False], ids=["existing", "new"])
def test_a_save_is_refused_where_another_saves_between_its_read_and_its_write(db, existing) -> None:  # type: ignore[no-untyped-def]
    # two collectors count the same interval of one series (a new one: both count it from zero
    # as the agent started while watched); the other saves right before this one writes,
    # after anything this one's save read. Both saves landed before: SQLite ignores FOR
    # UPDATE and took no lock before the write; a series with no row had nothing to lock
    from sqlalchemy import event, select

    from kvctl.counters import CountersMoved
    from kvctl.db.models import CounterState

    s = "cache:1:all"
    mine, other = CounterTracker(), CounterTracker()
    if existing:
        with db.begin() as conn:
            mine.increase(s, {"hits": 100.0}, epoch=5.0, ts_ms=0)
            mine.save(conn)
    for t in (mine, other):
        with db.connect() as conn:
            t.load(conn, ())
        t.started_while_watched(5.0, 0)
    counted = {"hits": 50.0 if existing else 150.0}
    assert mine.increase(s, {"hits": 150.0}, epoch=5.0, ts_ms=10) == counted
    assert other.increase(s, {"hits": 150.0}, epoch=5.0, ts_ms=11) == counted
    fired: list[str] = []

    def other_saves_first(_conn, _cursor, statement: str, *_args) -> None:  # type: ignore[no-untyped-def]
        write = statement.lstrip().upper().startswith(("INSERT", "UPDATE", "WITH"))
        if fired or not write or "counter_state" not in statement:
            return
        fired.append(statement)
        with db.begin() as conn2:
            if conn2.dialect.name == "postgresql":  # no deadlock where a lock is held
                conn2.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
            other.save(conn2)

    with pytest.raises(CountersMoved) as moved, db.begin() as conn:
        event.listen(conn, "before_cursor_execute", other_saves_first)
        mine.save(conn)
    assert fired and moved.value.series == [s]
    with db.connect() as conn:
        assert conn.execute(select(CounterState.ts_ms)).scalars().all() == [11]  # the other's
