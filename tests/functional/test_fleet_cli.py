"""`kvctl fleet add-dc|add-node|add-link|ls|rm|import|export` on a real SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.fleet.audit import AuditEntry, recent

runner = CliRunner()

FLEET_TOML = """\
[[dcs]]
name = "fra"
region = "eu-central"
carbon_g_per_kwh = 350
pue = 1.2

[[dcs]]
name = "ams"
location = "Amsterdam"

[[nodes]]
name = "n1"
dc = "fra"
agent_url = "http://10.0.0.1:7070"
gpu_model = "H100"

[[nodes]]
name = "n2"
dc = "ams"
agent_url = "http://10.0.0.2:7070"

[[links]]
a = "fra"
b = "ams"
distance_km = 360
"""

# the same fleet, with n2 on a new GPU, a new DC par holding a new node n3, and no link
FLEET_YAML = """\
dcs:
  - {name: fra, region: eu-central, carbon_g_per_kwh: 350, pue: 1.2}
  - {name: ams, location: Amsterdam}
  - {name: par}
nodes:
  - {name: n1, dc: fra, agent_url: "http://10.0.0.1:7070", gpu_model: H100}
  - {name: n2, dc: ams, agent_url: "http://10.0.0.2:7070", gpu_model: H200}
  - {name: n3, dc: par, agent_url: "http://10.0.0.3:7070"}
"""


@pytest.fixture(autouse=True)
def _actor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCTL_ACTOR", "alice@bastion")
    monkeypatch.delenv("KVCTL_DB_URL", raising=False)


@pytest.fixture
def url(db: Engine) -> str:
    return db.url.render_as_string(hide_password=False)


def fleet(url: str, *args: str, input: str | None = None, code: int = 0) -> Result:
    result = runner.invoke(app, ["fleet", *args, "--db", url], input=input)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def flat(text: str) -> str:
    """Output with rich's line wrapping undone, for matching messages."""
    return " ".join(text.split())


def inventory(url: str) -> dict[str, Any]:
    """`kvctl fleet ls --json` without row ids (they differ between databases)."""
    data = json.loads(fleet(url, "ls", "--json").stdout)
    return {k: [{f: v for f, v in x.items() if f != "id"} for x in data[k]] for k in data}


def audit(db: Engine) -> list[AuditEntry]:
    with db.connect() as conn:
        return list(reversed(recent(conn, action="fleet.")))


def build(url: str) -> None:
    fleet(url, "add-dc", "fra", "--region", "eu-central", "--carbon", "350", "--pue", "1.2")
    fleet(url, "add-dc", "ams", "--location", "Amsterdam")
    fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://10.0.0.1:7070",
          "--gpu-model", "H100")  # fmt: skip
    fleet(url, "add-node", "n2", "--dc", "ams", "--agent-url", "http://10.0.0.2:7070",
          "--engine-url", "http://10.0.0.2:8000/metrics")  # fmt: skip
    fleet(url, "add-link", "fra", "ams", "--distance-km", "360")


