"""A shared cpu tier's arena is unmapped when the tier closes, even while its pages are being
faulted in (``kvctl.store.tiers.prefault``, started as the arena is made): an agent runtime or a
store opened in a longer process (tests, an embedder) and closed must not keep the arena, the
tier's whole capacity, mapped for as long as the tier object lives (in a reference cycle, until
the garbage collector's next full pass). Checked against the process's mappings."""

from __future__ import annotations

import sys
import time

import pytest

from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.hostreg import buffer_address

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="shared arenas are Linux only"
)
MIB = 1 << 20


def _mapped_at(start: int) -> bool:
    with open("/proc/self/maps") as maps:
        return any(int(line.split("-", 1)[0], 16) == start for line in maps)


def test_a_closed_tier_unmaps_its_arena_while_its_pages_are_faulted_in() -> None:
    tier = CpuTier(256 * MIB, shared=True)  # populating its first 256 MiB starts at once
    start = buffer_address(tier._view)
    assert _mapped_at(start)
    prefault = tier._prefault
    assert prefault is not None
    # closed once the first step is done: then (it is made of several) the next is under way
    deadline_s = time.monotonic() + 30
    while prefault.populated_bytes == 0 and not prefault.failed:
        assert time.monotonic() < deadline_s, "the arena's first pages were never faulted in"
        time.sleep(0.001)
    if prefault.failed:
        pytest.skip(f"this kernel cannot prefault: {prefault.failed}")
    tier.close()
    assert not _mapped_at(start), "the closed tier kept its arena mapped"
