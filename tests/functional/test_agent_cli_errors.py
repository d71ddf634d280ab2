"""`kvctl agent ...` given bad input or pointed at the wrong thing: one clear line and a hint
that fits (exit 2 for bad input, before anything is started or asked), never a traceback, and
an agent that is up is never called down."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import Agent, closed_port, running_agent
from tests.not_an_agent import answering_url, hang_up_url, web_page_url

runner = CliRunner()
TOKEN = "cli-errors-s3cret"
START_HINT = "kvctl agent start"


@pytest.fixture(scope="module")
def token_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("token-agent")
    with running_agent(root / "a", "--cpu", "8MiB", "--disk", "0", token=TOKEN) as agent:
        yield agent


def _run(tmp_path: Path, *args: str, **env: str) -> Any:
    """``kvctl ARGS`` with no KVCTL_* variable and no user config file but ``env``."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    clean["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    clean["COLUMNS"] = "1000"  # long paths in one piece
    return runner.invoke(app, list(args), env=clean | env)


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps at the terminal's width


@pytest.mark.parametrize("detach", [True, False])
def test_a_data_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path, detach: bool) -> None:
    file = tmp_path / "afile"
    file.write_text("")
    args = ["agent", "start", "--data-dir", str(file), *(["--detach"] if detach else [])]
    out = _run(tmp_path, *args)
    assert out.exit_code == 2, out.output
    said = _flat(out.output)
    assert f"the data directory {file} exists and is not a directory" in said
    assert "--data-dir" in said and "Traceback" not in said and "Errno" not in said
    assert file.is_file() and file.read_text() == ""


@pytest.mark.parametrize(
    "where", [lambda tmp: tmp / "afile" / "sub", lambda tmp: Path("/proc/kvctl-nope")]
)
def test_a_data_dir_that_cannot_be_created_is_refused_naming_it(tmp_path: Path, where: Any) -> None:
    (tmp_path / "afile").write_text("")
    path = where(tmp_path)
    out = _run(tmp_path, "agent", "start", "--detach", "--data-dir", str(path))
    assert out.exit_code == 2, out.output
    said = _flat(out.output)
    assert f"cannot create the data directory {path}" in said and "Traceback" not in said


@pytest.mark.parametrize(
    ("args", "example"),
    [(["--peer", "bad"], "--peer fra-2=10.1.0.7:7071"), (["--link", "bad"], "--link pool:")],
)
def test_a_bad_peer_or_link_names_the_flag_that_exists(
    tmp_path: Path, args: list[str], example: str
) -> None:
    out = _run(tmp_path, "agent", "start", "--data-dir", str(tmp_path / "d"), *args)
    assert out.exit_code == 2, out.output
    said = _flat(out.output)
    assert f"for example: {example}" in said
    assert "--peers" not in said and "--links" not in said


def test_an_agent_that_refuses_the_token_is_up_not_down(tmp_path: Path, token_agent: Agent) -> None:
    url = token_agent.state.control_url
    out = _run(tmp_path, "agent", "status", "--url", url)
    assert out.exit_code == 1
    said = _flat(out.output)
    assert said.startswith("token refused:") and "is up but needs a token" in said
    assert "KVCTL_TOKEN" in said and "do not start another" in said
    assert "down" not in said and START_HINT not in said
    report = json.loads(_run(tmp_path, "agent", "status", "--url", url, "--json").stdout)
    assert report["up"] is True and report["auth_refused"] is True
    wrong = _flat(_run(tmp_path, "agent", "status", "--url", url, KVCTL_TOKEN="nope").output)
    assert "is up but refused the token" in wrong
    right = _run(tmp_path, "agent", "status", "--url", url, KVCTL_TOKEN=TOKEN)
    assert right.exit_code == 0, right.output


def test_a_url_without_a_scheme_is_refused_before_asking(tmp_path: Path) -> None:
    for command in ("status", "remote"):
        out = _run(tmp_path, "agent", command, "--url", "127.0.0.1:47070")
        assert out.exit_code == 2, out.output
        said = _flat(out.output)
        assert "--url: agent URL must be http:// or https://" in said and START_HINT not in said


PAGE = b"<!DOCTYPE HTML>\n<html lang='en'>\n<title>Error response</title>\n" + b"<p>x</p>\n" * 500


