"""A real Prometheus (Debian's 2.42) scrapes two real agents with deploy/prometheus's rules
loaded, and its recording rules give the hit ratio the agents' own counters give.

Agent fra has no token (loopback needs none); agent ams has one, as an agent off loopback must:
Prometheus scrapes it with the bearer token from a credentials file, and a second job without
the token is refused (up == 0). Lookups through fra's data plane make reuse and sharing hits;
the recording rules, the dashboard's own queries and the clock-skew expression are then read
over Prometheus' HTTP API."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.deploy_queries import RULES, dashboard, panel_queries, rules
from tests.functional.agents import Agent, closed_port, key, payload, running_agent
from tests.prometheus_tools import prometheus_binary

pytestmark = pytest.mark.slow

TOKEN = "prometheus-scrape-test-token"
DEADLINE_S = 60.0
AGENT_ARGS = ["--disk", "0", "--cpu", "16MiB"]


def target(agent: Agent) -> str:
    return urlsplit(agent.state.control_url).netloc


def write_config(tmp: Path, fra: Agent, ams: Agent) -> Path:
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kvctl",
                "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                "static_configs": [
                    {"targets": [target(fra)], "labels": {"dc": "fra"}},
                    {"targets": [target(ams)], "labels": {"dc": "ams"}},
                ],
            },
            {
                "job_name": "kvctl-without-token",
                "static_configs": [{"targets": [target(ams)], "labels": {"dc": "ams"}}],
            },
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def prometheus_server(binary: str, tmp: Path, config: Path) -> Iterator[httpx.Client]:
    """Prometheus on a free loopback port with its storage in ``tmp``; stopped (and killed if
    it will not stop) whatever happens."""
    port = closed_port()
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited {proc.returncode}:\n{log.read_text()}")
                with contextlib.suppress(httpx.TransportError):
                    return client.get("/-/ready").status_code == 200
                return False

            wait_for(ready, "prometheus ready", log)
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_for(check: Callable[[], Any], what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log else ""
            pytest.fail(f"timed out after {DEADLINE_S:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.25)


def query(client: httpx.Client, expr: str) -> list[dict[str, Any]]:
    body = client.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def by_labels(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(k, "") for k in labels): float(r["value"][1]) for r in result}


def close(got: dict[Any, float], want: dict[Any, float]) -> bool:
    return got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want)


@dataclass
class Fleet:
    fra: Agent
    ams: Agent
    prom: httpx.Client


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The two agents scraped by Prometheus, after fra served lookups: 3 chunks stored by tenant
    a; a looks 4 up (3 reuse hits), b twice (6 sharing hits): 9 hits of 12 chunks."""
    binary = prometheus_binary("prometheus")  # skips (or fails in CI) before any agent starts
    tmp = tmp_path_factory.mktemp("prometheus")
    with (
        running_agent(tmp / "fra", *AGENT_ARGS) as fra,
        running_agent(tmp / "ams", *AGENT_ARGS, token=TOKEN) as ams,
    ):
        config = write_config(tmp, fra, ams)
        with prometheus_server(binary, tmp, config) as prom:
            # traffic after a first scrape, so the counters' increase falls inside the window
            wait_for(lambda: query(prom, 'up{job="kvctl", dc="fra"} == 1'), "fra's first scrape")
            keys = [key(i, 77) for i in range(4)]
            with fra.data("tcp") as c:
                c.put_many([(k, payload(k, 4096)) for k in keys[:3]], tenant="a")
                assert c.lookup(keys, tenant="a").matched_chunks == 3
                for _ in range(2):
                    assert c.lookup(keys, tenant="b").matched_chunks == 3
            stats = fra.control().stats()["stats"]
            assert (stats["lookup_chunks"], stats["reuse_hits"], stats["sharing_hits"]) == (
                12,
                3,
                6,
            )
            yield Fleet(fra, ams, prom)


