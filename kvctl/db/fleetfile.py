"""The fleet inventory as a document, for `kvctl fleet import` / `export` (TOML or YAML):

    {"dcs":   [{name, region, location, carbon_g_per_kwh, pue}],
     "nodes": [{name, dc, agent_url, gpu_model, engine_url}],
     "links": [{a, b, distance_km}]}

The file states the wanted fleet: an optional field left out means its default (empty text, or
unknown for carbon, PUE and engine URL), so editing a field out of the file clears it on the
next import. Export leaves out None and empty values (TOML has no null), which import reads
back as the same defaults: export -> import -> export gives the same text.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from sqlalchemy.engine import Connection

from kvctl.db import inventory as inv

Format = Literal["toml", "yaml"]
FORMATS: Final = ("toml", "yaml")
_SUFFIXES: Final[dict[str, Format]] = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}


class FleetFileError(inv.InventoryError):
    """The fleet file cannot be read or imported; ``problems`` lists each with its location."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems in the fleet file: {'; '.join(self.problems)}"
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class _Field:
    required: bool
    check: Callable[[Any], str | None]
    #: what an optional field left out means
    default: Any = None


def _text(what: str, limit: int) -> Callable[[Any], str | None]:
    return lambda v: inv.text_problem(v, what, limit)


_DC: Final = {
    "name": _Field(True, lambda v: inv.name_problem(v, "DC")),
    "region": _Field(False, _text("region", inv.REGION_MAX), ""),
    "location": _Field(False, _text("location", inv.LOCATION_MAX), ""),
    "carbon_g_per_kwh": _Field(False, inv.carbon_problem),
    "pue": _Field(False, inv.pue_problem),
}
_NODE: Final = {
    "name": _Field(True, lambda v: inv.name_problem(v, "node")),
    "dc": _Field(True, lambda v: inv.name_problem(v, "DC")),
    "agent_url": _Field(True, lambda v: inv.url_problem(v, "agent URL")),
    "gpu_model": _Field(False, _text("GPU model", inv.GPU_MODEL_MAX), ""),
    "engine_url": _Field(False, lambda v: inv.url_problem(v, "engine URL")),
}
_LINK: Final = {
    "a": _Field(True, lambda v: inv.name_problem(v, "DC")),
    "b": _Field(True, lambda v: inv.name_problem(v, "DC")),
    "distance_km": _Field(True, inv.distance_problem),
}
SECTIONS: Final = {"dcs": _DC, "nodes": _NODE, "links": _LINK}
#: numbers are stored as floats; an int in the file (``pue = 1``) compares equal after this
_FLOATS: Final = {"carbon_g_per_kwh", "pue", "distance_km"}


# --- formats ----------------------------------------------------------------------------------
def format_for(path: str | Path) -> Format:
    """The format a file's suffix names: .toml, .yaml or .yml."""
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise FleetFileError(
            f"cannot tell the format of {str(path)!r} from its suffix: use .toml, .yaml or .yml"
        )
    return _SUFFIXES[suffix]


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise FleetFileError(f"unknown format {fmt!r} (use toml or yaml)")


def _compact(values: dict[str, Any]) -> dict[str, Any]:
    """Without None (TOML cannot say it) and empty text (the default import fills back in)."""
    return {k: v for k, v in values.items() if v is not None and v != ""}


def dump(doc: dict[str, Any], fmt: str) -> str:
    """The document as TOML or YAML text; None values are left out."""
    _check_format(fmt)
    clean = {
        k: [_compact(item) if isinstance(item, dict) else item for item in v]
        if isinstance(v, list)
        else v
        for k, v in doc.items()
        if v is not None
    }
    if fmt == "toml":
        return _dump_toml(clean)
    import yaml

    return yaml.safe_dump(clean, sort_keys=False, allow_unicode=True, default_flow_style=False)


def _dump_toml(doc: dict[str, Any]) -> str:
    """TOML with every entry as its own ``[[section]]`` table: one field per line reads and
    diffs better than the inline tables tomli_w picks for short entries."""
    import tomli_w

    def flat(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(t, dict) and not any(isinstance(x, dict | list) for x in t.values())
            for t in v
        )

    if not all(flat(v) for v in doc.values()):
        return tomli_w.dumps(doc)  # not the fleet's shape: let tomli_w lay it out
    # empty sections first: a plain key after a [[table]] header would belong to that table
    head = tomli_w.dumps({k: v for k, v in doc.items() if not v})
    tables = [
        f"[[{tomli_w.dumps({k: 0}).split(' = ')[0]}]]\n{tomli_w.dumps(item)}"
        for k, v in doc.items()
        for item in v
    ]
    return "\n".join([head, *tables] if head else tables)