# --- add and ls ---------------------------------------------------------------------------------
def test_add_and_ls(url: str, db: Engine) -> None:
    out = fleet(url, "add-dc", "fra", "--region", "eu-central", "--json").stdout
    assert json.loads(out)["name"] == "fra" and json.loads(out)["region"] == "eu-central"
    assert "added DC ams" in fleet(url, "add-dc", "ams", "--pue", "1.1").stdout
    out = fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://10.0.0.1:7070").stdout
    assert "added node n1 in DC fra" in out
    added = json.loads(
        fleet(url, "add-link", "fra", "ams", "--distance-km", "360", "--json").stdout
    )
    assert (added["a"], added["b"], added["distance_km"]) == ("ams", "fra", 360.0)

    table = fleet(url, "ls").stdout
    for word in ("DCs", "nodes", "links", "eu-central", "http://10.0.0.1:7070", "360 km"):
        assert word in table
    assert inventory(url) == {
        "dcs": [
            {"name": "ams", "region": "", "location": "", "carbon_g_per_kwh": None,
             "pue": 1.1, "nodes": 0},
            {"name": "fra", "region": "eu-central", "location": "", "carbon_g_per_kwh": None,
             "pue": None, "nodes": 1},
        ],
        "nodes": [{"name": "n1", "dc": "fra", "agent_url": "http://10.0.0.1:7070",
                   "gpu_model": "", "engine_url": None}],
        "links": [{"a": "ams", "b": "fra", "distance_km": 360.0}],
    }  # fmt: skip
    only = json.loads(fleet(url, "ls", "--dc", "ams", "--json").stdout)
    assert [d["name"] for d in only["dcs"]] == ["ams"] and only["nodes"] == []
    assert len(only["links"]) == 1
    assert "no nodes yet" in fleet(url, "ls", "--dc", "ams").stdout
    bad = fleet(url, "ls", "--dc", "nope", code=2)
    assert "no DC named 'nope' (known: ams, fra)" in flat(bad.output)

    entries = audit(db)
    assert [(e.action, e.target, e.ok) for e in entries] == [
        ("fleet.add-dc", "fra", True),
        ("fleet.add-dc", "ams", True),
        ("fleet.add-node", "n1", True),
        ("fleet.add-link", "ams,fra", True),
    ]
    assert {e.actor for e in entries} == {"alice@bastion"}
    assert entries[1].args == {"region": "", "location": "", "carbon_g_per_kwh": None, "pue": 1.1}
    assert entries[2].args["agent_url"] == "http://10.0.0.1:7070"


def test_an_empty_fleet_gives_a_hint(url: str) -> None:
    result = fleet(url, "ls")
    assert "empty" in result.stdout
    assert "kvctl fleet add-dc" in flat(result.output) and "kvctl fleet import" in flat(
        result.output
    )
    assert json.loads(fleet(url, "ls", "--json").stdout) == {"dcs": [], "nodes": [], "links": []}


def test_bad_input_is_one_clear_line_and_exit_2(url: str, db: Engine) -> None:
    fleet(url, "add-dc", "fra")
    cases = {
        ("add-dc", "fra"): "a DC named 'fra' already exists",
        ("add-dc", "x", "--pue", "0.5"): "PUE must be at least 1, got 0.5",
        ("add-node", "n1", "--dc", "nope", "--agent-url", "http://a:1"):
            "no DC named 'nope' (known: fra); add it with `kvctl fleet add-dc`",
        ("add-node", "gpu#1", "--dc", "fra", "--agent-url", "http://a:1"):
            "a node name must not hold '#' (got 'gpu#1'): the fleet index keeps it for an "
            "engine's own cache (NODE#ENGINE)",
        ("add-node", "n1", "--dc", "fra", "--agent-url", "10.0.0.1:7070"):
            "agent URL must be http:// or https:// with a host (e.g. http://10.0.0.7:7070)",
        ("add-node", "n1", "--dc", "fra", "--agent-url", "http://a:1", "--engine-url", "x"):
            "engine URL must be http:// or https://",
        ("add-link", "fra", "fra", "--distance-km", "1"): "a link joins two different DCs",
        ("add-link", "fra", "zzz", "--distance-km", "1"): "no DC named 'zzz'",
        ("rm", "node", "ghost"): "no node named 'ghost' (known: none); `kvctl fleet ls` lists",
        ("rm", "dc", "ghost"): "no DC named 'ghost' (known: fra); `kvctl fleet ls` lists them",
        ("rm", "link", "fra"): "`kvctl fleet rm link` takes DC_A DC_B, got 1 name(s)",
        ("rm", "node", "a", "--with-nodes"): "--with-nodes only applies to `kvctl fleet rm dc`",
    }  # fmt: skip
    for args, message in cases.items():
        result = fleet(url, *args, code=2)
        assert f"error: {message}" in flat(result.output), (args, result.output)
    fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://a:1")
    dup = fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://b:1", code=2)
    assert "a node named 'n1' already exists" in flat(dup.output)
    assert "kvctl fleet ls" in flat(dup.output)  # the hint
    # typer's own checks (a number that is not one, a kind that does not exist) exit 2 too
    fleet(url, "add-dc", "y", "--carbon", "lots", code=2)
    fleet(url, "rm", "rack", "r1", code=2)

    assert inventory(url)["dcs"][0]["name"] == "fra" and len(inventory(url)["dcs"]) == 1
    refused = [e for e in audit(db) if not e.ok]
    # changes the inventory refused are on the audit trail too, with the reason
    assert ("fleet.add-dc", "fra") in [(e.action, e.target) for e in refused]
    assert any("already exists" in e.result for e in refused)


