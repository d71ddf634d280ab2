"""A router's ``/v1/stats`` (counts since it started) into ``route_sample`` and
``route_link_sample`` rows of increases.

The answer is checked whole before any counter is tracked, so a router that answers garbage
leaves no half-updated baseline. All of one router's counters (its own, each node's, each DC
link's) are one series of the counter tracker: a node or link that appears between two scrapes
counts from zero, the first scrape of a router only sets the baseline, and a restart (a new
start time, or a counter going down) counts the new values from zero (``kvctl.counters``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import String

from kvctl.counters import CounterTracker
from kvctl.db.models import SERIES_BY_TABLE, RouteLinkSample, RouteSample
from kvctl.db.sample_checks import MAX_MAGNITUDE

#: the router's own counters, as named in ``/v1/stats`` and in ``route_sample``
ROUTER_COUNTERS: Final = tuple(c for c in SERIES_BY_TABLE["route_sample"].sums if c != "decision_s")
NODE_COUNTERS: Final = ("decisions", "to_holder")
#: widths of the key columns: longer names from a router are cut to fit
_ROUTER_CHARS: Final = cast(String, RouteSample.__table__.c.router.type).length or 255
_NODE_CHARS: Final = cast(String, RouteSample.__table__.c.node.type).length or 128
_DC_CHARS: Final = cast(String, RouteLinkSample.__table__.c.from_dc.type).length or 64
#: the most nodes and DC links one router's answer may report: each is a row a scrape (and
#: counters in its tracker series). A router routes among the fleet's nodes, and every node
#: it ever decided for stays in its answer (renamed or replaced ones too), and pulls between
#: its DCs' pairs (128 DCs: 16,256); one answering hundreds of thousands (broken or hostile)
#: had the collector write as many rows every scrape. 16,384 of each is ~1 MB of answer,
#: well under the collector's 8 MiB; 4,096 (the first cap) reported a large fleet's router down
MAX_ROUTER_NODES: Final = 16_384
MAX_ROUTER_LINKS: Final = 16_384


class RouterAnswerError(ValueError):
    """The router answered, but not with a kvctl router's ``/v1/stats``."""


@dataclass(frozen=True, slots=True)
class RouterReading:
    """One router's counts since it started, checked."""

    #: the router's start time (its ``/v1/info``): a change means its counts restarted
    started_s: float | None
    counters: dict[str, int]
    #: seconds spent deciding, summed (measured by the router)
    decision_s: float
    #: node -> (decisions, to_holder)
    nodes: dict[str, tuple[int, int]]
    #: (from_dc, to_dc) -> (pulled chunks, pulled bytes)
    links: dict[tuple[str, str], tuple[int, int]]


def router_key(redacted_url: str) -> str:
    """The ``router`` column: the router's URL (credentials already redacted)."""
    key = redacted_url.rstrip("/")
    if len(key) > _ROUTER_CHARS:
        raise ValueError(f"router URL longer than {_ROUTER_CHARS} characters: {key[:60]}...")
    return key


def _count(value: Any, where: str) -> int:
    # beyond BIGINT, its increase was refused by the database with the cycle's whole batch
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MAGNITUDE:
        raise RouterAnswerError(f"{where} is not a count: {value!r}")
    return value


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RouterAnswerError(f"{where} is not a number of seconds: {value!r}")
    # compared first: an int past float's range raised OverflowError in isfinite
    if value > MAX_MAGNITUDE or not (math.isfinite(value) and value >= 0):
        raise RouterAnswerError(f"{where} is not a number of seconds: {value!r}")
    return float(value)


def _name(value: Any, where: str, chars: int) -> str:
    if not isinstance(value, str):
        raise RouterAnswerError(f"{where} is not a name: {value!r}")
    return value[:chars]


