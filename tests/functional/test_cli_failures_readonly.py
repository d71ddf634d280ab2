"""The read-only commands (collect, status, the fleet's lookups) under failure: an agent that
refuses the token is up, not down, in the collectors' report and history as in `kvctl status`,
and so is one still starting (its tiers opening), shown "starting";
a hung agent (it takes the connection and says nothing) is "not answering", not down; a Ctrl-C
while a hung agent is asked ends the command at once with one line, where it waited out
--timeout in silence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from kvctl.agent_starting import STARTING_PREFIX, says_starting
from kvctl.cli.main import app
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, Node, NodeSample
from tests.functional.agents import closed_port, running_agent
from tests.functional.hung import SIGINT_ONCE_ASLEEP, ctrl_c, hung_http_agent
from tests.starting_agent import starting_url

runner = CliRunner()
#: the --timeout the commands get where a hung agent is asked: far beyond any hang guard's
#: share, so only the fix ends a wait early
LONG_TIMEOUT_S = 300


def _cli(db: str, *args: str, code: int = 0) -> str:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    result = runner.invoke(app, [*args, "--db", db], env={**env, "COLUMNS": "1000"})
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, result.output
    return result.stdout


def _fleet(tmp_path: Path, nodes: dict[str, str]) -> str:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    _cli(db, "fleet", "add-dc", "fra")
    for name, url in nodes.items():
        _cli(db, "fleet", "add-node", name, "--dc", "fra", "--agent-url", url)
    return db


def test_collect_reports_an_agent_refusing_the_token_as_up_not_down(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    with running_agent(tmp_path / "locked", "--cpu", "8MiB", token="not-yours") as locked:
        db = _fleet(tmp_path, {"locked": locked.state.control_url, "gone": dead})
        args = ("collect", "--once", "--no-links", "--metrics-listen", "off")
        report = json.loads(_cli(db, *args, "--json", code=1))["scrape"]  # gone is down
        table = " ".join(_cli(db, *args, code=1).replace("│", " ").split())
    assert report["up"] == [] and list(report["down"]) == ["gone"], report
    assert list(report["token_refused"]) == ["locked"], report
    assert "KVCTL_TOKEN" in report["token_refused"]["locked"]
    assert "locked token refused" in table and "locked down" not in table, table
    assert "gone down" in table, table
    engine = open_db(db)
    try:
        with engine.connect() as conn:
            ids = dict(conn.execute(select(Node.name, Node.id)).all())
            samples = conn.execute(select(NodeSample)).all()
            cache = conn.execute(select(CacheSample.node_id)).scalars().all()
    finally:
        engine.dispose()
    refused = [s for s in samples if s.node_id == ids["locked"]]
    # it answered: up, as status shows it, with why it could not be read; no figures made up
    assert [s.up for s in refused] == [True, True]
    assert all("token" in (s.error or "") and s.scrape_seconds is not None for s in refused)
    assert [s.up for s in samples if s.node_id == ids["gone"]] == [False, False]
    assert cache == []


def test_collect_once_reports_a_starting_agent_as_starting_and_exits_1(tmp_path: Path) -> None:
    with starting_url() as url:
        db = _fleet(tmp_path, {"warming": url})
        args = ("collect", "--once", "--no-links", "--metrics-listen", "off")
        # nothing down, but its figures were not recorded: 1, as for a refused token
        report = json.loads(_cli(db, *args, "--json", code=1))["scrape"]
        table = " ".join(_cli(db, *args, code=1).replace("│", " ").split())
    assert (report["up"], report["down"], report["token_refused"]) == ([], {}, {}), report
    assert list(report["starting"]) == ["warming"], report
    said = report["starting"]["warming"]
    assert said.startswith(STARTING_PREFIX) and url in said, said
    assert f"warming starting {STARTING_PREFIX}" in table, table
    assert "warming down" not in table and "token refused" not in table, table
    engine = open_db(db)
    try:
        with engine.connect() as conn:
            samples = conn.execute(select(NodeSample)).all()
            cache = conn.execute(select(CacheSample.node_id)).scalars().all()
    finally:
        engine.dispose()
    # it answered: up, with what it said; no figures made up
    assert [(s.up, says_starting(s.error)) for s in samples] == [(True, True)] * 2
    assert all(s.scrape_seconds is not None for s in samples)
    assert cache == []


def test_status_tells_a_hung_agent_from_one_that_is_down(tmp_path: Path) -> None:
    with hung_http_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url, "gone": f"http://127.0.0.1:{closed_port()}"})
        status = json.loads(_cli(db, "status", "--timeout", "1", "--json"))
        table = " ".join(_cli(db, "status", "--timeout", "1").replace("│", " ").split())
    nodes = {n["node"]: n for n in status["nodes"]}
    assert nodes["hung"]["up"] is False and nodes["hung"]["state"] == "not answering", nodes
    assert "said nothing for 1 s" in nodes["hung"]["error"], nodes
    assert nodes["gone"]["up"] is False and nodes["gone"]["state"] == "down", nodes
    assert "hung fra not answering" in table and "gone fra down" in table, table
    assert "hung down" not in table and "hung not answering:" in table, table
    assert status["total"]["up"] == 0


def test_doctor_lookup_and_evict_tell_a_hung_agent_from_one_that_is_down(tmp_path: Path) -> None:
    """Before: a hung agent was "unreachable" with "start the agent" as the fix (doctor), and
    "cannot reach the agent ... is it running" (lookup, evict): starting a second agent is
    the wrong move for one that runs and says nothing."""
    key = "3f2a9c0d1e4b5a697887766554433221"
    with hung_http_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url, "gone": f"http://127.0.0.1:{closed_port()}"})
        doctor = json.loads(_cli(db, "doctor", "--timeout", "1", "--json", code=1))
        lookup = _cli(db, "lookup", "--node", "hung", "--key", key, "--timeout", "1", code=1)
        evict = runner.invoke(
            app, ["evict", "--node", "hung", "--key", key, "--yes", "--timeout", "1", "--db", db]
        )
    rows = {c["name"]: c for c in doctor["checks"]}
    assert rows["agent hung"]["detail"].startswith("not answering: "), rows["agent hung"]
    assert "hung or overloaded" in rows["agent hung"]["fix"], rows["agent hung"]
    assert "start the agent on hung" not in rows["agent hung"]["fix"], rows["agent hung"]
    assert rows["agent gone"]["detail"].startswith("unreachable: "), rows["agent gone"]
    assert "start the agent on gone" in rows["agent gone"]["fix"], rows["agent gone"]
    for said in (lookup, evict.output):
        flat_said = " ".join(said.split())
        # the client's read timeout (1 s) or, on a loaded machine where its thread reports
        # late, the fan-out's whole-answer deadline (2 s) says it: either way hung, not down
        assert (
            "took the connection but did not answer in time" in flat_said
            or "did not answer in full within 2 s: hung" in flat_said
        ), said
        assert "is it running" not in flat_said, said


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--timeout", str(LONG_TIMEOUT_S)],
        ["lookup", "--all", "--key", "3f2a9c0d1e4b5a697887766554433221"],
        ["doctor", "--timeout", str(LONG_TIMEOUT_S)],
    ],
    ids=["status", "lookup", "doctor"],
)
def test_ctrl_c_while_a_hung_agent_is_asked_ends_a_read_only_command(
    tmp_path: Path, args: list[str]
) -> None:
    """Nothing a read-only command asks needs auditing: a Ctrl-C ends it with one line, where
    it waited in silence for the hung agent's --timeout (here far beyond the hang guard)."""
    if args[0] == "lookup":
        args = [*args, "--timeout", str(LONG_TIMEOUT_S)]
    with hung_http_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url})
        code, said, _ = ctrl_c(["-m", "kvctl", *args, "--db", db], hung.asked)
    assert code == 130, said
    assert said == "interrupted", said