def test_a_duplicate_says_how_to_change_what_exists(url: str) -> None:
    """An agent restarted on another port, at 3 a.m.: `add-node` of its name again is refused,
    and the hint said only that `kvctl fleet ls` lists it, not how to change its URL."""
    fleet(url, "add-dc", "fra")
    fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://a:1")
    dup = flat(
        fleet(url, "add-node", "n1", "--dc", "fra", "--agent-url", "http://b:1", code=2).output
    )
    assert "a node named 'n1' already exists" in dup
    assert "`kvctl fleet export -o fleet.toml`" in dup and "`kvctl fleet import fleet.toml`" in dup


# --- rm -----------------------------------------------------------------------------------------
def test_rm_dc_with_nodes_asks(url: str, db: Engine) -> None:
    build(url)
    refused = fleet(url, "rm", "dc", "fra", code=2)
    assert "DC 'fra' still has 1 node(s): n1" in flat(refused.output)
    assert "--with-nodes" in refused.output

    declined = fleet(url, "rm", "dc", "fra", "--with-nodes", input="n\n", code=1)
    assert "Remove DC 'fra' and its 1 node(s): n1?" in declined.output
    assert "nothing removed" in declined.output
    assert [d["name"] for d in inventory(url)["dcs"]] == ["ams", "fra"]

    accepted = fleet(url, "rm", "dc", "fra", "--with-nodes", input="y\n")
    assert "removed DC fra with 1 node(s) and 1 link(s)" in flat(accepted.stdout)
    left = inventory(url)
    assert [d["name"] for d in left["dcs"]] == ["ams"]
    assert [n["name"] for n in left["nodes"]] == ["n2"] and left["links"] == []

    fleet(url, "add-dc", "par")
    fleet(url, "add-link", "par", "ams", "--distance-km", "500")
    out = json.loads(fleet(url, "rm", "link", "ams", "par", "--json").stdout)
    assert out == {"removed": "link", "id": out["id"], "a": "ams", "b": "par", "distance_km": 500.0}
    assert json.loads(fleet(url, "rm", "node", "n2", "--json").stdout)["name"] == "n2"
    fleet(url, "add-node", "n4", "--dc", "ams", "--agent-url", "http://10.0.0.4:7070")
    out = json.loads(fleet(url, "rm", "dc", "ams", "--with-nodes", "--yes", "--json").stdout)
    assert out == {"removed": "dc", "name": "ams", "nodes": ["n4"], "links": []}

    rms = [e for e in audit(db) if e.action == "fleet.rm"]
    assert [(e.target, e.ok) for e in rms] == [
        ("fra", False),  # refused without --with-nodes; the declined prompt wrote nothing
        ("fra", True),
        ("ams,par", True),
        ("n2", True),
        ("ams", True),
    ]
    assert rms[1].args == {"kind": "dc", "with_nodes": True}


