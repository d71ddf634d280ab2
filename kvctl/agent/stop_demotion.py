"""At a clean stop, the volatile tiers' chunks go down to the disk tier, hottest first.

Tiers are exclusive: a read promotes a disk chunk into the cpu tier, which dies with the process,
so without this a restart (an upgrade, a rollout) loses the hot set, even chunks that were safe on
disk before they were read. Run after the data plane drained and before the tiers close, so the
disk tier's clean-close index lists what landed. Pinned chunks stay where they are (a pin holds a
tier) and are lost with the process, as before.

A SIGKILL mid-way (a stopper whose timeout is shorter than the drain plus this budget) leaves
what a crash leaves: no clean-close index, so the next open scans the tier; each chunk is written
to a temp file and renamed, so a chunk is on disk whole or not at all (temp files are dropped).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvctl.store.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StopDemotion:
    """What a stop's demotion did: chunks (and payload bytes) demoted, those left behind
    (unpinned: the budget ran out, or no room below; pinned ones are counted apart)."""

    demoted: int = 0
    demoted_bytes: int = 0
    left: int = 0
    left_bytes: int = 0
    pinned: int = 0
    out_of_time: bool = False
    seconds: float = 0.0
    #: why nothing was tried ("" when it was)
    skipped: str = ""


def demote_for_stop(store: TieredStore, budget_seconds: float) -> StopDemotion:
    """Demote the unpinned chunks of the tiers above the disk tier (gpu, then cpu) to it,
    each tier hottest first, beginning none past ``budget_seconds``; logs one line."""
    began = time.monotonic()
    try:
        result = _demote(store, budget_seconds, began)
    except Exception:  # a stop goes on (the tiers still close) whatever this met
        log.exception("stop: demoting to disk failed; what was demoted stays")
        return StopDemotion(skipped="failed", seconds=time.monotonic() - began)
    if result.skipped:
        log.info("stop: no chunk demoted to disk (%s)", result.skipped)
        return result
    log.info(
        "stop: demoted %d chunks (%d bytes) to disk in %.3f s; left behind %d chunks (%d "
        "bytes)%s, %d pinned (lost with the process)",
        result.demoted,
        result.demoted_bytes,
        result.seconds,
        result.left,
        result.left_bytes,
        (" (the budget of stop_demote_seconds ran out)" if result.out_of_time else " (no room)")
        if result.left
        else "",
        result.pinned,
    )
    return result


def _demote(store: TieredStore, budget_seconds: float, began: float) -> StopDemotion:
    if budget_seconds <= 0:
        return StopDemotion(skipped="stop_demote_seconds is 0")
    names = store.tier_names
    absent = store.absent_tiers
    disk = next((n for n in names if store.tier(n).durable and n not in absent), None)
    if disk is None:
        return StopDemotion(skipped="no disk tier" if "disk" not in absent else "disk tier absent")
    if disk in store.offline_tiers:
        return StopDemotion(skipped=f"the {disk} tier is offline")
    volatile = [n for n in names[: names.index(disk)] if n not in absent]
    deadline_s = began + budget_seconds
    demoted = demoted_bytes = 0
    out_of_time = False
    landed: set[bytes] = set()  # a colder tier's chunks never push a hotter one's off the disk
    for name in volatile:  # top down: a gpu tier's chunks are the hottest
        r = store.flush(
            name,
            demote=True,
            into=disk,
            hottest_first=True,
            deadline_s=deadline_s,
            landed=landed,
        )
        demoted += r.done
        demoted_bytes += r.done_bytes
        out_of_time = out_of_time or r.unfinished > 0
    left = left_bytes = pinned = 0
    for name in volatile:
        for e in store.entries(name):
            if e.pinned:
                pinned += 1
            else:
                left += 1
                left_bytes += e.size_bytes
    return StopDemotion(
        demoted=demoted,
        demoted_bytes=demoted_bytes,
        left=left,
        left_bytes=left_bytes,
        pinned=pinned,
        out_of_time=out_of_time,
        seconds=time.monotonic() - began,
    )
