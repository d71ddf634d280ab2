"""The fleet inventory: DCs, the nodes in them (one agent each), and the links between DCs.

Every function works inside the caller's connection/transaction, so a CLI command can make
several changes and write its audit row all or nothing. Bad input raises ``InventoryError``
with a message fit to show an operator as is; the ``*_problem`` checks are shared with the
fleet file's validation (``kvctl.db.fleetfile``) so both reject the same things the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from kvctl.db.models import DataCenter, Link, Node, RemovedNode
from kvctl.profiles import MAX_DISTANCE_KM
from kvctl.redact import redact_url

#: column widths of the schema; checked here because PostgreSQL refuses longer text with a
#: database error, while SQLite silently stores it
DC_NAME_MAX: Final = 64
NODE_NAME_MAX: Final = 128
REGION_MAX: Final = 64
LOCATION_MAX: Final = 128
#: power usage effectiveness past 3 (twice the IT load spent on cooling and power delivery) is
#: no working data center's: a typo, which would multiply every energy and carbon figure
MAX_PUE: Final = 3.0
GPU_MODEL_MAX: Final = 64
URL_MAX: Final = 255

#: fields ``update_dc`` / ``update_node`` may change (the name is the identity, never updated)
DC_FIELDS: Final = ("region", "location", "carbon_g_per_kwh", "pue")
NODE_FIELDS: Final = ("dc", "agent_url", "gpu_model", "engine_url")

#: good examples quoted in URL errors
AGENT_URL_EXAMPLE: Final = "http://10.0.0.7:7070"
ENGINE_URL_EXAMPLE: Final = "http://10.0.0.7:8000/metrics"


class InventoryError(ValueError):
    """An inventory change that cannot be made as asked (unknown DC, duplicate name...)."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    id: int
    name: str
    dc: str
    agent_url: str
    gpu_model: str
    engine_url: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def removed(self) -> bool:
        return False

    @property
    def label(self) -> str:
        """The node's name as listings show it."""
        return self.name


@dataclass(frozen=True, slots=True)
class RemovedNodeInfo(NodeInfo):
    """A node removed from the inventory, as it was (``RemovedNode``): its samples stay in the
    totals of the windows that hold them. No agent to ask: ``agent_url`` is ''."""

    removed_ms: int = 0
    #: its DC's grid intensity and PUE when it was removed (the DC may be gone since)
    dc_carbon_g_per_kwh: float | None = None
    dc_pue: float | None = None

    @property
    def removed(self) -> bool:
        return True

    @property
    def label(self) -> str:
        return removed_label(self.name)


def removed_label(name: str) -> str:
    """A removed node's or DC's name as listings show it."""
    return f"{name} (removed)"


@dataclass(frozen=True, slots=True)
class DcInfo:
    id: int
    name: str
    region: str
    location: str
    carbon_g_per_kwh: float | None
    pue: float | None
    #: how many nodes the DC holds
    nodes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """A link by its DCs' names, ``a < b`` by name (so listings do not depend on row ids)."""

    id: int
    a: str
    b: str
    distance_km: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RemovedDc:
    """What ``remove_dc`` took away: the DC, its nodes and the links that touched it."""

    name: str
    nodes: tuple[str, ...]
    links: tuple[LinkInfo, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": list(self.nodes),
            "links": [[link.a, link.b] for link in self.links],
        }


# --- checks shared with the fleet file --------------------------------------------------------
def name_problem(name: Any, kind: str) -> str | None:
    """Why ``name`` cannot name a ``kind`` ("DC" or "node"), or None when it can."""
    limit = DC_NAME_MAX if kind == "DC" else NODE_NAME_MAX
    if not isinstance(name, str):
        return f"a {kind} name must be text, got {type(name).__name__}"
    if not name.strip():
        return f"a {kind} name must not be empty"
    if name != name.strip() or not name.isprintable():
        return f"a {kind} name must not have leading/trailing spaces or control characters"
    if len(name) > limit:
        return f"{kind} name {name[:20]!r}... is longer than {limit} characters"
    if kind == "node" and "#" in name:
        # the fleet index names an engine's own cache NODE#ENGINE (kvctl.index.model): such a
        # node was taken here, then every router on the database refused to start or reread
        return (
            f"a node name must not hold '#' (got {name!r}): the fleet index keeps it for an "
            "engine's own cache (NODE#ENGINE)"
        )
    return None