def test_metrics_need_the_token_when_the_agent_has_one(fleet: Fleet) -> None:
    """A loopback agent without a token serves /metrics to anyone; one with a token (required
    off loopback) only with it, and Prometheus scrapes it with the credentials file."""
    assert httpx.get(f"{fleet.ams.state.control_url}/metrics").status_code == 401
    authed = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{fleet.ams.state.control_url}/metrics", headers=authed).status_code == 200
    assert httpx.get(f"{fleet.fra.state.control_url}/metrics").status_code == 200
    want = {("kvctl", "fra"): 1.0, ("kvctl", "ams"): 1.0, ("kvctl-without-token", "ams"): 0.0}
    wait_for(lambda: close(by_labels(query(fleet.prom, "up"), "job", "dc"), want), "the scrapes")


def test_recording_rules_give_the_agents_hit_ratio(fleet: Fleet) -> None:
    prom, node = fleet.prom, (target(fleet.fra), "fra")
    wait_for(
        lambda: close(
            by_labels(
                query(prom, "dc_instance_kind:kvctl_hit_ratio:rate5m"), "instance", "dc", "kind"
            ),
            {(*node, "reuse"): 3 / 12, (*node, "sharing"): 6 / 12},
        ),
        "the reuse and sharing hit ratios",
    )
    # the idle agent (ams) has no ratio at all rather than NaN
    assert close(
        by_labels(query(prom, "dc_instance:kvctl_hit_ratio:rate5m"), "instance", "dc"),
        {node: 9 / 12},
    )
    assert close(by_labels(query(prom, "dc:kvctl_hit_ratio:rate5m"), "dc"), {("fra",): 9 / 12})
    assert close(
        by_labels(query(prom, "dc_kind:kvctl_share_of_hits:rate5m"), "dc", "kind"),
        {("fra", "reuse"): 3 / 9, ("fra", "sharing"): 6 / 9},
    )


def test_every_rule_evaluates_without_error(fleet: Fleet) -> None:
    want = {r.name for r in rules()}

    def evaluated() -> dict[str, tuple[str, str]]:
        groups = fleet.prom.get("/api/v1/rules").json()["data"]["groups"]
        got = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]}
        return got if all(h != "unknown" for h, _ in got.values()) else {}

    got = wait_for(evaluated, "every rule evaluated")
    assert got.keys() == want
    assert all(h == ("ok", "") for h in got.values()), got


def test_agent_clocks_are_read_at_scrape_time(fleet: Fleet) -> None:
    """kvctl_time_seconds against the scrape's timestamp: what KvctlClockSkew measures, tiny
    on one machine (a clock fixed at start would drift by the seconds since)."""
    expr = 'kvctl_time_seconds{job="kvctl"} - timestamp(kvctl_time_seconds{job="kvctl"})'
    skew = wait_for(lambda: by_labels(query(fleet.prom, expr), "dc"), "the clock series")
    assert skew.keys() == {("fra",), ("ams",)}
    assert all(abs(s) < 0.5 for s in skew.values()), skew


def grafana(expr: str) -> str:
    """A dashboard query as Grafana sends it with every DC and node selected."""
    return expr.replace("$dc", ".*").replace("$instance", ".*").replace("$__rate_interval", "5m")


def test_dashboard_queries_run_and_agree_with_the_rules(fleet: Fleet) -> None:
    queries = panel_queries(dashboard())
    for _, expr in queries:
        query(fleet.prom, grafana(expr))  # asserts Prometheus parses and evaluates each one
    by_title = dict(queries)
    ratio = grafana(by_title["Hit ratio, selected nodes"])
    wait_for(lambda: close(by_labels(query(fleet.prom, ratio)), {(): 9 / 12}), "the stat panel")
    split = grafana(by_title["Reuse and sharing, selected nodes"])
    wait_for(
        lambda: close(
            by_labels(query(fleet.prom, split), "kind"),
            {("reuse",): 3 / 12, ("sharing",): 6 / 12},
        ),
        "the reuse and sharing panel",
    )