# --- import and export --------------------------------------------------------------------------
def test_import_toml_then_yaml(url: str, db: Engine, tmp_path: Path) -> None:
    toml_file, yaml_file = tmp_path / "fleet.toml", tmp_path / "fleet.yaml"
    toml_file.write_text(FLEET_TOML)
    yaml_file.write_text(FLEET_YAML)

    dry = json.loads(fleet(url, "import", str(toml_file), "--dry-run", "--json").stdout)
    assert dry["applied"] is False and len(dry["changes"]) == 5
    assert inventory(url)["dcs"] == []  # a dry run writes nothing

    done = fleet(url, "import", str(toml_file))
    assert "imported fleet.toml: 5 added, 0 updated, 0 removed" in flat(done.stdout)
    first = inventory(url)
    assert [(d["name"], d["nodes"], d["pue"]) for d in first["dcs"]] == [
        ("ams", 1, None),
        ("fra", 1, 1.2),
    ]
    assert first["links"] == [{"a": "ams", "b": "fra", "distance_km": 360.0}]

    again = fleet(url, "import", str(toml_file))
    assert "already matches" in flat(again.stdout)
    assert inventory(url) == first

    # without --prune nothing goes: the link the YAML file leaves out stays
    plan = json.loads(fleet(url, "import", str(yaml_file), "--json").stdout)
    assert plan["applied"] is True
    assert plan["counts"] == {
        "dc": {"add": 1, "update": 0, "remove": 0},
        "node": {"add": 1, "update": 1, "remove": 0},
        "link": {"add": 0, "update": 0, "remove": 0},
    }
    update = next(c for c in plan["changes"] if c["action"] == "update")
    assert update == {"kind": "node", "action": "update", "name": "n2",
                      "fields": {"gpu_model": ["", "H200"]}}  # fmt: skip
    assert len(inventory(url)["links"]) == 1

    # --prune: asks, and a no changes nothing
    declined = fleet(url, "import", str(toml_file), "--prune", input="n\n", code=1)
    assert "Remove 1 dc(s), 1 node(s)" in flat(declined.output)
    assert len(inventory(url)["nodes"]) == 3
    pruned = json.loads(fleet(url, "import", str(toml_file), "--prune", "--yes", "--json").stdout)
    assert pruned["counts"]["dc"]["remove"] == 1 and pruned["counts"]["node"]["remove"] == 1
    assert pruned["counts"]["node"]["update"] == 1  # n2's GPU back to none
    assert inventory(url) == first

    imports = [e for e in audit(db) if e.action == "fleet.import"]
    # one row per import that changed something; dry runs, no-ops and declines write none
    assert [(e.target, e.ok) for e in imports] == [
        ("fleet.toml", True),
        ("fleet.yaml", True),
        ("fleet.toml", True),
    ]
    assert imports[2].args == {"file": str(toml_file), "prune": True}
    assert json.loads(imports[2].result)["dc"] == {"add": 0, "update": 0, "remove": 1}
    assert imports[0].actor == "alice@bastion"


def test_import_moves_a_node_before_pruning_its_old_dc(url: str, tmp_path: Path) -> None:
    build(url)
    moved = tmp_path / "moved.yml"
    moved.write_text(
        "dcs: [{name: par}]\nnodes: [{name: n1, dc: par, agent_url: 'http://10.0.0.1:7070'}]\n"
    )
    fleet(url, "import", str(moved), "--prune", "--yes")
    assert inventory(url) == {
        "dcs": [{"name": "par", "region": "", "location": "", "carbon_g_per_kwh": None,
                 "pue": None, "nodes": 1}],
        "nodes": [{"name": "n1", "dc": "par", "agent_url": "http://10.0.0.1:7070",
                   "gpu_model": "", "engine_url": None}],
        "links": [],
    }  # fmt: skip