def text_problem(value: Any, what: str, limit: int) -> str | None:
    if not isinstance(value, str):
        return f"{what} must be text, got {type(value).__name__}"
    if len(value) > limit:
        return f"{what} is longer than {limit} characters"
    if not value.isprintable():  # an escape sequence would be played by every terminal listing it
        return f"{what} must not hold control characters, got {value[:40]!r}"
    return None


def url_problem(url: Any, what: str = "agent URL") -> str | None:
    """Why ``url`` is not an http(s) URL with a host and a usable port, or None when it is."""
    example = ENGINE_URL_EXAMPLE if what.startswith("engine") else AGENT_URL_EXAMPLE
    if not isinstance(url, str):
        return f"{what} must be text (e.g. {example}), got {type(url).__name__}"
    if len(url) > URL_MAX:
        return f"{what} is longer than {URL_MAX} characters"
    # what these messages echo goes to screens, the router's log and its /v1/stats: never a
    # password, even in a URL refused for something else (a bad port, no scheme)
    shown = redact_url(url)
    bad = f"{what} must be http:// or https:// with a host (e.g. {example}), got {shown!r}"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when not a number or out of range
    except ValueError:
        return f"{what} has a bad port (e.g. {example}), got {shown!r}"
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        return bad
    if port == 0:
        return f"{what} has a bad port (e.g. {example}), got {shown!r}"
    if parts.username is not None or parts.password is not None:
        # the inventory, the audit trail and error messages all show URLs: no secrets in them
        return f"{what} must not carry a user or password; agents take $KVCTL_TOKEN instead"
    return None


