"""JSON nested thousands deep ('[[[[...') makes Python's parser raise RecursionError, which no
caller took for bad input: an agent's error answer printed RecursionError text (a bug's line),
an audit row so nested failed `kvctl audit`, a trace line so nested failed simulate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.client import AgentClient, AgentError, NotAnAgent, RequestError
from tests.functional.test_cli_failures_interrupt import DONE, KEY, _cli
from tests.not_an_agent import answering_url

runner = CliRunner()
DEEP = "[" * 5000 + "]" * 5000
JSON = "application/json"


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (500, json.dumps({"detail": "x"}).replace('"x"', DEEP), RequestError),
        (409, json.dumps({"detail": "x"}).replace('"x"', DEEP), NotAnAgent),
        (422, DEEP, NotAnAgent),
        (200, DEEP, NotAnAgent),
        (200, "{not json", NotAnAgent),  # a JSON content type, invalid: JSONDecodeError escaped
    ],
)
def test_an_answer_nested_too_deep_is_an_agent_error(
    status: int, body: str, error: type[AgentError]
) -> None:
    with (
        answering_url(status, body.encode(), JSON) as url,
        AgentClient(url, timeout_s=5.0) as client,
        pytest.raises(AgentError) as caught,
    ):
        client.info()
    assert type(caught.value) is error, caught.value
    said = str(caught.value)
    assert "recursion" not in said.lower() and "\n" not in said and len(said) < 400, said
    assert url in said


def test_a_node_answering_so_fails_alone_and_its_audit_row_lists(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    deep_detail = json.dumps({"detail": "x"}).replace('"x"', DEEP).encode()
    with (
        answering_url(500, deep_detail, JSON) as deep,
        answering_url(200, DONE, JSON) as good,
    ):
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "deep", "--dc", "fra", "--agent-url", deep)
        _cli(db, "fleet", "add-node", "good", "--dc", "fra", "--agent-url", good)
        out = runner.invoke(
            app,
            ["pin", "--all", "--yes", "--key", KEY, "--db", db, "--json"],
            env={"KVCTL_TOKEN": None},
        )
    said = " ".join(out.output.split())
    assert out.exit_code == 1, said
    assert json.loads(out.stdout)["failed"] == ["deep"], said
    assert "recursion" not in said.lower() and "did not expect" not in said, said

    # a row whose args and result are JSON nested too deep (written by hand, or another tool)
    from sqlalchemy import create_engine

    from kvctl.db.models import Audit

    engine = create_engine(db)
    with engine.begin() as conn:
        conn.execute(
            Audit.__table__.insert().values(
                ts_ms=1, actor="me", action="pin", target="x", args=DEEP, ok=False, result=DEEP
            )
        )
    engine.dispose()
    for args in (["audit"], ["audit", "--json"]):
        listed = runner.invoke(app, [*args, "--db", db], env={"COLUMNS": "1000"})
        said = " ".join(listed.output.split())
        assert listed.exit_code == 0, said
        assert "recursion" not in said.lower() and "did not expect" not in said, said
        assert "deep" in said and "nested too deep" in said, said


def test_a_trace_line_nested_too_deep_is_refused_with_its_line(tmp_path: Path) -> None:
    trace = tmp_path / "deep.jsonl"
    record = {"timestamp": 1, "input_length": 512, "output_length": 7, "hash_ids": [0]}
    trace.write_text(f"{json.dumps(record)}\n{DEEP}\n", encoding="utf-8")
    out = runner.invoke(app, ["simulate", "--trace", str(trace)])
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert f"{trace}:2: invalid JSON: nested too deep" in said, said
