"""A password in a URL never reaches the audit trail. The inventory refuses agent and engine
URLs that carry a user and password, because the trail and the error messages show URLs; but
the refused attempt was itself audited with the URL as typed, so the secret was kept in the
trail anyway (and, for a URL with a bad port too, in the row's result)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import _cli

runner = CliRunner()
SECRET = "s3cret-pw"


@pytest.mark.parametrize(
    "option",
    [
        ["--agent-url", f"http://admin:{SECRET}@10.0.0.7:7070"],
        ["--agent-url", f"http://admin:{SECRET}@10.0.0.7:70x0"],  # the bad port's message
        ["--agent-url", "http://10.0.0.7:7070", "--engine-url", f"https://u:{SECRET}@e:8000/m"],
        ["--agent-url", f"ops:{SECRET}@10.0.0.7:7070"],  # no scheme: refused for that
        ["--agent-url", f"http://admin:pw@{SECRET}@10.0.0.7:7070"],  # an '@' in the password
    ],
)
def test_a_refused_url_with_a_password_is_audited_without_it(
    tmp_path: Path, option: list[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    _cli(db, "fleet", "add-dc", "fra")
    out = runner.invoke(app, ["fleet", "add-node", "n1", "--dc", "fra", *option, "--db", db])
    assert out.exit_code == 2, out.output
    trail = _cli(db, "audit", "--action", "fleet.add-node", "--json")
    assert '"ok": false' in trail and "10.0.0.7" in trail  # the attempt is there
    assert SECRET not in trail, trail
