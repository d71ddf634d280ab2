"""A real `kvctl router serve --vllm-events` process reads a vLLM engine's own KV events (a
publisher speaking vLLM's ZMQ protocol, as in test_vllm_events_zmq.py) into its index as
``NODE#vllm``: what the engine stored before the router started comes from the replay socket,
later batches live; a prompt the engine's GPU cache holds is routed to its node; an eviction
takes it out; the feed shows in /v1/index, /metrics and `kvctl router status`; bad flags are
refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.functional.agents import Agent, running_agent
from tests.functional.routers import cli_env, running_router
from tests.functional.test_vllm_events_zmq import TOPIC, FakeVllmPublisher
from tests.functional.waiting import wait_until

CHUNK_TOKENS = 16
BLOCK_TOKENS = 4
TOKEN = "functional-router-vllm-token"


def blocks_stored(tokens: list[int], first_hash: int) -> list[Any]:
    """One vLLM BlockStored event for ``tokens`` from the start of a sequence (hashes from
    ``first_hash`` on, each block's parent the one before)."""
    hashes = list(range(first_hash, first_hash + len(tokens) // BLOCK_TOKENS))
    return ["BlockStored", hashes, None, tokens, BLOCK_TOKENS, None, "GPU"]


@dataclass
class Served:
    url: str
    http: httpx.Client
    pub: FakeVllmPublisher
    agents: dict[str, Agent]


FIRST = list(range(7000, 7000 + 3 * CHUNK_TOKENS))  # stored before the router starts
SECOND = list(range(9000, 9000 + 2 * CHUNK_TOKENS))  # stored while it runs


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("router-vllm")
    (root / "router.token").write_text(TOKEN)
    pub = FakeVllmPublisher(replay=True)
    # kept for the replay socket only, as if published before anyone listened
    pub.publish([blocks_stored(FIRST, 100)], send=False)
    small = ["--cpu", "16MiB", "--disk", "0"]
    try:
        with (
            running_agent(root / "a1", "--name", "a1", "--dc", "fra", *small) as a1,
            running_agent(root / "a2", "--name", "a2", "--dc", "fra", *small) as a2,
        ):
            args = [
                "--token-file", str(root / "router.token"),
                "--agent", f"a1={a1.state.control_url}@fra",
                "--agent", f"a2={a2.state.control_url}@fra",
                "--chunk-tokens", str(CHUNK_TOKENS), "--prefill-tokens-per-s", "10000",
                "--poll-s", "0.05",
                "--vllm-events", f"a1={pub.endpoint},replay={pub.replay_endpoint},topic={TOPIC}",
            ]  # fmt: skip
            with running_router(args, token=TOKEN) as router:
                # routes are refused until the router has reached an agent (slow on a loaded
                # machine: the first route of a test failed with "no node is up" in CI)
                wait_until(
                    "every agent followed",
                    lambda: (
                        sum(x["up"] for x in router.http.get("/v1/index").json()["followers"]) == 2
                    ),
                )
                yield Served(router.url, router.http, pub, {"a1": a1, "a2": a2})
    finally:
        pub.close()


def engines(s: Served) -> list[dict[str, Any]]:
    feeds: list[dict[str, Any]] = s.http.get("/v1/index").json()["engines"]
    return feeds


def route(s: Served, tokens: list[int]) -> dict[str, Any]:
    r = s.http.post(
        "/v1/route", json={"tokens": tokens, "tenant": "acme", "origin_dc": "fra", "explain": True}
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_what_the_engine_stored_before_the_router_started_is_routed_to_its_node(
    served: Served,
) -> None:
    wait_until("the replayed chunks in the index", lambda: engines(served)[0]["live_chunks"] == 3)
    feed = engines(served)[0]
    assert feed["node"] == "a1#vllm" and feed["replay_endpoint"] == served.pub.replay_endpoint
    assert feed["replayed"] >= 1 and feed["unrecovered"] == 0
    d = route(served, FIRST)
    # the engine's GPU cache is a1's own: nothing to fetch, nothing to prefill
    assert d["node"] == "a1" and d["local_chunks"] == 3 and d["prefill_s"] == 0.0
    a2 = next(s for s in d["scores"] if s["node"] == "a2")
    assert a2["local_chunks"] == 0 and a2["pulled_chunks"] == 0  # an engine's GPU is not a source
    assert served.http.get("/v1/index").json()["nodes"].get("a1#vllm") == 3


def test_live_batches_and_evictions_follow_the_engine(served: Served) -> None:
    wait_until("the feed connected", lambda: engines(served)[0]["connected"])

    def arrived() -> bool:  # a PUB socket drops what it sends before the subscription lands
        if engines(served)[0]["messages"] > 0:
            return True
        served.pub.publish([])
        return False

    wait_until("a live batch through", arrived)
    served.pub.publish([blocks_stored(SECOND, 500)])
    wait_until("the live chunks in the index", lambda: route(served, SECOND)["local_chunks"] == 2)
    assert route(served, SECOND)["node"] == "a1"
    # vLLM evicts the second prompt's first block: both its chunks are unusable now
    served.pub.publish([["BlockRemoved", [500], "GPU"]])
    wait_until("the eviction applied", lambda: route(served, SECOND)["indexed_chunks"] == 0)
    metrics = served.http.get("/metrics").text
    assert 'kvctl_index_engine_connected{node="a1#vllm"} 1.0' in metrics
    assert re.search(r'kvctl_index_engine_chunks_removed_total\{node="a1#vllm"\} 2\.0', metrics)
    assert re.search(r'kvctl_index_engine_gaps_total\{node="a1#vllm"\} 0\.0', metrics)


def test_router_status_shows_the_engine_feed(served: Served, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    done = subprocess.run(
        [sys.executable, "-m", "kvctl", "router", "status", "--router", served.url,
         "--token-file", str(token_file)],
        capture_output=True, text=True, env=cli_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "engine events a1#vllm" in done.stdout and "connected" in done.stdout


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("nobody=tcp://127.0.0.1:5557", "'nobody', which is not a node of the fleet"),
        ("a1", "expected NODE=tcp://HOST:PORT"),
        ("a1=tcp://127.0.0.1:5557,color=red", "bad --vllm-events option 'color=red'"),
        ("a1=http://127.0.0.1:5557", "endpoint must be tcp://HOST:PORT"),
    ],
)
def test_bad_vllm_events_flags_are_refused(flag: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvctl", "router", "serve", "--listen", "127.0.0.1:0",
         "--agent", "a1=http://127.0.0.1:9@fra", "--vllm-events", flag],
        capture_output=True, text=True, env=cli_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in " ".join((done.stdout + done.stderr).split())


def test_an_engine_feed_that_cannot_start_is_one_line_and_nothing_is_served() -> None:
    # a path longer than a Unix socket's: ZMQ refuses it only when the feed starts
    endpoint = "ipc:///" + "x" * 200
    done = subprocess.run(
        [sys.executable, "-m", "kvctl", "router", "serve", "--listen", "127.0.0.1:0",
         "--agent", "a1=http://127.0.0.1:9@fra", "--vllm-events", f"a1={endpoint}"],
        capture_output=True, text=True, env=cli_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "serving at" not in done.stdout  # never announced as serving
    assert "cannot connect to vLLM's events" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