def test_ctrl_c_while_a_fan_out_sleeps_ends_status_at_once(tmp_path: Path) -> None:
    """The SIGINT taken once the main thread sleeps waiting for the hung agent's answer (see
    SIGINT_ONCE_ASLEEP): it slept on to the agent's deadline (twice --timeout, here far beyond
    the hang guard); each sleep is now short, and its end raises it."""
    with hung_http_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url})
        argv = ["status", "--timeout", str(LONG_TIMEOUT_S), "--db", db]
        code, said, _ = ctrl_c(["-c", SIGINT_ONCE_ASLEEP, "_as_answered", *argv], None)
    assert code == 130, said
    assert said == "interrupted", said


def test_ctrl_c_during_collect_once_says_nothing_was_recorded(tmp_path: Path) -> None:
    """A Ctrl-C ends collect --once at once with one line (the scrapes under way are not
    waited for; see test_collect_once_ctrl_c.py), where it exited 130 in silence."""
    with hung_http_agent() as hung:
        db = _fleet(tmp_path, {"hung": hung.url})
        argv = ["-m", "kvctl", "collect", "--once", "--no-links", "--metrics-listen", "off"]
        code, said, _ = ctrl_c([*argv, "--db", db], hung.asked)
    assert code == 130, said
    assert said == "interrupted: nothing recorded, the scrapes under way dropped", said