def load(text: str, fmt: str) -> dict[str, Any]:
    """Parse TOML or YAML text; a syntax error becomes one FleetFileError with its line.

    The result is not validated: that is ``validate``'s job (it lists every problem at once).
    An empty document is an empty fleet."""
    _check_format(fmt)
    if fmt == "toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FleetFileError(f"not valid TOML: {exc}") from None
        except RecursionError:  # '[[[[...' thousands deep: the parser gives up, no line said
            raise FleetFileError("not valid TOML: nested too deep to read") from None
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise FleetFileError(f"not valid YAML{where}: {problem}") from None
    except RecursionError:  # '[[[[...' thousands deep: the parser gives up, no line said
        raise FleetFileError("not valid YAML: nested too deep to read") from None
    return {} if data is None else data


# --- validation -------------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    return {dict: "a table", list: "a list", str: "text"}.get(type(value), type(value).__name__)


def _sections(doc: Any, problems: list[str]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Each section's entries as (location, the entry's valid fields); every shape and field
    problem goes to ``problems``."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {s: [] for s in SECTIONS}
    if not isinstance(doc, dict):
        problems.append(
            f"the fleet file must be a table with dcs, nodes and links, got {_type_name(doc)}"
        )
        return out
    for key in doc:
        if key not in SECTIONS:
            problems.append(f"{key}: unknown key (expected: {', '.join(SECTIONS)})")
    for section, spec in SECTIONS.items():
        items = doc.get(section)
        if items is None:  # absent, or YAML's `links:` with nothing under it
            continue
        if not isinstance(items, list):
            problems.append(f"{section}: expected a list of tables, got {_type_name(items)}")
            continue
        for i, item in enumerate(items):
            loc = f"{section}[{i}]"
            if not isinstance(item, dict):
                problems.append(f"{loc}: expected a table, got {_type_name(item)}")
                continue
            for key in item:
                if key not in spec:
                    problems.append(f"{loc}.{key}: unknown key (expected: {', '.join(spec)})")
            good: dict[str, Any] = {}
            for name, f in spec.items():
                value = item.get(name)
                if value is None:
                    if f.required:
                        problems.append(f"{loc}.{name}: missing (required)")
                elif problem := f.check(value):
                    problems.append(f"{loc}.{name}: {problem}")
                else:
                    good[name] = value
            out[section].append((loc, good))
    return out


def validate(doc: Any, *, known_dcs: Collection[str] = ()) -> list[str]:
    """Every problem of the document, each with its location (``nodes[3].dc: unknown DC 'x'``);
    empty when it can be imported. Nodes and links must name DCs of the file or ``known_dcs``
    (those already in the database, when the import keeps them)."""
    problems: list[str] = []
    sections = _sections(doc, problems)
    # the cross-checks below look at each field that is valid on its own, so one bad field
    # does not hide an entry's other problems

    dcs: dict[str, str] = {}
    for loc, good in sections["dcs"]:
        if (name := good.get("name")) is None:
            continue
        if name in dcs:
            problems.append(f"{loc}.name: duplicate DC {name!r} (also {dcs[name]})")
        else:
            dcs[name] = loc

    def unknown_dc(loc: str, name: str | None) -> None:
        if name is not None and name not in dcs and name not in known_dcs:
            where = "the file's dcs nor the database" if known_dcs else "the file's dcs"
            problems.append(f"{loc}: unknown DC {name!r} (not in {where})")

    nodes: dict[str, str] = {}
    for loc, good in sections["nodes"]:
        if (name := good.get("name")) is not None:
            if name in nodes:
                problems.append(f"{loc}.name: duplicate node {name!r} (also {nodes[name]})")
            else:
                nodes[name] = loc
        unknown_dc(f"{loc}.dc", good.get("dc"))

    links: dict[tuple[str, str], str] = {}
    for loc, good in sections["links"]:
        a, b = good.get("a"), good.get("b")
        if a is not None and a == b:
            problems.append(f"{loc}: a link joins two different DCs, got {a!r} twice")
            continue
        if a is not None and b is not None:
            pair = (min(a, b), max(a, b))
            if pair in links:
                problems.append(f"{loc}: duplicate link {a!r}-{b!r} (also {links[pair]})")
            else:
                links[pair] = loc
        unknown_dc(f"{loc}.a", a)
        unknown_dc(f"{loc}.b", b)
    return problems


