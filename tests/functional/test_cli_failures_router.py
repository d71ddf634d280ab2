"""The router's clients in the CLI (`kvctl router status`, `kvctl route`, `kvctl replay
--router`) pointed at the wrong thing: a URL without its scheme, a router that wants a token,
something that is not a router, a router that is not there. Each says what is wrong and what to
do, with exit 2 for bad input and 1 for a failure; none blames a running router for being down,
and replay fails before its first request instead of falling back on every one."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import Agent, closed_port, running_agent
from tests.not_an_agent import answering_url

runner = CliRunner()
#: what a router with a token answers a request without it
UNAUTHORIZED = json.dumps({"detail": "missing or wrong bearer token"}).encode()
NOT_FOUND = json.dumps({"detail": "Not Found"}).encode()
#: a hang guard, never a timing claim
GUARD_S = 60.0
#: an inventory name rich would read as markup: the replay's per-node table shows it as it is
NODE = "gpu[/]1"


def _run(*args: str, **env: str | None) -> tuple[int, str]:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    result = runner.invoke(app, list(args), env=clean | {"COLUMNS": "1000"} | env)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_a_router_url_without_its_scheme_is_bad_input(command: list[str]) -> None:
    code, out = _run(*command, "--router", "127.0.0.1:9480")
    assert code == 2, out
    assert "--router must be the router's URL" in out and "'127.0.0.1:9480'" in out
    assert "did not answer" not in out and "start it" not in out
    code, out = _run(*command, KVCTL_ROUTER_URL="localhost")
    assert code == 2 and "$KVCTL_ROUTER_URL must be the router's URL" in out, out


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_a_router_that_wants_a_token_says_where_to_give_it(command: list[str]) -> None:
    with answering_url(401, UNAUTHORIZED, "application/json") as url:
        code, out = _run(*command, "--router", url)
    assert code == 1, out
    assert "401" in out and "--token-file" in out and "$KVCTL_ROUTER_TOKEN" in out


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_a_token_that_cannot_be_sent_says_to_fix_the_token(command: list[str]) -> None:
    # $KVCTL_ROUTER_TOKEN=$(cat token.txt) of a CRLF file: the router was never asked, so the
    # hint must be about the token, not "start it with `kvctl router serve`"
    with answering_url(200, b"{}", "application/json") as url:
        code, out = _run(*command, "--router", url, KVCTL_ROUTER_TOKEN="s3cret-tok\r")
    assert code == 1, out
    assert "cannot be sent" in out and "--token-file" in out and "start it" not in out
    assert "s3cret-tok" not in out


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_something_that_is_not_a_router_is_said_to_be_so(command: list[str]) -> None:
    with answering_url(404, NOT_FOUND, "application/json") as url:  # an agent answers so
        code, out = _run(*command, "--router", url)
    assert code == 1, out
    assert "is that a kvctl router?" in out and "9480" in out


PAGE = b"<!DOCTYPE HTML>\n<html lang='en'>\n<title>Error response</title>\n" + b"<p>x</p>\n" * 50


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_a_web_page_instead_of_a_router_is_one_line(command: list[str]) -> None:
    """A web server's 404 page was quoted whole, 200 characters over many lines."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    with answering_url(404, PAGE) as url:
        result = runner.invoke(app, [*command, "--router", url], env=clean | {"COLUMNS": "1000"})
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint:"), result.output
    assert "the router answered 404: <!DOCTYPE HTML>: is that a kvctl router?" in lines[0]


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_https_at_a_plain_http_port_says_to_give_http(command: list[str]) -> None:
    """It said "did not answer: [SSL: WRONG_VERSION_NUMBER] ..." and "start it"."""
    with answering_url(200, b"{}", "application/json") as url:
        https = url.replace("http://", "https://", 1)
        code, out = _run(*command, "--router", https)
    assert code == 1, out
    assert f"{https} answered in plain HTTP, not TLS" in out and url in out, out
    assert "start it" not in out and "SSL" not in out


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "a b"]])
def test_json_that_is_not_the_routers_answer_is_not_a_router(command: list[str]) -> None:
    """Another JSON API at --router: "a bug in kvctl" (KeyError: 'nodes', 'node')."""
    with answering_url(200, b'{"foo": 1}', "application/json") as url:
        code, out = _run(*command, "--router", url)
    assert code == 1, out
    assert "did not answer as a kvctl router does" in out, out
    assert "did not expect" not in out and "start it" not in out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, str]]:
    """A real agent, and a fleet database holding it as NODE."""
    root = tmp_path_factory.mktemp("replay-router")
    db = f"sqlite:///{root / 'kvctl.db'}"
    with running_agent(root / "a", "--cpu", "64MiB", "--disk", "0") as agent:
        add_node = ["add-node", NODE, "--dc", "fra", "--agent-url", agent.state.control_url]
        assert _run("fleet", "add-dc", "fra", "--db", db)[0] == 0
        assert _run("fleet", *add_node, "--db", db)[0] == 0
        yield agent, db


