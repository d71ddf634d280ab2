"""`kvctl collect` whose /metrics port another process holds (a second collector started by
hand beside the service, at 3 a.m.): the one line said "cannot serve /metrics on ...:
[Errno 98] Address already in use" and no hint of what holds it or what to do."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import closed_port

runner = CliRunner()


def test_a_metrics_port_taken_hints_at_another_collector_and_the_flag(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    url = f"http://127.0.0.1:{closed_port()}"
    for args in (["fleet", "add-dc", "fra"], ["fleet", "add-node", "n1", "--dc", "fra",
                                               "--agent-url", url]):  # fmt: skip
        assert runner.invoke(app, [*args, "--db", db]).exit_code == 0
    with socket.create_server(("127.0.0.1", 0)) as taken:
        where = f"127.0.0.1:{taken.getsockname()[1]}"
        result = runner.invoke(
            app,
            ["collect", "--db", db, "--no-links", "--metrics-listen", where],
            env={"COLUMNS": "1000"},
        )
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert f"cannot serve /metrics on {where}" in said
    assert "hint: another process listens there (another `kvctl collect`?)" in said, said
    assert "--metrics-listen" in said.split("hint:")[1]
