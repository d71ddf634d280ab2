"""Where `kvctl top` reads from: the fleet's inventory in the database (every node's agent asked
live, link RTTs from the collectors' probes), or agents named by URL; and, when one is named, the
router's decision counts. Each poll asks every agent (and the router) at once and never raises
for one that does not answer: that node, or the router, is down, or not answering when it took
the connection and said nothing (a poll given ``wait_s`` waits no longer than that for it)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from kvctl.client import AgentNotAnswering, AgentStarting, AuthError
from kvctl.db.engine import follow_the_path
from kvctl.db.inventory import NodeInfo
from kvctl.db.sample_checks import Rejections, count
from kvctl.fleet.fanout import ClientPool, _reason
from kvctl.tui.asking import Answer, Calls
from kvctl.tui.db_reads import DB_WAIT_S, DatabaseUnavailable, DbReads
from kvctl.tui.model import GpuPower, Poll, Reading, RouterReading

if TYPE_CHECKING:
    from kvctl.db.analytics.recorded import Recorded
    from kvctl.router.client import RouterClient

#: mean RTT per DC pair (both orders), and its basis (see ``FleetSource.rtt``)
_Rtt = tuple[dict[tuple[str, str], float | None], dict[tuple[str, str], str]]
#: GPUs are read this often (seconds): NVML power moves slowly and costs a request per node
GPU_EVERY_S = 10.0
#: link RTTs are the collectors' probes over this window
LINK_WINDOW_S = 15 * 60.0


#: events read when a node's page opens (the most recent ones), and hot/pinned chunks listed
RECENT_EVENTS = 300
TOP_CHUNKS = 50
PINNED_CHUNKS = 200
#: beyond any real sequence number: the agent answers with its last one (see EventHub.read)
_RESYNC_CURSOR = 1 << 62


@dataclass(frozen=True, slots=True)
class Details:
    """A node's own detail: new events since ``cursor``, hottest and pinned chunks."""

    events: list[dict[str, Any]] = field(default_factory=list)
    #: pass back as ``cursor`` next time
    cursor: int | None = None
    dropped: int = 0
    #: the agent's sequence went back: it restarted since the last read
    restarted: bool = False
    top: list[dict[str, Any]] | None = None
    pinned: list[dict[str, Any]] | None = None
    error: str | None = None


def _details_from(
    pool: ClientPool, node: NodeInfo, cursor: int | None
) -> tuple[int | None, Details]:
    """:func:`fetch_details` with the cursor it was asked from: an answer that comes back late
    is applied only where the page still reads from that cursor."""
    return cursor, fetch_details(pool, node, cursor)


def fetch_details(pool: ClientPool, node: NodeInfo, cursor: int | None) -> Details:
    """Ask ``node``'s agent for its detail over the pool's kept-open client; a failure is a
    :class:`Details` with ``error``."""
    from kvctl.client import NotAnAgent

    try:
        c = pool.get(node.agent_url)
        after = cursor
        if after is None:  # first read: only the most recent events
            last = int(c.events(after=_RESYNC_CURSOR, limit=1)["last_seq"])
            after = max(last - RECENT_EVENTS, 0)
        ev = c.events(after=after, limit=1000)
        restarted = cursor is not None and int(ev["last_seq"]) < cursor
        try:
            top = c.top_keys(limit=TOP_CHUNKS)["items"]
            pinned = c.top_keys(limit=PINNED_CHUNKS, pinned=True)["items"]
            error = None
        except NotAnAgent as exc:
            if exc.code != 404:
                raise
            # it answered the events above: an agent from before /v1/keys/top
            top = pinned = None
            error = "this agent does not list hot chunks (upgrade it)"
    except Exception as exc:
        return Details(cursor=cursor, error=str(exc))
    return Details(
        ev["events"], int(ev["last_seq"]), int(ev.get("dropped", 0)), restarted, top, pinned, error
    )


class Source(Protocol):
    #: what the header says is being watched
    label: str
    #: the agents' bearer token (None: the SDK reads KVCTL_TOKEN)
    token: str | None

    def poll(self, wait_s: float | None = None) -> Poll:
        """Every watched agent's reading, waited for up to ``wait_s`` seconds (None: until
        each answers or times out); one still silent then reads as not answering."""
        ...

    def details(self, node: NodeInfo, cursor: int | None, wait_s: float | None = None) -> Details:
        """``node``'s detail from ``cursor``, waited for up to ``wait_s`` seconds (None: until
        it answers or times out); still asking then, a :class:`Details` saying so."""
        ...

    def close(self) -> None: ...


