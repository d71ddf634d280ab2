"""The event hub: sequence numbers, followers that fall behind, waiting, and resync."""

from __future__ import annotations

import threading
import time

from kvctl.agent.events import EventHub


def publish(hub: EventHub, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        hub.publish({"type": "store", "i": i})


def seqs(events: list[dict[str, object]]) -> list[object]:
    return [e["seq"] for e in events]


def test_sequence_numbers_increase_and_events_keep_their_fields() -> None:
    hub = EventHub(16)
    assert hub.last_seq == 0
    before = time.time()
    publish(hub, 3)
    assert hub.last_seq == 3
    batch = hub.read(0)
    assert seqs(batch.events) == [1, 2, 3]
    assert [e["i"] for e in batch.events] == [0, 1, 2]
    assert all(e["type"] == "store" for e in batch.events)
    assert all(before <= e["time_s"] <= time.time() for e in batch.events)  # type: ignore[operator]
    assert (batch.last_seq, batch.dropped) == (3, 0)


def test_read_after_returns_only_newer_events_and_respects_limit() -> None:
    hub = EventHub(100)
    publish(hub, 10)
    b = hub.read(4)
    assert seqs(b.events) == [5, 6, 7, 8, 9, 10] and b.last_seq == 10 and b.dropped == 0
    b = hub.read(4, limit=2)
    assert seqs(b.events) == [5, 6] and b.last_seq == 6
    b = hub.read(b.last_seq, limit=3)
    assert seqs(b.events) == [7, 8, 9] and b.last_seq == 9
    b = hub.read(b.last_seq)
    assert seqs(b.events) == [10]
    # caught up: nothing, and the cursor stays put
    b = hub.read(10)
    assert (b.events, b.last_seq, b.dropped) == ([], 10, 0)


def test_a_follower_that_falls_behind_learns_how_many_it_missed() -> None:
    hub = EventHub(4)
    publish(hub, 10)  # seqs 7..10 are kept
    b = hub.read(0)
    assert b.dropped == 6 and seqs(b.events) == [7, 8, 9, 10] and b.last_seq == 10
    b = hub.read(2)
    assert b.dropped == 4 and seqs(b.events) == [7, 8, 9, 10]
    b = hub.read(6)  # exactly at the edge: nothing missed
    assert b.dropped == 0 and seqs(b.events) == [7, 8, 9, 10]
    b = hub.read(3, limit=1)  # continues from the oldest kept event
    assert b.dropped == 3 and seqs(b.events) == [7] and b.last_seq == 7
    b = hub.read(b.last_seq)
    assert b.dropped == 0 and seqs(b.events) == [8, 9, 10]

    # a follower keeps up by reading from each batch's last_seq, and loses nothing more
    publish(hub, 3, start=10)
    b = hub.read(10)
    assert b.dropped == 0 and seqs(b.events) == [11, 12, 13]


def test_read_waits_for_a_publish_from_another_thread() -> None:
    hub = EventHub(16)
    publish(hub, 2)
    timer = threading.Timer(0.05, lambda: hub.publish({"type": "late"}))
    timer.start()
    try:
        t0 = time.monotonic()
        b = hub.read(2, timeout_s=60.0)
        elapsed = time.monotonic() - t0
    finally:
        timer.cancel()
        timer.join()
    assert seqs(b.events) == [3] and b.events[0]["type"] == "late"
    assert b.last_seq == 3 and b.dropped == 0
    assert elapsed < 30.0  # woken by the publish, not by the 60 s timeout


def test_read_with_events_already_there_does_not_wait() -> None:
    hub = EventHub(16)
    publish(hub, 1)
    t0 = time.monotonic()
    b = hub.read(0, timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0
    assert seqs(b.events) == [1]


def test_read_times_out_with_nothing_new() -> None:
    hub = EventHub(16)
    publish(hub, 2)
    t0 = time.monotonic()
    b = hub.read(2, timeout_s=0.1)
    elapsed = time.monotonic() - t0
    assert (b.events, b.last_seq, b.dropped) == ([], 2, 0)
    assert 0.05 <= elapsed < 30.0  # waited, and not for ever


def test_many_publishers_one_follower_sees_every_event_once() -> None:
    hub = EventHub(100_000)
    n_threads, per_thread = 4, 500

    def work(t: int) -> None:
        for i in range(per_thread):
            hub.publish({"t": t, "i": i})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    got: list[dict[str, object]] = []
    cursor = 0
    deadline = time.monotonic() + 20
    while len(got) < n_threads * per_thread and time.monotonic() < deadline:
        b = hub.read(cursor, limit=97, timeout_s=0.05)
        assert b.dropped == 0
        got.extend(b.events)
        cursor = b.last_seq
    for th in threads:
        th.join()
    assert seqs(got) == list(range(1, n_threads * per_thread + 1))
    for t in range(n_threads):  # each publisher's events in its own order
        assert [e["i"] for e in got if e["t"] == t] == list(range(per_thread))


def test_a_follower_from_before_a_restart_resyncs_to_last_seq() -> None:
    hub = EventHub(16)  # a new hub: the follower's cursor is from the old one
    publish(hub, 3)
    b = hub.read(1000)
    assert (b.events, b.last_seq, b.dropped) == ([], 3, 0)
    publish(hub, 1)
    b = hub.read(b.last_seq)
    assert seqs(b.events) == [4] and b.dropped == 0
    # an empty new hub resyncs to 0
    b = EventHub(16).read(50)
    assert (b.events, b.last_seq, b.dropped) == ([], 0, 0)


def test_a_stale_follower_resyncs_at_once_even_when_it_would_wait() -> None:
    hub = EventHub(16)
    publish(hub, 3)
    t0 = time.monotonic()
    # a wait far longer than any scheduling delay: answering before it ran out is the point
    b = hub.read(1000, timeout_s=60.0)
    elapsed = time.monotonic() - t0
    assert (b.events, b.last_seq, b.dropped) == ([], 3, 0)
    assert elapsed < 30.0


def test_a_cursor_past_the_newest_seq_answers_the_newest_seq_and_the_instance() -> None:
    # the fleet index's followers note where to resume a resync this way (one request), and
    # tell a restarted agent by its new instance
    from kvctl.agent.events import EventHub

    hub = EventHub(capacity=4)
    for i in range(6):
        hub.publish({"type": "store", "key": f"{i:032x}"})
    batch = hub.read(2**63 - 1, limit=1)
    assert (batch.events, batch.last_seq, batch.dropped) == ([], 6, 0)
    assert batch.instance == hub.instance and len(hub.instance) == 16
    assert EventHub().instance != hub.instance
    # a follower that fell behind the buffer learns how many it missed
    behind = hub.read(0)
    assert behind.dropped == 2 and [e["seq"] for e in behind.events] == [3, 4, 5, 6]
