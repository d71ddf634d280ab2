"""A real `kvctl router serve` process, operated: its log at --log-level info is not one line
per poll of every agent; it rereads its inventory (the database, a fleet file) every --reload-s
and on SIGHUP, so a removed node stops getting traffic and a new one is followed, and a reread
that fails changes nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app as cli_app
from tests.functional.agents import closed_port
from tests.functional.routers import running_router
from tests.functional.waiting import wait_until
from tests.unit.test_index_follower import scripted

TOKEN = "serve-ops-token"


def _script() -> dict[str, object]:
    return {"instance": "one", "events": [], "items": []}


def test_info_logs_are_not_one_line_per_poll(tmp_path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with scripted(_script()) as agent_url:
        args = ["--agent", f"a1={agent_url}@fra", "--token-file", str(token_file)]
        args += ["--log-level", "info", "--poll-s", "0.05"]
        with running_router(args, token=TOKEN) as router:
            time.sleep(1.0)  # about 20 polls
            assert router.http.get("/v1/health").json()["followers_up"] == 1
        assert router.proc.stdout is not None
        log = router.early + router.proc.stdout.read()
    assert "a1: resynced" in log  # info from kvctl itself still shows
    assert "HTTP Request" not in log, log[-2000:]


def _fleet_file(nodes: dict[str, str]) -> str:
    """A fleet file of ``nodes`` (name -> agent URL), all in DC fra."""
    text = '[[dcs]]\nname = "fra"\nregion = "eu"\nlocation = "Frankfurt"\n'
    for name, url in nodes.items():
        text += f'[[nodes]]\nname = "{name}"\ndc = "fra"\nagent_url = "{url}"\n'
    return text


def _followed(router) -> list[str]:  # type: ignore[no-untyped-def]
    return [f["node"] for f in router.http.get("/v1/index").json()["followers"]]


def test_a_node_removed_from_the_database_stops_getting_traffic_and_a_new_one_is_followed(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    with scripted(_script()) as a1, scripted(_script()) as a2, scripted(_script()) as b1:
        seed = tmp_path / "fleet.toml"
        seed.write_text(_fleet_file({"a1": a1, "a2": a2}))
        done = CliRunner().invoke(cli_app, ["fleet", "import", str(seed), "--db", db, "--yes"])
        assert done.exit_code == 0, done.output
        args = ["--db", db, "--token-file", str(token_file), "--reload-s", "0.2"]
        with running_router(args, token=TOKEN) as router:
            wait_until("a1 and a2 followed", lambda: _followed(router) == ["a1", "a2"])
            for command in (
                ["fleet", "rm", "node", "a1", "--yes"],
                ["fleet", "add-node", "b1", "--dc", "fra", "--agent-url", b1],
            ):
                done = CliRunner().invoke(cli_app, [*command, "--db", db])
                assert done.exit_code == 0, done.output
            wait_until("a1 removed, b1 added", lambda: _followed(router) == ["a2", "b1"])
            for _ in range(8):  # a round-robin over the fleet never lands on a1
                r = router.http.post("/v1/route", json={"tokens": [1], "policy": "round-robin"})
                assert r.status_code == 200 and r.json()["node"] in ("a2", "b1"), r.text
            status = CliRunner().invoke(
                cli_app,
                ["router", "status", "--router", router.url, "--token-file", str(token_file)],
            )
            assert "inventory: fleet database, read" in status.output, status.output
            assert router.http.get("/v1/stats").json()["inventory"]["changes"] >= 1


def test_sighup_rereads_the_fleet_file_and_a_bad_one_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    fleet = tmp_path / "fleet.toml"
    with scripted(_script()) as a1, scripted(_script()) as b1:
        fleet.write_text(_fleet_file({"a1": a1}))
        args = ["--fleet", str(fleet), "--token-file", str(token_file), "--reload-s", "0"]
        with running_router(args, token=TOKEN) as router:
            wait_until("a1 followed", lambda: _followed(router) == ["a1"])
            fleet.write_text("[[nodes]\nnot toml")
            router.proc.send_signal(signal.SIGHUP)
            wait_until(
                "the bad reread",
                lambda: router.http.get("/v1/stats").json()["inventory"]["errors"] == 1,
            )
            assert _followed(router) == ["a1"]
            fleet.write_text(_fleet_file({"b1": b1}))
            router.proc.send_signal(signal.SIGHUP)
            wait_until("b1 instead of a1", lambda: _followed(router) == ["b1"])
            inventory = router.http.get("/v1/stats").json()["inventory"]
            assert inventory["reload_s"] == 0 and inventory["last_error"] == ""


def test_the_router_closes_a_connection_whose_request_head_trickles_in() -> None:
    """The router serves with the agent's limits: a client sending its request line a byte at a
    time is closed once the head deadline passes (uvicorn alone held it for ever)."""
    import socket

    from kvctl import http_serving
    from kvctl.index.model import EmbeddedIndex
    from kvctl.router.app import RouterServer
    from tests.unit.test_router_service import make_router

    with RouterServer(make_router(EmbeddedIndex()), listen="127.0.0.1:0",
                      header_timeout_s=0.5) as server:  # fmt: skip
        config = server._server.config
        assert config.limit_concurrency == http_serving.MAX_CONNECTIONS
        assert config.backlog == http_serving.BACKLOG
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as slow:
            slow.sendall(b"GET /v1/health HTTP/1.1\r\n")  # and never the rest
            slow.settimeout(5)
            assert slow.recv(1024) == b""  # closed by the router, well before the 5 s


@pytest.mark.parametrize(
    "url",
    [
        "redis://:{secret}@127.0.0.1:{port}/0",
        # redis-py takes the password from the query too: the serving line printed it whole
        "redis://127.0.0.1:{port}/0?password={secret}",
    ],
)
def test_the_index_url_comes_from_the_environment_and_its_password_is_never_shown(
    tmp_path,  # type: ignore[no-untyped-def]
    url: str,
) -> None:
    """A Redis index with a password is given in $KVCTL_INDEX (a flag's value is in every
    process listing); the router names it without the password (its serving line too), and
    uses it."""
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(_fleet_file({"a1": f"http://127.0.0.1:{closed_port()}"}))
    secret = "s3cret-index-pw"
    env = {"KVCTL_INDEX": url.format(secret=secret, port=closed_port())}
    args = ["--fleet", str(fleet), "--token-file", str(token_file)]
    with running_router(args, token=TOKEN, env=env) as router:
        health = router.http.get("/v1/health").json()
        assert health["index_up"] is False  # a Redis index that is not there: not embedded
        assert secret not in json.dumps(health)
        router.proc.send_signal(signal.SIGTERM)
        out, _ = router.proc.communicate(timeout=20)
    out = router.early + out  # the serving line is read before the test's part
    assert "index redis://" in out and "127.0.0.1" in out and secret not in out


def _move(path: Path, to: Path) -> None:
    """``mv fleet.db* to``: the file and SQLite's -wal and -shm beside it."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{to}{suffix}")


