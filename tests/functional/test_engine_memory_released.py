"""What an engine or client maps of an agent (its shared arena: the cpu tier's whole capacity;
a writer's staging segment) is unmapped once they are done with it, even when they are not
closed in the order expected, or not closed at all: a long-running engine process (or a test
worker) must not keep a dead connection's arena committed. Checked against the process's own
mappings (``/proc/self/maps``)."""

from __future__ import annotations

import gc
from pathlib import Path

from kvctl.store.tiers.hostreg import buffer_address
from tests.functional.agents import running_agent


def _memfd_mappings(name: str) -> set[int]:
    """Start addresses of this process's mappings of memfds named ``kvctl-<name>``."""
    starts = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if f"/memfd:kvctl-{name} " in line:
                starts.add(int(line.split("-", 1)[0], 16))
    return starts


def test_a_closed_client_unmaps_its_arena_once_the_last_view_of_it_goes(tmp_path: Path) -> None:
    with running_agent(tmp_path, "--cpu", "64MiB") as agent:
        client = agent.data("unix")
        arena = client.shared_arena()
        assert arena is not None
        start = buffer_address(memoryview(arena))
        assert start in _memfd_mappings("cpu")
        # an engine's tensor over the arena, still held when the connection closes: the
        # client cannot unmap it then, and must not keep it mapped after the view goes
        held = memoryview(arena)
        del arena
        client.close()
        assert start in _memfd_mappings("cpu")  # the view is still good to read
        held.release()
        gc.collect()
        assert start not in _memfd_mappings("cpu"), "the closed client kept its arena mapped"
        assert client.closed  # (the client object itself is still alive here)
