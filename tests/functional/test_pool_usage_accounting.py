"""A pool agent's usage (what its HELLO tells the nodes that write to it, and its stats) is the
sum of the chunks it holds, per tier, and never below zero, whatever sequence of writes reaches
it: chunks replaced (a put over a chunk the putter may not see), refused writes (a size that
disagrees with the cached copy, bytes damaged on the way, a disk write that fails), pins, and
evictions, flushes and resizes between them. Random sequences against a real pool agent runtime
(``--role pool``: cpu over disk) and its data plane, checked after every step."""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl import client as client_module
from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.errors import DiskFullError, StoreError
from kvctl.store.tiers.disk import DiskTier

KEYS = [hashlib.blake2b(b"k%d" % i, digest_size=16).digest() for i in range(12)]
TENANTS = ("acme", "globex", "initech")
SIZES = (4096, 8192)


@contextmanager
def pool_agent() -> Iterator[tuple[AgentRuntime, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        config = AgentSettings(
            name="pool",
            role="pool",
            data_dir=str(Path(tmp) / "pool"),
            cpu_bytes=48 << 10,
            disk_bytes=96 << 10,
            shm=False,
        )
        runtime = AgentRuntime.open(config)
        server = DataPlaneServer(runtime)
        host, port = server.listen_tcp("127.0.0.1", 0)[:2]
        server.start()
        try:
            yield runtime, f"{host}:{port}"
        finally:
            server.stop()
            runtime.close()


def check_usage(runtime: AgentRuntime, address: str, step: object) -> None:
    """The pool's usage, as its stats and a new connection's HELLO say it, is its chunks'."""
    store = runtime.store
    with DataClient.connect(address, use_shm=False) as c:
        told: dict[str, dict[str, int]] = c.info["usage"]
    assert told == store.usage(), step
    for tier, u in told.items():
        held = store.entries(tier)
        assert u["used_bytes"] >= 0 and u["chunks"] >= 0, (step, tier, u)
        assert u["chunks"] == len(held), (step, tier, u)
        assert u["used_bytes"] == sum(e.size_bytes for e in held), (step, tier, u)
        assert u["pinned_bytes"] == sum(e.size_bytes for e in held if e.pinned), (step, tier, u)


def run(
    runtime: AgentRuntime, c: DataClient, step: tuple[Any, ...], mp: pytest.MonkeyPatch
) -> None:
    kind, key_indices, tenant, size, isolated, pinned = step
    keys = [KEYS[i] for i in key_indices]
    store = runtime.store
    items = [(k, bytes([i]) * size) for i, k in zip(key_indices, keys, strict=True)]
    if kind == "put":
        c.put_many(items, tenant=tenant, isolated=isolated, pinned=pinned, checksums=True)
    elif kind == "put_damaged":  # every checksum off by one: each chunk refused, none stored
        with mp.context() as m:
            m.setattr(client_module, "chunk_checksum", lambda v: 1)
            outcomes = c.put_many(items, tenant=tenant, isolated=isolated, checksums=True)
        assert {o.status for o in outcomes} == {"corrupt"}
    elif kind == "put_disk_full":  # the disk below fails each write while the step runs

        def full(*_: object, **__: object) -> None:
            raise DiskFullError("No space left on device (the test's)")

        with mp.context() as m:
            m.setattr(DiskTier, "_write_file", full)
            c.put_many(items, tenant=tenant, isolated=isolated, checksums=True)
            store.flush("cpu", demote=True)
    elif kind == "evict":
        store.evict(keys)
    elif kind == "flush":
        store.flush("cpu", demote=isolated)
    elif kind == "resize":
        store.resize("cpu", (32 << 10) if isolated else (48 << 10))
    elif kind == "read":
        c.get_many(keys, tenant=tenant)


step_strategy = st.tuples(
    st.sampled_from(
        ["put"] * 4 + ["put_damaged", "put_disk_full", "evict", "flush", "resize", "read"]
    ),
    st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4, unique=True),
    st.sampled_from(TENANTS),
    st.sampled_from(SIZES),
    st.booleans(),  # isolated (put); demote (flush); shrink (resize)
    st.integers(0, 9).map(lambda n: n == 0),  # pinned, now and then
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(step_strategy, min_size=1, max_size=25))
def test_a_pool_agents_usage_is_the_sum_of_its_chunks_and_never_negative(
    steps: list[tuple[Any, ...]],
) -> None:
    with (
        pool_agent() as (runtime, address),
        pytest.MonkeyPatch.context() as mp,
        DataClient.connect(address, use_shm=False) as c,
    ):
        for n, step in enumerate(steps):
            # refused as a whole (an operator's evict of pins, a resize too small): checked too
            with contextlib.suppress(StoreError):
                run(runtime, c, step, mp)
            check_usage(runtime, address, (n, step))
