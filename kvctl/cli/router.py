"""`kvctl router serve|status|forget` and `kvctl route`: the fleet's KV index and cost-based
routing.

The router follows every agent's store events into one index and answers "which node should
serve this prompt" from it (``kvctl.router``). This module only reads the fleet (a fleet file,
the fleet database or --agent flags), builds the router, and renders answers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import (
    MAX_CHUNK_TOKENS,
    MFU_DEFAULT,
    DbOpt,
    JsonOpt,
    KeyOpt,
    KeysFileOpt,
    MfuOpt,
    TextOpt,
    TokenizerOpt,
    TokensOpt,
    bundled,
    prompt_or_keys,
    read_option_file,
    read_secret_file,
)
from kvctl.cli.output import console, err_console, fail, print_json, user_errors

if TYPE_CHECKING:
    from kvctl.index.model import FleetIndex
    from kvctl.index.vllm_events import VllmEventSubscriber
    from kvctl.router.client import RouterClientError
    from kvctl.router.inventory import ReadInventory
    from kvctl.router.score import Costs
    from kvctl.router.service import KeySpace
    from kvctl.router.topology import DcLink, Node, Topology

router_app = typer.Typer(
    no_args_is_help=True,
    help="The fleet's KV index and cache/link-aware routing: serve it, inspect it.",
)

ROUTER_URL_ENV = "KVCTL_ROUTER_URL"
ROUTER_TOKEN_ENV = "KVCTL_ROUTER_TOKEN"

RouterUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--router",
        help=f"Router URL (default: ${ROUTER_URL_ENV}, else http://127.0.0.1:9480).",
        show_default=False,
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        help=f"File holding the router's bearer token (default: ${ROUTER_TOKEN_ENV}).",
        show_default=False,
    ),
]


def router_token(token_file: Path | None) -> str | None:
    """The router's token: the file's first line, else $KVCTL_ROUTER_TOKEN, else none."""
    if token_file is None:
        return os.environ.get(ROUTER_TOKEN_ENV) or None
    return read_secret_file(token_file)


def router_url(url: str | None) -> str:
    """--router, else $KVCTL_ROUTER_URL, else the default; one that is not an http(s) URL with
    a host is a usage error naming where it came from (without a scheme, it read as "the router
    did not answer" and "start it", about a router that was running)."""
    from urllib.parse import urlsplit

    from kvctl.router.client import DEFAULT_URL

    where = "--router" if url else f"${ROUTER_URL_ENV}"
    url = url or os.environ.get(ROUTER_URL_ENV) or DEFAULT_URL
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number or out of range
        ok = False
    if not ok:
        fail(
            f"{where} must be the router's URL, http:// or https:// with a host, got {url!r}",
            hint=f"e.g. {DEFAULT_URL}: the address `kvctl router serve` prints",
        )
    return url


#: where a router's token comes from, for the hint of a 401
ROUTER_TOKEN_HINT = (
    f"give the router's token: --token-file FILE (its first line) or ${ROUTER_TOKEN_ENV}, as "
    "`kvctl router serve --token-file` reads it"
)


#: where a router that did not answer is given, for its hint
ROUTER_AWAY_HINT = (
    f"start it with `kvctl router serve`, or give --router URL (or ${ROUTER_URL_ENV})"
)


def router_failed(
    exc: RouterClientError,
    *,
    token_hint: str = ROUTER_TOKEN_HINT,
    away_hint: str = ROUTER_AWAY_HINT,
) -> NoReturn:
    """Exit with what a failed call to the router means and what to do next: 1 when it did not
    answer, refused the token, is not a router or failed; 2 when it refused the request itself
    (bad input: a 400 or 422). ``token_hint`` and ``away_hint`` say where the token and the
    router's URL are given, for a command that takes them otherwise (`kvctl replay`)."""
    from kvctl.router.client import (  # loaded already: exc came from there
        RouterNotTls,
        RouterTokenError,
        RouterWrongAnswer,
    )

    if isinstance(exc, RouterTokenError):  # never sent: the token is what to fix
        fail(str(exc), hint=token_hint, code=1)
    if isinstance(exc, RouterNotTls | RouterWrongAnswer):  # up there: the URL is what to fix
        fail(str(exc), hint="give --router the address `kvctl router serve` prints", code=1)
    if exc.status is None:
        fail(str(exc), hint=away_hint, code=1)
    if exc.status in (401, 403):
        fail(str(exc), hint=token_hint, code=1)
    if exc.status in (404, 405):  # every router path exists: this is something else
        fail(
            f"{exc}: is that a kvctl router? (an agent's control API answers so; the router "
            "listens on 9480 by default)",
            hint="give --router the address `kvctl router serve` prints",
            code=1,
        )
    fail(str(exc), code=2 if exc.status in (400, 422) else 1)


# --- serve -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSource:
    """Where the router learns the fleet: a fleet file, --agent flags, or the database."""

    fleet: Annotated[
        Path | None,
        typer.Option(
            "--fleet",
            help="Fleet file (TOML or YAML, as `kvctl fleet export` writes): DCs, nodes with "
            "agent_url, links with distance_km.",
            show_default=False,
        ),
    ] = None
    agents: Annotated[
        list[str] | None,
        typer.Option(
            "--agent",
            help="An agent to follow: NAME=URL@DC, e.g. gpu-1=http://10.0.0.7:7070@fra "
            "(repeatable; instead of --fleet or the database).",
            metavar="NAME=URL@DC",
            show_default=False,
        ),
    ] = None
    links: Annotated[
        list[str] | None,
        typer.Option(
            "--link",
            help="With --agent: the distance between two DCs, A:B=KM (repeatable); the "
            "link is modeled as that much fiber.",
            metavar="A:B=KM",
            show_default=False,
        ),
    ] = None
    db: DbOpt = None


@dataclass(frozen=True, slots=True)
class CostFlags:
    """What the router assumes about every node's prefill and copies."""

    model: Annotated[
        str,
        typer.Option(
            help="Model the agents serve: its KV layout makes the keys of --tokens requests, "
            "and its profile models prefill."
        ),
    ] = "llama-3.1-8b"
    gpu: Annotated[str, typer.Option(help="GPU profile prefill is modeled on.")] = "h100"
    mfu: MfuOpt = MFU_DEFAULT
    prefill_tokens_per_s: Annotated[
        float | None,
        typer.Option(
            "--prefill-tokens-per-s",
            help="Prefill rate to use instead of the modeled one (configured).",
            min=1.0,
            show_default=False,
        ),
    ] = None
    host_to_device_gbps: Annotated[
        float | None,
        typer.Option(
            "--host-to-device-gbps",
            help="Host -> GPU copy rate in Gbit/s for chunks in host memory (default: free).",
            min=0.001,
            show_default=False,
        ),
    ] = None
    carbon_weight: Annotated[
        float,
        typer.Option(
            "--carbon-weight",
            help="Seconds of modeled TTFT one gram of CO2 is worth (0: carbon shown, not weighed).",
            min=0.0,
        ),
    ] = 0.0
    chunk_tokens: Annotated[
        int,
        typer.Option(
            "--chunk-tokens",
            help="Tokens per chunk (the agents' setting).",
            min=1,
            max=MAX_CHUNK_TOKENS,
        ),
    ] = 256
    isolated_tenants: Annotated[
        list[str] | None,
        typer.Option(
            "--isolated-tenant",
            help="A tenant the agents isolate (repeatable; the agents' isolated_tenants).",
            metavar="TENANT",
            show_default=False,
        ),
    ] = None

    def costs(self) -> Costs:
        from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
        from kvctl.remote.fetchplan import PrefillRate
        from kvctl.router.score import Costs

        if self.prefill_tokens_per_s is not None:
            rate = PrefillRate(self.prefill_tokens_per_s, "configured: --prefill-tokens-per-s")
        else:
            inputs = ModeledInputs(model_profile(self.model), gpu_profile(self.gpu), self.mfu)
            rate = PrefillRate.modeled(inputs)
        h2d = None if self.host_to_device_gbps is None else self.host_to_device_gbps * 1e9 / 8
        return Costs(
            rate.as_model(),
            host_to_device_bytes_per_s=h2d,
            carbon_s_per_g=self.carbon_weight,
        )


def _parse_agent(text: str) -> tuple[str, str, str]:
    name, eq, rest = text.partition("=")
    url, at, dc = rest.rpartition("@")
    if not (eq and at and name.strip() and url.strip() and dc.strip()):
        fail(
            f"bad --agent {text!r}: expected NAME=URL@DC",
            hint="e.g. --agent gpu-1=http://10.0.0.7:7070@fra",
        )
    if not url.startswith(("http://", "https://")):
        fail(f"bad --agent {text!r}: the URL must start with http:// or https://")
    return name.strip(), url.strip(), dc.strip()


def _parse_link(text: str) -> tuple[str, str, float]:
    pair, eq, km = text.partition("=")
    a, colon, b = pair.partition(":")
    try:
        distance = float(km)
    except ValueError:
        distance = -1.0
    if not (eq and colon and a and b) or not distance >= 0:
        fail(f"bad --link {text!r}: expected A:B=KM", hint="e.g. --link fra:ams=360")
    return a, b, distance


@dataclass(frozen=True, slots=True)
class VllmFeed:
    """One ``--vllm-events`` flag: whose engine, where it publishes, how to key its blocks."""

    node: str
    endpoint: str
    replay: str | None = None
    topic: str = ""
    tenant: str = "default"


_FEED_OPTIONS = ("replay", "topic", "tenant")


def parse_vllm_feed(text: str) -> VllmFeed:
    """``NODE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T][,tenant=T]``."""
    node, eq, rest = text.partition("=")
    endpoint, *options = rest.split(",")
    hint = "e.g. --vllm-events gpu-1=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558"
    if not (eq and node.strip() and endpoint.strip()):
        fail(f"bad --vllm-events {text!r}: expected NODE=tcp://HOST:PORT[,replay=...]", hint=hint)
    given: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key.strip() not in _FEED_OPTIONS or not value.strip():
            fail(
                f"bad --vllm-events option {option!r}: expected one of "
                + ", ".join(f"{k}=VALUE" for k in _FEED_OPTIONS),
                hint=hint,
            )
        given[key.strip()] = value.strip()
    return VllmFeed(
        node.strip(),
        endpoint.strip(),
        replay=given.get("replay"),
        topic=given.get("topic", ""),
        tenant=given.get("tenant", "default"),
    )


def load_fleet(source: FleetSource) -> tuple[Topology, dict[str, str]]:
    """The router's topology and each node's agent URL, from one of the sources."""
    from kvctl.router.topology import DcLink, Node, Topology

    given = [source.fleet is not None, bool(source.agents)]
    if sum(given) > 1:
        fail("give one of --fleet and --agent (or neither: the fleet database)")
    if source.links and not source.agents:
        fail("--link goes with --agent; a fleet file or the database has its own links")
    nodes: list[Node] = []
    urls: dict[str, str] = {}
    links: dict[tuple[str, str], DcLink] = {}
    if source.agents:
        for text in source.agents:
            name, url, dc = _parse_agent(text)
            nodes.append(Node(name, dc))
            urls[name] = url
        for text in source.links or []:
            a, b, km = _parse_link(text)
            links[(a, b)] = DcLink.fiber(km)
    else:
        dcs, node_rows, link_rows = (
            _fleet_file(source.fleet) if source.fleet is not None else _fleet_db(source.db)
        )
        nodes, urls, links = _inventory(dcs, node_rows, link_rows)
    if not nodes:
        fail(
            "the fleet has no nodes: the router has nothing to route to",
            hint="add nodes (`kvctl fleet add-node`), or give --fleet FILE or --agent NAME=URL@DC",
        )
    with user_errors():
        return Topology.build(nodes, links), urls


Rows = list[dict[str, Any]]


def _inventory(
    dcs: dict[str, dict[str, Any]], node_rows: Rows, link_rows: Rows
) -> tuple[list[Node], dict[str, str], dict[tuple[str, str], DcLink]]:
    """The nodes, their agent URLs and the DC links of a fleet file's or the database's rows.

    The inventory has no role: every node is given as serving. A pool agent (``role`` "pool"
    in its /v1/info, started with --role pool) runs no engine; the router's followers read
    each agent's role once per agent start and the router routes it no request (kept, for its
    chunks and its DC's links), for the inventory's nodes and --agent flags alike, so a reread
    asks the agents nothing."""
    from kvctl.router.topology import DcLink, Node

    nodes: list[Node] = []
    urls: dict[str, str] = {}
    for n in node_rows:
        site = dcs.get(n["dc"], {})
        nodes.append(
            Node(
                n["name"],
                n["dc"],
                carbon_g_per_kwh=site.get("carbon_g_per_kwh"),
                pue=site.get("pue") or 1.0,
            )
        )
        urls[n["name"]] = n["agent_url"]
    links = {(x["a"], x["b"]): DcLink.fiber(float(x["distance_km"])) for x in link_rows}
    return nodes, urls, links


def inventory_reader(source: FleetSource) -> tuple[str, ReadInventory | None]:
    """What the running router rereads (``InventoryReloader``), and its name for the status:
    the fleet file or the database; None for --agent flags, which cannot change. Unlike
    ``load_fleet`` a reread raises (the router logs it and keeps what it has), never exits."""
    from kvctl.router.topology import Topology

    if source.agents:
        return "--agent flags", None
    if source.fleet is not None:
        path = source.fleet

        def rows() -> tuple[dict[str, dict[str, Any]], Rows, Rows]:
            from kvctl.db.fleetfile import format_for, load, validate
            from kvctl.errors import InvalidArgument
            from kvctl.paths import read_text_file

            doc = load(read_text_file(path, "the fleet file"), format_for(path))
            problems = validate(doc)
            if problems:
                raise InvalidArgument(f"{path}: " + "; ".join(problems))
            dcs = {d["name"]: d for d in doc.get("dcs") or []}
            return dcs, list(doc.get("nodes") or []), list(doc.get("links") or [])

        name = f"fleet file {path}"
    else:
        from sqlalchemy.exc import SQLAlchemyError

        from kvctl.cli.options import open_engine
        from kvctl.db.engine import DatabaseError, driver_message, follow_the_path
        from kvctl.db.inventory import list_dcs, list_links, list_nodes

        engine = open_engine(source.db)  # at start: a database that is not there exits here
        # a SQLite file moved away or replaced while the router runs (`mv metrics.db*`, a
        # backup restored over the path): its pooled connection went on rereading the file it
        # had opened, an inventory no longer at the path, and a file put there was never read.
        # Followed, a reread of a path with no file fails (the router keeps what it has, says
        # why, creates no file there) and a file put at the path is read from then on
        follow_the_path(engine, "the router")

        def rows() -> tuple[dict[str, dict[str, Any]], Rows, Rows]:
            try:
                with engine.connect() as conn:
                    dcs = {d.name: d.as_dict() for d in list_dcs(conn)}
                    nodes = [n.as_dict() for n in list_nodes(conn)]
                    links = [x.as_dict() for x in list_links(conn)]
            except SQLAlchemyError as exc:
                # the driver's words on one line (SQLAlchemy's text runs over several, with
                # the statement and a link): the reloader logs and shows it as it is
                raise DatabaseError(driver_message(exc)) from exc
            return dcs, nodes, links

        name = "fleet database"

    def read() -> tuple[Topology, dict[str, str]]:
        nodes, urls, links = _inventory(*rows())
        return Topology.build(nodes, links), urls

    return name, read


def _fleet_file(path: Path) -> tuple[dict[str, dict[str, Any]], Rows, Rows]:
    from kvctl.db.fleetfile import FleetFileError, format_for, load, validate

    with user_errors(hint="`kvctl fleet export` writes a fleet file"):
        try:
            doc = load(read_option_file(path, "the fleet file"), format_for(path))
        except FleetFileError as exc:
            fail(f"{path}: {exc}")
        problems = validate(doc)
        if problems:
            fail(f"{path}: " + "; ".join(problems))
    dcs = {d["name"]: d for d in doc.get("dcs") or []}
    return dcs, list(doc.get("nodes") or []), list(doc.get("links") or [])


def _fleet_db(db: str | None) -> tuple[dict[str, dict[str, Any]], Rows, Rows]:
    from kvctl.cli.options import db_errors, open_engine
    from kvctl.db.inventory import list_dcs, list_links, list_nodes

    engine = open_engine(db)
    with db_errors(), engine.connect() as conn:
        dcs = {d.name: d.as_dict() for d in list_dcs(conn)}
        nodes = [n.as_dict() for n in list_nodes(conn)]
        links = [x.as_dict() for x in list_links(conn)]
    return dcs, nodes, links


@router_app.command("serve")
@bundled
def serve_command(
    *,
    source: FleetSource,
    cost: CostFlags,
    listen: Annotated[
        str, typer.Option(help="HOST:PORT of the router's API; off loopback it needs --token-file.")
    ] = "127.0.0.1:9480",
    token_file: TokenFileOpt = None,
    index: Annotated[
        str,
        typer.Option(
            help="The index: 'embedded' (this process) or a Redis URL (redis://HOST:6379/0); "
            "a URL with a password belongs in $KVCTL_INDEX, which no process listing shows.",
            envvar="KVCTL_INDEX",
        ),
    ] = "embedded",
    poll_s: Annotated[
        float,
        typer.Option("--poll-s", help="Seconds between reads of each agent's events.", min=0.01),
    ] = 0.2,
    vllm_events: Annotated[
        list[str] | None,
        typer.Option(
            "--vllm-events",
            help="A vLLM engine's own KV events (its GPU prefix cache) to index as NODE's: "
            "NODE=tcp://HOST:PORT of its --kv-events-config publisher, with "
            ",replay=tcp://HOST:PORT (its replay endpoint: gaps are filled, and what it "
            "stored before the router started is read), ,topic=T and ,tenant=T (an isolated "
            "tenant's engine) (repeatable; needs the vllm-events extra).",
            metavar="NODE=ENDPOINT[,replay=..]",
            show_default=False,
        ),
    ] = None,
    reload_s: Annotated[
        float,
        typer.Option(
            "--reload-s",
            help="Seconds between rereads of the inventory (fleet database or --fleet file): "
            "nodes added or removed are followed or dropped; 0: only on SIGHUP.",
            min=0.0,
        ),
    ] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level")] = "warning",
) -> None:
    """Serve the router: follow every agent's store events into the fleet index, answer
    POST /v1/route (which node serves a prompt fastest, modeled from what each node holds, the
    links between DCs and the prefill rate), serve the index to agents (/v1/index/holders) and
    /metrics. Runs until SIGTERM or Ctrl-C.

    The fleet comes from --fleet FILE, from --agent flags, or else from the fleet database;
    a file or the database is reread every --reload-s seconds and on SIGHUP. With the
    database, a shared (Redis) index's entries of nodes it does not name (removed while no
    router ran) are dropped at start and at each reread, unless the index holds none of its
    nodes or another running router follows them; with --fleet or --agent,
    `kvctl router status` names them and `kvctl router forget NODE` drops one.
    Agents are read with $KVCTL_TOKEN when they have a token. Every figure the router reports
    is modeled, from the inputs it shows (link distances, the prefill profile or rate).

    Examples:

      kvctl router serve

      kvctl router serve --fleet fleet.toml --model llama-3.1-70b --gpu h100

      kvctl router serve --agent a=http://h1:7070@fra --agent b=http://h2:7070@ams --link fra:ams=90

      kvctl router serve --listen 0.0.0.0:9480 --token-file router.token --index redis://h3:6379/0

      kvctl router serve --vllm-events gpu-1=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558
    """
    from kvctl.wire.address import is_loopback, split_host_port

    token = router_token(token_file)
    with user_errors(hint="--listen takes HOST:PORT"):
        host, _ = split_host_port(listen, 9480)
    if not is_loopback(host) and not token:
        fail(
            f"the router would listen on {listen}, off loopback, without a token",
            hint=f"give --token-file FILE (or set ${ROUTER_TOKEN_ENV})",
        )
    feeds = [parse_vllm_feed(text) for text in vllm_events or []]
    if feeds:
        needs_extra("kvctl router serve --vllm-events", "vllm-events")
    topology, urls = load_fleet(source)
    inventory_name, read_inventory = inventory_reader(source)
    known = set(topology.nodes)
    for feed in feeds:
        if feed.node not in known:
            fail(
                f"--vllm-events names {feed.node!r}, which is not a node of the fleet",
                hint="nodes: " + ", ".join(sorted(known)),
            )
    if len({f.node for f in feeds}) < len(feeds):
        fail("--vllm-events names a node twice: one engine event stream per node")
    from kvctl import daemon_logging

    daemon_logging.configure(log_level)  # the followers' polls' request lines left out
    from kvctl.errors import KvctlError
    from kvctl.index.follower import Followers
    from kvctl.index.open import open_index
    from kvctl.router.app import RouterServer
    from kvctl.router.inventory import InventoryReloader
    from kvctl.router.service import KeySpace, Router

    agent_token = os.environ.get("KVCTL_TOKEN") or None
    try:
        fleet_index = open_index(index)
        keyspace = KeySpace.of_model(
            cost.model, chunk_tokens=cost.chunk_tokens, isolated_tenants=cost.isolated_tenants or ()
        )
        followers = Followers(
            fleet_index, {name: (url, agent_token) for name, url in urls.items()}, poll_s=poll_s
        )
        engine_feeds = [_vllm_subscriber(feed, fleet_index, keyspace) for feed in feeds]
        router = Router(
            fleet_index,
            topology,
            cost.costs(),
            keyspace=keyspace,
            followers=followers,
            engine_feeds=engine_feeds,
        )
        reloader = InventoryReloader(
            read_inventory,
            router,
            followers,
            source=inventory_name,
            agent_token=agent_token,
            interval_s=reload_s,
            # the fleet database is the fleet's own inventory: what it does not name left the
            # fleet. Not --agent flags or a file: a developer's router with a few of the nodes
            # against the fleet's Redis would empty it for every router
            forget_unknown=not source.agents and source.fleet is None,
        )
        router.inventory = reloader
        server = RouterServer(router, listen=listen, token=token, log_level=log_level)
    except (KvctlError, ValueError) as exc:
        fail(str(exc), hint="check --index, --model, --gpu and --listen")
    import signal

    # SIGHUP: reread the inventory now (in the reloader's thread; a handler must not block)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: reloader.request())

    from kvctl.redact import redact_url

    def serving() -> None:
        # the first line is the URL: scripts (and tests) read where it listens from it.
        # redact_url: a password may be in the URL's query too (redis-py takes ?password=)
        console.print(
            f"router serving at {server.url}: {len(topology.nodes)} nodes in "
            f"{len(topology.dcs)} DCs, index {redact_url(index)}, prefill "
            f"{router.costs.prefill.basis}",
            highlight=False,
            soft_wrap=True,
        )

    try:
        server.run(on_serving=serving)
    except KvctlError as exc:  # an engine feed that cannot start: nothing was served
        fail(str(exc), hint="check --vllm-events")


def _vllm_subscriber(feed: VllmFeed, index: FleetIndex, keyspace: KeySpace) -> VllmEventSubscriber:
    """The feed's blocks keyed as the router keys a prompt of its tenant, under NODE#vllm."""
    from kvctl.index.model import engine_index_name
    from kvctl.index.vllm_events import VllmEventSubscriber, VllmEventTranslator

    translator = VllmEventTranslator(
        engine_index_name(feed.node, "vllm"),
        namespace=keyspace.namespace(feed.tenant),
        chunk_tokens=keyspace.chunk_tokens,
        tenant=feed.tenant,
    )
    return VllmEventSubscriber(
        index, translator, feed.endpoint, topic=feed.topic, replay_endpoint=feed.replay
    )


# --- status ----------------------------------------------------------------------------------


@router_app.command("status")
def status_command(
    router: RouterUrlOpt = None,
    token_file: TokenFileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The router's index (entries per node), the agents it follows (up or down, with the
    last error; a node whose entries the index keeps failing to replace, with when it is
    tried again) and its decisions (per node, to a holder, pulls per DC link). Exits 1 when the
    router does not answer.

    Examples:

      kvctl router status

      kvctl router status --router http://10.0.0.9:9480 --token-file router.token --json
    """
    from kvctl.redact import redact_url
    from kvctl.router.client import RouterClient, RouterClientError

    url = router_url(router)
    try:
        with RouterClient(url, token=router_token(token_file)) as client:
            try:
                report = {"router": redact_url(url), "index": client.index()}
            except RouterClientError as exc:
                if exc.status != 503:
                    raise
                _index_down(client, exc)
            report["stats"] = client.stats()
    except RouterClientError as exc:
        router_failed(exc)
    if json_out:
        print_json(report)
        return
    _render_status(report)


def _index_down(client: Any, exc: Exception) -> NoReturn:
    """The router answers but its index does not (a 503): say so, with what the router still
    reports (its health), and exit 1."""
    try:
        health = client.health()
    except Exception:  # the 503 is the news; the health is a detail
        health = {}
    up, total = health.get("followers_up"), health.get("followers")
    agents = f"; {up} of {total} agents answer" if total is not None else ""
    kind = health.get("index") or "its"
    fail(
        f"the router at {client.shown_url} is up, but {kind} index does not answer{agents}: "
        f"{health.get('index_error') or exc}",
        hint="check the index (the Redis server of `kvctl router serve --index`); the router "
        "resyncs every agent when it answers again",
        code=1,
    )


def _render_status(report: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvctl.daemon_logging import one_line
    from kvctl.format import count_of, format_bytes, format_seconds

    index, stats = report["index"], report["stats"]
    followers = {str(f["node"]): f for f in index.get("followers", [])}
    nodes = sorted(set(stats["nodes"]) | set(index["nodes"]) | set(followers))
    table = Table("node", "agent", "entries", "decisions", "to holder", "queue (modeled)")
    unknown = index.get("not_in_inventory") or {}
    for name in nodes:
        f = followers.get(name)
        state = "-" if f is None else ("[green]up[/]" if f.get("up") else "[bold red]down[/]")
        if name in unknown:
            state = "[yellow]not in inventory[/]"
        if f is not None and (note := _replace_failing(f)):
            state += f"\n[yellow]{note}[/]"
        if f is not None and f.get("role_error"):  # maybe a pool agent, routed requests
            state += "\n[yellow]role not read[/]"
        row = stats["nodes"].get(name, {})
        table.add_row(
            escape(name),
            state,
            f"{index['nodes'].get(name, 0):,}",
            f"{row.get('decisions', 0):,}",
            f"{row.get('to_holder', 0):,}",
            format_seconds(row.get("queue_s", 0.0)),
        )
    console.print(table)
    for f in followers.values():
        if not f.get("up") and f.get("last_error"):
            console.print(
                # escaped (a line break, an escape sequence): the agent's or a proxy's words
                f"[red]{escape(str(f['node']))}[/]: {escape(one_line(str(f['last_error'])))}",
                highlight=False,
            )
        if f.get("role_error"):
            console.print(
                f"[yellow]{escape(str(f['node']))}: role not read[/] from its /v1/info "
                f"({escape(one_line(str(f['role_error'])))}): check the token the router has "
                "for it",
                highlight=False,
            )
    d = stats["decisions"]
    lat = stats["decision_s"]
    console.print(
        f"index {index['kind']}: {sum(index['nodes'].values()):,} entries; decisions {d:,} "
        f"(to a holder {stats['to_holder']:,}, no node {stats['no_node']:,}); index hits "
        f"{stats['indexed_chunks']:,} of {stats['requested_chunks']:,} chunks; tokens fetched "
        f"{stats['fetched_tokens']:,}, recomputed {stats['recomputed_tokens']:,}; decision "
        f"p50 {format_seconds(lat['p50'])} p99 {format_seconds(lat['p99'])} (measured)",
        highlight=False,
    )
    if malformed := index.get("malformed_entries"):
        console.print(
            f"[yellow]index entries skipped as malformed: {malformed:,}[/] (entries no index "
            "wrote, met by lookups since the router started, which found no holder in them: "
            "check what else writes to the Redis of `kvctl router serve --index`; the router's "
            "log names the first)",
            highlight=False,
        )
    inventory = stats.get("inventory")
    if inventory:
        every = inventory.get("reload_s")
        when = (
            "read at start (does not change)"
            if every is None
            else f"read {format_seconds(inventory['age_s'])} ago ("
            + (f"every {format_seconds(every)} and on SIGHUP" if every else "on SIGHUP")
            + f"; {inventory['changes']:,} rereads changed it)"
        )
        console.print(f"inventory: {escape(str(inventory['source']))}, {when}", highlight=False)
        if inventory.get("last_error"):
            console.print(
                f"[red]inventory reread failed[/]: {escape(str(inventory['last_error']))} "
                "(routing on what was read before)",
                highlight=False,
            )
        if inventory.get("forgotten_nodes"):
            console.print(
                f"dropped from the index as not in the inventory: "
                f"{count_of(inventory['forgotten_nodes'], 'node')}, "
                f"{inventory['forgotten_entries']:,} "
                f"entries (last: {escape(', '.join(inventory.get('last_forgotten') or []))})",
                highlight=False,
            )
    if unknown := index.get("not_in_inventory"):
        console.print(unknown_nodes_line(unknown, inventory or {}), highlight=False)
    for link in stats["links"]:
        console.print(
            f"pulled {escape(link['from_dc'])} -> {escape(link['to_dc'])}: {link['chunks']:,} "
            f"chunks, {format_bytes(link['bytes'])}",
            highlight=False,
        )
    for feed in index.get("engines", []):
        console.print(engine_feed_line(feed), highlight=False)
        if note := _replace_failing(feed):
            console.print(f"  [yellow]{note}[/]", highlight=False)
        if feed.get("last_error"):
            console.print(f"  [red]{escape(str(feed['last_error']))}[/]", highlight=False)


#: index names ``kvctl router status`` shows of those not in the router's inventory
UNKNOWN_NODES_SHOWN = 3


def unknown_nodes_line(unknown: dict[str, int], inventory: dict[str, Any]) -> str:
    """The index's nodes the router's inventory does not name (``not_in_inventory``), and how
    they go: this router drops them itself (the fleet database) unless its last pass says why
    not, else `kvctl router forget`."""
    from rich.markup import escape

    from kvctl.format import count_of
    from kvctl.index.model import owners

    names = sorted(owners(unknown))  # NODE#vllm, its engine's entries, goes with NODE
    shown = ", ".join(names[:UNKNOWN_NODES_SHOWN]) + (
        ", ..." if len(names) > UNKNOWN_NODES_SHOWN else ""
    )
    line = (
        f"[yellow]in the index, not in this router's inventory[/]: {count_of(len(names), 'node')} "
        f"({sum(unknown.values()):,} entries), e.g. {escape(shown)}; "
    )
    note = inventory.get("forget_note")
    if inventory.get("forgets_unknown") and not note:
        return line + "dropped at the next reread of the inventory"
    if note:
        line += f"not dropped: {escape(str(note))}; "
    return line + (
        "`kvctl router forget NODE` drops them"
        + (" (one still followed is written back)" if note else "")
    )


def engine_feed_line(feed: dict[str, Any]) -> str:
    """One vLLM event feed of ``kvctl router status``: its state and counts, and what it had
    to drop (batches cut at their malformed events, messages over max_message_bytes) where it
    dropped any: each is a gap in what the index knows of the engine."""
    from rich.markup import escape

    from kvctl.format import format_bytes

    state = "[green]connected[/]" if feed.get("connected") else "[bold red]not connected[/]"
    line = (
        f"engine events {escape(str(feed['node']))} ({escape(str(feed['endpoint']))}): "
        f"{state}, {feed['live_chunks']:,} chunks indexed, {feed['messages']:,} batches, "
        f"gaps {feed['gaps']:,} (unrecovered {feed['unrecovered']:,}), restarts "
        f"{feed['restarts']:,}"
    )
    cut = (feed.get("translator") or {}).get("batches_cut") or 0
    if cut:
        line += f", [yellow]{cut:,} batches cut at malformed events[/]"
    if oversized := feed.get("oversized") or 0:
        limit = format_bytes(feed.get("max_message_bytes") or 0)
        line += f", [yellow]{oversized:,} messages over {limit} refused[/]"
    return line


def _replace_failing(state: dict[str, Any]) -> str:
    """Why a follower's or an engine feed's index entries are stale: the replace of the node's
    entries failing, and when it is sent again ("" when none failed)."""
    failures = state.get("index_replace_failures") or 0
    if not failures:
        return ""
    retry_s = state.get("index_retry_in_s")
    if retry_s:
        when = f"in {max(1, math.ceil(retry_s))} s"
    elif state.get("up") is False:  # a follower sends nothing while its agent is down
        when = "once the agent answers"
    else:
        when = "now"
    return f"index replace failing: retry {when} ({failures:,} failed in a row)"


# --- forget ----------------------------------------------------------------------------------


@router_app.command("forget")
def forget_command(
    node: Annotated[
        str,
        typer.Argument(
            metavar="NODE",
            help="The node that left the fleet (its engines' NODE#vllm entries go with it), "
            "or NODE#ENGINE for that engine's entries only.",
            show_default=False,
        ),
    ],
    router: RouterUrlOpt = None,
    token_file: TokenFileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Drop a node's entries from the router's fleet index: a node removed from the inventory
    while no router ran, or one a router was restarted without (fewer --agent flags), stays in
    a shared (Redis) index, and `kvctl router status` names it ("in the index, not in this
    router's inventory"). Refused for a node the router follows (it would write them again at
    once: remove it from the inventory first), for one another running router follows (it
    claims the node in the shared index, and would write its entries again) and for one the
    index holds no entry of.

    Examples:

      kvctl router forget gpu-17

      kvctl router forget gpu-17#vllm --router http://10.0.0.9:9480 --token-file router.token

      kvctl router forget gpu-17 --json
    """
    from kvctl.redact import redact_url
    from kvctl.router.client import RouterClient, RouterClientError

    url = router_url(router)
    try:
        with RouterClient(url, token=router_token(token_file)) as client:
            answer = client.forget(node)
    except RouterClientError as exc:
        if exc.status in (404, 405):  # every router path exists: one before `forget`?
            fail(
                f"{exc}: a router older than this kvctl (no /v1/index/forget), or not a kvctl "
                "router",
                hint="upgrade the router, or give --router the address `kvctl router serve` prints",
                code=1,
            )
        router_failed(exc)
    if json_out:
        print_json({"router": redact_url(url), **answer})
        return
    from rich.markup import escape

    dropped: dict[str, int] = answer.get("dropped") or {}
    parts = ", ".join(f"{escape(name)} {n:,}" for name, n in sorted(dropped.items()))
    console.print(
        f"dropped {answer.get('entries', 0):,} index entries of {escape(node)} ({parts})",
        highlight=False,
    )


# --- route -----------------------------------------------------------------------------------


def route_command(
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant the prompt belongs to.")] = "",
    key: KeyOpt = None,
    keys_file: KeysFileOpt = None,
    text: TextOpt = None,
    tokens: TokensOpt = None,
    tokenizer: TokenizerOpt = "simple",
    origin_dc: Annotated[
        str | None,
        typer.Option("--origin-dc", help="DC the request comes from.", show_default=False),
    ] = None,
    policy: Annotated[
        str, typer.Option(help="cost, or a baseline: round-robin, session-affinity, prefix-only.")
    ] = "cost",
    explain: Annotated[
        bool, typer.Option("--explain", help="Every node's score, with its links' figures.")
    ] = False,
    router: RouterUrlOpt = None,
    token_file: TokenFileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Ask the router which node should serve a prompt: the chosen node, what it would pull
    from where, and its modeled time to first token next to a full prefill. With --explain,
    every node's score: origin round trip, fetch, prefill and queue, and the links' figures
    with their basis. All figures are modeled. Exits 1 when the router does not answer,
    refuses the token or is not a router; 2 when it refuses the prompt.

    Examples:

      kvctl route --text "You are a helpful assistant. Summarise ..." --tenant acme

      kvctl route --tokens prompt-ids.txt --origin-dc fra --explain

      echo 1,2,3,4 | kvctl route --tokens - --json

      kvctl route --key 3f2a9c0d1e4b5a697887766554433221 --tenant acme --json
    """
    from kvctl.router.client import RouterClient, RouterClientError

    keys, ids = prompt_or_keys(key, keys_file, text, tokens, tokenizer)
    url = router_url(router)
    try:
        with RouterClient(url, token=router_token(token_file)) as client:
            decision = client.route(
                tenant=tenant,
                keys=keys or None,
                tokens=ids,
                origin_dc=origin_dc,
                policy=policy,
                explain=explain,
            )
    except RouterClientError as exc:
        router_failed(exc)
    if json_out:
        print_json(decision)
        return
    _render_decision(decision, explain=explain)


def _ms(seconds: float | None) -> str:
    return "N/A" if seconds is None else f"{seconds * 1000:.2f} ms"


def _render_decision(d: dict[str, Any], *, explain: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvctl.format import format_bytes, format_rate

    console.print(
        f"route to [bold]{escape(d['node'])}[/] (dc {escape(d['dc'])}): modeled TTFT "
        f"{_ms(d['ttft_s'])} vs {_ms(d['full_prefill_ttft_s'])} with a full prefill "
        f"[dim](origin {_ms(d['origin_s'])}, fetch {_ms(d['fetch_s'])}, prefill "
        f"{_ms(d['prefill_s'])}, queue {_ms(d['queue_s'])})[/]",
        highlight=False,
    )
    console.print(
        f"{d['chunks']:,} chunks, {d['tokens']:,} tokens; held somewhere: {d['indexed_chunks']:,} "
        f"chunks; the node holds {d['local_chunks']:,} itself, pulls {d['pulled_chunks']:,} "
        f"({format_bytes(d['pulled_bytes'])}), prefills "
        f"{max(0, d['tokens'] - d['fetched_tokens']):,} tokens; plan: {escape(d['plan_reason'])}",
        highlight=False,
    )
    if d["pulls"]:
        table = Table("chunks", "from", "tier", "bytes")
        for p in d["pulls"]:
            table.add_row(
                f"{p['first']}..{p['first'] + p['chunks'] - 1}",
                escape(p["from"]),
                escape(p["tier"]),
                format_bytes(p["size_bytes"]),
            )
        console.print(table)
    if not explain:
        return
    table = Table(
        "node", "dc", "local", "pulls", "origin", "fetch", "prefill", "queue", "TTFT", "score"
    )
    for s in d["scores"]:
        table.add_row(
            escape(s["node"]),
            escape(s["dc"]),
            f"{s['local_chunks']:,}",
            f"{s['pulled_chunks']:,} ({format_bytes(s['pulled_bytes'])})",
            _ms(s["origin_s"]),
            _ms(s["fetch_s"]),
            _ms(s["prefill_s"]),
            _ms(s["queue_s"]),
            _ms(s["ttft_s"]),
            _ms(s["score_s"]),
        )
    console.print(table)
    for s in d["scores"]:
        for name, link in s.get("links", {}).items():
            bw = link.get("bandwidth_bytes_per_s")
            rate = "free" if bw is None else format_rate(bw)
            basis = escape(str(link.get("rtt_basis", "")))
            console.print(
                f"[dim]{escape(s['node'])} via {escape(name)}: rtt {_ms(link.get('rtt_s'))}, "
                f"{rate} ({basis})[/]",
                highlight=False,
            )
    for link in d.get("dc_links", []):
        console.print(
            f"[dim]DC link {escape(' - '.join(link['dcs']))}: rtt {_ms(link['rtt_s'])}, "
            f"{format_rate(link['bandwidth_bytes_per_s'])} ({escape(link['basis'])})[/]",
            highlight=False,
        )
    prefill = d["prefill"]
    console.print(
        f"[dim]prefill {prefill['tokens_per_s']:,.0f} tokens/s ({escape(prefill['basis'])})[/]",
        highlight=False,
    )
    err_console.print("[dim]every figure is modeled[/]", highlight=False)