@pytest.mark.parametrize(
    ("serve", "reason"),
    [
        (lambda: answering_url(404, PAGE), "HTTP 404 from {url}/v1/info (<!DOCTYPE HTML>)"),
        (lambda: answering_url(404, b""), "HTTP 404 from {url}/v1/info (empty body)"),
        (hang_up_url, "is that an agent's data-plane port?"),
    ],
)
def test_something_that_is_not_an_agent_gets_a_short_reason(
    tmp_path: Path, serve: Any, reason: str
) -> None:
    with serve() as url:
        out = _run(tmp_path, "agent", "status", "--url", url)
        report = json.loads(_run(tmp_path, "agent", "status", "--url", url, "--json").stdout)
    assert out.exit_code == 1
    said = _flat(out.output)
    assert said.startswith(("not an agent:", "no HTTP answer:")) and reason.format(url=url) in said
    assert "--listen" in said and START_HINT not in said and "<html" not in said
    assert report["up"] is False and len(report["error"]) < 200


def test_https_at_a_plain_http_port_says_to_give_http_not_to_start_the_agent(
    tmp_path: Path,
) -> None:
    """An agent serves plain HTTP: an https:// URL for it got "down: ... [SSL:
    WRONG_VERSION_NUMBER] ... is it running" and the hint to start it, which it is."""
    with web_page_url() as url:
        https = url.replace("http://", "https://", 1)
        out = _run(tmp_path, "agent", "status", "--url", https)
        report = json.loads(_run(tmp_path, "agent", "status", "--url", https, "--json").stdout)
    assert out.exit_code == 1
    said = _flat(out.output)
    assert said.startswith("not an agent:"), said
    assert f"{https} answered in plain HTTP, not TLS" in said and url in said
    assert START_HINT not in said and "SSL" not in said
    assert report["up"] is False and "plain HTTP" in report["error"]


def test_an_agent_url_ending_in_v1_says_to_drop_it(tmp_path: Path, token_agent: Agent) -> None:
    """The API's paths are under /v1: a URL copied with it asked /v1/v1/info, and the answer
    said "no such endpoint; not a kvctl agent's control API", of an agent."""
    url = token_agent.state.control_url + "/v1"
    out = _run(tmp_path, "agent", "status", "--url", url, KVCTL_TOKEN=TOKEN)
    assert out.exit_code == 1, out.output
    said = _flat(out.output)
    assert f"give the agent's URL without /v1 ({token_agent.state.control_url})" in said, said


@pytest.mark.parametrize(
    "command", [["status"], ["remote"], ["probe", "127.0.0.1:1"], ["retry-tier", "disk"]]
)
@pytest.mark.parametrize("body", [b'{"foo": 1}', b'{"stats": {}, "usage": {}}'])
def test_json_that_is_not_an_agents_answer_is_not_an_agent(
    tmp_path: Path, command: list[str], body: bytes
) -> None:
    """Another JSON API at the URL: "a bug in kvctl" (KeyError: 'lookups', 'configured',
    'target', 'tier')."""
    with answering_url(200, body, "application/json") as url:
        out = _run(tmp_path, "agent", *command, "--url", url)
    said = _flat(out.output)
    assert out.exit_code == 1, said
    assert "not an agent:" in said and "is a kvctl agent's control API" in said, said
    assert "did not expect" not in said and "KeyError" not in said


def test_a_403_is_a_refused_token_not_a_missing_agent(tmp_path: Path) -> None:
    # what an authenticating proxy in front of an agent answers a wrong token with
    with answering_url(403, b"<html>Forbidden</html>") as url:
        out = _run(tmp_path, "agent", "status", "--url", url)
        report = json.loads(_run(tmp_path, "agent", "status", "--url", url, "--json").stdout)
    assert out.exit_code == 1
    said = _flat(out.output)
    assert said.startswith("token refused:") and "403 Forbidden" in said, said
    assert "KVCTL_TOKEN" in said and "not an agent" not in said and "<html" not in said
    assert report["up"] is True and "403 Forbidden" in report["error"]


def test_status_at_an_agents_data_port_hints_at_the_control_port(
    tmp_path: Path, token_agent: Agent
) -> None:
    out = _run(tmp_path, "agent", "status", "--url", f"http://{token_agent.state.data_tcp}")
    assert out.exit_code == 1
    said = _flat(out.output)
    assert "closed the connection without an HTTP answer" in said
    assert "data-plane port" in said and START_HINT not in said