def test_an_invalid_file_lists_its_problems_and_writes_nothing(
    url: str, db: Engine, tmp_path: Path
) -> None:
    fleet(url, "add-dc", "keep")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        FLEET_TOML
        + '\n[[nodes]]\nname = "n1"\ndc = "nowhere"\nagent_url = "ftp://x"\ncolour = "red"\n'
    )
    result = fleet(url, "import", str(bad), "--prune", "--yes", code=2)
    out = flat(result.output)
    for problem in (
        "nodes[2].name: duplicate node 'n1' (also nodes[0])",
        "nodes[2].dc: unknown DC 'nowhere' (not in the file's dcs)",
        "nodes[2].agent_url: agent URL must be http:// or https://",
        "nodes[2].colour: unknown key",
        "4 problem(s); nothing was imported",
    ):
        assert problem in out, out
    assert [d["name"] for d in inventory(url)["dcs"]] == ["keep"]
    assert [e.action for e in audit(db)] == ["fleet.add-dc"]

    # without --prune, nodes may name DCs already in the database
    extra = tmp_path / "extra.yaml"
    extra.write_text("nodes: [{name: k1, dc: keep, agent_url: 'http://k:1'}]\n")
    fleet(url, "import", str(extra))
    assert inventory(url)["nodes"][0]["dc"] == "keep"

    syntax = tmp_path / "broken.yaml"
    syntax.write_text("dcs: [\n")
    assert "not valid YAML at line" in flat(fleet(url, "import", str(syntax), code=2).output)
    other = tmp_path / "fleet.json"
    other.write_text("{}")
    assert "use .toml, .yaml or .yml" in flat(fleet(url, "import", str(other), code=2).output)
    missing = fleet(url, "import", str(tmp_path / "nope.toml"), code=2)
    assert "no such file" in flat(missing.output)

    # the one reader every file option uses: a directory, bytes that are not UTF-8
    def unwrapped(text: str) -> str:  # long paths wrap at any character
        return "".join(text.split())

    folder = unwrapped(fleet(url, "import", str(tmp_path), code=2).output)
    assert unwrapped(f"cannot read {tmp_path}: it is a directory") in folder
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"name = '\xff'\n")
    said = unwrapped(fleet(url, "import", str(binary), code=2).output)
    assert unwrapped(f"cannot read {binary}: not UTF-8") in said


@pytest.mark.parametrize("fmt", ["toml", "yaml"])
def test_export_import_export_round_trips(url: str, tmp_path: Path, fmt: str) -> None:
    build(url)
    fleet(url, "add-dc", "par", "--location", "Paris, FR", "--carbon", "56.5")
    text = fleet(url, "export", "--format", fmt).stdout
    assert ("[[nodes]]" if fmt == "toml" else "- name: n1") in text
    path = tmp_path / f"fleet.{fmt}"
    saved = runner.invoke(app, ["fleet", "export", "-o", str(path), "--db", url])
    assert saved.exit_code == 0 and path.read_text() == text  # format from the suffix

    # into an empty database (SQLite, whatever the source) and back out: the same text
    other = f"sqlite:///{tmp_path / 'other.db'}"
    fleet(other, "import", str(path))
    assert fleet(other, "export", "--format", fmt).stdout == text
    # and into the source database emptied by a pruning import of an empty fleet
    empty = tmp_path / f"empty.{fmt}"
    empty.write_text("")
    fleet(url, "import", str(empty), "--prune", "--yes")
    assert inventory(url) == {"dcs": [], "nodes": [], "links": []}
    fleet(url, "import", str(path))
    assert fleet(url, "export", "--format", fmt).stdout == text


def test_export_options(url: str, tmp_path: Path) -> None:
    build(url)
    yml = tmp_path / "out.yml"
    fleet(url, "export", "-o", str(yml))
    assert yml.read_text().startswith("dcs:\n")
    forced = tmp_path / "out.txt"
    fleet(url, "export", "-o", str(forced), "--format", "toml")
    assert forced.read_text().startswith("[[dcs]]")
    bad = fleet(url, "export", "-o", str(tmp_path / "out.json"), code=2)
    assert "--format" in flat(bad.output)
    assert not (tmp_path / "out.json").exists()


