"""A fan-out's call cut off at its deadline lets go of its thread: its connection is shut down,
so the nodes queued behind it are asked in time. httpx's timeouts bound each read, not a whole
answer, so before, the call of an agent trickling its answer (a byte every 100 ms, here for
1,000 s) was reported overdue at its deadline but read on, holding one of the fan-out's
threads; with as many trickling agents as threads (DEFAULT_CONCURRENCY, 32), every sound node
queued behind them waited for the trickles to end and was itself reported overdue, or never
asked. Here two threads and three trickling agents show it: the sound node queued last was not
asked until the trickles ended."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.client import AgentClient
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.fanout import NodeResult, fan_out
from tests.not_an_agent import send, serving

#: a byte every this long: far within any read timeout, so only the deadline ends the call
TRICKLE_BYTE_S = 0.1
#: the trickled body: 1,000 s of bytes at that rate
TRICKLE_BODY_BYTES = 10_000
#: each node's deadline in the fan-out: far past a sound node's answer on a loaded machine (the
#: sound node must answer within it), far short of the trickle
DEADLINE_S = 3.0
#: a hang guard, never a timing claim: without the fix the fan-out waits for the trickles
GUARD_S = 30.0


class Trickler:
    """A loopback agent stand-in whose every answer trickles; counts the callers that hung up
    on it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hung_up = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(TRICKLE_BODY_BYTES))
                self.end_headers()
                try:
                    for _ in range(TRICKLE_BODY_BYTES):
                        if outer.stop.wait(TRICKLE_BYTE_S):
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                except OSError:  # the caller hung up: what the test wants
                    with outer._lock:
                        outer.hung_up += 1

            def log_message(self, *args: Any) -> None:
                pass

        self.handler = Handler


class _Sound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"status": "ok"}).encode()
        send(self, body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def trickler() -> Iterator[tuple[Trickler, str]]:
    t = Trickler()
    with serving(t.handler) as url:
        try:
            yield t, url
        finally:
            t.stop.set()  # the trickles end, whatever the fan-out did


def test_calls_cut_off_at_their_deadline_free_their_threads_for_the_nodes_queued_behind(
    trickler: tuple[Trickler, str],
) -> None:
    t, slow_url = trickler
    with serving(_Sound) as sound_url:
        # as many trickling agents as threads and one more, the sound node queued last
        nodes = [NodeInfo(i, f"slow{i}", "fra", slow_url, "", None) for i in range(3)]
        nodes.append(NodeInfo(3, "sound", "fra", sound_url, "", None))
        out: list[list[NodeResult[dict[str, Any]]]] = []

        def run() -> None:
            out.append(
                fan_out(
                    nodes,
                    AgentClient.health,
                    token="",
                    timeout_s=5.0,
                    concurrency=2,
                    deadline_s=DEADLINE_S,
                )
            )

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(GUARD_S)
        assert out, "fan_out waited for the trickling agents: their calls held its threads"
    *slow, sound = out[0]
    assert sound.ok and sound.value == {"status": "ok"}, sound.error
    for r in slow:
        assert not r.ok and r.silent and r.overdue, r
        assert f"within {DEADLINE_S:g} s" in str(r.error)
    # each cut-off call hung up on its agent: its thread no longer reads the trickle
    t0 = time.monotonic()
    while t.hung_up < len(slow) and time.monotonic() - t0 < GUARD_S:
        time.sleep(0.05)
    assert t.hung_up == len(slow), "a call cut off at its deadline still reads its answer"
