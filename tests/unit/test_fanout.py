"""Fan-out: one result per node whatever the node does, and no node acted on unrecorded."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

from kvctl.client import AgentClient, AgentStarting, AgentUnreachable, AuthError
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.fanout import NodeResult, fan_out

NODES = [NodeInfo(i, f"n{i}", "fra", f"http://127.0.0.1:{9000 + i}", "", None) for i in range(10)]
#: a hang guard, never a timing claim
GUARD_S = 30.0


def test_every_kind_of_failure_is_a_result_in_node_order() -> None:
    def call(client: AgentClient) -> int:
        port = int(client.url.rsplit(":", 1)[1]) - 9000
        if port % 3 == 0:
            raise AgentUnreachable(f"cannot reach {client.url}")
        if port % 3 == 1:
            raise ValueError("dictionary update sequence element #0 has length 1")  # HTML reply
        return port

    results = fan_out(NODES, call, concurrency=4)
    assert [r.node.name for r in results] == [n.name for n in NODES]
    assert [r.value for r in results if r.ok] == [2, 5, 8]
    assert results[0].error == "cannot reach http://127.0.0.1:9000"
    assert results[1].error is not None and results[1].error.startswith("ValueError: ")


def test_a_bad_url_fails_only_its_node() -> None:
    # an inventory row from before URLs were checked: the client cannot even be built
    bad = NodeInfo(99, "bad", "fra", "http://[::1", "", None)
    results = fan_out([bad, NODES[2]], lambda c: "ok")
    assert [r.ok for r in results] == [False, True] and results[0].error


def test_a_failing_callback_stops_the_nodes_not_yet_asked() -> None:
    asked: list[str] = []
    failed = threading.Event()

    def call(client: AgentClient) -> None:
        asked.append(client.url)
        if len(asked) > 1:
            # the one worker holds every later node until the first result's callback failed,
            # then a moment more: calls as fast as appends would otherwise all have run before
            # the failing callback's fan_out cancels the ones not yet asked
            failed.wait(10)
            time.sleep(0.1)

    def audit_down(_result: object) -> None:
        failed.set()
        raise RuntimeError("audit trail cannot be written")

    with pytest.raises(RuntimeError, match="audit trail"):
        fan_out(NODES, call, concurrency=1, on_result=audit_down)
    assert len(asked) < len(NODES)


def test_an_agent_that_refuses_the_token_is_a_failure_marked_auth_refused() -> None:
    # it answered: callers must not call it down (and have an operator start a second one)
    def call(client: AgentClient) -> int:
        if client.url.endswith("9001"):
            raise AuthError(f"the agent at {client.url} is up but refused the token")
        raise AgentUnreachable(f"cannot reach {client.url}")

    refused, down = fan_out(NODES[1:3], call)
    assert not refused.ok and refused.auth_refused and "refused the token" in str(refused.error)
    assert not down.ok and not down.auth_refused


def test_an_agent_still_starting_is_a_failure_marked_starting_not_down() -> None:
    def call(client: AgentClient) -> int:
        if client.url.endswith("9001"):
            raise AgentStarting(f"the agent is starting: ... ({client.url})", 503)
        raise AgentUnreachable(f"cannot reach {client.url}")

    starting, down = fan_out(NODES[1:3], call)
    assert not starting.ok and starting.starting and not starting.auth_refused
    assert "the agent is starting" in str(starting.error)
    assert not down.ok and not down.starting


def test_an_answer_a_ctrl_c_beat_to_its_report_is_reported_all_the_same() -> None:
    """A Ctrl-C that lands after an answer arrived but before ``on_result`` took it (here: at
    the start of its first report) must not leave that node's action unreported, so unaudited
    (the fresh-clone CI saw a pin answered around the Ctrl-C missing from the report)."""
    reported: list[str] = []
    interrupted = False

    def report(result: NodeResult[str]) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt
        reported.append(result.node.name)

    both_asked = threading.Barrier(2)  # neither answers before both were asked

    def pin(client: AgentClient) -> str:
        both_asked.wait(GUARD_S)
        return "pinned"

    with pytest.raises(KeyboardInterrupt):
        fan_out(NODES[:2], pin, concurrency=2, on_result=report)
    assert sorted(reported) == ["n0", "n1"]  # both acted: both are reported


def test_a_ctrl_c_during_a_report_waits_for_it_to_end() -> None:
    """A Ctrl-C (a real SIGINT) that lands halfway through ``on_result`` is held until that
    report ends: torn, the audit write it made could leave SQLite's write lock taken, losing
    the row and failing every later one (the fresh-clone CI's "0 of 2 node(s) answered"), or
    be written again when the interrupted report is retried."""
    steps: list[str] = []

    def report(result: NodeResult[str]) -> None:
        steps.append(f"{result.node.name} begun")
        if len(steps) == 1:
            signal.raise_signal(signal.SIGINT)  # the handler runs before the next line
        steps.append(f"{result.node.name} ended")

    both_asked = threading.Barrier(2)

    def pin(client: AgentClient) -> str:
        both_asked.wait(GUARD_S)
        return "pinned"

    with pytest.raises(KeyboardInterrupt):
        fan_out(NODES[:2], pin, concurrency=2, on_result=report)
    assert len(steps) == 4 and steps[0].endswith("begun") and steps[1].endswith("ended"), steps
    assert sorted(s.split()[0] for s in steps) == ["n0", "n0", "n1", "n1"]  # each once


def test_a_ctrl_c_while_the_threads_start_reports_every_node_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C (a real SIGINT) that lands while fan_out starts its threads (here: as the third
    starts) cancels the nodes not yet asked and reports those that were: raised before the
    fan-out's ``try``, it left the first threads asking every node, none of them reported (so
    unaudited)."""
    import kvctl.daemon_pool as daemon_pool

    asked: list[str] = []
    reported: list[str] = []
    started: list[threading.Thread] = []

    class Interrupted(threading.Thread):
        def start(self) -> None:
            if len(started) == 2:
                signal.raise_signal(signal.SIGINT)
            started.append(self)
            super().start()

    # the pool's own view of threading only: every other thread of the test run is left alone
    fake = SimpleNamespace(
        Thread=Interrupted,
        Lock=threading.Lock,
        Condition=threading.Condition,
    )
    monkeypatch.setattr(daemon_pool, "threading", fake)

    def pin(client: AgentClient) -> str:
        asked.append(client.url)
        return "pinned"

    with pytest.raises(KeyboardInterrupt):
        fan_out(NODES, pin, concurrency=8, on_result=lambda r: reported.append(r.node.agent_url))
    for t in started:
        t.join(GUARD_S)
    assert sorted(reported) == sorted(asked) and asked


def test_a_second_ctrl_c_while_waiting_reports_the_unanswered_nodes() -> None:
    """After a Ctrl-C the fan-out waits for the nodes already asked; a second one (a real
    SIGINT, in that wait) stops it at once. Every node asked is still reported: the one whose
    answer it did not wait for as unanswered, its outcome unknown. Before, the second Ctrl-C
    left both unreported, so unaudited."""
    import os
    import sys

    reported: list[NodeResult[str]] = []
    slow_asked, release = threading.Event(), threading.Event()

    def pin(client: AgentClient) -> str:
        if client.url.endswith("9001"):
            slow_asked.set()
            release.wait(GUARD_S)
        return "pinned"

    main = threading.main_thread().ident
    assert main is not None

    def in_wait() -> bool:
        """In the wait for the nodes still asking, after the first Ctrl-C (the fan-out's wait
        for answers before it is a concurrent.futures.wait too)."""
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "_wait_unreported":
                return True
            frame = frame.f_back
        return False

    def press_twice() -> None:
        deadline = time.monotonic() + GUARD_S
        while not (slow_asked.is_set() and reported) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # the first: the fan-out waits for n1
        while not in_wait() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # the second, in that wait

    presser = threading.Thread(target=press_twice)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fan_out(NODES[:2], pin, concurrency=2, on_result=reported.append)
    finally:
        presser.join(GUARD_S)
        release.set()
    by_name = {r.node.name: r for r in reported}
    assert sorted(by_name) == ["n0", "n1"] and len(reported) == 2
    assert by_name["n0"].ok and by_name["n0"].value == "pinned"
    assert not by_name["n1"].ok and by_name["n1"].unanswered
    assert "unknown" in str(by_name["n1"].error)


def test_a_forced_stop_during_a_stuck_report_waits_for_nothing_more() -> None:
    """Ctrl-C twice while a report is stuck (an audit write waiting on a lock) forces a stop
    (ForcedInterrupt): the operator was told it stops now. Before, it was taken as a first
    Ctrl-C, so the fan-out went on to wait for the nodes still asking (up to their deadline)
    and reported them, each write stuck the same way."""
    from kvctl.interrupts import ForcedInterrupt

    reported: list[str] = []
    slow_asked, release, slow_done = threading.Event(), threading.Event(), threading.Event()

    def pin(client: AgentClient) -> str:
        if client.url.endswith("9001"):
            slow_asked.set()
            release.wait(GUARD_S)
            slow_done.set()
        return "pinned"

    def stuck(result: NodeResult[str]) -> None:
        reported.append(result.node.name)
        assert slow_asked.wait(GUARD_S)
        raise ForcedInterrupt  # what interrupts_held raises on the second press

    try:
        with pytest.raises(ForcedInterrupt):
            fan_out(NODES[:2], pin, concurrency=2, on_result=stuck, deadline_s=GUARD_S)
        assert not slow_done.is_set()  # not waited for
        assert reported == ["n0"]  # nor reported: that write would be stuck too
    finally:
        release.set()


def test_a_node_past_its_deadline_is_a_silent_failure_and_the_others_are_not_held() -> None:
    """A node whose call runs past ``deadline_s`` (an answer trickling a byte at a time, each
    read within the client's timeout) is reported then as not answering in full, its thread
    left to end on its own, instead of holding the whole fan-out for as long as it trickles."""
    release = threading.Event()

    def stats(client: AgentClient) -> str:
        if client.url.endswith("9001"):
            release.wait(GUARD_S)  # the trickle: ends only when the test lets it
        return "stats"

    try:
        quick, stuck = fan_out(NODES[:2], stats, deadline_s=0.2)
        assert not release.is_set()  # it was not waited for
    finally:
        release.set()
    assert quick.ok and quick.value == "stats"
    assert not stuck.ok and stuck.silent and stuck.overdue
    assert "within 0.2 s" in str(stuck.error)
