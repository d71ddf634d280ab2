"""`kvctl top` when a DC's link goes down: more of its agents than top has threads (64) hang
at once, each call held for its timeout. The agents that answer are still shown with their
figures from the first poll on: their calls, queued behind the hung ones', get a thread of
their own once they have waited a while (``kvctl.daemon_pool.DaemonPool``'s overflow), and the
hung agents' next calls run on threads of their own.

Before, every call ran on one pool of 64 threads: the agents that answer, behind the hung
ones in the queue, were shown "no answer ... (still asking)" until those timed out.

Real hung stand-ins (loopback HTTP servers that take each request and answer none) and real
answering stand-ins; the view's source as `kvctl top --agent URL...` makes it.
"""

from __future__ import annotations

import contextlib

from kvctl.tui.asking import MAX_THREADS
from kvctl.tui.sources import AgentSource
from tests.functional.hung import guarded
from tests.functional.test_collector_hung_dc import hung_agents
from tests.functional.test_collector_impossible_values import StandIn

#: more hung agents than threads, all ahead of the sound ones
HUNG = MAX_THREADS + 6
#: each call's timeout: a hung call holds its thread this long (far past a poll's wait)
TIMEOUT_S = 30.0
#: how long a poll waits for the answers
WAIT_S = 3.0


def test_a_dcs_agents_hanging_at_once_do_not_hide_the_answering_ones() -> None:
    sound = [StandIn("z0"), StandIn("z1")]
    with contextlib.ExitStack() as stack:
        for s in sound:
            stack.callback(s.close)
        hung = stack.enter_context(hung_agents(HUNG))
        urls = [h.url for h in hung] + [s.url for s in sound]
        source = AgentSource(urls, timeout_s=TIMEOUT_S)
        stack.callback(source.close)

        for _ in range(2):  # the first poll, and the next (the hung calls still held)
            readings = guarded(lambda: source.poll(WAIT_S)).readings
            by_url = {r.node.agent_url: r for r in readings}
            shown = [by_url[s.url] for s in sound]
            assert all(r.up and r.error is None for r in shown), [r.error for r in shown]
            assert [r.node.name for r in shown] == ["z0", "z1"]  # named by their answers
            assert all(by_url[h.url].silent and not by_url[h.url].up for h in hung)
