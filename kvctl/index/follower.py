"""Followers: keep a ``FleetIndex`` in step with what real agents hold.

A ``Follower`` polls one agent's event buffer (``/v1/events/recent``) from a cursor and applies
the chunk events to the index. It resyncs from the agent's key listing (``/v1/keys``) when it
cannot trust the stream: on first contact, when the agent restarted (its stream's ``instance``
changed, so sequence numbers started over) and when it fell behind the agent's bounded buffer
(``dropped > 0``). A resync notes the agent's newest sequence number *before* paging through the
listing and resumes from there: events that the listing already reflects are re-applied, which
changes nothing (each event sets or deletes one node's entry for one key), and none is missed.

It also resyncs when the index lost what it wrote, whole or in part: each poll makes one cheap
check (``FleetIndex.check``). A marker (left by the node's resync) gone or changed means a Redis
index restarted empty, was flushed or evicted it. Part of the node's entries lost with the
marker kept (a server evicting under ``maxmemory``, an operator's DEL) shows as the node's
entry count off its key set, or as a listed entry gone in the check's rolling audit, which reads
a slice of the node's entries per poll (``audit_entries_per_s``, so a whole pass over a node of
N entries takes about N / that many seconds). Such a resync is of that node alone, at most once
per ``DAMAGE_RESYNC_MIN_S`` (a server evicting all the time must not have every agent listed on
every poll). A poll the index failed (``IndexUnavailable``) is the index's failure, not the
agent's: the agent is not marked down, and the next poll that the index answers resyncs (what
was written while it was away may be lost). Every resync is counted by its reason
(``RESYNC_REASONS``).

An agent that has not answered for ``drop_after_s``, or whose port refused a poll's connection
(nothing listens: stopped or restarting), is marked down: the router leaves it out of
its decisions and its holder answers (``Followers.down_nodes``). Down is this router's view: in
an index of its own (``EmbeddedIndex``) its entries are dropped too, but a shared one
(``RedisIndex.shared``) keeps them, since another router may reach the agent (a wrong URL or a
partition here must not empty the index for every router). When it answers again it is
resynced. Each agent's role (its /v1/info) is read once per event stream (first contact, a
restart), before it is first called up: a pool agent (``POOL_ROLE``) runs no engine, and the
router routes it no request (``Followers.pool_nodes``), whether the inventory or an --agent
flag names it. ``Followers`` polls a set of agents from one background thread, each poll on a
small thread pool, so one slow agent (bounded by a short per-request timeout) never delays the
others; agents whose last poll failed are polled on a pool of their own, and a poll that has
waited a round for a thread (the pool's threads held by agents that all hung at once: a DC's
link down) gets one of its own, up to a bound, so that many agents hanging never hold up the
polls of the agents that answer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, wait
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

from kvctl.client import AgentClient
from kvctl.daemon_pool import DaemonPool
from kvctl.errors import InvalidArgument
from kvctl.index.backoff import Backoff
from kvctl.index.events import ChunkEvent, from_agent_event, from_listing
from kvctl.index.model import DAMAGE_COUNT, FleetIndex
from kvctl.index.remote import IndexUnavailable

log = logging.getLogger("kvctl.index.follower")

#: a cursor past any sequence number (the agent's own bound): the agent answers it with no
#: events and its newest seq, which is how a resync notes where to resume in one request
_PAST_ANY_SEQ = 2**63 - 1
#: the agent's largest page (``MAX_PAGE``); each listing page scans the agent's whole index, so
#: a resync asks for as few pages as it can
LISTING_PAGE = 10_000
#: full event batches read in one poll before yielding to the next round: an agent publishing
#: faster than it can be read must not keep a pool thread forever (the next round goes on)
MAX_BATCHES_PER_POLL = 64
#: one request's timeout, at most; shorter when ``drop_after_s`` is short, so that an agent that
#: hangs is noticed within the time it is given
MAX_REQUEST_TIMEOUT_S = 2.0
#: a whole answer (headers and body) is read within this many request timeouts of its start,
#: and never less than ``MIN_REQUEST_DEADLINE_S``: an agent trickling its answer a byte at a
#: time, each within the timeout, must not hold its poll (and a pool thread) for as long as it
#: trickles. The agent builds an answer before sending it, so a real one is quick once begun
REQUEST_DEADLINE_TIMEOUTS = 3
MIN_REQUEST_DEADLINE_S = 2.0
#: the longest answer the follower reads (a listing page of ``LISTING_PAGE`` chunks is ~3 MiB,
#: ~6 MiB with 256-byte tenants); a longer one is the agent's failure (the node is failed)
MAX_ANSWER_BYTES = 16 << 20
#: the longest events answer: this much per event asked (an event is ~250 bytes, ~600 with a
#: 256-byte tenant), and ``MIN_EVENTS_ANSWER_BYTES`` at least (1 MiB for the default page)
EVENT_ANSWER_BYTES = 1 << 10
MIN_EVENTS_ANSWER_BYTES = 1 << 20
#: the most chunks one resync takes from an agent's listing (by default; ``max_listing_chunks``):
#: a resync holds them all (~250 bytes each) until it replaces the node's entries, so an agent
#: listing pages without end must not grow the router without end. 1M chunks is a 256 TB store
#: of 256 KiB chunks; an agent listing more is failed (its listing named in the error)
DEFAULT_MAX_LISTING_CHUNKS = 1_000_000
#: polls running at once in ``Followers``, in each of its two pools: the agents that answer
#: and those whose last poll failed (threads are made only as needed)
MAX_POLL_THREADS = 16
#: threads of the pool of the agents that answer, at most: past ``MAX_POLL_THREADS``, a poll
#: that has waited a round (``poll_s``, or its request timeout when shorter) for a thread gets
#: one of its own. Agents that answered and all hang at once (a DC's link down) hold the first
#: threads for a request timeout each, and the other agents' polls waited behind them in the
#: queue (400 hung agents: 25 request timeouts). Up to this many hung at once, an answering
#: agent's poll starts within a round; past it, it waits for the first hung polls to time out
MAX_POLL_THREADS_TOTAL = 256
#: entries of a node the index check audits per second, by default: about 2 ms a second of a
#: Redis server's time per node and router (measured on a busy 2-core machine: ~2 us an entry);
#: 0: no audit, only the marker and the count
DEFAULT_AUDIT_ENTRIES_PER_S = 1000.0
#: the audit's slice per poll, at least and at most
MIN_AUDIT_SLICE = 64
MAX_AUDIT_SLICE = 4096
#: a node resynced for entries the index lost (not its marker) is not again for this long
DAMAGE_RESYNC_MIN_S = 10.0
#: after a resync's replace failed, the node is not polled for this long, doubled by each
#: failed replace up to the max and reset by one done: sent again at every poll (``poll_s``), a
#: replace the index server takes longer to run than its client waits would hold the server
#: for its whole length at each try
REPLACE_RETRY_S = 1.0
REPLACE_RETRY_MAX_S = 30.0
#: an agent's role (/v1/info) that could not be read is asked again ROLE_RETRY_FIRST_S after,
#: then twice as long each time, up to ROLE_RETRY_S (the agent is up meanwhile, its role
#: unknown: a pool agent is routed requests until it is read). Once read, a stream's role is
#: kept: a role changes only with a restart, a new stream
ROLE_RETRY_FIRST_S = 1.0
ROLE_RETRY_S = 30.0
#: a role read failing this many times in a row (one stream's) is logged at warning, once until
#: read: a first failure may be the router's start, when every agent is asked at once
ROLE_WARN_AFTER_FAILURES = 3
#: the role of an agent that runs no engine (``kvctl agent start --role pool``): the router
#: routes no request to it, though it holds chunks others pull (``Followers.pool_nodes``)
POOL_ROLE = "pool"
#: why a follower resyncs, as its status counts them: first contact, the agent answering again
#: after being marked down, the agent restarted, the follower fell behind its event buffer, the
#: index answering again after failing, the index lost the node's marker (its entries with it),
#: part of its entries (a listed entry gone), or its key set (the count off the set)
RESYNC_REASONS = (
    "first",
    "agent_back",
    "agent_restarted",
    "behind",
    "index_back",
    "index_lost",
    "index_partial",
    "index_count",
)


def _refused(exc: BaseException | None) -> bool:
    """Whether the agent's port refused the connection (``ConnectionRefusedError`` under the
    SDK's error): nothing listens there, the agent stopped or restarting, so no answer is on
    its way, unlike a poll that times out (a lost packet, a slow or hung agent)."""
    for _ in range(8):  # the SDK's error, httpx's, httpcore's, the OSError
        if exc is None:
            return False
        if isinstance(exc, ConnectionRefusedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Follower:
    """Follows one agent's events into ``index`` under the node name ``node``.

    ``poll_once`` is safe to call from any thread (one poll runs at a time); ``status`` never
    waits for a poll. An answer that is not the agent's events (a refused token, an error
    status, a web page) counts as no answer: following it cannot be trusted either.
    """

    def __init__(
        self,
        index: FleetIndex,
        node: str,
        url: str,
        *,
        token: str | None = None,
        drop_after_s: float = 3.0,
        page_limit: int = 1000,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float | None = None,
        audit_entries_per_s: float = DEFAULT_AUDIT_ENTRIES_PER_S,
        max_listing_chunks: int = DEFAULT_MAX_LISTING_CHUNKS,
    ) -> None:
        if not isinstance(node, str) or not node:
            raise InvalidArgument(f"a follower needs a node name, got {node!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"{node}: agent URL must be http(s)://..., got {_safe(url)!r}")
        _check_seconds("drop_after_s", drop_after_s)
        if isinstance(page_limit, bool) or not isinstance(page_limit, int):
            raise InvalidArgument(f"page_limit must be an int, got {page_limit!r}")
        if not 1 <= page_limit <= LISTING_PAGE:
            raise InvalidArgument(f"page_limit must be 1..{LISTING_PAGE}, got {page_limit}")
        _check_count("max_listing_chunks", max_listing_chunks)
        self.max_listing_chunks = max_listing_chunks
        timeout_s = request_timeout_s(drop_after_s, timeout_s)
        _check_seconds("timeout_s", timeout_s)
        _check_rate("audit_entries_per_s", audit_entries_per_s)
        self.index = index
        self.node = node
        self.audit_entries_per_s = float(audit_entries_per_s)
        self.url = url.rstrip("/")
        self.drop_after_s = float(drop_after_s)
        self.page_limit = page_limit
        self._clock = clock
        from kvctl.deadline_transport import BoundedTransport

        transport = BoundedTransport(
            deadline_s=max(MIN_REQUEST_DEADLINE_S, REQUEST_DEADLINE_TIMEOUTS * timeout_s),
            max_answer_bytes=MAX_ANSWER_BYTES,
            verify=self.url.startswith("https://"),
        )
        self._client = AgentClient(self.url, token=token, timeout_s=timeout_s, transport=transport)
        self._token = token  # to tell whether an add() names the same agent; never shown
        #: the token the client sends (KVCTL_TOKEN without one): masked in what an answer
        #: quotes of the request (a proxy's page echoing its Authorization header)
        self._sent_token = os.environ.get("KVCTL_TOKEN", "") if token is None else token
        self._shown_url = _safe(self.url)  # what status and logs show: never credentials
        self._lock = threading.Lock()  # one poll at a time
        self._closed = False
        #: drop the node's entries when the agent is down: only in an index this router alone
        #: reads (an index that does not say is taken as shared: never drop others' view)
        self.drops_when_down = not getattr(index, "shared", True)
        #: the index's marker for the node after our last resync (None: not resynced yet)
        self._marker: str | None = None
        #: where the index check's audit resumes, and when the last check ran
        self._audit_cursor = 0
        self._checked_s: float | None = None
        self._damage_resync_s: float | None = None
        #: why the next resync happens when ``_instance`` is None (a ``RESYNC_REASONS``)
        self._pending_reason = "first"
        self._index_failing = False
        #: when a replace may be sent again after failing (on the follower's clock)
        self._replace_backoff = Backoff(REPLACE_RETRY_S, REPLACE_RETRY_MAX_S, clock)
        #: None until the agent is first heard from, then whether it answers (``_up``)
        self._up_value: bool | None = None
        #: the stream followed; None: the next answer triggers a resync
        self._instance: str | None = None
        self._cursor = 0
        self._since_s = clock()  # when following started (for an agent never heard from)
        self._last_ok_s: float | None = None
        #: when the request to the agent now in flight was sent (None: none in flight): only
        #: that time is the agent's silence, never a poll's wait for a pool thread or the
        #: index's writes (``_asking_since_s``; written by ``_asking`` alone)
        self._asking_since_value: float | None = None
        self._failing = False
        self.applied = 0
        self.resyncs = 0
        self.dropped_events = 0
        self.gaps = 0
        self.malformed = 0
        self.errors = 0
        self.last_error = ""
        self.index_errors = 0
        self.index_error = ""
        self.index_lost = 0
        #: resyncs by reason (``RESYNC_REASONS``)
        self.resync_reasons: Counter[str] = Counter()
        #: the agent's role as its /v1/info says it ("node", "pool"; None: not read, or not
        #: said), read once per event stream (``_learn_role``), and the stream it was read for
        self._role_value: str | None = None
        self._role_instance: str | None = None
        #: the stream the role's read last failed for, and when it is asked again
        self._role_failed_instance: str | None = None
        self._role_backoff = Backoff(ROLE_RETRY_FIRST_S, ROLE_RETRY_S, clock)
        #: why the role's last read failed (None: read, or not asked yet), and whether that was
        #: logged at warning (``ROLE_WARN_AFTER_FAILURES``)
        self.role_error: str | None = None
        self._role_warned = False

    # --- polling -------------------------------------------------------------------------
    def poll_once(self) -> int:
        """One round: read events after the cursor and apply them (resyncing first when the
        stream cannot be trusted). Returns the index changes made: events applied, plus the
        listed chunks on a resync. Never raises for an agent's failure (counted in status)."""
        with self._lock:
            if self._closed:
                return 0
            if not self._replace_backoff.due():
                # a replace failed: not sent again before its wait is over (up to 30 s), but
                # the agent is still asked whether it answers, so one gone meanwhile is
                # marked down after drop_after_s as ever, not at the end of the wait
                try:
                    *_, instance = _batch(self._events(after=_PAST_ANY_SEQ, limit=1))
                except Exception as exc:
                    self._failed(exc)
                    return 0
                # an agent restarted meanwhile (--role pool at its URL) is not called up with
                # its old role for the rest of the wait
                self._learn_role(instance)
                self._answered()
                return 0
            try:
                changed = self._poll_locked()
            except IndexUnavailable as exc:  # the index's failure, not the agent's
                self._index_failed(exc)
                return 0
            except Exception as exc:  # any other failure is this agent's; keep going
                self._failed(exc)
                return 0
            self._answered()
            if self._index_failing:
                self._index_failing = False
                log.info("%s: the index answers again", self.node)
            return changed

    def _poll_locked(self) -> int:
        changed = 0
        resynced = False
        for batch in range(MAX_BATCHES_PER_POLL):
            events, last_seq, dropped, instance = _batch(
                self._events(after=self._cursor, limit=self.page_limit)
            )
            if len(events) > self.page_limit:
                raise ValueError(
                    f"{self._shown_url}/v1/events/recent answered {len(events):,} events to a "
                    f"read of {self.page_limit:,}"
                )
            if batch == 0:  # before it is called up: a pool agent is never routed meanwhile
                self._learn_role(instance)
            # the first answer after being down is enough to call it up again
            self._answered()
            # the index is checked once per poll (its audit's rate counts polls), not per page
            checked = resynced or batch > 0 or self._instance is None
            damage = "" if checked else self._index_damage()
            if self._instance is None or instance != self._instance or dropped > 0 or damage:
                if resynced:
                    break  # behind again already: the next poll resyncs, not this one forever
                changed += self._resync(self._note_resync_cause(instance, dropped, damage=damage))
                resynced = True
                continue  # read on from the noted cursor
            changed += self._apply(events)
            self._cursor = last_seq
            if len(events) < self.page_limit:
                break
        return changed

    def _learn_role(self, instance: str) -> None:
        """Read the agent's role (/v1/info) when its event stream is new to it: first contact,
        a restart (``kvctl agent start --role pool`` after a node's agent at the same URL), not
        at every poll or inventory reread. One that fails leaves the role as it was (an agent
        not known to be a pool agent serves), asked again ``ROLE_RETRY_FIRST_S`` later, then
        less often (up to ``ROLE_RETRY_S``). ``instance``: the stream the agent's events answer
        just named."""
        if instance == self._role_instance:
            return
        if instance == self._role_failed_instance and not self._role_backoff.due():
            return
        try:
            with self._asking():
                info = self._client.info()
        except Exception as exc:  # the events answered: a poll that worked, the role unknown
            if instance != self._role_failed_instance:  # a new stream's first failure
                self._role_backoff.succeeded()
            self._role_failed_instance = instance
            self._role_backoff.failed()
            self.role_error = self._shown_error(exc)
            log.debug("%s: reading the agent's role failed: %s", self.node, self.role_error)
            failures = self._role_backoff.failures
            if failures >= ROLE_WARN_AFTER_FAILURES and not self._role_warned:
                self._role_warned = True
                log.warning(
                    "%s (%s): its role could not be read from its /v1/info %d times in a row "
                    "(%s); %s until it is: check the token the router has for it and that "
                    "/v1/info answers at its URL (asked again every %.0f s at most)",
                    self.node,
                    self._shown_url,
                    failures,
                    self.role_error,
                    "it is still taken as a pool agent (its role last read)"
                    if self.role == POOL_ROLE
                    else "it is routed requests, even if it is a pool agent",
                    ROLE_RETRY_S,
                )
            return
        role = info.get("role") if isinstance(info, dict) else None
        was, self.role = self.role, role if isinstance(role, str) else None
        self._role_instance, self._role_failed_instance = instance, None
        self._role_backoff.succeeded()
        self.role_error = None
        if self._role_warned:
            self._role_warned = False
            log.info("%s: its role read again from its /v1/info: %s", self.node, self.role)
        if self.role == POOL_ROLE and was != POOL_ROLE:
            log.warning(
                "%s (%s) is a pool agent (it reports role 'pool'): it runs no engine, so no "
                "request is routed to it; it stays in the fleet as a source of chunks "
                "(`kvctl fleet rm node %s`, or no --agent for it, if it should not be there)",
                self.node,
                self._shown_url,
                self.node,
            )
        elif was == POOL_ROLE and self.role != POOL_ROLE:
            log.warning(
                "%s: no longer a pool agent (role %s): requests are routed to it",
                self.node,
                self.role,
            )

    def _events(self, *, after: int, limit: int) -> dict[str, Any]:
        """The agent's events answer, at most ``EVENT_ANSWER_BYTES`` an event asked for."""
        from kvctl.deadline_transport import at_most

        with at_most(max(MIN_EVENTS_ANSWER_BYTES, limit * EVENT_ANSWER_BYTES)), self._asking():
            return self._client.events(after=after, limit=limit)

    @contextlib.contextmanager
    def _asking(self) -> Iterator[None]:
        """A request to the agent in flight for the block (``up`` counts its silence)."""
        self._set_asking(True)
        try:
            yield
        finally:
            self._set_asking(False)

    def _set_asking(self, asking: bool) -> None:
        owner = self._owner
        if owner is None:
            self._asking_since_value = self._clock() if asking else None
            return
        with owner._lock:
            # the clock read under the owner's lock: its requests in flight are then in the
            # order they were sent (``Followers._promote_asked_long_locked`` relies on it)
            self._asking_since_value = self._clock() if asking else None
            owner._asking_changed_locked(self)

    def _index_damage(self) -> str:
        """Why the index no longer holds what our resync and events wrote: "index_lost" (its
        marker is gone or another), "index_partial" or "index_count" (part of the entries: see
        the module), "" when nothing says so. One call per poll, so a Redis restarted empty is
        noticed within one."""
        now_s = self._clock()
        limit = 0
        if self.audit_entries_per_s:
            since_s = 0.0 if self._checked_s is None else max(0.0, now_s - self._checked_s)
            slice_ = round(self.audit_entries_per_s * since_s)
            limit = min(MAX_AUDIT_SLICE, max(MIN_AUDIT_SLICE, slice_))
        check = self.index.check(self.node, cursor=self._audit_cursor, limit=limit)
        self._checked_s = now_s
        self._audit_cursor = check.cursor
        if check.marker != self._marker:
            return "index_lost"
        if not check.damage:
            return ""
        last = self._damage_resync_s
        if last is not None and now_s - last < DAMAGE_RESYNC_MIN_S:
            return ""  # the check after the pause finds it again: it is still gone
        self._damage_resync_s = now_s
        return "index_count" if check.damage == DAMAGE_COUNT else "index_partial"

    def _note_resync_cause(self, instance: str, dropped: int, *, damage: str = "") -> str:
        """Log why this resync happens; returns the reason (``RESYNC_REASONS``)."""
        if damage == "index_lost":
            self.index_lost += 1
            log.warning(
                "%s: the index lost the node's entries (restarted empty, flushed or evicted); "
                "resyncing from %s",
                self.node,
                self._shown_url,
            )
        elif damage:
            what = "key set" if damage == "index_count" else "entries"
            log.warning(
                "%s: the index lost part of the node's %s (evicted or deleted), its marker "
                "kept; resyncing the node from %s",
                self.node,
                what,
                self._shown_url,
            )
        elif self._instance is None:
            damage = self._pending_reason
            log.info("%s: resyncing from %s", self.node, self._shown_url)
        elif instance != self._instance:
            damage = "agent_restarted"
            log.info("%s: agent restarted (new event stream); resyncing", self.node)
        else:
            damage = "behind"
            self.gaps += 1
            self.dropped_events += dropped
            log.warning(
                "%s: fell %d events behind the agent's buffer; resyncing", self.node, dropped
            )
        return damage

    def _resync(self, reason: str) -> int:
        """Make the index's entries for the node the agent's listing, counted under ``reason``
        once done. For "index_count" the node's entries are forgotten by a scan of the index
        first (its key set was lost: ``drop``, which works from it, cannot)."""
        if self._index_failing:
            # one cheap call first: listing the agent (each page a scan of its whole index) for
            # an index that still fails would load every agent at every poll of the outage
            self.index.marker(self.node)
        _, seq, _, instance = _batch(self._events(after=_PAST_ANY_SEQ, limit=1))
        chunks: list[ChunkEvent] = []
        after: str | None = None
        listed = 0
        while True:
            with self._asking():
                page = self._client.keys(limit=LISTING_PAGE, after=after)
            items = page.get("items")
            if not isinstance(items, list):
                raise ValueError(f"{self._shown_url}/v1/keys answered without items")
            if len(items) > LISTING_PAGE:
                raise ValueError(
                    f"{self._shown_url}/v1/keys listed {len(items):,} chunks in a page of "
                    f"{LISTING_PAGE:,}"
                )
            listed += len(items)
            if listed > self.max_listing_chunks:
                raise ListingTooLong(
                    f"{self._shown_url}/v1/keys listed over {self.max_listing_chunks:,} chunks "
                    "(max_listing_chunks): not followed"
                )
            for item in items:
                try:
                    chunks.append(from_listing(item))
                except (InvalidArgument, TypeError, AttributeError):
                    self.malformed += 1
            self._last_ok_s = self._clock()  # a page listed is an answer: still up
            nxt = page.get("next")
            if not nxt or not items:
                break
            if after is not None and str(nxt) <= after:
                # keys are listed in order (hex of one length) after the cursor: a page that
                # does not move it is the same page again, for ever
                raise ValueError(f"{self._shown_url}/v1/keys: listing did not advance past {after}")
            after = str(nxt)
        if reason == "index_count":
            purged = self.index.purge(self.node)
            log.info("%s: %d entries purged from the index", self.node, purged)
        try:
            entries = self.index.replace(self.node, chunks)
        except IndexUnavailable:
            self._replace_backoff.failed()
            raise
        self._replace_backoff.succeeded()
        self._marker = self.index.marker(self.node)
        self._audit_cursor = 0
        self._instance = instance
        self._cursor = seq
        self.resyncs += 1
        self.resync_reasons[reason] += 1
        log.info("%s: resynced, %d chunks, resuming after event %d", self.node, entries, seq)
        return entries

    def _apply(self, events: list[Any]) -> int:
        chunk_events: list[ChunkEvent] = []
        for event in events:
            try:
                ce = from_agent_event(event)
            except (InvalidArgument, TypeError, AttributeError):
                self.malformed += 1
                continue
            if ce is not None:
                chunk_events.append(ce)
        if not chunk_events:
            return 0
        n = self.index.apply(self.node, chunk_events)
        self.applied += n
        return n

    def _answered(self) -> None:
        self._last_ok_s = self._clock()
        if self._up is not True:
            if self._up is False:
                log.info("%s: agent at %s answers again", self.node, self._shown_url)
            self._up = True
        self._failing = False

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = self._shown_error(exc)
        if not self._failing:
            self._failing = True
            log.debug("%s: poll failed: %s", self.node, self.last_error)
        silent_s = self._clock() - (self._since_s if self._last_ok_s is None else self._last_ok_s)
        # a refused connection is no lost packet: nothing listens (stopped, restarting)
        refused = _refused(exc)
        if (silent_s >= self.drop_after_s or refused) and self._up is not False:
            self._up = False
            self._instance = None  # whatever it holds when back, learn it from its listing
            self._pending_reason = "agent_back"
            kept = "its index entries kept (a shared index: others may reach it)"
            if self.drops_when_down:
                try:
                    kept = f"{self.index.drop(self.node)} index entries dropped"
                except IndexUnavailable as exc:  # dropped with the rest when it comes back
                    self._index_failed(exc)
                    kept = "its index entries not dropped (the index failed)"
            log.warning(
                "%s: agent at %s %s; marked down, %s (%s)",
                self.node,
                self._shown_url,
                "refused the connection" if refused else f"silent for {silent_s:.1f} s",
                kept,
                self.last_error,
            )

    def _shown_error(self, exc: Exception) -> str:
        """``exc`` as status and logs show it, at most 300 characters: the SDK's messages name
        the URL as given, which may carry user info, and quote the answer (a proxy's page, an
        agent's detail), which may echo the request's token."""
        text = _masked(str(exc).replace(self.url, self._shown_url), self._sent_token)
        return f"{type(exc).__name__}: {text}"[:300]

    def _index_failed(self, exc: IndexUnavailable) -> None:
        self.index_errors += 1
        self.index_error = str(exc)[:300]
        # what this poll wrote may be lost, and what the index held may be gone when it is
        # back: the next poll it answers resyncs the node
        self._instance = None
        self._pending_reason = "index_back"
        if not self._index_failing:
            self._index_failing = True
            log.warning(
                "%s: the index failed (%s); the node is resynced when it answers",
                self.node,
                self.index_error,
            )

    # --- state ---------------------------------------------------------------------------
    #: the ``Followers`` that keeps this follower's node in its node sets (None: on its own).
    #: What they are made of (``_up``, ``role``, ``_asking_since_s``) is written through the
    #: properties below, which update the sets under the owner's lock: no writer can be missed
    _owner: Followers | None = None

    def _set_state(self, name: str, value: object) -> None:
        owner = self._owner
        if owner is None:
            setattr(self, name, value)
            return
        with owner._lock:
            setattr(self, name, value)
            owner._state_changed_locked(self)

    @property
    def _up(self) -> bool | None:
        """None until the agent is first heard from, then whether it answers."""
        return self._up_value

    @_up.setter
    def _up(self, value: bool | None) -> None:
        self._set_state("_up_value", value)

    @property
    def role(self) -> str | None:
        """The agent's role as its /v1/info says it (see ``_learn_role``)."""
        return self._role_value

    @role.setter
    def role(self, value: str | None) -> None:
        self._set_state("_role_value", value)

    @property
    def _asking_since_s(self) -> float | None:
        """When the request in flight was sent (None: none); ``_asking`` alone sets it."""
        return self._asking_since_value

    def _asked_long(self) -> bool:
        """A request to the agent has been in flight for ``drop_after_s``: its answer, if any,
        trickles. Time a poll waits for a pool thread (other agents' hung polls) or spends on
        the index is not the agent's, and a healthy agent must not go down for it."""
        since = self._asking_since_s
        return since is not None and self._clock() - since >= self.drop_after_s

    @property
    def up(self) -> bool:
        """The agent answered its last request, and none to it has been in flight for
        ``drop_after_s`` (an agent trickling its answer is no longer up)."""
        return self._up is True and not self._asked_long()

    @property
    def failing(self) -> bool:
        """The agent's last poll failed (it has not answered since): ``Followers`` polls it on
        its pool for such agents."""
        return self._failing

    @property
    def down(self) -> bool:
        """Marked down, or a request to it in flight for ``drop_after_s``."""
        return self._up is False or self._asked_long()

    def status(self, *, entries: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The follower's state; ``last_ok_s`` is how many seconds ago the agent last answered
        (None: never). No credentials: the URL is shown without user info, never the token.
        ``entries``: the index's ``nodes()`` when the caller already has it (one index call for
        many followers). ``entries`` in the answer is None when the index does not answer."""
        held: Mapping[str, int] | None = entries
        if held is None:
            try:
                held = self.index.nodes()
            except IndexUnavailable:
                held = None
        last_ok = self._last_ok_s
        return {
            "node": self.node,
            "url": self._shown_url,
            "up": self.up,
            "instance": self._instance,
            "last_seq": self._cursor,
            "applied": self.applied,
            "resyncs": self.resyncs,
            "dropped_events": self.dropped_events,
            "gaps": self.gaps,
            "malformed": self.malformed,
            "errors": self.errors,
            "last_error": self.last_error,
            "index_errors": self.index_errors,
            "index_error": self.index_error,
            "index_lost": self.index_lost,
            # why the node's entries may be stale: its replaces failing in a row, and seconds
            # until the next is sent (None: none failed since the last done)
            "index_replace_failures": self._replace_backoff.failures,
            "index_retry_in_s": self._replace_backoff.retry_in_s(),
            # every reason, 0 included: a counter series exists before its first increase
            "resync_reasons": {r: self.resync_reasons[r] for r in RESYNC_REASONS},
            "drops_when_down": self.drops_when_down,
            # None: not read yet (or the agent does not say); "pool": routed no request
            "role": self.role,
            # why the role's last read failed (None: read, or not asked yet): the role above is
            # then the one read before (None: routed like a node's, even a pool agent's)
            "role_error": self.role_error,
            "entries": None if held is None else held.get(self.node, 0),
            "last_ok_s": None if last_ok is None else max(0.0, self._clock() - last_ok),
        }

    def follows(self, url: str, token: str | None) -> bool:
        """Whether this follower reads ``url`` with ``token``."""
        return self.url == url.rstrip("/") and self._token == token

    def close(self) -> None:
        """Stop following (waits for a poll in progress); the index keeps what it has."""
        with self._lock:
            self._closed = True
            self._client.close()


def request_timeout_s(drop_after_s: float, timeout_s: float | None) -> float:
    """One request's timeout: ``timeout_s``, or (None) a third of ``drop_after_s`` so that a few
    tries fit in it and one lost packet does not drop a node, within 0.1 s and
    ``MAX_REQUEST_TIMEOUT_S``."""
    if timeout_s is not None:
        return timeout_s
    return min(MAX_REQUEST_TIMEOUT_S, max(0.1, drop_after_s / 3))


class Followers:
    """Follows a set of agents (``agents``: node -> (url, token)) from one background thread.

    Each round starts a poll for every agent whose previous poll has finished, on a small thread
    pool, and does not wait for slow ones: a hung agent costs its own follower one request
    timeout per round and nothing to the others. An agent whose last poll failed is polled on a
    second pool: with one pool, as many hung agents as it has threads (a partitioned DC's) held
    every thread for a request timeout each round, and the agents that answer waited behind
    them (320 hung agents: each answering agent's chunks reached the index ~19 s late, not
    ~0.2 s). The first hung poll of an agent that answered before still runs on the first pool:
    so that many of them at once (a DC's link down) do not hold up the others' polls there, a
    poll that has waited a round for a thread gets one of its own (``DaemonPool``'s overflow,
    up to ``MAX_POLL_THREADS_TOTAL``).
    """

    def __init__(
        self,
        index: FleetIndex,
        agents: Mapping[str, tuple[str, str | None]] | None = None,
        *,
        poll_s: float = 0.2,
        drop_after_s: float = 3.0,
        timeout_s: float | None = None,
        audit_entries_per_s: float = DEFAULT_AUDIT_ENTRIES_PER_S,
        max_listing_chunks: int = DEFAULT_MAX_LISTING_CHUNKS,
    ) -> None:
        _check_seconds("poll_s", poll_s)
        _check_count("max_listing_chunks", max_listing_chunks)
        #: each follower's cap on one resync's listing (see ``Follower``)
        self.max_listing_chunks = max_listing_chunks
        _check_seconds("drop_after_s", drop_after_s)
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
        _check_rate("audit_entries_per_s", audit_entries_per_s)
        self.index = index
        #: each follower's index audit rate (see ``Follower``)
        self.audit_entries_per_s = float(audit_entries_per_s)
        self.poll_s = float(poll_s)
        self.drop_after_s = float(drop_after_s)
        #: one request's timeout (None: from drop_after_s, see ``Follower``)
        self.timeout_s = timeout_s
        self._followers: dict[str, Follower] = {}
        self._lock = threading.Lock()
        # The node sets a routing decision asks for, kept as the followers' state changes
        # rather than made by a pass over every follower at each call (three per routed
        # request: ~26 us at 1,000 followers): the nodes called up (``_up`` True), marked down
        # (False), pool agents.
        # Under ``_lock``, written by ``_state_changed_locked``, ``_asking_changed_locked``,
        # ``_forget_locked`` and ``_promote_asked_long_locked`` only
        self._answering: set[str] = set()
        self._marked_down: set[str] = set()
        self._pools: set[str] = set()
        #: the nodes with a request in flight, in the order sent, and those whose request has
        #: been in flight for drop_after_s (``Follower._asked_long``: neither up, and down)
        self._asking: OrderedDict[str, Follower] = OrderedDict()
        self._asking_long: dict[str, Follower] = {}
        #: the sets as ``up_nodes``, ``down_nodes`` and ``pool_nodes`` answer them
        self._up_nodes: frozenset[str] = frozenset()
        self._down_nodes: frozenset[str] = frozenset()
        self._pool_nodes: frozenset[str] = frozenset()
        #: a poll of the pool of agents that answer waits this long for a thread at most: a
        #: round, and never more than a request timeout (see ``MAX_POLL_THREADS_TOTAL``)
        self.max_queue_wait_s = min(self.poll_s, request_timeout_s(drop_after_s, timeout_s))
        self._pool: DaemonPool | None = None
        #: the polls of agents whose last poll failed (see the class)
        self._failing_pool: DaemonPool | None = None
        self._inflight: dict[str, Future[int]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for node, (url, token) in (agents or {}).items():
            self.add(node, url, token)

    def add(self, node: str, url: str, token: str | None = None) -> None:
        """Follow ``node`` at ``url``; a node already followed at another URL or token is
        followed anew (its entries come from the new agent's listing)."""
        follower = Follower(
            self.index,
            node,
            url,
            token=token,
            drop_after_s=self.drop_after_s,
            timeout_s=self.timeout_s,
            audit_entries_per_s=self.audit_entries_per_s,
            max_listing_chunks=self.max_listing_chunks,
        )
        with self._lock:
            old = self._followers.get(node)
            if old is not None and old.follows(url, token):
                follower.close()
                return
        while True:
            with self._lock:
                # a concurrent add of this node may have put its follower in while one closed:
                # each is taken out and closed in turn (else it polled on, unfollowed, for ever)
                old = self._followers.pop(node, None)
                if old is None:
                    self._followers[node] = follower
                    follower._owner = self
                    # from its state as it is
                    self._state_changed_locked(follower)
                    self._asking_changed_locked(follower)
                    return
                self._inflight.pop(node, None)
                self._forget_locked(node)
            # before the new one starts: a poll of the old one in progress must not apply its
            # events after the new one's resync
            old.close()

    def remove(self, node: str) -> None:
        """Stop following ``node`` and drop its entries, in a shared index too: the node left
        the fleet (waits for its poll in progress, so that poll cannot bring them back)."""
        with self._lock:
            follower = self._followers.pop(node, None)
            self._inflight.pop(node, None)
            self._forget_locked(node)
        if follower is None:
            return
        follower.close()
        try:
            dropped = self.index.drop(node)
        except IndexUnavailable as exc:
            log.warning("%s: no longer followed; its index entries not dropped: %s", node, exc)
            return
        log.info("%s: no longer followed; its %d index entries dropped", node, dropped)

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._followers)

    def poll_all(self) -> int:
        """One round over every agent, waiting for each poll; returns the index changes. A
        ``stop`` meanwhile ends it quietly: the polls it cancelled count none."""
        with self._lock:
            followers = list(self._followers.values())
            pool = self._ensure_pool_locked()
        if len(followers) <= 1:
            return sum(f.poll_once() for f in followers)
        polls: list[Future[int]] = []
        for follower in followers:
            try:
                polls.append(pool.submit(follower.poll_once))
            except RuntimeError:
                with self._lock:
                    if self._pool is pool:  # not stop()'s doing: no thread to be had
                        raise
                break  # stop() shut the pool meanwhile: the rest are not polled
        wait(polls)
        # a poll stop() cancelled (DaemonPool.shutdown) changed nothing: result() raised
        # CancelledError for it, out of a round a stopped follower set should end quietly
        return sum(p.result() for p in polls if not p.cancelled())

    def _poll_round(self, stop: threading.Event) -> None:
        """Start a poll for every agent not still busy with the last one (the thread's round).
        Nothing once ``stop`` is set: stop() has taken the pools, and a round begun before it
        would make new ones that no one shuts, their polls going on after it returned."""
        with self._lock:
            if stop.is_set():
                return
            pool = self._ensure_pool_locked()
            for node, follower in self._followers.items():
                busy = self._inflight.get(node)
                if busy is None or busy.done():
                    lane = self._ensure_failing_pool_locked() if follower.failing else pool
                    self._inflight[node] = lane.submit(follower.poll_once)

    def _ensure_pool_locked(self) -> DaemonPool:
        if self._pool is None:
            self._pool = DaemonPool(
                MAX_POLL_THREADS,
                "kvctl-follow",
                overflow_after_s=self.max_queue_wait_s,
                max_threads=MAX_POLL_THREADS_TOTAL,
            )
        return self._pool

    def _ensure_failing_pool_locked(self) -> DaemonPool:
        if self._failing_pool is None:
            # no thread of their own for polls that wait: these agents failed, and a thread
            # for each of a partitioned DC's would grow with the fleet
            self._failing_pool = DaemonPool(MAX_POLL_THREADS, "kvctl-follow-failing")
        return self._failing_pool

    def start(self) -> None:
        """Poll every ``poll_s`` in a background thread (no-op when already running)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name="kvctl-followers", daemon=True
            )
            self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started_s = time.monotonic()
            try:
                self._poll_round(stop)
            except Exception:  # the thread must outlive any one bad round
                log.exception("follower round failed")
            stop.wait(max(0.0, self.poll_s - (time.monotonic() - started_s)))

    def stop(self) -> None:
        """Stop the thread and wait for polls in progress (no-op when not running)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            pools = [self._pool, self._failing_pool]
            self._pool = self._failing_pool = None
            polls, self._inflight = list(self._inflight.values()), {}
        if thread is not None:
            thread.join()
        for pool in pools:
            if pool is not None:
                pool.shutdown()  # the polls not started are cancelled
        wait(polls)  # (a hung agent's poll ends within its request's deadline)

    def close(self) -> None:
        """Stop, and close every follower's connection (the index keeps its entries)."""
        self.stop()
        with self._lock:
            followers = list(self._followers.values())
        for f in followers:
            f.close()

    def status(self) -> list[dict[str, Any]]:
        """Each follower's state (``entries`` None when the index does not answer: the
        followers' own state is still worth showing)."""
        with self._lock:
            followers = [self._followers[n] for n in sorted(self._followers)]
        try:
            entries: Mapping[str, int] | None = self.index.nodes()
        except IndexUnavailable:
            return [{**f.status(entries={}), "entries": None} for f in followers]
        return [f.status(entries=entries) for f in followers]

    def up_nodes(self) -> frozenset[str]:
        """The nodes whose agent answers (``Follower.up``; asks the index nothing: a routing
        decision calls it)."""
        with self._lock:
            self._promote_asked_long_locked()
            return self._up_nodes

    def down_nodes(self) -> frozenset[str]:
        """The followed nodes marked down (``Follower.down``): their entries (kept in a shared
        index) must not be used as sources by this router (asks the index nothing)."""
        with self._lock:
            self._promote_asked_long_locked()
            return self._down_nodes

    def pool_nodes(self) -> frozenset[str]:
        """The followed nodes whose agent says it is a pool agent (``POOL_ROLE``): they run no
        engine, so they serve no request, whether named by the inventory or by --agent (asks
        the index and the agents nothing: a routing decision calls it)."""
        with self._lock:
            return self._pool_nodes

    # --- the node sets, kept as each follower's state changes (see __init__) ----------------
    def _state_changed_locked(self, follower: Follower) -> None:
        """``follower``'s node in or out of the sets as its ``_up`` and ``role`` say; nothing
        for a follower no longer followed (replaced or removed while its poll ran)."""
        node = follower.node
        if self._followers.get(node) is not follower:
            return
        self._refreeze_locked(
            up=_placed(self._answering, node, follower._up is True),
            down=_placed(self._marked_down, node, follower._up is False),
            pool=_placed(self._pools, node, follower.role == POOL_ROLE),
        )

    def _asking_changed_locked(self, follower: Follower) -> None:
        """``follower`` sent a request, or its request ended (``Follower._asking``)."""
        node = follower.node
        if self._followers.get(node) is not follower:
            return
        self._asking.pop(node, None)
        was_long = self._asking_long.pop(node, None) is not None
        if follower._asking_since_s is not None:
            self._asking[node] = follower  # the last sent, last
        if was_long:
            self._refreeze_locked(up=True, down=True)

    def _promote_asked_long_locked(self) -> None:
        """Move the nodes whose request has been in flight for drop_after_s (no longer up, and
        down) to ``_asking_long``. ``_asking`` is in the order the requests were sent (each
        follower reads the clock under ``_lock``), and every follower here has the same clock
        and drop_after_s: the first one not asked long ends the search."""
        moved = False
        while self._asking:
            node, follower = next(iter(self._asking.items()))
            if not follower._asked_long():
                break
            del self._asking[node]
            self._asking_long[node] = follower
            moved = True
        if moved:
            self._refreeze_locked(up=True, down=True)

    def _forget_locked(self, node: str) -> None:
        """``node`` is no longer followed (removed, or its follower replaced): in no set."""
        self._asking.pop(node, None)
        was_long = self._asking_long.pop(node, None) is not None
        self._refreeze_locked(
            up=_placed(self._answering, node, False) or was_long,
            down=_placed(self._marked_down, node, False) or was_long,
            pool=_placed(self._pools, node, False),
        )

    def _refreeze_locked(self, *, up: bool = False, down: bool = False, pool: bool = False) -> None:
        """Make the answers anew of the sets that changed (a pass over their members, at a
        change only)."""
        if up:
            self._up_nodes = frozenset(self._answering.difference(self._asking_long))
        if down:
            self._down_nodes = frozenset(self._marked_down.union(self._asking_long))
        if pool:
            self._pool_nodes = frozenset(self._pools)


def _placed(members: set[str], node: str, member: bool) -> bool:
    """Put ``node`` in ``members`` or take it out; whether that changed them."""
    if (node in members) == member:
        return False
    if member:
        members.add(node)
    else:
        members.discard(node)
    return True


def _batch(answer: Mapping[str, Any]) -> tuple[list[Any], int, int, str]:
    """(events, last_seq, dropped, instance) of an events answer, checked: an answer of another
    shape is an error (counted), never a reason to move the cursor."""
    events = answer.get("events")
    last_seq = answer.get("last_seq")
    dropped = answer.get("dropped", 0)
    instance = answer.get("instance")
    if (
        not isinstance(events, list)
        or not _is_count(last_seq)
        or not _is_count(dropped)
        or not isinstance(instance, str)
        # past the agent's own bound: taken as the cursor, every later read asked for events
        # after it, which the agent refuses, and the node was down for good
        or cast(int, last_seq) > _PAST_ANY_SEQ
    ):
        raise ValueError(f"not an events answer: {dict(answer)!r:.200}")
    assert isinstance(last_seq, int) and isinstance(dropped, int)  # for mypy: _is_count checked
    return events, last_seq, dropped, instance


class ListingTooLong(ValueError):
    """An agent listed more chunks than a resync takes (``max_listing_chunks``)."""


def _check_count(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{what} must be a whole number >= 1, got {value!r}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_rate(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number per second, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{what} must be >= 0 per second, got {value!r}")


def _check_seconds(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {value!r}")
    # the threads wait this long at a time: past TIMEOUT_MAX a wait raises OverflowError
    if not 0 < value <= threading.TIMEOUT_MAX:
        raise InvalidArgument(
            f"{what} must be > 0 and at most {threading.TIMEOUT_MAX:.0f} seconds, got {value!r}"
        )


#: of a token quoted only in part (an answer's quote cut in it), this many first characters
#: or more are masked: fewer match too much of other text
_TOKEN_HEAD_CHARS = 8


def _masked(text: str, token: str) -> str:
    """``text`` with ``token`` as ``***``, and its head where a quote was cut in it (the SDK
    quotes an answer's first 80 characters): at least ``_TOKEN_HEAD_CHARS`` of it."""
    if not token:
        return text
    head = token[:_TOKEN_HEAD_CHARS]
    parts, at = [], 0
    while (found := text.find(head, at)) >= 0:
        end = found + len(head)
        while end - found < len(token) and end < len(text) and text[end] == token[end - found]:
            end += 1
        parts += [text[at:found], "***"]
        at = end
    return "".join(parts) + text[at:]


def _safe(url: object) -> str:
    """``url`` without user info (``http://user:secret@host`` -> ``http://host``)."""
    text = str(url)
    try:
        parts = urlsplit(text)
    except ValueError:
        return "<unparsable URL>"
    if parts.username is None and parts.password is None:
        return text
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