def parse_router_stats(stats: Any, info: Any = None) -> RouterReading:
    """Check a router's ``/v1/stats`` (and ``/v1/info`` for its start time); raises
    ``RouterAnswerError`` naming the first field that is not what a router sends."""
    if not isinstance(stats, Mapping):
        raise RouterAnswerError("the stats are not a JSON object")
    counters = {c: _count(stats.get(c), c) for c in ROUTER_COUNTERS}
    latency = stats.get("latency")
    if not isinstance(latency, Mapping):
        raise RouterAnswerError(f"latency is not an object: {latency!r}")
    decision_s = _seconds(latency.get("sum_s"), "latency.sum_s")
    raw_nodes = stats.get("nodes")
    if not isinstance(raw_nodes, Mapping):
        raise RouterAnswerError(f"nodes is not an object: {raw_nodes!r}")
    if len(raw_nodes) > MAX_ROUTER_NODES:
        raise RouterAnswerError(
            f"{len(raw_nodes):,} nodes, more than the {MAX_ROUTER_NODES:,} read: not read"
        )
    nodes: dict[str, tuple[int, int]] = {}
    for name, row in raw_nodes.items():
        if not isinstance(row, Mapping):
            raise RouterAnswerError(f"nodes.{name} is not an object")
        key = _name(name, "a node", _NODE_CHARS)
        if not key:
            raise RouterAnswerError("a node has an empty name")
        d, h = (_count(row.get(c), f"nodes.{name}.{c}") for c in NODE_COUNTERS)
        old = nodes.get(key, (0, 0))
        nodes[key] = (_count(old[0] + d, f"nodes.{key}"), _count(old[1] + h, f"nodes.{key}"))
    raw_links = stats.get("links")
    if not isinstance(raw_links, list):
        raise RouterAnswerError(f"links is not a list: {raw_links!r}")
    if len(raw_links) > MAX_ROUTER_LINKS:
        raise RouterAnswerError(
            f"{len(raw_links):,} links, more than the {MAX_ROUTER_LINKS:,} read: not read"
        )
    links: dict[tuple[str, str], tuple[int, int]] = {}
    for i, row in enumerate(raw_links):
        if not isinstance(row, Mapping):
            raise RouterAnswerError(f"links[{i}] is not an object")
        pair = (
            _name(row.get("from_dc"), f"links[{i}].from_dc", _DC_CHARS),
            _name(row.get("to_dc"), f"links[{i}].to_dc", _DC_CHARS),
        )
        chunks = _count(row.get("chunks"), f"links[{i}].chunks")
        nbytes = _count(row.get("bytes"), f"links[{i}].bytes")
        old = links.get(pair, (0, 0))
        links[pair] = (
            _count(old[0] + chunks, f"links[{i}]"),
            _count(old[1] + nbytes, f"links[{i}]"),
        )
    started = info.get("started_s") if isinstance(info, Mapping) else None
    started_s = None if started is None else _seconds(started, "info.started_s")
    return RouterReading(started_s, counters, decision_s, nodes, links)


def tracker_series(router: str) -> str:
    """The counter tracker's series of a router: a digest, so the name fits ``counter_state``
    whatever the URL's length."""
    return "route:" + hashlib.sha256(router.encode()).hexdigest()[:16]


def _link_name(pair: tuple[str, str], what: str) -> str:
    return f"link:{json.dumps(list(pair))}:{what}"


def route_rows(
    tracker: CounterTracker, router: str, ts_ms: int, reading: RouterReading
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``route_sample`` rows (the router's own, node '', then one per node) and
    ``route_link_sample`` rows of one scrape."""
    raw: dict[str, float | None] = {**reading.counters, "decision_s": reading.decision_s}
    for node, (decisions, to_holder) in reading.nodes.items():
        raw[f"node:{node}:decisions"] = decisions
        raw[f"node:{node}:to_holder"] = to_holder
    for pair, (chunks, nbytes) in reading.links.items():
        raw[_link_name(pair, "chunks")] = chunks
        raw[_link_name(pair, "bytes")] = nbytes
    inc = tracker.increase(tracker_series(router), raw, epoch=reading.started_s, ts_ms=ts_ms)

    def whole(name: str) -> int:
        return round(inc[name] or 0)

    routes: list[dict[str, Any]] = [
        {
            "router": router,
            "node": "",
            "ts_ms": ts_ms,
            **{c: whole(c) for c in ROUTER_COUNTERS},
            "decision_s": inc["decision_s"] or 0.0,
        }
    ]
    for node in sorted(reading.nodes):
        routes.append(
            {
                "router": router,
                "node": node,
                "ts_ms": ts_ms,
                **{c: None for c in ROUTER_COUNTERS},
                "decision_s": None,
                "decisions": whole(f"node:{node}:decisions"),
                "to_holder": whole(f"node:{node}:to_holder"),
            }
        )
    links = [
        {
            "router": router,
            "from_dc": a,
            "to_dc": b,
            "ts_ms": ts_ms,
            "pulled_chunks": whole(_link_name((a, b), "chunks")),
            "pulled_bytes": whole(_link_name((a, b), "bytes")),
        }
        for a, b in sorted(reading.links)
    ]
    return routes, links
