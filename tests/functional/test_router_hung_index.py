"""A served router whose Redis index hangs (a listener that never answers: a partition, a
stopped VM) answers /v1/health at once, 200 with index_up false, as a liveness probe needs:
a restart would not fix the index, so health must not fail on it, by status or by time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvctl.index.follower import Followers
from kvctl.index.redis_index import RedisIndex
from kvctl.router.app import RouterServer
from tests.functional.agents import closed_port
from tests.unit.test_router_service import make_router

#: the index's own timeout: each of its calls hangs this long
INDEX_TIMEOUT_S = 5.0
#: well under one index timeout, well over the health's own wait for the index
HEALTH_WITHIN_S = 2.5


@pytest.fixture
def hung_index_router() -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # accepts (the kernel's backlog) and never answers
    index = RedisIndex(
        f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=INDEX_TIMEOUT_S
    )
    port = closed_port()
    followers = Followers(index, {"a1": (f"http://127.0.0.1:{port}", None)}, poll_s=60)
    try:
        with RouterServer(make_router(index, followers=followers), listen="127.0.0.1:0") as server:  # type: ignore[arg-type]
            yield server.url
    finally:
        listener.close()


def test_health_answers_at_once_while_the_index_hangs(hung_index_router: str) -> None:
    # Before, health asked the index twice (the followers' status, then index_nodes), each
    # waiting the index's whole timeout: 2 x 5 s here, 4 s with the default 2 s, past a
    # Kubernetes liveness probe's 1 s, so a Redis partition restarted every router.
    with httpx.Client(base_url=hung_index_router, timeout=60) as http:
        for _ in range(2):  # the second while the first's question is still unanswered
            t0 = time.monotonic()
            r = http.get("/v1/health")
            elapsed_s = time.monotonic() - t0
            assert elapsed_s < HEALTH_WITHIN_S, f"/v1/health took {elapsed_s:.1f} s"
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["index_up"] is False and "did not answer" in body["index_error"]
            assert (body["followers"], body["followers_up"]) == (1, 0)


def test_health_answers_while_requests_wait_on_the_hung_index(hung_index_router: str) -> None:
    # agents' holder lookups stuck on the index fill the threadpool sync endpoints run in
    stuck = 60
    with httpx.Client(base_url=hung_index_router, timeout=60) as http:
        lookups = [
            threading.Thread(
                target=lambda: http.post("/v1/index/holders", json={"keys": ["00" * 16]})
            )
            for _ in range(stuck)
        ]
        for t in lookups:
            t.start()
        time.sleep(0.5)  # they reached the index
        t0 = time.monotonic()
        r = http.get("/v1/health")
        elapsed_s = time.monotonic() - t0
        for t in lookups:
            t.join()
    assert r.status_code == 200 and r.json()["index_up"] is False
    assert elapsed_s < HEALTH_WITHIN_S, f"/v1/health took {elapsed_s:.1f} s"
