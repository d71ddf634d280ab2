"""Link probes that match the emulation: which configured link's emulated delay a probe of a
target includes (``emulated_source``), and that ``probe_link`` waits it for real on every round
trip and labels the figures ``emulated`` (against an in-process data plane)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvctl.agent.api import create_app
from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.remote import open_remote
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings, LinkSpec
from kvctl.cli.agent import probe_rtt_text
from kvctl.remote.federation import RemoteTiers
from kvctl.remote.links import EmulatedDelay
from kvctl.remote.probe import emulated_source, probe_link
from tests.functional.agents import closed_port
from tests.unit.test_agent_api import _runtime, _settings

DELAY_A_S = 0.005
DELAY_POOL_S = 0.002
PEER_A = "127.0.0.1:7101"
PEER_B = "10.0.0.2:7071"
POOL = "127.0.0.1:7200"


def _with_links(settings: AgentSettings, peers: tuple[tuple[str, str], ...]) -> AgentSettings:
    """Peers a (delayed), b (no delay) and a kvctl pool agent (delayed), as --peer/--link give."""
    return dataclasses.replace(
        settings,
        peers=peers,
        pool=f"kvctl://{POOL}",
        links=(
            LinkSpec("a", delay_seconds=DELAY_A_S),
            LinkSpec("b", rtt_seconds=0.01),
            LinkSpec("pool", delay_seconds=DELAY_POOL_S),
        ),
    )


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[RemoteTiers]:
    rt = _runtime(_settings(tmp_path), tmp_path)
    settings = _with_links(rt.settings, (("a", PEER_A), ("b", PEER_B)))
    tiers = open_remote(settings, rt.store, emit=lambda _event: None)
    yield tiers
    tiers.close()
    rt.close()


def _name(remote: RemoteTiers, *, target: str, name: str | None = None) -> str | None:
    found = emulated_source(remote.sources, target=target, name=name)
    return None if found is None else found.name


def test_a_peer_is_found_by_name_or_by_its_configured_address(remote: RemoteTiers) -> None:
    by_name = emulated_source(remote.sources, target="192.0.2.9:7071", name="a")
    assert by_name is not None and by_name.name == "a"
    # the very object the agent's fetches over the link wait on, not a second figure
    assert by_name.delay is next(s.delay for s in remote.peers if s.name == "a")
    assert by_name.delay.delay_s == DELAY_A_S
    assert _name(remote, target=PEER_A) == "a"
    assert _name(remote, target=f"kvctl://{PEER_A}") == "a"


def test_the_name_wins_over_the_address(remote: RemoteTiers) -> None:
    # the fleet may spell the host differently from the peer's configured address
    assert _name(remote, target="localhost:9999", name="a") == "a"
    assert _name(remote, target=PEER_A, name="b") is None  # b has no delay: measured


def test_the_pool_is_found_by_address_only(remote: RemoteTiers) -> None:
    assert _name(remote, target=POOL) == "pool"
    assert _name(remote, target="192.0.2.9:7071", name="pool") is None


def test_unconfigured_or_undelayed_targets_are_measured(remote: RemoteTiers) -> None:
    assert _name(remote, target=PEER_B) is None  # configured, but no delay_ms
    assert _name(remote, target="127.0.0.1:7102", name="c") is None
    assert _name(remote, target="127.0.0.1:7101x") is None  # not an address: no match
    assert emulated_source((), target=PEER_A, name="a") is None  # no pool, no peers


@pytest.fixture
def data_plane(runtime: AgentRuntime) -> Iterator[str]:
    """An in-process data plane to probe: HOST:PORT."""
    server = DataPlaneServer(runtime)
    host, port = server.listen_tcp("127.0.0.1", 0)
    server.start()
    yield f"{host}:{port}"
    server.stop()


class CountingSleep:
    """time.sleep for real, counted, so a test sees each wait the probe made."""

    def __init__(self) -> None:
        self.waits_s: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits_s.append(seconds)
        time.sleep(seconds)


def test_every_round_trip_of_an_emulated_probe_waits_the_delay(data_plane: str) -> None:
    sleep = CountingSleep()
    out = probe_link(
        data_plane,
        token="",
        pings=4,
        size_bytes=64 << 10,
        timeout_s=2.0,
        delay=EmulatedDelay(DELAY_A_S, sleep=sleep),
    )
    assert out["ok"], out["error"]
    assert sleep.waits_s == [DELAY_A_S] * (4 + 2)  # each ping, the upload and the download
    assert out["rtt_basis"] == "emulated"
    assert out["emulated_delay_s"] == DELAY_A_S
    # the wait is real and inside the timed span, so no round trip can come in under it
    assert out["rtt_min_s"] is not None and out["rtt_min_s"] >= DELAY_A_S


@pytest.mark.parametrize("delay", [None, EmulatedDelay(0.0)])
def test_a_probe_without_a_delay_is_measured(data_plane: str, delay: EmulatedDelay | None) -> None:
    out = probe_link(data_plane, token="", pings=2, size_bytes=0, timeout_s=2.0, delay=delay)
    assert out["ok"], out["error"]
    assert (out["rtt_basis"], out["emulated_delay_s"]) == ("measured", None)


def test_a_failed_probe_still_says_its_basis() -> None:
    out = probe_link(
        f"127.0.0.1:{closed_port()}",
        token="",
        pings=2,
        size_bytes=0,
        timeout_s=1.0,
        delay=EmulatedDelay(DELAY_A_S),
    )
    assert not out["ok"] and out["rtt_s"] is None
    assert (out["rtt_basis"], out["emulated_delay_s"]) == ("emulated", DELAY_A_S)


def test_the_api_applies_the_link_to_the_named_target(tmp_path: Path, data_plane: str) -> None:
    """POST /v1/probe on an agent whose peer ``a`` is the data plane above, with a delay."""
    rt = _runtime(_settings(tmp_path / "prober"), tmp_path / "prober")
    settings = _with_links(rt.settings, (("a", data_plane),))
    rt.remote = open_remote(settings, rt.store, emit=lambda _event: None)
    try:
        with TestClient(create_app(rt)) as client:
            body = {"target": data_plane, "pings": 2, "bytes": 0}
            by_address = client.post("/v1/probe", json=body).json()
            by_name = client.post("/v1/probe", json={**body, "name": "a"}).json()
            bad_name = client.post("/v1/probe", json={**body, "name": ""})
    finally:
        rt.close()
    for out in (by_address, by_name):
        assert out["ok"], out["error"]
        assert (out["rtt_basis"], out["emulated_delay_s"]) == ("emulated", DELAY_A_S)
        assert out["rtt_min_s"] >= DELAY_A_S
    assert bad_name.status_code == 422 and "name" in bad_name.text


def test_the_cli_shows_the_basis_next_to_the_rtt() -> None:
    assert probe_rtt_text(0.00085, "emulated", 0.0008) == "0.85 ms (emulated +0.80 ms)"
    assert probe_rtt_text(0.00017, "measured", None) == "0.17 ms (measured)"
    assert probe_rtt_text(None, "measured", None) == "N/A (measured)"
