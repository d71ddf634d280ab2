"""kvctl top's calls to agents (kvctl.tui.asking): a poll waits for its calls up to its own
deadline; a call still running is never made twice, and its answer, once back, is the next
poll's (marked late) unless a fresh one came in time; failures are answers; the threads are
daemons, so a call stuck in a hung agent never holds up quitting."""

from __future__ import annotations

import threading
import time

from kvctl.tui.asking import Answer, Calls

#: the longest any test here waits on a call that is meant to be stuck: no timing claim
SHORT_S = 0.05


def deadline(seconds: float = SHORT_S) -> float:
    return time.perf_counter() + seconds


class Gated:
    """A job whose n-th call returns n once its gate opens (a gate per call)."""

    def __init__(self) -> None:
        self.calls = 0
        self.gates: list[threading.Event] = []
        self._lock = threading.Lock()

    def gate(self, n: int) -> threading.Event:
        with self._lock:
            while len(self.gates) < n:
                self.gates.append(threading.Event())
            return self.gates[n - 1]

    def __call__(self) -> int:
        with self._lock:
            self.calls += 1
            n = self.calls
        assert self.gate(n).wait(30), "a gate the test forgot to open"
        return n


def test_a_stuck_call_is_waiting_and_never_asked_twice() -> None:
    calls: Calls[int] = Calls()
    stuck, quick = Gated(), Gated()
    quick.gate(1).set()
    quick.gate(2).set()
    first = calls.start({"stuck": stuck, "quick": quick}).answers(deadline())
    assert first["quick"].value == 1 and not first["quick"].late
    assert first["stuck"].waiting and first["stuck"].value is None
    second = calls.start({"stuck": stuck, "quick": quick}).answers(deadline())
    assert second["stuck"].waiting
    assert second["stuck"].waiting_s is not None and first["stuck"].waiting_s is not None
    assert second["stuck"].waiting_s > first["stuck"].waiting_s  # the same call, older
    assert (stuck.calls, quick.calls) == (1, 2)
    stuck.gate(1).set()
    calls.close()


def settled(calls: Calls[int], key: str) -> None:
    """Until the call in flight for ``key`` has come back (its gate opened)."""
    pending = calls._pending[key].future
    assert pending.exception(timeout=30) is None  # waits for it, whatever it returned


def test_a_late_answer_is_the_next_polls_unless_a_fresh_one_comes_in_time() -> None:
    calls: Calls[int] = Calls()
    job = Gated()
    assert calls.start({"a": job}).answers(deadline())["a"].waiting
    job.gate(1).set()  # the first call comes back after its poll's deadline
    settled(calls, "a")
    # the second call is stuck: the first one's answer stands in, marked late
    late = calls.start({"a": job}).answers(deadline())["a"]
    assert (late.value, late.late) == (1, True) and late.at_s is not None
    job.gate(2).set()
    settled(calls, "a")
    job.gate(3).set()
    # a fresh answer within the deadline wins over the late one
    fresh = calls.start({"a": job}).answers(None)["a"]
    assert (fresh.value, fresh.late) == (3, False)
    assert job.calls == 3
    calls.close()


def test_failures_are_answers_and_none_waits_for_every_call() -> None:
    calls: Calls[int] = Calls()

    def broken() -> int:
        raise ConnectionError("refused")

    out = calls.start({"x": broken, "y": lambda: 7}).answers(None)
    assert isinstance(out["x"].error, ConnectionError) and out["x"].value is None
    assert out["y"].value == 7 and out["y"].error is None
    calls.close()


def test_keys_no_longer_asked_are_forgotten_and_threads_are_daemons() -> None:
    calls: Calls[int] = Calls(name="test-ask")
    stuck = Gated()
    assert calls.start({"gone": stuck}).answers(deadline())["gone"].waiting
    threads = [t for t in threading.enumerate() if t.name.startswith("test-ask")]
    assert threads and all(t.daemon for t in threads)
    stuck.gate(1).set()
    again = Gated()
    again.gate(1).set()
    # "gone" left the inventory: its call's answer is not handed to anyone
    assert set(calls.start({"new": again}).answers(None)) == {"new"}
    calls.close()