def test_the_db_url_can_come_from_the_environment(url: str) -> None:
    result = runner.invoke(app, ["fleet", "add-dc", "env-dc"], env={"KVCTL_DB_URL": url})
    assert result.exit_code == 0, result.output
    assert [d["name"] for d in inventory(url)["dcs"]] == ["env-dc"]


# --- a real process -----------------------------------------------------------------------------
def test_as_a_real_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    env = {"KVCTL_ACTOR": "bob@ci", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def kvctl(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "kvctl", "fleet", *args, "--db", url],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr
        return done

    # each process costs a second of imports: three show exit codes and the streams
    assert "added DC fra" in kvctl("add-dc", "fra", "--pue", "1.3").stdout
    duplicate = kvctl("add-dc", "fra", code=2)
    assert duplicate.stdout == "" and "a DC named 'fra' already exists" in duplicate.stderr
    assert '[[dcs]]\nname = "fra"\npue = 1.3\n' in kvctl("export").stdout


def test_prune_removes_only_what_the_operator_agreed_to(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvctl.cli.fleet as fleet_cli

    fleet(url, "add-dc", "fra")
    fleet(url, "add-node", "old", "--dc", "fra", "--agent-url", "http://10.0.0.1:7070")
    wanted = tmp_path / "fleet.toml"
    wanted.write_text('[[dcs]]\nname = "fra"\n', encoding="utf-8")

    def someone_adds_a_node_meanwhile(question: str) -> bool:
        fleet(url, "add-node", "new", "--dc", "fra", "--agent-url", "http://10.0.0.2:7070")
        return True  # the operator agreed to remove "old" only

    monkeypatch.setattr(fleet_cli, "confirm", someone_adds_a_node_meanwhile)
    out = fleet(url, "import", str(wanted), "--prune", code=2)
    assert "changed while you were asked" in flat(out.output)
    assert sorted(n["name"] for n in inventory(url)["nodes"]) == ["new", "old"]


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["top", "--json"],
        ["fleet", "ls"],
        ["fleet", "export"],
        ["fleet", "rm", "node", "n1"],
        ["audit"],
        ["lookup", "--all", "--text", "hello"],
        ["pin", "--all", "--yes", "--key", "00" * 16],
        ["collect", "--once"],
        ["db", "maintain"],
    ],
    ids=" ".join,
)
def test_a_reader_pointed_at_no_database_says_so_and_creates_nothing(
    tmp_path: Path, command: list[str]
) -> None:
    path = tmp_path / "nodb" / "x.db"  # a mistyped --db
    out = runner.invoke(app, [*command, "--db", f"sqlite:///{path}"])
    assert out.exit_code == 2, out.output
    said = flat(out.output)
    assert f"no fleet database at {path}; create one with `kvctl fleet add-dc NAME`" in said
    assert not path.parent.exists()


def test_db_current_shows_a_missing_database_without_creating_it(tmp_path: Path) -> None:
    path = tmp_path / "nodb" / "x.db"
    out = runner.invoke(app, ["db", "current", "--db", f"sqlite:///{path}", "--json"])
    assert out.exit_code == 1  # behind, as an empty one is
    doc = json.loads(out.stdout)
    assert doc["exists"] is False and doc["current"] is None
    assert not path.parent.exists()


