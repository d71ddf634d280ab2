"""Rereading the fleet's inventory while the router runs.

A router reads its nodes, DCs and links (the fleet database or a fleet file) at start; an
``InventoryReloader`` reads them again every ``interval_s`` and when asked (``request``: the CLI
wires SIGHUP to it), so a node removed with ``kvctl fleet rm`` stops getting traffic and a new
one is followed. A reread that changed something swaps the router's topology, then follows the
new nodes (``Followers.add``: a node at a new URL or token is followed anew) and stops following
the removed ones (``Followers.remove``, which drops their index entries: they left the fleet, for
every router). A reread that fails, or finds no node at all (a database restored empty, a file
half written), changes nothing: the router keeps routing on what it read last, and says why in
its status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvctl.errors import InvalidArgument
from kvctl.index.follower import Followers
from kvctl.router.service import Router
from kvctl.router.topology import Topology

log = logging.getLogger("kvctl.router.inventory")

#: how often a router rereads its inventory by default
DEFAULT_RELOAD_S = 30.0

#: reads the inventory: the topology and each node's agent URL; raises when it cannot
ReadInventory = Callable[[], tuple[Topology, Mapping[str, str]]]


class InventoryReloader:
    """Keeps ``router`` and ``followers`` in step with the inventory ``read`` returns (see the
    module). ``read`` None: the inventory cannot change (``--agent`` flags); ``interval_s`` 0:
    reread only when asked. ``source`` names the inventory in the status."""

    def __init__(
        self,
        read: ReadInventory | None,
        router: Router,
        followers: Followers,
        *,
        source: str,
        agent_token: str | None = None,
        interval_s: float = DEFAULT_RELOAD_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        # the thread waits interval_s at a time: past TIMEOUT_MAX (inf) its first wait raised
        # OverflowError, and the rereads (SIGHUP's too) died with it
        if not 0 <= interval_s <= threading.TIMEOUT_MAX:
            raise InvalidArgument(
                f"the inventory reload interval must be 0 to {threading.TIMEOUT_MAX:.0f} s, "
                f"got {interval_s}"
            )
        self._read = read
        self.router = router
        self.followers = followers
        self.source = source
        self._token = agent_token  # the agents' token: given to the followers, never shown
        self.interval_s = float(interval_s)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()  # one reread at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: when the inventory was last read successfully (the start's read until a reread)
        self.read_s = wall_clock()
        self.reads = 0
        self.changes = 0
        self.errors = 0
        self.last_error = ""
        self.last_error_s: float | None = None

    # --- rereading ---------------------------------------------------------------------------
    def reload(self) -> bool:
        """Read the inventory and apply what changed; returns whether it was read (a failure
        is logged, counted and kept in the status, and changes nothing)."""
        if self._read is None:
            return False
        with self._lock:
            try:
                topology, urls = self._read()
                if not topology.nodes:
                    raise InvalidArgument(
                        f"the inventory has no nodes; still routing to the "
                        f"{len(self.router.topology.nodes)} read before"
                    )
                changed = self._apply(topology, urls)
            except Exception as exc:  # the router keeps what it has; the status says why
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self.last_error_s = self._wall_clock()
                log.warning("rereading the inventory (%s) failed: %s", self.source, exc)
                return False
            self.reads += 1
            self.read_s = self._wall_clock()
            self.last_error = ""
            if changed:
                self.changes += 1
            return True

    def _apply(self, topology: Topology, urls: Mapping[str, str]) -> bool:
        followed = set(self.followers.nodes())
        added = sorted(set(urls) - followed)
        removed = sorted(followed - set(urls))
        # the topology first: a removed node is no longer chosen before its entries go
        changed = self.router.set_topology(topology)
        for node, url in urls.items():
            self.followers.add(node, url, self._token)  # no-op for a node at the same URL
        for node in removed:
            self.followers.remove(node)
        if changed or added or removed:
            log.info(
                "inventory (%s) reread: %d nodes; added %s; removed %s",
                self.source,
                len(topology.nodes),
                ", ".join(added) or "none",
                ", ".join(removed) or "none",
            )
        return changed or bool(added or removed)

    def request(self) -> None:
        """Reread soon, in the reloader's thread (safe from a signal handler)."""
        self._wake.set()

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._read is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvctl-inventory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s or None)
            if self._stop.is_set():
                return
            self._wake.clear()
            self.reload()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def status(self) -> dict[str, Any]:
        """Where the inventory comes from, when it was last read (unix seconds, and how long
        ago), how often it is reread, and the last failure."""
        now_s = self._wall_clock()
        return {
            "source": self.source,
            "read_s": self.read_s,
            "age_s": max(0.0, now_s - self.read_s),
            "reload_s": self.interval_s if self._read is not None else None,
            "reloads": self.reads,
            "changes": self.changes,
            "errors": self.errors,
            "last_error": self.last_error,
            "last_error_s": self.last_error_s,
        }
