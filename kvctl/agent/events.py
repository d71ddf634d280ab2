"""A bounded, sequenced buffer of store events that any number of followers read.

The store calls ``publish`` under its lock, so publishing only appends and wakes waiters. Each
event gets a sequence number; a follower that falls more than ``capacity`` events behind learns
how many it missed (``dropped``) instead of slowing the store down.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class EventBatch:
    events: list[Event]
    #: sequence number to pass as ``after`` next time
    last_seq: int
    #: events that fell out of the buffer before this follower read them
    dropped: int
    #: the hub's instance: a new one (an agent restart) starts its sequence over
    instance: str = ""


class EventHub:
    def __init__(self, capacity: int = 8192) -> None:
        self._buf: deque[Event] = deque(maxlen=capacity)
        self._seq = 0
        self._cond = threading.Condition()
        #: tells followers that a sequence started over: a restarted agent's seq 5 is not the
        #: old one's, so a follower that sees a new instance resyncs instead of resuming
        self.instance = secrets.token_hex(8)

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, event: Event) -> None:
        with self._cond:
            self._seq += 1
            self._buf.append({"seq": self._seq, "time_s": time.time(), **event})
            self._cond.notify_all()

    def read(self, after: int, *, limit: int = 1000, timeout_s: float = 0.0) -> EventBatch:
        """Events with ``seq > after`` (oldest first), waiting up to ``timeout_s`` for one."""
        with self._cond:
            if after > self._seq:  # a cursor from before a restart: resync at once
                return EventBatch([], self._seq, 0, self.instance)
            if self._seq <= after and timeout_s > 0:
                self._cond.wait_for(lambda: self._seq > after, timeout=timeout_s)
            if not self._buf or self._seq <= after:
                return EventBatch([], max(after, 0), 0, self.instance)
            first = self._buf[0]["seq"]
            dropped = max(0, first - after - 1)
            start = max(after + 1, first) - first
            events = [self._buf[i] for i in range(start, min(len(self._buf), start + limit))]
            return EventBatch(events, events[-1]["seq"], dropped, self.instance)
