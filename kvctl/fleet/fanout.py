"""One call to many agents at once: concurrent, each with its own deadline, one result per node
whether it answered or not."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvctl.client import AgentClient, AgentError
from kvctl.db.inventory import NodeInfo
from kvctl.store.errors import StoreError

T = TypeVar("T")

#: at most this many agents are asked at the same time
DEFAULT_CONCURRENCY = 32


@dataclass(frozen=True, slots=True)
class NodeResult(Generic[T]):
    node: NodeInfo
    ok: bool
    value: T | None
    error: str | None
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node.name,
            "dc": self.node.dc,
            "ok": self.ok,
            "result": self.value,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }


def fan_out(
    nodes: Sequence[NodeInfo],
    call: Callable[[AgentClient], T],
    *,
    token: str | None = None,
    timeout_s: float = 5.0,
    concurrency: int = DEFAULT_CONCURRENCY,
    on_result: Callable[[NodeResult[T]], None] | None = None,
) -> list[NodeResult[T]]:
    """Run ``call`` against each node's agent concurrently; results come back in the order of
    ``nodes``. ``on_result`` sees each as it finishes (a progress bar). Agent errors (down,
    refused token, 4xx/5xx) are results, not exceptions."""

    def one(node: NodeInfo) -> NodeResult[T]:
        t0 = time.perf_counter()
        client = AgentClient(node.agent_url, token=token, timeout_s=timeout_s)
        try:
            value = call(client)
        except (AgentError, StoreError, OSError) as exc:
            return NodeResult(node, False, None, str(exc), time.perf_counter() - t0)
        finally:
            client.close()
        return NodeResult(node, True, value, None, time.perf_counter() - t0)

    results: dict[int, NodeResult[T]] = {}
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(nodes)))) as pool:
        futures = {pool.submit(one, node): i for i, node in enumerate(nodes)}
        for fut in as_completed(futures):
            res = fut.result()
            results[futures[fut]] = res
            if on_result is not None:
                on_result(res)
    return [results[i] for i in range(len(nodes))]