@pytest.mark.parametrize(
    "command",
    [["fleet", "add-dc", "fra"], ["fleet", "import", "FILE"], ["db", "upgrade"]],
    ids=" ".join,
)
def test_a_writer_creates_the_database_for_its_owner_only(
    tmp_path: Path, command: list[str]
) -> None:
    import os
    import stat

    from sqlalchemy import event

    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET_TOML)
    path = tmp_path / "new" / "x.db"
    args = [str(fleet_file) if a == "FILE" else a for a in command]
    # the WAL's -wal and -shm files hold the database's pages while a connection is open and
    # are gone once the last one closes: their modes are read at each of the writer's commits
    # (checked after the command had ended, they were never there to check)
    extras = (path.with_name("x.db-wal"), path.with_name("x.db-shm"))
    seen: list[tuple[str, int]] = []

    def modes_at_commit(_conn: object) -> None:
        seen.extend((f.name, stat.S_IMODE(f.stat().st_mode)) for f in extras if f.exists())

    old_umask = os.umask(0o022)  # the usual one: files 0644 unless made otherwise
    event.listen(Engine, "commit", modes_at_commit)
    try:
        out = runner.invoke(app, [*args, "--db", f"sqlite:///{path}"])
    finally:
        event.remove(Engine, "commit", modes_at_commit)
        os.umask(old_umask)
    assert out.exit_code == 0, out.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # SQLite makes them with the database's mode
    assert {name for name, _ in seen} == {"x.db-wal", "x.db-shm"}, seen
    assert all(mode == 0o600 for _, mode in seen), seen
    ls = runner.invoke(app, ["fleet", "ls", "--db", f"sqlite:///{path}"])
    assert ls.exit_code == 0, ls.output


@pytest.mark.parametrize("once", [["--once"], []], ids=["once", "loop"])
def test_collect_for_a_dc_the_fleet_lacks_is_one_line_exit_2(
    tmp_path: Path, once: list[str]
) -> None:
    """Before: "kvctl failed where it did not expect to: InventoryError" (a bug's line), exit
    1, where status, top and replay say the usual line."""
    db = f"sqlite:///{tmp_path / 'kv.db'}"
    assert runner.invoke(app, ["fleet", "add-dc", "fra", "--db", db]).exit_code == 0
    out = runner.invoke(
        app, ["collect", *once, "--dc", "nosuch", "--metrics-listen", "off", "--db", db]
    )
    assert out.exit_code == 2, out.output
    said = flat(out.output)
    assert "no DC named 'nosuch' (known: fra)" in said and "did not expect" not in said


@pytest.mark.parametrize(
    "same",
    [
        "http://10.0.0.1:7070",
        "http://10.0.0.1:7070/",
        "HTTP://10.0.0.1:7070",
        "http://10.0.0.1:7070/."[:-1],
    ],
)
def test_a_second_node_for_one_agent_is_refused(url: str, same: str) -> None:
    """Before: taken silently, and status counted the agent once per node (fleet totals
    twice). localhost is 127.0.0.1, and a default port is the same spelled out or not."""
    build(url)  # n1 at http://10.0.0.1:7070
    said = flat(fleet(url, "add-node", "dup", "--dc", "fra", "--agent-url", same, code=2).output)
    assert "one agent URL for several nodes ('dup', 'n1')" in said, said
    assert "dup" not in {n["name"] for n in inventory(url)["nodes"]}
    fleet(url, "add-node", "lo", "--dc", "fra", "--agent-url", "http://localhost:7070")
    said = flat(
        fleet(
            url, "add-node", "lo2", "--dc", "fra", "--agent-url", "http://127.0.0.1:7070", code=2
        ).output
    )
    assert "('lo', 'lo2')" in said, said
    fleet(url, "add-node", "web", "--dc", "fra", "--agent-url", "http://10.9.9.9")
    fleet(url, "add-node", "web2", "--dc", "fra", "--agent-url", "http://10.9.9.9:80", code=2)