def test_a_bad_probe_target_is_refused_before_the_agent_is_asked(tmp_path: Path) -> None:
    # nothing listens at --url: had the agent been asked, this would be exit 1, "down"
    down = f"http://127.0.0.1:{closed_port()}"
    out = _run(tmp_path, "agent", "probe", "notanaddress", "--url", down)
    assert out.exit_code == 2, out.output
    said = _flat(out.output)
    assert "target must be a data-plane TCP address HOST:PORT, got 'notanaddress'" in said


def test_a_422_from_the_agent_is_one_readable_line(tmp_path: Path, token_agent: Agent) -> None:
    # an empty --target-name passes the CLI; the agent's schema refuses it
    out = _run(
        tmp_path, "agent", "probe", token_agent.state.data_tcp or "", "--target-name", "",
        "--url", token_agent.state.control_url, KVCTL_TOKEN=TOKEN,
    )  # fmt: skip
    assert out.exit_code == 1
    said = _flat(out.output)
    assert "error: 422: name: String should have at least 1 character" in said
    assert "'loc'" not in said and "[{" not in said and START_HINT not in said


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("command", ["status", "remote", "stop"])
@pytest.mark.parametrize("case", ["no such dir", "empty dir", "corrupt record", "dead pid"])
def test_a_data_dir_with_no_running_agent_is_said_and_no_other_agent_is_asked(
    tmp_path: Path, token_agent: Agent, command: str, case: str
) -> None:
    # another agent listens where this node's config says: it must not answer for the dir
    listen = token_agent.state.control_url.removeprefix("http://")
    data_dir = tmp_path / "meant"
    if case != "no such dir":
        data_dir.mkdir()
    if case == "corrupt record":
        (data_dir / "agent.json").write_text('{"pid": "x"')
    if case == "dead pid":  # killed: the record stays, and names the other agent's URL
        record = {"pid": _dead_pid(), "control_url": token_agent.state.control_url}
        (data_dir / "agent.json").write_text(json.dumps(record))
    out = _run(tmp_path, "agent", command, "--data-dir", str(data_dir), KVCTL_LISTEN=listen)
    said = _flat(out.output)
    if case == "dead pid" and command == "stop":  # nothing to stop, and the dir is the right one
        assert out.exit_code == 0 and f"no agent is running for {data_dir}" in said
        return
    assert out.exit_code == 1, out.output
    expected = {
        "no such dir": f"no agent has run from {data_dir}: there is no such directory",
        "empty dir": f"no agent is running from {data_dir}: it holds no agent.json",
        "corrupt record": f"{data_dir / 'agent.json'} is not an agent's record",
        "dead pid": "is not running: it did not stop cleanly",
    }[case]
    assert expected in said, said
    assert f"kvctl agent start --data-dir {data_dir} --detach" in said
    assert "token" not in said and "up" not in said.split()
    assert not (case == "no such dir" and data_dir.exists())  # nothing created


def test_status_json_of_a_data_dir_with_no_agent_reports_it_down(
    tmp_path: Path, token_agent: Agent
) -> None:
    listen = token_agent.state.control_url.removeprefix("http://")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run(tmp_path, "agent", "status", "--data-dir", str(empty), "--json", KVCTL_LISTEN=listen)
    assert out.exit_code == 1
    report = json.loads(out.stdout)
    assert report["up"] is False and report["control_url"] is None
    assert "no agent is running from" in report["error"]


