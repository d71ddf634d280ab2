"""Rereading the fleet's inventory while the router runs.

A router reads its nodes, DCs and links (the fleet database or a fleet file) at start; an
``InventoryReloader`` reads them again every ``interval_s`` and when asked (``request``: the CLI
wires SIGHUP to it), so a node removed with ``kvctl fleet rm`` stops getting traffic and a new
one is followed. A reread that changed something swaps the router's topology, then follows the
new nodes (``Followers.add``: a node at a new URL or token is followed anew) and stops following
the removed ones (``Followers.remove``, which drops their index entries: they left the fleet, for
every router), with their engines' (``NODE#vllm``, an engine's own KV events). A reread that
fails, or finds no node at all (a database restored empty, a file half written), changes nothing:
the router keeps routing on what it read last, and says why in its status.

A shared index (Redis) also holds nodes no running router removed: one removed while no router
ran, or one a router restarted without (fewer ``--agent`` flags). With ``forget_unknown`` (the
inventory is the fleet's own: the fleet database) a node in the index that the inventory does not
name is dropped at start and at each reread, with its engines' entries. The index's nodes are
listed before the inventory is read: a node added meanwhile, and written by a router that read
it, is in the inventory read after. Not when the index holds no entry of the inventory's nodes (a
database of another fleet, a developer's own SQLite file, against the fleet's Redis): nothing is
dropped then, and the status says why. Nor a node another running router follows: every router
claims the nodes it knows in a shared index every ``CLAIM_INTERVAL_S`` (``ClaimingIndex``), and
a node whose last claim by another router is under ``claim_stale_s`` old is kept (a router on a
stale copy of the database, or a developer's with a node of its own, which passes the check
above once its node is written, dropped every other router's nodes at each reread). Without
``forget_unknown`` (``--agent`` flags, a fleet file, which a developer's router may give with a
few nodes) nothing is dropped: the router's status names the index's nodes it does not know,
and ``Router.forget`` drops one on an operator's word. A router of the version before claims
claims nothing: a node it follows, dropped, is written again by its follower, and was dropped
again at each reread (its entries flapping for every router); a name written again after this
router dropped it is kept from then on, and the status says so, until the inventory names its
node again (then its entries are this router's own, and a node leaving again leaves anew).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from math import inf
from typing import Any

from kvctl.errors import InvalidArgument
from kvctl.format import count_of
from kvctl.index.follower import Followers
from kvctl.index.model import owner, owners
from kvctl.index.remote import IndexUnavailable
from kvctl.router.service import CLAIM_STALE_S, Router
from kvctl.router.topology import Topology

log = logging.getLogger("kvctl.router.inventory")

#: how often a router rereads its inventory by default
DEFAULT_RELOAD_S = 30.0

#: index names of the last nodes forgotten kept for the status
MAX_LAST_FORGOTTEN = 10
#: index names dropped that a reloader remembers (the oldest forgotten past it): a node's
#: second drop is neither counted again nor made at all (see ``_forget_unknown``)
MAX_REMEMBERED_DROPS = 10_000

#: reads the inventory: the topology and each node's agent URL; raises when it cannot
ReadInventory = Callable[[], tuple[Topology, Mapping[str, str]]]


class InventoryReloader:
    """Keeps ``router`` and ``followers`` in step with the inventory ``read`` returns (see the
    module). ``read`` None: the inventory cannot change (``--agent`` flags); ``interval_s`` 0:
    reread only when asked. ``source`` names the inventory in the status. ``forget_unknown``:
    the inventory is the fleet's own, so the index's nodes it does not name are dropped (at
    start and at each reread; see the module)."""

    def __init__(
        self,
        read: ReadInventory | None,
        router: Router,
        followers: Followers,
        *,
        source: str,
        agent_token: str | None = None,
        interval_s: float = DEFAULT_RELOAD_S,
        forget_unknown: bool = False,
        claim_stale_s: float = CLAIM_STALE_S,
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
        self.forget_unknown = bool(forget_unknown) and read is not None
        self.claim_stale_s = float(claim_stale_s)
        #: index names dropped as not in the inventory, and their entries, since the start
        self.forgotten_nodes = 0
        self.forgotten_entries = 0
        #: the newest of them (at most MAX_LAST_FORGOTTEN)
        self.last_forgotten: list[str] = []
        #: index names dropped, and the nodes they belong to, since the start (the newest
        #: MAX_REMEMBERED_DROPS; not a node's once the inventory names it again): a node is
        #: counted once however many passes dropped its names
        self._dropped_names: dict[str, None] = {}
        self._forgotten_owners: dict[str, None] = {}
        #: why the last pass dropped none of the index's nodes that the inventory does not name
        self.forget_note = ""

    # --- rereading ---------------------------------------------------------------------------
    def reload(self) -> bool:
        """Read the inventory and apply what changed; returns whether it was read (a failure
        is logged, counted and kept in the status, and changes nothing)."""
        if self._read is None:
            return False
        with self._lock:
            # listed before the read: a node added to the inventory meanwhile (and written by a
            # router that read it) is in the read, never taken for one that left
            listed = None
            if self.forget_unknown:
                try:
                    listed = self._index_nodes()
                except Exception as exc:  # nothing dropped this pass; the reread goes on
                    self._forget_failed(exc)
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
            self._forget_drops_of_known()
            if changed:
                self.changes += 1
            if listed is not None:  # None: the index failed (noted by _index_nodes)
                try:
                    self._forget_unknown(listed)
                except Exception as exc:
                    self._forget_failed(exc)
            return True

    def _forget_drops_of_known(self) -> None:
        """Forget the drops of the nodes this router knows again (back in the inventory): their
        entries are its own follower's, not written again by something that claims nothing, and
        a node leaving again leaves anew (dropped and counted as the first time)."""
        known = self.router.known_nodes()
        for names in (self._dropped_names, self._forgotten_owners):
            for name in [n for n in names if owner(n) in known]:
                del names[name]

    def _forget_failed(self, exc: Exception) -> None:
        """Listing or dropping the index's unknown nodes failed as no index should (anything
        but IndexUnavailable): said in the status, logged; the rereads go on."""
        self.forget_note = f"dropping the nodes not in the inventory failed: {exc}"[:300]
        log.exception("inventory (%s): %s", self.source, self.forget_note)

    def _index_nodes(self) -> dict[str, int] | None:
        """The index's entries per name; None when it does not answer (noted, logged)."""
        nodes = self.router.index_nodes()
        if nodes is None:
            self.forget_note = f"the index did not answer: {self.router.index_watch.error}"
        return nodes

    def _forget_unknown(self, listed: Mapping[str, int]) -> None:
        """Drop the names of ``listed`` (the index's nodes before the read) whose node this
        router does not know now, unless none of them is one it knows."""
        unknown = sorted(self.router.unknown_index_nodes(listed))
        if unknown and len(unknown) == len(listed):
            # (nodes() lists nodes with entries only: the inventory's may be in the index,
            # resynced, and hold no chunk yet, as a new fleet's agents do)
            self.forget_note = (
                "the index holds no entry of the inventory's "
                f"{count_of(len(self.router.topology.nodes), 'node')}, "
                f"only of {count_of(len(owners(unknown)), 'other node')} (another "
                "fleet's index, or the inventory's nodes hold no chunk yet?): none dropped"
            )
            log.warning("inventory (%s): %s", self.source, self.forget_note)
            return
        # a node another running router claims is one it follows (an --agent or fleet-file
        # router, a stale copy of the database, a developer's router with a node of its own):
        # dropped, it would be resynced at once, and dropped again at each reread
        claims = self.router.index_claims() if unknown else {}
        if claims is None:
            self.forget_note = (
                f"the index did not answer for its claims: {self.router.claim_error}: none dropped"
            )[:300]
            return
        followed = [n for n in unknown if claims.get(owner(n), inf) < self.claim_stale_s]
        # written again since this router dropped it: something follows it that claims
        # nothing (a router of the version before claims, one whose claims fail): dropped
        # again, it was resynced at once, its entries flapping for every router
        # (not once a router claims it: claims hold from then on, a stale one dropping it)
        back = [
            n
            for n in unknown
            if n in self._dropped_names and n not in followed and owner(n) not in claims
        ]
        notes = []
        if followed:
            notes.append(
                f"another router follows {len(owners(followed))} of them (claimed in the last "
                f"{self.claim_stale_s:g} s), e.g. {', '.join(followed[:3])}"
            )
        if back:
            notes.append(
                f"{len(owners(back))} of them written again after this router dropped it (a "
                f"router that claims no nodes, of a version before claims?), e.g. "
                f"{', '.join(back[:3])}: kept"
            )
        self.forget_note = "; ".join(notes)
        self._drop(
            [n for n in unknown if n not in followed and n not in back], "not in the inventory"
        )

    def _drop(self, names: Collection[str], why: str) -> None:
        """Drop the index names ``names`` (logged and counted as forgotten)."""
        dropped: dict[str, int] = {}
        try:
            for name in names:
                dropped[name] = self.router.index.drop(name)
        except IndexUnavailable as exc:
            self.router.index_watch.failed(exc)
            self.forget_note = f"the index failed dropping them: {exc}"[:300]
        dropped = {name: n for name, n in dropped.items() if n}  # 0: gone already
        if not dropped:
            return
        entries = sum(dropped.values())
        for name in dropped:
            _remember(self._dropped_names, name)
            # NODE#vllm goes with NODE, dropped in the same pass or a later one
            self.forgotten_nodes += _remember(self._forgotten_owners, owner(name))
        self.forgotten_entries += entries
        last = [n for n in self.last_forgotten if n not in dropped]
        self.last_forgotten = [*last, *dropped][-MAX_LAST_FORGOTTEN:]
        log.warning(
            "inventory (%s): %d index entries dropped, of %s (%s)",
            self.source,
            entries,
            ", ".join(dropped),
            why,
        )

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
        if removed and not self.forget_unknown:  # (forget_unknown drops them after the read)
            self._drop_engines(removed)
        if changed or added or removed:
            log.info(
                "inventory (%s) reread: %d nodes; added %s; removed %s",
                self.source,
                len(topology.nodes),
                ", ".join(added) or "none",
                ", ".join(removed) or "none",
            )
        return changed or bool(added or removed)

    def _drop_engines(self, removed: Collection[str]) -> None:
        """Drop the engines' entries (``NODE#vllm``) of the ``removed`` nodes: ``Followers.remove``
        drops a node's own only. Not those of a node whose engine events this router reads."""
        nodes = self.router.index_nodes()
        if nodes is None:
            log.warning(
                "inventory (%s): the engines' index entries of %s not dropped: the index did "
                "not answer",
                self.source,
                ", ".join(removed),
            )
            return
        gone = set(removed)
        known = self.router.known_nodes()
        self._drop(
            [n for n in nodes if n not in gone and owner(n) in gone and owner(n) not in known],
            "their node left the inventory",
        )

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
        if self.forget_unknown:
            self._reload_logged()  # at start: what nodes removed while no router ran left goes
        while not self._stop.is_set():
            self._wake.wait(self.interval_s or None)
            if self._stop.is_set():
                return
            self._wake.clear()
            self._reload_logged()

    def _reload_logged(self) -> None:
        """``reload`` in the thread, which must outlive any one bad pass (SIGHUP's rereads
        end with it)."""
        try:
            self.reload()
        except Exception:
            log.exception("rereading the inventory (%s) failed", self.source)

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
            "forgets_unknown": self.forget_unknown,
            "forgotten_nodes": self.forgotten_nodes,
            "forgotten_entries": self.forgotten_entries,
            "last_forgotten": list(self.last_forgotten),
            "forget_note": self.forget_note,
            # a shared index's claims (the nodes each router knows) failing: "" when they answer
            "claim_error": self.router.claim_error,
        }


def _remember(names: dict[str, None], name: str) -> bool:
    """Put ``name`` in ``names`` (newest last, the oldest gone past MAX_REMEMBERED_DROPS);
    whether it was not there."""
    new = name not in names
    names.pop(name, None)
    names[name] = None
    if len(names) > MAX_REMEMBERED_DROPS:
        del names[next(iter(names))]
    return new
