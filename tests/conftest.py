"""Shared fixtures. Unit tests: tests/unit; functional (CLI, subprocess): tests/functional."""

from __future__ import annotations

import gc
import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of
from kvctl.workload.trace import find_default_trace

# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment; rich fixes a
# console's width from COLUMNS when the console is made (when kvctl.cli is imported, after this
# file), so each CLI test's own COLUMNS would be ignored and its output wrapped at 80. Tests
# that want a width set it per call.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# One intra-op thread for torch (and BLAS) in each worker and in the agents and engines the
# tests start: pytest runs a worker per core or more, and a pool of threads per worker spinning
# against the others' cost test_engine_hf 85 s of CPU against 46 s with one, on 2 busy cores.
# Set before anything imports torch; a run that sets it itself keeps its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is alive once the tests are collected (modules, items) lives to the end: frozen out
    of the collector's reach, every full collection of the run has that much less to walk."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """One collection now, finalizers run while pytest still reports what they raise, then the
    survivors frozen. pytest's exit then collects five times more, which in a worker whose heap
    grew over ~1,500 tests was still running 3 s after the session's end (a fresh-clone run's
    stack dump); xdist's gateway, closed by the controller when the last worker is done, sends
    a worker still running 5 s later a SIGINT: a KeyboardInterrupt in the middle of a
    collection, reported as an unraisable exception attributed to no test."""
    gc.collect()
    gc.freeze()


#: the signals kvctl's long-running commands take over (collect, router, agent, demo)
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_handlers_left_as_found() -> Iterator[None]:
    """A test (a command run in-process) that leaves a signal handler of its own fails, and the
    handler is put back: else every later test in that worker gets it (one left SIGINT setting
    an event, and a Ctrl-C test of fan_out saw no KeyboardInterrupt)."""
    before = {sig: signal.getsignal(sig) for sig in _HANDLED}
    yield
    left = {sig: h for sig in _HANDLED if (h := signal.getsignal(sig)) is not before[sig]}
    for sig in left:
        signal.signal(sig, before[sig])
    assert not left, f"the test left signal handlers of its own: {left}"


TINY_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype="float16")


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", TINY_LAYOUT)


def chain(ns: Namespace, n_chunks: int, *, seed: int = 0, chunk_tokens: int = 4) -> list[bytes]:
    """Keys of a request of ``n_chunks`` full chunks whose tokens depend on ``seed``."""
    tokens = [seed * 1_000_003 + i for i in range(n_chunks * chunk_tokens)]
    return keys_for(tokens, ns, chunk_tokens)


def put_chain(store, keys: list[bytes], size: int = 100, tenant: str = "a", **kw) -> None:  # type: ignore[no-untyped-def]
    for k, p in zip(keys, parents_of(keys), strict=True):
        store.put(k, bytes([k[0]]) * size, parent=p, tenant=tenant, **kw)


@pytest.fixture
def shared_trace():  # type: ignore[no-untyped-def]
    path = find_default_trace()
    if path is None:
        pytest.skip("shared Mooncake trace not found at ../shared/data (a fresh machine has none)")
    return path


# --- databases ------------------------------------------------------------------------------
# Tests use the real PostgreSQL on this machine: each test gets its own database, created and
# dropped around it. Outside CI an unreachable server skips those tests; with CI=true it fails.
PG_ADMIN_URL = os.environ.get("KVCTL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def pg_admin():  # type: ignore[no-untyped-def]
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    from kvctl.db.engine import resolve_url

    engine = create_engine(resolve_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc.orig}")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_admin):  # type: ignore[no-untyped-def]
    """URL of a new, empty PostgreSQL database, dropped after the test."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    name = f"kvctl_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(pg_admin.url).set(database=name).render_as_string(hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path):  # type: ignore[no-untyped-def]
    return f"sqlite:///{tmp_path / 'metrics.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request):  # type: ignore[no-untyped-def]
    """An empty database of each backend."""
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture
def db(empty_db_url):  # type: ignore[no-untyped-def]
    """An engine on a freshly migrated database of each backend."""
    from kvctl.db.migrate import open_db

    engine = open_db(empty_db_url, auto_upgrade=True)
    yield engine
    engine.dispose()