def _lookups(agent: Agent) -> int:
    with agent.control() as client:
        return int(client.stats()["stats"]["lookups"])


REPLAY = ["replay", "--workload", "chat", "--limit", "20", "--kv-scale", "1/256"]


@pytest.mark.parametrize(
    ("router", "says"),
    [("closed", "did not answer"), ("token", "--token-file")],
)
def test_replay_fails_before_its_first_request_on_a_router_it_cannot_use(
    fleet: tuple[Agent, str], router: str, says: str
) -> None:
    agent, db = fleet
    before = _lookups(agent)
    if router == "closed":
        code, out = _run(*REPLAY, "--db", db, "--router", f"http://127.0.0.1:{closed_port()}")
    else:
        with answering_url(401, UNAUTHORIZED, "application/json") as url:
            code, out = _run(*REPLAY, "--db", db, "--router", url)
    assert code == 1, out
    assert says in out and "fallbacks" not in out
    assert _lookups(agent) == before  # no request was replayed


def _interrupted_replay(db: str, agent: Agent, *extra: str) -> tuple[int, str, str]:
    """`kvctl replay` at a crawl (the second request is due minutes after the first), sent
    SIGINT once the agent has served the first: its exit code, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["COLUMNS"] = "1000"
    before = _lookups(agent)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", *REPLAY, "--db", db, "--speed", "0.001", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + GUARD_S
        # the handler is in place before the header; --json has none: the agent's count says
        if "--json" not in extra:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], GUARD_S)
            assert ready and proc.stdout.readline().startswith(b"replay "), proc.stderr
        while _lookups(agent) == before:
            assert time.monotonic() < deadline and proc.poll() is None, "the replay never asked"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out.decode(), err.decode()


def test_ctrl_c_ends_a_replay_with_the_summary_of_what_ran(fleet: tuple[Agent, str]) -> None:
    agent, db = fleet
    code, out, err = _interrupted_replay(db, agent)
    assert code == 130, out + err
    assert "Traceback" not in err and "stopping after the request in flight" in err
    assert "requests 1 of 20 (stopped early)" in " ".join(out.split()), out
    assert f"{NODE} (fra)" in out and "modeled" in out  # the per-node table, as it is


def test_ctrl_c_ends_a_json_replay_with_valid_json(fleet: tuple[Agent, str]) -> None:
    agent, db = fleet
    code, out, err = _interrupted_replay(db, agent, "--json")
    assert code == 130, out + err
    report = json.loads(out)
    assert report["stopped_early"] is True and report["requests"]["requests"] == 1
    assert report["agents_agree"] is True


@pytest.mark.parametrize(
    ("router", "says", "never"),
    [
        # replay reads no $KVCTL_ROUTER_URL (its --router is always given) ...
        ("closed", "--router", "$KVCTL_ROUTER_URL"),
        # ... and takes its token from $KVCTL_ROUTER_TOKEN only: it has no --token-file
        ("token", "$KVCTL_ROUTER_TOKEN", "--token-file FILE"),
    ],
)
def test_replay_hints_at_what_replay_reads(
    fleet: tuple[Agent, str], router: str, says: str, never: str
) -> None:
    db = fleet[1]
    if router == "closed":
        code, out = _run(*REPLAY, "--db", db, "--router", f"http://127.0.0.1:{closed_port()}")
    else:
        with answering_url(401, UNAUTHORIZED, "application/json") as url:
            code, out = _run(*REPLAY, "--db", db, "--router", url)
    assert code == 1, out
    hint = out.partition("hint:")[2]
    assert says in hint and never not in hint, out