def gpu_power(answer: dict[str, Any]) -> GpuPower:
    """A node's ``/v1/gpus`` as total power, or N/A with NVML's own reason. A power that
    cannot be true (NaN, Infinity, negative: the collectors' check) is read as a missing
    reading, and named in ``rejected``."""
    nvml = answer.get("nvml", {})
    gpus = answer.get("gpus", [])
    if not nvml.get("available"):
        return GpuPower(None, 0, f"NVML unavailable: {nvml.get('error') or 'unknown'}")
    rejected = Rejections()
    read = [count(g.get("power_w"), f"gpus[{i}].power_w", rejected) for i, g in enumerate(gpus)]
    watts = [w for w in read if w is not None]
    if not watts:
        why = f"power rejected: {rejected.summary()}" if rejected else "no power reading"
        return GpuPower(None, len(gpus), why, rejected.fields)
    return GpuPower(float(sum(watts)), len(gpus), rejected=rejected.fields)


def router_url(url: str) -> str:
    """``url`` checked as a router's address (http or https, with a host)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a router URL: {url!r} (use http://HOST:PORT)")
    if parts.username or parts.password:  # the URL is shown in the header: no secrets in it
        raise ValueError("give the router's token with --router-token-file, not in its URL")
    return parts.geturl().rstrip("/")


class RouterWatch:
    """Reads the router's ``/v1/stats`` once a poll over one kept-open client; never raises:
    a router that does not answer is a :class:`RouterReading` with the reason."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 2.0) -> None:
        self.url = router_url(url)
        self._token = token
        self._timeout_s = timeout_s
        self._client: RouterClient | None = None

    def read(self) -> RouterReading:
        from kvctl.router.client import RouterClient, RouterClientError

        try:
            if self._client is None:
                self._client = RouterClient(self.url, token=self._token, timeout_s=self._timeout_s)
            return RouterReading(self.url, self._client.stats())
        except RouterClientError as exc:
            return RouterReading(self.url, None, str(exc))
        except Exception as exc:  # not the router's answer at all: its reason, not a crash
            return RouterReading(self.url, None, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


@dataclass(frozen=True, slots=True)
class _Reply:
    """One agent's answers to a poll's call: its stats, and its identity when asked."""

    stats: dict[str, Any]
    info: dict[str, Any] | None = None


class Asker:
    """Asks agents for stats each poll, for GPUs every :data:`GPU_EVERY_S` and, when told, for
    who they are; and the router (when one is watched) for its stats alongside. No poll waits
    on a hung agent or router past its ``wait_s`` (see :mod:`kvctl.tui.asking`)."""

    def __init__(
        self,
        token: str | None,
        timeout_s: float,
        clock: Callable[[], float] = time.time,
        router: RouterWatch | None = None,
    ) -> None:
        self.token, self.timeout_s, self.clock, self.router = token, timeout_s, clock, router
        self._gpus_at: dict[str, float] = {}
        self._pool: ClientPool | None = None
        self._agents: Calls[_Reply] = Calls(clock=clock, name="kvctl-top-agent")
        # GPUs on calls of their own: an agent whose NVML hangs still shows its stats
        self._gpus: Calls[GpuPower] = Calls(clock=clock, name="kvctl-top-gpus")
        self._router: Calls[RouterReading] = Calls(
            max_threads=1, clock=clock, name="kvctl-top-router"
        )
        # a node page's detail, with the cursor it was asked from: one trickling its answer
        # (which no read timeout ends) holds no thread of the view, and a page opened again
        # asks it no second call
        self._details: Calls[tuple[int | None, Details]] = Calls(
            clock=clock, name="kvctl-top-details"
        )

    @property
    def pool(self) -> ClientPool:
        if self._pool is None:
            self._pool = ClientPool(token=self.token, timeout_s=self.timeout_s)
        return self._pool

    def close(self) -> None:
        self._agents.close()
        self._gpus.close()
        self._router.close()
        self._details.close()
        if self._pool is not None:
            self._pool.close()
        if self.router is not None:
            self.router.close()

    def ask(
        self,
        nodes: Sequence[NodeInfo],
        wait_s: float | None = None,
        *,
        identify: Collection[int] = (),
    ) -> tuple[list[Reading], RouterReading | None]:
        """Every node's reading and the router's (None when no router is watched), asked at
        the same time and waited for up to ``wait_s`` (None: until each answers or times out).
        Nodes whose id is in ``identify`` are also asked their ``/v1/info`` (``Reading.info``)."""
        deadline_s = None if wait_s is None else time.perf_counter() + wait_s
        watch = self.router
        router = None if watch is None else self._router.start({"router": watch.read})
        readings = self._ask_agents(nodes, deadline_s, set(identify))
        if watch is None or router is None:
            return readings, None
        a = router.answers(deadline_s)["router"]
        if a.value is not None:
            return readings, replace(a.value, read_at_s=a.at_s if a.late else None)
        return readings, RouterReading(watch.url, None, f"no answer for {a.waiting_s or 0:.1f} s")

    def details(self, node: NodeInfo, cursor: int | None, wait_s: float | None) -> Details:
        """``node``'s detail from ``cursor`` (see :meth:`Source.details`)."""
        key = _key(node)
        deadline_s = None if wait_s is None else time.perf_counter() + wait_s
        fetch = partial(_details_from, self.pool, node, cursor)
        a = self._details.start({key: fetch}).answers(deadline_s)[key]
        if a.value is not None:
            asked, details = a.value
            # a late answer asked from another cursor (a page closed since, or read past it):
            # no news, its events are not ours to add; this fetch's call brings them
            return details if asked == cursor else Details(cursor=cursor)
        if a.error is not None:
            return Details(cursor=cursor, error=_reason(a.error))
        why = (
            f"no detail from {node.agent_url} for {a.waiting_s or 0:.1f} s (still asking): "
            "hung or overloaded?"
        )
        return Details(cursor=cursor, error=why)

    def _ask_agents(
        self, nodes: Sequence[NodeInfo], deadline_s: float | None, identify: set[int]
    ) -> list[Reading]:
        now = self.clock()
        jobs: dict[str, Callable[[], _Reply]] = {}
        gpu_jobs: dict[str, Callable[[], GpuPower] | None] = {}
        for n in nodes:
            jobs[_key(n)] = partial(self._call, n.agent_url, n.id in identify)
            due = now - self._gpus_at.get(n.name, -GPU_EVERY_S) >= GPU_EVERY_S
            gpu_jobs[_key(n)] = partial(self._gpu_call, n.agent_url) if due else None
            if due:
                self._gpus_at[n.name] = now
        stats_round, gpus_round = self._agents.start(jobs), self._gpus.start(gpu_jobs)
        answers = stats_round.answers(deadline_s)
        gpus = gpus_round.answers(deadline_s)
        readings = []
        for n in nodes:
            gpu = gpus.get(_key(n))
            readings.append(self._reading(n, answers[_key(n)], None if gpu is None else gpu.value))
        return readings

    def _call(self, url: str, identify: bool) -> _Reply:
        client = self.pool.get(url)
        stats = dict(client.stats())
        info = None
        if identify:
            with contextlib.suppress(Exception):  # unnamed until it tells: no reason to fail
                info = dict(client.info())
        return _Reply(stats, info)

    def _gpu_call(self, url: str) -> GpuPower:
        try:
            return gpu_power(self.pool.get(url).gpus())
        except Exception as exc:  # an agent without /v1/gpus still has stats
            return GpuPower(None, 0, f"GPUs unreadable: {exc}")

    def _reading(self, node: NodeInfo, a: Answer[_Reply], gpu: GpuPower | None) -> Reading:
        if a.value is not None:
            v = a.value
            # an answer within this poll's wait counts at the poll's time, a late one at its own
            at_s = a.at_s if a.late else None
            return Reading(node, v.stats, None, a.elapsed_s, gpu, read_at_s=at_s, info=v.info)
        if a.waiting_s is not None:
            why = (
                f"no answer from {node.agent_url} for {a.waiting_s:.1f} s (still asking): "
                "hung or overloaded? Its log (agent.log in its data dir) says what it was doing"
            )
            return Reading(node, None, why, a.waiting_s, silent=True)
        exc = a.error
        assert exc is not None
        if isinstance(exc, AuthError):  # it answered: up, but its figures are not ours to read
            return Reading(node, None, _reason(exc), a.elapsed_s, auth_refused=True)
        if isinstance(exc, AgentStarting):  # up, opening its tiers: no figures yet, not down
            return Reading(node, None, _reason(exc), a.elapsed_s, starting=True)
        if isinstance(exc, AgentNotAnswering):
            why = (
                f"{node.agent_url} took the connection and said nothing for {self.timeout_s:g} "
                "s: hung or overloaded? Its log (agent.log in its data dir) says what it was doing"
            )
            return Reading(node, None, why, a.elapsed_s, silent=True)
        return Reading(node, None, _reason(exc), a.elapsed_s)


def _key(node: NodeInfo) -> str:
    return f"{node.id} {node.agent_url}"


class FleetSource:
    """The inventory's nodes (optionally some DCs or nodes), re-read every poll so nodes added
    while the view is open appear; RTT between DCs from the collectors' link probes."""

    def __init__(
        self,
        engine: Engine,
        *,
        dcs: Sequence[str] = (),
        nodes: Sequence[str] = (),
        token: str | None = None,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        router: RouterWatch | None = None,
        db_wait_s: float = DB_WAIT_S,
    ) -> None:
        # a SQLite file moved away or replaced while top runs: its pooled connections would go
        # on reading the file they opened (an inventory no longer at the path, shown as live),
        # and one opened where no file is would create an empty database there. Followed, a
        # read says 'no database file at PATH (moved or deleted while kvctl top ran)' in the
        # view (the agents asked as last read) and a file put at the path is read from then on
        follow_the_path(engine, "kvctl top")
        self.engine = engine
        self.dcs, self.nodes = list(dcs), list(nodes)
        self.token = token
        self.clock = clock
        self._asker = Asker(token, timeout_s, clock, router)
        url = engine.url
        self.label = f"fleet · {url.get_backend_name()}:{url.database or ''}"
        if self.dcs or self.nodes:
            self.label += " · " + ",".join([*self.dcs, *self.nodes])
        self.label += _router_label(router)
        #: the inventory and RTTs as last read: a poll whose database fails asks those nodes
        self._last_targets: list[NodeInfo] | None = None
        self._last_rtt: _Rtt
        self._last_rtt = ({}, {})
        self._seen_ms: dict[int, int] = {}
        self._db = DbReads((SQLAlchemyError,), _db_reason, wait_s=db_wait_s)

    def targets(self) -> list[NodeInfo]:
        from kvctl.fleet.targets import resolve_targets

        everyone = not (self.dcs or self.nodes)
        with self.engine.connect() as conn:
            return resolve_targets(conn, nodes=self.nodes, dcs=self.dcs, all_nodes=everyone)

    def recorded(self, span: str) -> Recorded:
        """What the collectors recorded over the last ``span`` (a duration such as ``15m``) for
        the nodes watched, per node, DC and in total: with the nodes removed since it started
        (those of the DCs watched), as `kvctl status --window` counts them."""
        from kvctl.db.analytics.recorded import recorded, removed_in
        from kvctl.db.analytics.windows import window_of

        win = window_of(span, int(self.clock() * 1000))
        nodes = self.targets()
        everyone = not (self.dcs or self.nodes)
        with self.engine.connect() as conn:
            gone = removed_in(conn, win, dcs=self.dcs, everyone=everyone)
            return recorded(conn, win, nodes, gone)

    def rtt(self) -> _Rtt:
        """Mean RTT per DC pair (both orders) over :data:`LINK_WINDOW_S`, and its basis: an
        agent-emulated delay is inside the RTT it was added to, so the view must say so."""
        from kvctl.db.analytics.inventory import inventory
        from kvctl.db.analytics.links import link_figures, rtt_bases

        end_ms = int(self.clock() * 1000)
        start_ms = end_ms - int(LINK_WINDOW_S * 1000)
        with self.engine.connect() as conn:
            inv = inventory(conn)
            figures = link_figures(conn, start_ms, end_ms, inv)
            bases = rtt_bases(conn, start_ms, end_ms, inv)
        out: dict[tuple[str, str], float | None] = {}
        basis: dict[tuple[str, str], str] = {}
        for f in figures:
            out[(f.dc_a, f.dc_b)] = out[(f.dc_b, f.dc_a)] = f.rtt_mean_s
        for (a, b), rb in bases.items():
            basis[(a, b)] = basis[(b, a)] = rtt_basis_word(rb.probes)
        return out, basis

    def last_seen(self, down: list[int]) -> dict[int, int]:
        """The collectors' last successful scrape of each of the ``down`` nodes, where there is
        one."""
        from kvctl.fleet.status import last_seen

        if not down:
            return {}
        with self.engine.connect() as conn:
            return last_seen(conn, down)

    def _after_asking(self, down: list[int]) -> tuple[_Rtt, dict[int, int]]:
        return self.rtt(), self.last_seen(down)

    def poll(self, wait_s: float | None = None) -> Poll:
        """The agents' readings; when the database fails or is slow to answer (once the
        inventory was read), the nodes, RTTs and last-seen times as last read, and ``db_error``
        says why: the metrics database going away must not blind the live view of the agents,
        nor slow it (see :mod:`kvctl.tui.db_reads`). Each node that did not answer carries the
        collectors' last successful scrape of it, so the view counts its downtime as
        `kvctl status` does, not from when top started."""
        t0 = time.perf_counter()
        ts_s = self.clock()
        db_error = None
        targets = self._last_targets
        if targets is None:  # never read: nothing to watch until it is (raises)
            targets = self._last_targets = self.targets()
        else:
            try:
                targets = self._last_targets = self._db.read(self.targets)
            except DatabaseUnavailable as exc:
                db_error = str(exc)
        readings, router = self._asker.ask(targets, wait_s)
        if db_error is None:
            down = [r.node.id for r in readings if not r.up]
            try:
                self._last_rtt, seen_ms = self._db.read(partial(self._after_asking, down))
                self._seen_ms.update(seen_ms)
            except DatabaseUnavailable as exc:
                db_error = str(exc)
        seen = self._seen_ms
        readings = [
            replace(r, last_seen_s=seen[r.node.id] / 1000) if not r.up and r.node.id in seen else r
            for r in readings
        ]
        rtt, basis = self._last_rtt
        elapsed_s = time.perf_counter() - t0
        return Poll(ts_s, readings, rtt, elapsed_s, router, rtt_basis=basis, db_error=db_error)

    def details(self, node: NodeInfo, cursor: int | None, wait_s: float | None = None) -> Details:
        return self._asker.details(node, cursor, wait_s)

    def close(self) -> None:
        self._asker.close()
        self._db.close()
        self.engine.dispose()


def _db_reason(exc: Exception) -> str:
    """A database failure in one line: the driver's own words where there are some."""
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]