def _imported(db: Path, nodes: dict[str, str], tmp_path: Path) -> None:
    """A SQLite fleet database at ``db`` whose nodes are ``nodes`` (`kvctl fleet import`)."""
    seed = tmp_path / f"{db.stem}.toml"
    seed.write_text(_fleet_file(nodes))
    done = CliRunner().invoke(
        cli_app, ["fleet", "import", str(seed), "--db", f"sqlite:///{db}", "--yes"]
    )
    assert done.exit_code == 0, done.output


def test_a_sqlite_fleet_database_moved_away_is_said_gone_and_the_one_put_there_is_read(
    tmp_path: Path,
) -> None:
    """`router serve --db` on a SQLite file moved away (`mv fleet.db* /backup/`), then another
    put at its path (a backup restored with mv), as the collector, the dashboard and `kvctl top`
    follow theirs (kvctl.db.engine.follow_the_path). Before, its pooled connection reread the
    moved file, an inventory no longer at the path, and never the file put there: the router
    went on routing to nodes the fleet's database no longer named. Now a reread with no file
    at the path fails on one line saying so, the router keeping its nodes and creating no
    file there, and the file put at the path is read at the next reread."""
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    path, away = tmp_path / "fleet.db", tmp_path / "backup"
    away.mkdir()
    with scripted(_script()) as a1, scripted(_script()) as a2, scripted(_script()) as b1:
        _imported(path, {"a1": a1, "a2": a2}, tmp_path)
        _imported(tmp_path / "restored.db", {"b1": b1}, tmp_path)
        args = ["--db", f"sqlite:///{path}", "--token-file", str(token_file), "--reload-s", "0.2"]
        with running_router(args, token=TOKEN) as router:
            wait_until("a1 and a2 followed", lambda: _followed(router) == ["a1", "a2"])

            def inventory() -> dict[str, Any]:
                stats: dict[str, Any] = router.http.get("/v1/stats").json()["inventory"]
                return stats

            _move(path, away / "fleet.db")
            wait_until("two rereads failed", lambda: inventory()["errors"] >= 2)
            gone = f"no database file at {path} (moved or deleted while the router ran)"
            assert inventory()["last_error"] == f"DatabaseError: {gone}", inventory()
            assert _followed(router) == ["a1", "a2"]  # what it had, kept
            assert not path.exists(), "the router created a database file at the path"

            _move(tmp_path / "restored.db", path)
            wait_until("b1 instead of a1 and a2", lambda: _followed(router) == ["b1"])
            assert inventory()["last_error"] == ""
            router.proc.send_signal(signal.SIGTERM)
            out, _ = router.proc.communicate(timeout=20)
    said = [line for line in out.splitlines() if "rereading the inventory" in line]
    assert said and all(line.endswith(gone) for line in said), said
    assert "sqlalche.me" not in out and "[SQL" not in out, out[-2000:]