# --- Redis / Valkey (the shared remote pool) ------------------------------------------------
# Tests use the Redis on this machine (shared: never flush it; each test gets its own key prefix,
# deleted after it), and throwaway redis-server processes for kill/restart and Cluster tests.
# Outside CI an unreachable server or a missing binary skips those tests; with CI=true it fails.
REDIS_URL = os.environ.get("KVCTL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _redis_binary(name: str) -> str:
    import shutil

    path = shutil.which(name)
    if path is None:
        _redis_unavailable(f"{name} not found on PATH")
    return path  # type: ignore[return-value]


def _free_port(*, bus: bool = False) -> int:
    """A TCP port free on 127.0.0.1 now (and port + 10000 too, for a Cluster node's bus)."""
    import random
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    for _ in range(200):
        port = random.randint(20000, 55000 if bus else 60000)
        if free(port) and (not bus or free(port + 10000)):
            return port
    raise RuntimeError("no free TCP port found")


def _wait_redis(port: int, proc, *, timeout_s: float = 10.0, cluster_ok: bool = False) -> None:  # type: ignore[no-untyped-def]
    import time

    import redis

    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
            try:
                if client.ping() and (
                    not cluster_ok or client.cluster("INFO").get("cluster_state") == "ok"
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} not ready in {timeout_s} s")
            time.sleep(0.05)
    finally:
        client.close()


class RedisServer:
    """A throwaway redis-server: ``kill()`` (SIGKILL) and ``start()`` again on the same port."""

    def __init__(self, binary: str, directory, port: int, *extra: str) -> None:  # type: ignore[no-untyped-def]
        self.binary = binary
        self.directory = directory
        self.port = port
        self.extra = extra
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def start(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory), *self.extra]
        log = open(os.path.join(self.directory, "redis.log"), "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        _wait_redis(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url():  # type: ignore[no-untyped-def]
    """URL of the machine's Redis (KVCTL_TEST_REDIS_URL overrides); pinged once."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        _redis_unavailable(f"Redis not reachable at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url):  # type: ignore[no-untyped-def]
    """A key prefix of this test alone; every key of it is deleted afterwards."""
    import redis

    prefix = f"kvctl-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield prefix
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        for pattern in (f"{prefix}:*", "{" + prefix + "}:*"):
            names = list(client.scan_iter(match=pattern, count=1000))
            for i in range(0, len(names), 1000):
                client.delete(*names[i : i + 1000])
    finally:
        client.close()


@pytest.fixture
def private_redis(tmp_path):  # type: ignore[no-untyped-def]
    """A redis-server of this test alone (free port, no persistence), killed afterwards."""
    server = RedisServer(_redis_binary("redis-server"), tmp_path, _free_port())
    try:
        server.start()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A 3-primary Redis Cluster on free ports; yields "redis+cluster://127.0.0.1:<port>"."""
    import subprocess

    server_bin = _redis_binary("redis-server")
    cli_bin = _redis_binary("redis-cli")
    base = tmp_path_factory.mktemp("redis-cluster")
    nodes: list[RedisServer] = []
    try:
        for _ in range(3):
            port = _free_port(bus=True)
            directory = base / str(port)
            directory.mkdir()
            node = RedisServer(
                server_bin,
                directory,
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(directory / "nodes.conf"),
                "--cluster-node-timeout",
                "5000",
            )
            nodes.append(node)
            node.start()
        create = [cli_bin, "--cluster", "create"]
        create += [f"127.0.0.1:{n.port}" for n in nodes]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        for n in nodes:
            _wait_redis(n.port, n.proc, timeout_s=30, cluster_ok=True)
        yield f"redis+cluster://127.0.0.1:{nodes[0].port}"
    finally:
        for n in nodes:
            n.kill()