def _number_problem(value: Any, what: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{what} must be a number, got {type(value).__name__}"
    if not math.isfinite(value):
        return f"{what} must be a finite number, got {value}"
    return None


def pue_problem(pue: Any) -> str | None:
    if pue is None:
        return None
    if problem := _number_problem(pue, "PUE"):
        return problem
    if pue < 1:
        return f"PUE must be at least 1, got {pue}"
    if pue > MAX_PUE:
        return (
            f"PUE must be 1 to {MAX_PUE:g} (facility energy over IT energy; real data centers "
            f"run about 1.1 to 2.5), got {pue:g}"
        )
    return None


def carbon_problem(carbon: Any) -> str | None:
    if carbon is None:
        return None
    if problem := _number_problem(carbon, "carbon intensity"):
        return problem
    return f"carbon intensity must not be negative, got {carbon}" if carbon < 0 else None


def distance_problem(distance_km: Any) -> str | None:
    if problem := _number_problem(distance_km, "distance"):
        return problem
    if distance_km < 0:
        return f"distance must not be negative, got {distance_km}"
    if distance_km > MAX_DISTANCE_KM:
        return (
            f"distance must be 0 to {MAX_DISTANCE_KM:,.0f} km (the Earth's circumference), "
            f"got {distance_km:g} km"
        )
    return None


def _check(*problems: str | None) -> None:
    for problem in problems:
        if problem:
            raise InventoryError(problem)


def _dc_field_problems(fields: dict[str, Any]) -> list[str | None]:
    checks = {
        "region": lambda v: text_problem(v, "region", REGION_MAX),
        "location": lambda v: text_problem(v, "location", LOCATION_MAX),
        "carbon_g_per_kwh": carbon_problem,
        "pue": pue_problem,
    }
    return [checks[k](v) for k, v in fields.items()]


def _node_field_problems(fields: dict[str, Any]) -> list[str | None]:
    checks = {
        "dc": lambda v: name_problem(v, "DC"),
        "agent_url": lambda v: url_problem(v, "agent URL"),
        "gpu_model": lambda v: text_problem(v, "GPU model", GPU_MODEL_MAX),
        "engine_url": lambda v: None if v is None else url_problem(v, "engine URL"),
    }
    return [checks[k](v) for k, v in fields.items()]


# --- lookups ----------------------------------------------------------------------------------
def _now_ms() -> int:
    return int(time.time() * 1000)


def _known(names: Iterable[str], limit: int = 20) -> str:
    """``a, b, c`` for an error message; long lists are cut so the message stays one line."""
    names = list(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f" and {len(names) - limit} more"
    return shown or "none"


def _insert(conn: Connection, model: Any, duplicate: str, **values: Any) -> int:
    """Insert one inventory row and return its id; a unique-key clash becomes ``duplicate``."""
    insert = model.__table__.insert().values(**values).returning(model.id)
    try:
        if conn.dialect.name != "sqlite":
            # PostgreSQL aborts the whole transaction on a failed statement: a savepoint
            # keeps it usable for the refusal's audit row
            with conn.begin_nested():
                return int(conn.execute(insert).scalar_one())
        # SQLite fails the statement alone; and its driver issues no BEGIN before a
        # SAVEPOINT, so the savepoint's release committed the row whatever the caller's
        # transaction did next (a refused change, a failed audit write kept it)
        return int(conn.execute(insert).scalar_one())
    except IntegrityError:
        raise InventoryError(duplicate) from None


#: what to do about an unknown name that was meant to exist (a removal, a target): look
LS_NEXT = "`kvctl fleet ls` lists them"


def dc_id(conn: Connection, name: str, *, adding: bool = False) -> int:
    """The DC's id. An unknown name says to add it only where something is being ``adding``
    into it (a node, a link); elsewhere it is more likely mistyped."""
    found = conn.execute(select(DataCenter.id).where(DataCenter.name == name)).scalar()
    if found is None:
        known = conn.execute(select(DataCenter.name).order_by(DataCenter.name)).scalars().all()
        next_step = "add it with `kvctl fleet add-dc`" if adding else LS_NEXT
        raise InventoryError(f"no DC named {name!r} (known: {_known(known)}); {next_step}")
    return found


def _node_query() -> Any:
    return select(
        Node.id, Node.name, DataCenter.name, Node.agent_url, Node.gpu_model, Node.engine_url
    ).join(DataCenter, Node.dc_id == DataCenter.id)


def node_by_name(conn: Connection, name: str) -> NodeInfo:
    row = conn.execute(_node_query().where(Node.name == name)).first()
    if row is None:
        known = conn.execute(select(Node.name).order_by(Node.name)).scalars().all()
        raise InventoryError(f"no node named {name!r} (known: {_known(known)}); {LS_NEXT}")
    return NodeInfo(*row)


def list_nodes(conn: Connection, *, dc: str | None = None) -> list[NodeInfo]:
    q = _node_query().order_by(DataCenter.name, Node.name)
    if dc is not None:
        dc_id(conn, dc)
        q = q.where(DataCenter.name == dc)
    return [NodeInfo(*row) for row in conn.execute(q)]


#: how long after a node's removal samples of it may still be stamped: a collector cycle that
#: read the inventory before the removal, a collector's clock ahead of the CLI's. Every window
#: query counts a removed node by this one rule; rows stamped later (a collector cut off from
#: the database keeps scraping the nodes it last read, and writes them on its return) are in
#: no window's totals, as rows of nodes outside the inventory never were
REMOVAL_MARGIN_MS: Final = 3_600_000


def counted_since(since_ms: int) -> Any:
    """Which removed nodes (``RemovedNode``) a window from ``since_ms`` counts: those removed
    after ``since_ms - REMOVAL_MARGIN_MS``. The one rule of every surface's totals."""
    return RemovedNode.removed_ms >= since_ms - REMOVAL_MARGIN_MS


def removed_nodes(
    conn: Connection, *, since_ms: int | None = None, dcs: Iterable[str] | None = None
) -> list[RemovedNodeInfo]:
    """Removed nodes that may have samples at or after ``since_ms`` (None: all of them; else
    those removed after ``since_ms - REMOVAL_MARGIN_MS``), of the DCs named ``dcs`` (None:
    any), by DC, name and id (a name removed twice is two nodes)."""
    r = RemovedNode
    q = select(r.id, r.name, r.dc, r.gpu_model, r.removed_ms, r.dc_carbon_g_per_kwh, r.dc_pue)
    if since_ms is not None:
        q = q.where(counted_since(since_ms))
    if dcs is not None:
        q = q.where(r.dc.in_(list(dcs)))
    return [
        RemovedNodeInfo(i, name, dc, "", gpu, None, removed, carbon, pue)
        for i, name, dc, gpu, removed, carbon, pue in conn.execute(q.order_by(r.dc, r.name, r.id))
    ]


def list_dcs(conn: Connection) -> list[DcInfo]:
    """Every DC by name, with how many nodes it holds."""
    counts = select(Node.dc_id, func.count().label("n")).group_by(Node.dc_id).subquery("counts")
    q = (
        select(
            DataCenter.id,
            DataCenter.name,
            DataCenter.region,
            DataCenter.location,
            DataCenter.carbon_g_per_kwh,
            DataCenter.pue,
            func.coalesce(counts.c.n, 0),
        )
        .outerjoin(counts, counts.c.dc_id == DataCenter.id)
        .order_by(DataCenter.name)
    )
    return [DcInfo(*row) for row in conn.execute(q)]


def list_links(conn: Connection) -> list[LinkInfo]:
    """Every link by its DCs' names (``a < b``), sorted by those names."""
    a, b = DataCenter.__table__.alias("a"), DataCenter.__table__.alias("b")
    q = (
        select(Link.id, a.c.name, b.c.name, Link.distance_km)
        .join(a, Link.dc_a_id == a.c.id)
        .join(b, Link.dc_b_id == b.c.id)
    )
    links = [LinkInfo(i, *sorted((x, y)), d) for i, x, y, d in conn.execute(q)]
    return sorted(links, key=lambda link: (link.a, link.b))


def _link_where(conn: Connection, dc_a: str, dc_b: str) -> Any:
    if dc_a == dc_b:
        raise InventoryError("a link joins two different DCs")
    a, b = sorted((dc_id(conn, dc_a), dc_id(conn, dc_b)))
    return (Link.dc_a_id == a) & (Link.dc_b_id == b)


def _unknown_link(conn: Connection, dc_a: str, dc_b: str) -> InventoryError:
    known = [f"{link.a} <-> {link.b}" for link in list_links(conn)]
    return InventoryError(
        f"no link between {dc_a!r} and {dc_b!r} (known: {_known(known)}); add it with "
        "`kvctl fleet add-link`"
    )


# --- changes ----------------------------------------------------------------------------------
def add_dc(
    conn: Connection,
    name: str,
    *,
    region: str = "",
    location: str = "",
    carbon_g_per_kwh: float | None = None,
    pue: float | None = None,
) -> int:
    fields = {"region": region, "location": location, "carbon_g_per_kwh": carbon_g_per_kwh}
    _check(name_problem(name, "DC"), pue_problem(pue), *_dc_field_problems(fields))
    return _insert(
        conn,
        DataCenter,
        f"a DC named {name!r} already exists",
        name=name,
        region=region,
        location=location,
        carbon_g_per_kwh=carbon_g_per_kwh,
        pue=pue,
        created_ms=_now_ms(),
    )


#: hosts that name this machine's loopback, as one: the same agent by either name
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1"})


def agent_key(url: str) -> tuple[str, str, int | None, str]:
    """What makes two agent URLs one agent: scheme, host (case, ``localhost`` as 127.0.0.1),
    port (the scheme's default spelled out or not) and path (a trailing slash or not)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host in _LOOPBACK_NAMES else host
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, host, port, parts.path.rstrip("/")


def shared_agents(urls: dict[str, str], names: Iterable[str] | None = None) -> list[list[str]]:
    """Groups of the nodes in ``urls`` (name -> agent URL) whose URLs name one agent (status
    and the dashboard would count it once per node), each holding one of ``names`` (None:
    any)."""
    by_agent: dict[tuple[str, str, int | None, str], list[str]] = {}
    for node in sorted(urls):
        by_agent.setdefault(agent_key(urls[node]), []).append(node)
    wanted = None if names is None else set(names)
    return [
        group
        for group in by_agent.values()
        if len(group) > 1 and (wanted is None or wanted & set(group))
    ]


def agent_urls(conn: Connection) -> dict[str, str]:
    """Every node's agent URL, by node name."""
    return {name: url for name, url in conn.execute(select(Node.name, Node.agent_url))}


def refuse_shared_agents(urls: dict[str, str], names: Iterable[str] | None = None) -> None:
    """Raise InventoryError where one agent would be two nodes (``shared_agents``): checked
    on the inventory as it would be, before anything is written."""
    if groups := shared_agents(urls, names):
        said = "; ".join(f"{', '.join(map(repr, g))}" for g in groups)
        raise InventoryError(
            f"one agent URL for several nodes ({said}): an agent is one node, and status and "
            "the dashboard would count it once per node; give each node its own agent's URL "
            "(`kvctl fleet ls` shows them)"
        )


def add_node(
    conn: Connection,
    name: str,
    *,
    dc: str,
    agent_url: str,
    gpu_model: str = "",
    engine_url: str | None = None,
    check_agent: bool = True,
) -> int:
    """``check_agent``: refuse an agent URL another node has (``refuse_shared_agents``); a
    caller making several changes checks once they are all made (an import swapping two
    nodes' URLs passes through a moment where they share one)."""
    fields = {"agent_url": agent_url, "gpu_model": gpu_model, "engine_url": engine_url}
    _check(name_problem(name, "node"), *_node_field_problems(fields))
    dc_key = dc_id(conn, dc, adding=True)
    if check_agent:
        urls = agent_urls(conn)
        if name not in urls:  # (a name taken is refused as such below)
            refuse_shared_agents({**urls, name: agent_url}, [name])
    return _insert(
        conn,
        Node,
        f"a node named {name!r} already exists",
        name=name,
        dc_id=dc_key,
        agent_url=agent_url,
        gpu_model=gpu_model,
        engine_url=engine_url,
        created_ms=_now_ms(),
    )


def add_link(conn: Connection, dc_a: str, dc_b: str, *, distance_km: float) -> int:
    if dc_a == dc_b:
        raise InventoryError("a link joins two different DCs")
    _check(distance_problem(distance_km))
    a, b = sorted((dc_id(conn, dc_a, adding=True), dc_id(conn, dc_b, adding=True)))
    return _insert(
        conn,
        Link,
        f"a link between {dc_a!r} and {dc_b!r} already exists",
        dc_a_id=a,
        dc_b_id=b,
        distance_km=distance_km,
    )


def update_dc(conn: Connection, name: str, **fields: Any) -> None:
    """Change some of a DC's ``DC_FIELDS``; the name stays (it is how everything refers to it)."""
    if unknown := sorted(set(fields) - set(DC_FIELDS)):
        raise InventoryError(f"cannot update {', '.join(unknown)} of a DC (fields: {DC_FIELDS})")
    _check(*_dc_field_problems(fields))
    key = dc_id(conn, name)
    if fields:
        conn.execute(update(DataCenter).where(DataCenter.id == key).values(**fields))


def update_node(conn: Connection, name: str, *, check_agent: bool = True, **fields: Any) -> None:
    """Change some of a node's ``NODE_FIELDS``; ``dc`` (a DC name) moves it to another DC.
    ``check_agent`` as for :func:`add_node`."""
    if unknown := sorted(set(fields) - set(NODE_FIELDS)):
        raise InventoryError(
            f"cannot update {', '.join(unknown)} of a node (fields: {NODE_FIELDS})"
        )
    _check(*_node_field_problems(fields))
    node = node_by_name(conn, name)
    if check_agent and "agent_url" in fields:
        refuse_shared_agents({**agent_urls(conn), name: fields["agent_url"]}, [name])
    values = dict(fields)
    if "dc" in values:
        values["dc_id"] = dc_id(conn, values.pop("dc"), adding=True)
    if values:
        conn.execute(update(Node).where(Node.id == node.id).values(**values))


def update_link(conn: Connection, dc_a: str, dc_b: str, *, distance_km: float) -> None:
    _check(distance_problem(distance_km))
    done = conn.execute(
        update(Link).where(_link_where(conn, dc_a, dc_b)).values(distance_km=distance_km)
    )
    if done.rowcount == 0:
        raise _unknown_link(conn, dc_a, dc_b)


def _keep_removed(conn: Connection, where: Any) -> list[int]:
    """Record the nodes ``where`` selects as they are (``RemovedNode``), in the caller's
    transaction, before they are deleted: their samples stay keyed by their ids, and window
    totals count them under their DC's name rather than losing them with the inventory row.
    Returns their ids, for the caller to delete by: the rows are locked first (PostgreSQL; a
    SQLite writer holds the whole database), so a removal racing another records each node
    once (the second finds it gone), and a node moved into a DC being removed is not deleted
    unrecorded (the DC's delete then fails on it instead)."""
    rows = conn.execute(
        select(
            Node.id,
            Node.name,
            DataCenter.name,
            Node.gpu_model,
            DataCenter.carbon_g_per_kwh,
            DataCenter.pue,
        )
        .join(DataCenter, Node.dc_id == DataCenter.id)
        .where(where)
        .with_for_update(of=Node)
    ).all()
    now_ms = _now_ms()
    if rows:
        conn.execute(
            insert(RemovedNode),
            [
                {
                    "id": i,
                    "name": name,
                    "dc": dc,
                    "gpu_model": gpu,
                    "dc_carbon_g_per_kwh": carbon,
                    "dc_pue": pue,
                    "removed_ms": now_ms,
                }
                for i, name, dc, gpu, carbon, pue in rows
            ],
        )
    return [row[0] for row in rows]


def remove_node(conn: Connection, name: str) -> NodeInfo:
    """Remove a node from the inventory; its recorded samples stay, as history, counted in the
    windows that hold them (``RemovedNode``)."""
    node = node_by_name(conn, name)
    if not _keep_removed(conn, Node.id == node.id):
        raise InventoryError(f"node {name!r} was removed by another command meanwhile")
    conn.execute(delete(Node).where(Node.id == node.id))
    return node


def remove_link(conn: Connection, dc_a: str, dc_b: str) -> LinkInfo:
    where = _link_where(conn, dc_a, dc_b)
    row = conn.execute(select(Link.id, Link.distance_km).where(where)).first()
    if row is None:
        raise _unknown_link(conn, dc_a, dc_b)
    conn.execute(delete(Link).where(Link.id == row.id))
    a, b = sorted((dc_a, dc_b))
    return LinkInfo(row.id, a, b, row.distance_km)


def remove_dc(conn: Connection, name: str, *, with_nodes: bool = False) -> RemovedDc:
    """Remove a DC and its links; refuses while it has nodes unless ``with_nodes``."""
    key = dc_id(conn, name)
    nodes = tuple(
        conn.execute(select(Node.name).where(Node.dc_id == key).order_by(Node.name)).scalars()
    )
    if nodes and not with_nodes:
        raise InventoryError(
            f"DC {name!r} still has {len(nodes)} node(s): {_known(nodes)}; remove them first "
            "(`kvctl fleet rm node NAME`) or remove them with it (`--with-nodes`)"
        )
    links = tuple(link for link in list_links(conn) if name in (link.a, link.b))
    # explicit deletes rather than relying on ON DELETE CASCADE, which SQLite only honours
    # when its foreign_keys pragma is on for this connection
    conn.execute(delete(Link).where(or_(Link.dc_a_id == key, Link.dc_b_id == key)))
    kept = _keep_removed(conn, Node.dc_id == key)
    if kept:
        conn.execute(delete(Node).where(Node.id.in_(kept)))
    conn.execute(delete(DataCenter).where(DataCenter.id == key))
    return RemovedDc(name, nodes, links)