def rtt_basis_word(probes: dict[str, int]) -> str:
    """A link's successful probes by basis as one word: "emulated" when every one carried an
    agent-emulated delay, "mixed" when some did, else "measured"."""
    if not probes.get("emulated"):
        return "measured"
    return "emulated" if set(probes) == {"emulated"} else "mixed"


def _router_label(router: RouterWatch | None) -> str:
    return "" if router is None else f" · router {router.url}"


def agent_node(url: str, index: int) -> NodeInfo:
    """A node for an agent named by URL, before it has said its own name and DC."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an agent URL: {url!r} (use http://HOST:PORT)")
    return NodeInfo(-(index + 1), parts.netloc, "?", parts.geturl().rstrip("/"), "", None)


class AgentSource:
    """Agents named by URL, without a database: each is named by its own ``/v1/info`` once it
    answers; no link RTTs (those come from the collectors' probes)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        router: RouterWatch | None = None,
    ) -> None:
        if not urls:
            raise ValueError("name at least one agent URL")
        # one row per agent: the same URL named twice is watched once
        nodes = [agent_node(u, i) for i, u in enumerate(urls)]
        unique = list(dict.fromkeys(n.agent_url for n in nodes))
        self._nodes = [agent_node(u, i) for i, u in enumerate(unique)]
        self._named: set[int] = set()
        self.token = token
        self.timeout_s = timeout_s
        self.clock = clock
        self._asker = Asker(token, timeout_s, clock, router)
        self.label = (
            f"agents · {len(self._nodes)}"
            if len(self._nodes) > 1
            else f"agent · {self._nodes[0].agent_url}"
        ) + _router_label(router)

    def targets(self) -> list[NodeInfo]:
        return list(self._nodes)

    def _name_new(self, readings: list[Reading]) -> None:
        """Name each agent that told who it is (asked along with its stats until it does)."""
        for r in readings:
            if r.info is None or r.node.id in self._named:
                continue
            i = -r.node.id - 1
            n = self._nodes[i]
            name = str(r.info.get("name") or n.name)
            if any(o.name == name for o in self._nodes if o.id != n.id):
                name = f"{name}@{n.name}"  # two agents with one host name: keep both apart
            dc = str(r.info.get("dc") or "?")
            self._nodes[i] = NodeInfo(n.id, name, dc, n.agent_url, n.gpu_model, n.engine_url)
            self._named.add(n.id)

    def poll(self, wait_s: float | None = None) -> Poll:
        t0 = time.perf_counter()
        ts_s = self.clock()
        unnamed = [n.id for n in self._nodes if n.id not in self._named]
        readings, router = self._asker.ask(self._nodes, wait_s, identify=unnamed)
        self._name_new(readings)
        by_id = {n.id: n for n in self._nodes}
        readings = [replace(r, node=by_id[r.node.id]) for r in readings]
        return Poll(ts_s, readings, None, time.perf_counter() - t0, router)

    def details(self, node: NodeInfo, cursor: int | None, wait_s: float | None = None) -> Details:
        return self._asker.details(node, cursor, wait_s)

    def close(self) -> None:
        self._asker.close()