def test_an_import_may_swap_two_nodes_agents_but_not_share_one(url: str, tmp_path: Path) -> None:
    build(url)  # n1 at 10.0.0.1, n2 at 10.0.0.2
    swapped = tmp_path / "swapped.yml"
    swapped.write_text(
        "dcs: [{name: fra}, {name: ams}]\nnodes:\n"
        "  - {name: n1, dc: fra, agent_url: 'http://10.0.0.2:7070'}\n"
        "  - {name: n2, dc: ams, agent_url: 'http://10.0.0.1:7070'}\n"
    )
    fleet(url, "import", str(swapped))
    urls = {n["name"]: n["agent_url"] for n in inventory(url)["nodes"]}
    assert urls == {"n1": "http://10.0.0.2:7070", "n2": "http://10.0.0.1:7070"}
    shared = tmp_path / "shared.yml"
    shared.write_text(
        "dcs: [{name: fra}]\nnodes:\n  - {name: n3, dc: fra, agent_url: 'http://10.0.0.1:7070/'}\n"
    )
    said = flat(fleet(url, "import", str(shared), code=2).output)
    assert "one agent URL for several nodes ('n2', 'n3')" in said, said
    assert "nothing was imported" in said, said
    assert "n3" not in {n["name"] for n in inventory(url)["nodes"]}  # nothing of it written


def test_an_inventory_change_rolled_back_leaves_nothing(db: Engine) -> None:
    """A transaction adding a DC, a node and a link that then fails leaves none of them, as a
    refused change or a failed audit write must. Before, on SQLite, each row's savepoint
    committed it on its own (the driver issues no BEGIN before a SAVEPOINT)."""
    from sqlalchemy import func, select

    from kvctl.db.inventory import add_dc, add_link, add_node
    from kvctl.db.models import DataCenter, Link, Node

    with pytest.raises(RuntimeError), db.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        add_node(conn, "n1", dc="fra", agent_url="http://10.0.0.1:7070")
        add_link(conn, "fra", "ams", distance_km=360)
        raise RuntimeError("the audit write failed")
    with db.connect() as conn:
        counts = [
            conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (DataCenter, Node, Link)
        ]
    assert counts == [0, 0, 0]


def test_a_postgresql_that_refuses_the_connection_is_said_on_one_line() -> None:
    """libpq's "connection refused" comes with an indented second line ("Is the server
    running on that host..."), which the error printed as it was: two lines."""
    from tests.functional.agents import closed_port

    db = f"postgresql://kvctl@127.0.0.1:{closed_port()}/kvctl"
    out = runner.invoke(app, ["status", "--db", db])
    assert out.exit_code == 2, out.output
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert "Connection refused Is the server running" in lines[0], lines


def test_a_dry_run_import_creates_no_database(tmp_path: Path) -> None:
    """A dry run changes nothing: pointed at a missing SQLite file (a mistyped --db), it plans
    against an empty inventory and leaves no database behind (it used to create one)."""
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET_TOML)
    path = tmp_path / "typo" / "x.db"
    out = runner.invoke(
        app,
        ["fleet", "import", str(fleet_file), "--dry-run", "--json", "--db", f"sqlite:///{path}"],
    )
    assert out.exit_code == 0, out.output
    assert not path.parent.exists()
    plan = json.loads(out.stdout)
    assert {kind: n["add"] for kind, n in plan["counts"].items()} == {"dc": 2, "node": 2, "link": 1}
    # a long path wraps at any character: compared with every space taken out
    assert "".join(f"no fleet database at {path} yet".split()) in "".join(out.stderr.split())


def test_audit_with_a_filter_that_matches_nothing_says_so(url: str) -> None:
    """`kvctl audit --action resize --failed` (its help's example) on a trail with rows, none
    failed: it said "nothing recorded yet", as if the trail were empty."""
    build(url)
    out = runner.invoke(app, ["audit", "--action", "fleet.", "--failed", "--db", url])
    assert out.exit_code == 0, out.output
    said = flat(out.output)
    assert "nothing recorded matches --action fleet. --failed" in said
    assert "nothing recorded yet" not in said
    everything = runner.invoke(app, ["audit", "--db", url])
    assert "fleet.add-dc" in everything.output and "nothing recorded" not in everything.output