def test_a_key_asked_no_new_call_keeps_its_call_in_flight_and_late_answer() -> None:
    """GPUs are asked every few polls: between, their call in flight is kept and its answer,
    once back, still handed over; a key with neither has no answer."""
    calls: Calls[int] = Calls()
    job = Gated()
    assert calls.start({"g": job}).answers(deadline())["g"].waiting
    assert calls.start({"g": None}).answers(deadline())["g"].waiting  # the same call
    job.gate(1).set()
    settled(calls, "g")
    late = calls.start({"g": None}).answers(deadline())["g"]
    assert (late.value, late.late) == (1, True)
    assert calls.start({"g": None}).answers(deadline()) == {}
    assert job.calls == 1
    calls.close()


def test_a_call_in_flight_is_joined_by_a_round_from_another_thread() -> None:
    """Two page workers asking one node's details share a Calls: the second, asking while
    the first still waits for a hung agent, joins that call; its answer is handed over once."""
    calls: Calls[int] = Calls()
    job = Gated()
    first: dict[str, Answer[int]] = {}
    waiter = threading.Thread(target=lambda: first.update(calls.start({"a": job}).answers(None)))
    waiter.start()
    for _ in range(3000):  # hang guard only: until the first round's call is in flight
        if job.calls:
            break
        time.sleep(0.01)
    assert job.calls == 1
    second: dict[str, Answer[int]] = {}
    joiner = threading.Thread(
        target=lambda: second.update(calls.start({"a": job}).answers(deadline()))
    )
    joiner.start()
    joiner.join(30)
    assert second["a"].waiting  # the first round's call, still stuck
    job.gate(1).set()
    waiter.join(30)
    assert (first["a"].value, first["a"].late) == (1, False)
    job.gate(2).set()  # a second call, had one been made, comes back: the next poll has it
    rest = calls.start({"a": None}).answers(None)
    assert job.calls == 1
    assert rest == {}  # handed over once, to the round that waited for it: nothing late
    calls.close()


def test_a_key_whose_call_hung_is_asked_next_on_threads_not_those_of_the_others() -> None:
    """One thread per pool: a key whose call failed (a hung agent's, at its timeout) has its
    next call on the failing keys' pool, so a key that answers is not queued behind it
    (before: one pool, its one thread held by the hung agent's second call)."""
    calls: Calls[int] = Calls(max_threads=1, overflow_after_s=None)
    gated, quick = Gated(), Gated()
    quick.gate(1).set()

    def hung() -> int:
        if gated() == 1:
            raise TimeoutError("no answer within its timeout")
        return 2

    assert calls.start({"hung": hung}).answers(deadline())["hung"].waiting
    gated.gate(1).set()  # its call times out; its next one hangs again
    assert calls._pending["hung"].future.result(30).error is not None
    round_ = calls.start({"hung": hung, "quick": quick})
    settled(calls, "quick")  # on the other pool's thread, however long the hung call runs
    answers = round_.answers(deadline())
    assert answers["quick"].value == 1
    assert answers["hung"].late and answers["hung"].error is not None  # the first call's
    assert (gated.calls, quick.calls) == (2, 1)
    gated.gate(2).set()
    calls.close()


def test_a_round_started_after_close_ends_its_wait_on_any_thread() -> None:
    """A poll finishing as the view quits (a page worker's thread, waiting without a
    deadline) gets no call and ends its wait: off the main thread the wait is
    concurrent.futures.wait, which counts a future done only once notified."""
    calls: Calls[int] = Calls(name="test-ask-closed")
    calls.close()
    got: dict[str, Answer[int]] = {}
    worker = threading.Thread(
        target=lambda: got.update(calls.start({"a": lambda: 1}).answers(None)), daemon=True
    )
    worker.start()
    worker.join(30)  # (a hang, not a timing: the wait never ended before)
    assert not worker.is_alive()
    assert got["a"].value is None and got["a"].error is None
