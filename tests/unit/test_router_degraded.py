"""The router when its index fails (a Redis outage): /v1/health and /metrics still answer 200
and say index_up 0 (a restart would not fix it, and Prometheus keeps every other series), the
failures are logged at warning, rate-limited, and `kvctl router status` tells a router whose
index is down from one that does not answer. Also: an empty prompt is a 400, not a decision,
and router URLs are shown without their password."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvctl.cli.main import app as cli_app
from kvctl.router.app import RouterServer, create_app
from tests.functional.agents import closed_port
from tests.unit.test_index_follower import _Flaky
from tests.unit.test_router_service import make_router, stored

K = bytes(range(16))


@pytest.fixture
def flaky() -> _Flaky:
    index = _Flaky(shared=True)
    index.apply("a1", stored([K]))
    return index


def test_health_and_metrics_answer_200_while_the_index_is_down(
    flaky: _Flaky, caplog: pytest.LogCaptureFixture
) -> None:
    router = make_router(flaky)  # type: ignore[arg-type]
    http = TestClient(create_app(router))
    metrics = http.get("/metrics").text
    assert "kvctl_index_up 1.0" in metrics and 'kvctl_index_entries{node="a1"} 1.0' in metrics
    flaky.failing = True
    with caplog.at_level(logging.WARNING, logger="kvctl.router"):
        health = http.get("/v1/health")
        assert health.status_code == 200, health.text
        body = health.json()
        assert (body["status"], body["index"], body["index_up"]) == ("ok", "embedded", False)
        assert "connection refused" in body["index_error"]
        r = http.get("/metrics")
        assert r.status_code == 200
        assert "kvctl_index_up 0.0" in r.text and "kvctl_router_decisions" in r.text
        assert "kvctl_index_entries{" not in r.text
        assert http.post("/v1/route", json={"keys": [K.hex()]}).status_code == 503
        assert http.get("/v1/index").status_code == 503  # what agents' IndexClient reads
    warnings = [r for r in caplog.records if "fleet index failed" in r.getMessage()]
    assert len(warnings) == 1  # four failures, one warning (rate-limited)
    flaky.failing = False
    assert http.get("/v1/health").json()["index_up"] is True


def test_index_warnings_are_rate_limited_and_count_what_they_stand_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvctl.router.service import IndexWatch

    now = [0.0]
    watch = IndexWatch(interval_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvctl.router"):
        for _ in range(5):
            watch.failed(RuntimeError("down"))
            now[0] += 10.0  # the 4th, 30 s after the 1st, is logged with the 3 it stands for
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "the fleet index failed (1 times since the last warning): down",
        "the fleet index failed (3 times since the last warning): down",
    ]
    assert watch.failures == 5 and not watch.up


@pytest.mark.parametrize("body", [{"keys": []}, {"tokens": []}, {"keys": [], "prompt_tokens": 0}])
def test_an_empty_prompt_is_a_400_and_not_a_decision(
    flaky: _Flaky, body: dict[str, object]
) -> None:
    router = make_router(flaky)  # type: ignore[arg-type]
    http = TestClient(create_app(router))
    r = http.post("/v1/route", json=body)
    assert r.status_code == 400 and "empty" in r.json()["detail"]
    assert router.stats()["decisions"] == 0
    # a prompt shorter than one chunk has no keys but is a prompt: still routed
    assert http.post("/v1/route", json={"keys": [], "prompt_tokens": 10}).status_code == 200


@pytest.fixture
def served_flaky(flaky: _Flaky, tmp_path: Path) -> Iterator[tuple[str, _Flaky]]:
    with RouterServer(make_router(flaky), listen="127.0.0.1:0") as server:  # type: ignore[arg-type]
        yield server.url, flaky


def test_router_status_says_the_router_is_up_and_its_index_is_not(
    served_flaky: tuple[str, _Flaky],
) -> None:
    url, flaky = served_flaky
    ok = CliRunner().invoke(cli_app, ["router", "status", "--router", url])
    assert ok.exit_code == 0, ok.output
    flaky.failing = True
    down = CliRunner().invoke(cli_app, ["router", "status", "--router", url])
    assert down.exit_code == 1
    assert "is up, but embedded index does not answer" in down.output
    assert "connection refused" in down.output and "kvctl router serve`" not in down.output
    assert "check the index" in down.output


@pytest.mark.parametrize("command", [["router", "status"], ["route", "--text", "hello world"]])
def test_router_urls_are_shown_without_their_password(command: list[str]) -> None:
    url = f"http://ops:hunter2@127.0.0.1:{closed_port()}"
    result = CliRunner().invoke(cli_app, [*command, "--router", url])
    assert result.exit_code == 1
    assert "did not answer" in result.output and "ops:***@127.0.0.1" in result.output
    assert "hunter2" not in result.output