def test_the_down_hint_says_what_to_check_not_to_run_itself(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{closed_port()}"
    out = _run(tmp_path, "agent", "status", "--url", down)
    assert out.exit_code == 1
    said = _flat(out.output)
    assert said.startswith("down: cannot reach the agent at")
    assert "kvctl agent status" not in said  # what was just run
    assert "kvctl agent config --show" in said and "agent.log" in said and START_HINT in said


def test_log_level_has_help(tmp_path: Path) -> None:
    out = _run(tmp_path, "agent", "start", "--help")
    said = _flat(out.output)
    assert "--log-level" in said and "debug, info, warning or error" in said


def test_the_index_token_comes_from_a_file_never_the_command_line(tmp_path: Path) -> None:
    """A token given as a flag's value is in every process listing: only a file is taken."""
    from kvctl.cli.agent import StartFlags

    token_file = tmp_path / "index.token"
    token_file.write_text("r0uter-s3cret\nignored\n")
    assert StartFlags(index_token_file=token_file).as_flags()["index_token"] == "r0uter-s3cret"
    assert StartFlags().as_flags()["index_token"] is None
    (tmp_path / "empty.token").write_text("\n")
    for bad, said in [(tmp_path / "empty.token", "is empty"), (tmp_path, "is a directory")]:
        data = str(tmp_path / "a")
        out = _run(tmp_path, "agent", "start", "--data-dir", data, "--index-token-file", str(bad))
        assert out.exit_code == 2, out.output
        assert "--index-token-file" in out.output and said in out.output, out.output
        assert not (tmp_path / "a" / "agent.json").exists()
    out = _run(tmp_path, "agent", "start", "--index-token", "s3cret")
    assert out.exit_code == 2 and "No such option" in out.output, out.output


@pytest.mark.parametrize("args", [["agent", "stop", "--timeout", "-1"]])
def test_a_negative_wait_is_refused_before_anything_is_signalled(
    tmp_path: Path, args: list[str]
) -> None:
    """Before: taken; the stop sent SIGTERM, said at once 'still running -1 s after SIGTERM'
    and exited 1, though the agent then stopped cleanly."""
    out = runner.invoke(app, [*args, "--data-dir", str(tmp_path)])
    assert out.exit_code == 2, out.output
    said = " ".join(out.output.replace("│", " ").split())
    assert "--timeout" in said and "greater than or equal to 0" in said, said


def test_config_of_a_data_dir_an_agent_runs_from_says_where_it_differs(
    tmp_path: Path, token_agent: Agent
) -> None:
    """Before: the defaults alone (listen 127.0.0.1:7070), though the agent there listens
    elsewhere, and agent status's hint sends the operator to this command for its address."""
    data_dir = str(token_agent.data_dir)
    doc = json.loads(_run(tmp_path, "agent", "config", "--data-dir", data_dir, "--json").stdout)
    running = doc["running"]
    assert running["pid"] == token_agent.state.pid
    assert running["control_url"] == token_agent.state.control_url
    assert "listen" in running["differs"]
    said = _flat(_run(tmp_path, "agent", "config", "--data-dir", data_dir).stdout)
    assert f"an agent runs from {data_dir} (pid {token_agent.state.pid})" in said, said
    assert f"control API {token_agent.state.control_url}" in said and "differ in: " in said
    elsewhere = json.loads(
        _run(tmp_path, "agent", "config", "--data-dir", str(tmp_path / "none"), "--json").stdout
    )
    assert elsewhere["running"] is None


@pytest.mark.parametrize("chosen_by", ["--config", "KVCTL_CONFIG", "KVCTL_CPU"])
def test_a_setting_that_cannot_load_names_what_to_fix_not_config_show(
    tmp_path: Path, chosen_by: str
) -> None:
    """`kvctl agent config --show` loads the same file and variables, so it fails the same way:
    the hint to run it sent the operator in a circle. It names the file to fix, or the
    variable to fix or unset."""
    bad = tmp_path / "agent.toml"
    bad.write_text('[agent]\ncpu = "8GiB\n')  # an unterminated string
    env = {"KVCTL_CONFIG": str(bad)} if chosen_by == "KVCTL_CONFIG" else {}
    env |= {"KVCTL_CPU": "lots"} if chosen_by == "KVCTL_CPU" else {}
    args = ["--config", str(bad)] if chosen_by == "--config" else []
    out = _run(tmp_path, "agent", "config", "--show", *args, **env)
    assert out.exit_code == 2, out.output
    said = _flat(out.output)
    assert "config --show" not in said and "Traceback" not in said
    if chosen_by == "KVCTL_CPU":
        assert "not a size: 'lots'" in said and "hint: fix or unset KVCTL_CPU" in said
    else:
        assert "is not valid TOML" in said and f"hint: fix {bad}" in said


def test_doctor_does_not_call_another_json_api_an_agent_that_is_up(tmp_path: Path) -> None:
    """A node URL where another JSON API answers /v1/health was "ok: up, version N/A"."""
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with answering_url(200, b'{"foo": 1}', "application/json") as url:
        assert _run(tmp_path, "fleet", "add-dc", "fra", "--db", db).exit_code == 0
        add = ["fleet", "add-node", "js", "--dc", "fra", "--agent-url", url, "--db", db]
        assert _run(tmp_path, *add).exit_code == 0
        report = json.loads(_run(tmp_path, "doctor", "--db", db, "--json").stdout)
    check = next(c for c in report["checks"] if c["name"] == "agent js")
    assert check["status"] == "fail", check
    assert "did not answer as a kvctl agent does (no status or name)" in check["detail"], check