def _normalized(doc: dict[str, Any], section: str) -> list[dict[str, Any]]:
    """A valid section's entries with every field present: defaults filled, numbers floats."""
    spec = SECTIONS[section]
    out = []
    for item in doc.get(section) or []:
        entry = {}
        for name, f in spec.items():
            value = item.get(name)
            value = f.default if value is None else value
            entry[name] = float(value) if name in _FLOATS and value is not None else value
        out.append(entry)
    return out


# --- export -----------------------------------------------------------------------------------
def export_fleet(conn: Connection) -> dict[str, Any]:
    """The inventory as a document (sorted by name; None and empty fields left out)."""
    return {
        "dcs": [_compact({k: getattr(d, k) for k in _DC}) for d in inv.list_dcs(conn)],
        "nodes": [
            _compact({k: getattr(n, k) for k in _NODE})
            for n in sorted(inv.list_nodes(conn), key=lambda n: n.name)
        ],
        "links": [
            {"a": link.a, "b": link.b, "distance_km": link.distance_km}
            for link in inv.list_links(conn)
        ],
    }


# --- import -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Change:
    kind: Literal["dc", "node", "link"]
    action: Literal["add", "update", "remove"]
    #: the DC or node name; ``a <-> b`` for a link
    name: str
    #: add: the new values; update: {field: [old, new]}; remove: empty
    fields: dict[str, Any] = field(default_factory=dict)
    #: a link's DCs (by name, a < b), so applying never parses ``name``
    dcs: tuple[str, str] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "action": self.action, "name": self.name, "fields": self.fields}
        if self.dcs is not None:
            out["dcs"] = list(self.dcs)
        return out


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """What an import changes (or changed, when ``applied``)."""

    changes: tuple[Change, ...]
    prune: bool
    applied: bool

    def counts(self) -> dict[str, dict[str, int]]:
        """{"dc": {"add": n, "update": n, "remove": n}, "node": {...}, "link": {...}}"""
        out = {k: {"add": 0, "update": 0, "remove": 0} for k in ("dc", "node", "link")}
        for c in self.changes:
            out[c.kind][c.action] += 1
        return out

    def totals(self) -> dict[str, int]:
        return {
            a: sum(1 for c in self.changes if c.action == a) for a in ("add", "update", "remove")
        }

    @property
    def removals(self) -> list[Change]:
        return [c for c in self.changes if c.action == "remove"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "prune": self.prune,
            "counts": self.counts(),
            "changes": [c.as_dict() for c in self.changes],
        }


def _link_name(a: str, b: str) -> str:
    return f"{a} <-> {b}"


def _diff(
    kind: Any,
    name: str,
    have: dict[str, Any],
    want: dict[str, Any],
    dcs: tuple[str, str] | None = None,
) -> list[Change]:
    changed = {k: [have[k], v] for k, v in want.items() if have[k] != v}
    return [Change(kind, "update", name, changed, dcs)] if changed else []


def _add_or_update(
    kind: Literal["dc", "node"],
    have: Mapping[str, Any],
    want: Iterable[tuple[str, dict[str, Any]]],
    adds: list[Change],
    updates: list[Change],
) -> None:
    """Appends, in ``want``'s order, an add for each named DC or node the inventory lacks and an
    update for each whose fields differ from the file's (``have``: the inventory's, by name)."""
    for name, entry in want:
        fields = {k: v for k, v in entry.items() if k != "name"}
        if name not in have:
            adds.append(Change(kind, "add", name, fields))
        else:
            current = {k: getattr(have[name], k) for k in fields}
            updates += _diff(kind, name, current, fields)


