"""Bringing a disk tier that could not be opened at start online once its directory is usable.

The agent starts without a disk tier whose directory cannot be used (a file in its place, a
filesystem not mounted, wrong permissions); an ``AbsentTier`` keeps its place in the store. A
``TierRetry`` thread opens it again with backoff (``first_s``, doubling up to ``max_s``), off
the store's lock, scan included, and hands the opened tier to ``TieredStore.adopt_tier``, which
indexes its chunks a batch per hold of the lock: a put or a read never waits on the retry. A
try that fails again is logged at once when its reason changed, else at most once per
``LOG_INTERVAL_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Literal

from kvctl.format import format_bytes
from kvctl.store.errors import TierUnavailable
from kvctl.store.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvctl.store.store import TieredStore
    from kvctl.store.tiers.base import Tier

log = logging.getLogger("kvctl.agent")

#: the first retry this long after the failed open, then twice as long each time up to MAX
FIRST_S = 5.0
MAX_S = 60.0
#: a retry that fails as the last one did is logged at most this often
LOG_INTERVAL_S = 600.0


class TierRetry:
    """Tries ``open_tier`` (which raises TierUnavailable while the tier still cannot be used)
    for the store's absent tier ``name`` until it opens and the store adopts it."""

    def __init__(
        self,
        store: TieredStore,
        name: str,
        open_tier: Callable[[], Tier],
        *,
        first_s: float = FIRST_S,
        max_s: float = MAX_S,
        on_online: Callable[[Tier], None] | None = None,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"retry delays must be 0 < first <= max, got {first_s}, {max_s}")
        self.store = store
        self.name = name
        self.first_s = first_s
        self.max_s = max_s
        self._open = open_tier
        self._on_online = on_online
        #: tries since start (the open at start not counted)
        self.tries = 0
        #: wall-clock time of the next try (None once online, or stopped)
        self.next_try_s: float | None = None
        self._try_lock = threading.Lock()  # one open of the directory at a time
        self._stop = threading.Event()
        self._say = RateLimitedLog(log, interval_s=LOG_INTERVAL_S)
        self._last_reason = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kvctl-retry-{self.name}", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop trying. A scan under way goes on in its thread, which then finds the store
        closed and closes what it opened."""
        self._stop.set()
        self.next_try_s = None
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def try_now(self) -> bool:
        """One try: True once the tier is online (now or before), False while it is not."""
        return self.attempt() != "absent"

    def attempt(self) -> Literal["online", "was_online", "absent"]:
        """One try, saying what came of it: "online" (this try brought the tier online),
        "was_online" (it was online already: nothing tried), "absent" (it still cannot be
        opened; the store's ``absent_tiers`` says why). A try under way in another thread (the
        backoff's, a scan of a large directory) is waited for, then this one is made if the
        tier is still absent."""
        with self._try_lock:
            if self.name not in self.store.absent_tiers:
                return "was_online"
            self.tries += 1
            started_s = time.monotonic()
            try:
                tier = self._open()
            except TierUnavailable as exc:  # DirectoryInUse too: another agent took it
                self._failed(str(exc))
                return "absent"
            try:
                chunks = self.store.adopt_tier(tier)
            except BaseException:
                tier.close()
                raise
            log.warning(
                "%s tier usable again (try %d): online with %d chunks (%s) found in it, "
                "opened in %.1f s",
                self.name,
                self.tries,
                chunks,
                format_bytes(tier.used_bytes),
                time.monotonic() - started_s,
            )
            self.next_try_s = None
            self._stop.set()  # the backoff's thread ends now, not after its wait
            if self._on_online is not None:
                self._on_online(tier)
            return "online"

    def _failed(self, reason: str) -> None:
        self.store.note_absent(self.name, reason)
        kind = f"retry:{self.name}"
        if reason != self._last_reason:  # news: said at once
            self._say.forget(kind)
            self._last_reason = reason
        self._say.say(
            kind,
            logging.WARNING,
            "%s tier still unavailable (try %d): %s; tried again every %.0f s at most",
            self.name,
            self.tries,
            reason,
            self.max_s,
        )

    def _run(self) -> None:
        delay_s = self.first_s
        while True:
            self.next_try_s = time.time() + delay_s
            if self._stop.wait(delay_s):
                return
            try:
                if self.try_now():
                    self.next_try_s = None
                    return
            except TierUnavailable as exc:
                if self.store.closed:  # under an adoption: nothing left to bring online
                    return
                # the adoption failed part way and was taken back: said, tried again
                self._say.say(
                    f"retry_error:{self.name}", logging.ERROR, "%s tier: %s", self.name, exc
                )
            except Exception as exc:  # the retry outlives any one surprise: said, tried again
                self._say.say(
                    f"retry_error:{self.name}",
                    logging.ERROR,
                    "%s tier: a retry failed unexpectedly: %r",
                    self.name,
                    exc,
                )
            delay_s = min(delay_s * 2, self.max_s)