def _plan(conn: Connection, doc: dict[str, Any], prune: bool) -> list[Change]:
    adds: list[Change] = []
    updates: list[Change] = []
    removes: list[Change] = []

    have_dcs = {d.name: d for d in inv.list_dcs(conn)}
    want_dcs = {d["name"]: d for d in _normalized(doc, "dcs")}
    _add_or_update("dc", have_dcs, want_dcs.items(), adds, updates)

    have_nodes = {n.name: n for n in inv.list_nodes(conn)}
    want_nodes = {n["name"]: n for n in _normalized(doc, "nodes")}
    _add_or_update("node", have_nodes, sorted(want_nodes.items()), adds, updates)

    have_links = {(x.a, x.b): x for x in inv.list_links(conn)}
    want_links = {}
    for link in _normalized(doc, "links"):
        a, b = sorted((link["a"], link["b"]))
        want_links[a, b] = link["distance_km"]
    for (a, b), km in sorted(want_links.items()):
        if (a, b) not in have_links:
            adds.append(Change("link", "add", _link_name(a, b), {"distance_km": km}, (a, b)))
        else:
            have = {"distance_km": have_links[a, b].distance_km}
            updates += _diff("link", _link_name(a, b), have, {"distance_km": km}, (a, b))

    if prune:
        removes += [Change("dc", "remove", n) for n in sorted(set(have_dcs) - set(want_dcs))]
        removes += [Change("node", "remove", n) for n in sorted(set(have_nodes) - set(want_nodes))]
        removes += [
            Change("link", "remove", _link_name(a, b), {}, (a, b))
            for a, b in sorted(set(have_links) - set(want_links))
        ]
    return adds + updates + removes


def _pair(change: Change) -> tuple[str, str]:
    assert change.dcs is not None  # every link change carries its DCs
    return change.dcs


def _refuse_shared_agents(conn: Connection, changes: list[Change]) -> None:
    """One agent as two nodes, refused on the inventory as the changes would leave it (before
    any is made; checked per change, two nodes swapping URLs would share one in between)."""
    urls = inv.agent_urls(conn)
    for c in changes:
        if c.kind != "node":
            continue
        if c.action == "remove":
            urls.pop(c.name, None)
        elif c.action == "add":
            urls[c.name] = c.fields["agent_url"]
        elif "agent_url" in c.fields:
            urls[c.name] = c.fields["agent_url"][1]  # (old, new)
    try:
        inv.refuse_shared_agents(urls, [c.name for c in changes if c.kind == "node"])
    except inv.InventoryError as exc:
        raise FleetFileError(str(exc)) from None


def _apply(conn: Connection, changes: list[Change]) -> None:
    """Make the changes in an order the constraints allow: DCs before the nodes and links that
    name them; nodes and links out before the DCs that held them."""

    def pick(kind: str, action: str) -> list[Change]:
        return [c for c in changes if c.kind == kind and c.action == action]

    for c in pick("dc", "add"):
        inv.add_dc(conn, c.name, **c.fields)
    for c in pick("dc", "update"):
        inv.update_dc(conn, c.name, **{k: new for k, (_old, new) in c.fields.items()})
    for c in pick("node", "remove"):
        inv.remove_node(conn, c.name)
    for c in pick("node", "add"):
        inv.add_node(conn, c.name, check_agent=False, **c.fields)
    for c in pick("node", "update"):
        fields = {k: new for k, (_old, new) in c.fields.items()}
        inv.update_node(conn, c.name, check_agent=False, **fields)

    for c in pick("link", "remove"):
        inv.remove_link(conn, *_pair(c))
    for c in pick("link", "add"):
        inv.add_link(conn, *_pair(c), distance_km=c.fields["distance_km"])
    for c in pick("link", "update"):
        inv.update_link(conn, *_pair(c), distance_km=c.fields["distance_km"][1])
    for c in pick("dc", "remove"):
        inv.remove_dc(conn, c.name)  # empty by now: its nodes were removed or moved above


def import_fleet(
    conn: Connection, doc: Any, *, prune: bool = False, dry_run: bool = False
) -> ImportPlan:
    """Make the inventory match ``doc``: add what is new, update what differs, and with
    ``prune`` remove what the document does not name. Validates first and raises
    FleetFileError listing every problem before anything is written; the changes are made in
    the caller's transaction, so a failure part way leaves it to roll back all of them."""
    known = () if prune else {d.name for d in inv.list_dcs(conn)}
    if problems := validate(doc, known_dcs=known):
        raise FleetFileError(problems)
    changes = _plan(conn, doc, prune)
    _refuse_shared_agents(conn, changes)
    if not dry_run:
        _apply(conn, changes)
    return ImportPlan(tuple(changes), prune, applied=not dry_run)
