"""`kvctl bench remote` for real, small: the pool tier on the machine's Redis and a pull from one
real peer agent. The JSON's shape and its internal consistency, the bytes read back intact, the
agent gone and no key left under the run's prefix afterwards (also when interrupted), the CLI,
and bad input. No assertion on speed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvctl.agent.daemon import pid_alive
from kvctl.bench import remote as bench_remote
from kvctl.bench.remote import parse_rtts_ms, render_remote_bench, run_remote_bench
from kvctl.errors import InvalidArgument
from tests.functional.agents import closed_port

SIZE, BYTES, PULL_CHUNKS, PULL_SIZE = 1 << 20, 8 << 20, 8, 1 << 20
RTTS_S = (0.0, 0.002)
SMALL = dict(
    bytes_per_size=BYTES,
    repeats=1,
    pull_chunks=PULL_CHUNKS,
    pull_chunk_bytes=PULL_SIZE,
    rtts_s=RTTS_S,
)
SMALL_ARGS = [
    "--sizes", "1MiB", "--bytes-per-size", "8MiB", "--repeats", "1",
    "--pull-chunks", "8", "--pull-chunk-size", "1MiB", "--rtts-ms", "0,2",
]  # fmt: skip


def _prefix() -> str:
    return f"kvctl-test-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _keys_under(url: str, prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return [
            name
            for pattern in (f"{prefix}:*", "{" + prefix + "}:*")
            for name in client.scan_iter(match=pattern, count=1000)
        ]
    finally:
        client.close()


@contextlib.contextmanager
def _deleted_after(url: str, prefix: str) -> Iterator[None]:
    """Whatever a failing test left under ``prefix`` goes (the shared server is never flushed)."""
    try:
        yield
    finally:
        names = _keys_under(url, prefix)
        if names:
            client = redis.Redis.from_url(url, socket_timeout=5)
            try:
                client.delete(*names)
            finally:
                client.close()


@pytest.fixture(scope="module")
def run(redis_url: str) -> Iterator[tuple[dict[str, Any], str, str]]:
    prefix = _prefix()
    with _deleted_after(redis_url, prefix):
        said: list[str] = []
        result = run_remote_bench(
            [SIZE], redis_url=redis_url, prefix=prefix, progress=said.append, **SMALL
        )
        result["_progress"] = said
        yield result, redis_url, prefix


def test_pool_figures_beside_the_plain_pipeline(run: tuple[dict[str, Any], str, str]) -> None:
    r, url, prefix = run
    assert r["benchmark"] == "remote"
    for key in ("kvctl_version", "python", "platform", "cpu_count"):
        assert r[key]
    assert r["repeats"] == 1 and r["elapsed_seconds"] > 0
    pool = r["pool"]
    assert pool["redis_url"] == url and pool["prefix"] == prefix
    assert pool["redis_version"] and pool["batch_chunks"] == 8
    assert pool["capacity_bytes"] >= BYTES  # one sample fits: nothing evicted while timing
    [row] = pool["sizes"]
    assert (row["chunk_bytes"], row["chunks"], row["bytes"]) == (SIZE, BYTES // SIZE, BYTES)
    assert row["mismatches"] == 0
    for op in ("put", "get"):
        fig = row[op]
        assert fig["kvctl_bytes_per_s"] > 0 and fig["redis_pipeline_bytes_per_s"] > 0
        assert math.isclose(
            fig["ratio"], fig["kvctl_bytes_per_s"] / fig["redis_pipeline_bytes_per_s"]
        )
        assert fig["kvctl_samples_bytes_per_s"] == [fig["kvctl_bytes_per_s"]]
        assert fig["redis_pipeline_samples_bytes_per_s"] == [fig["redis_pipeline_bytes_per_s"]]
    # the same pool read over one connection, beside the split one
    get = row["get"]
    assert pool["streams"] == get["streams"] >= 1 and pool["min_stream_bytes"] > 0
    assert get["kvctl_one_stream_samples_bytes_per_s"] == [get["kvctl_one_stream_bytes_per_s"]]
    assert math.isclose(
        get["streams_speedup"], get["kvctl_bytes_per_s"] / get["kvctl_one_stream_bytes_per_s"]
    )
    assert r["notes"] and all(isinstance(n, str) for n in r["notes"])
    json.dumps({k: v for k, v in r.items() if k != "_progress"}, allow_nan=False)


def test_peer_pull_beside_its_lower_bound(run: tuple[dict[str, Any], str, str]) -> None:
    p = run[0]["peer_pull"]
    assert (p["chunks"], p["chunk_bytes"], p["bytes"]) == (
        PULL_CHUNKS,
        PULL_SIZE,
        PULL_CHUNKS * PULL_SIZE,
    )
    assert p["ping_rtt_s"] > 0 and p["bandwidth_bytes_per_s"] > 0
    assert p["raw_tcp_bytes_per_s"] > 0 and p["client_buffers_alloc_s"] >= 0
    assert math.isclose(
        p["bandwidth_vs_raw_tcp_ratio"], p["bandwidth_bytes_per_s"] / p["raw_tcp_bytes_per_s"]
    )
    assert p["rtt_basis"] == "emulated"
    assert [run["emulated_rtt_s"] for run in p["runs"]] == list(RTTS_S)
    for run_ in p["runs"]:
        rtt_s = run_["emulated_rtt_s"]
        assert run_["rtt_basis"] == "emulated"
        assert run_["mismatches"] == 0
        assert 0 < run_["time_to_first_chunk_s"] <= run_["time_to_last_byte_s"]
        assert run_["lower_bound_s"] >= rtt_s
        assert math.isclose(
            run_["lower_bound_s"],
            p["ping_rtt_s"] + rtt_s + p["bytes"] / p["bandwidth_bytes_per_s"],
        )
        assert run_["first_chunk_lower_bound_s"] <= run_["lower_bound_s"]
        assert math.isclose(run_["ratio"], run_["time_to_last_byte_s"] / run_["lower_bound_s"])
        # the emulated wait is inside the timed span
        assert run_["time_to_first_chunk_s"] >= rtt_s
        assert run_["time_to_last_byte_s"] >= rtt_s
    assert p["runs"][1]["time_to_last_byte_s"] >= 0.002
    st = p["streams"]
    assert st["streams"] > 1 and st["mismatches"] == 0
    one_s, many_s = st["one_stream_time_to_last_byte_s"], st["streams_time_to_last_byte_s"]
    assert st["samples_one_stream_time_to_last_byte_s"] == [one_s]
    assert st["samples_streams_time_to_last_byte_s"] == [many_s]
    assert math.isclose(st["one_stream_bytes_per_s"], p["bytes"] / one_s)
    assert math.isclose(st["streams_bytes_per_s"], p["bytes"] / many_s)
    assert math.isclose(st["speedup"], one_s / many_s)
    # the one-connection bound is the runs' bound at 0 ms; the split one uses parallel PROBEs
    assert math.isclose(st["lower_bound_s"], p["runs"][0]["lower_bound_s"])
    assert math.isclose(
        st["streams_lower_bound_s"],
        p["ping_rtt_s"] + p["bytes"] / st["parallel_probe_bandwidth_bytes_per_s"],
    )
    assert math.isclose(st["one_stream_ratio"], one_s / st["lower_bound_s"])
    assert math.isclose(st["streams_ratio"], many_s / st["streams_lower_bound_s"])


def test_nothing_is_left_behind(run: tuple[dict[str, Any], str, str]) -> None:
    r, url, prefix = run
    assert not pid_alive(r["peer_pull"]["peer_pid"])
    assert _keys_under(url, prefix) == []
    said = r["_progress"]
    assert said[0].startswith("pool:") and said[-1] == "peer pull: stopping the agent"


def test_the_tables_for_people(run: tuple[dict[str, Any], str, str]) -> None:
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_remote_bench(run[0]))
    text = console.export_text()
    for words in ("redis pipeline", "mismatches", "emulated RTT", "lower bound", "2 ms"):
        assert words in text


def test_an_interrupted_run_stops_the_agent_and_deletes_its_keys(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _prefix()
    real_count_bad = bench_remote._count_bad
    seen_keys: list[bytes] = []

    def interrupted_while_reading(*args: Any) -> int:
        seen_keys.extend(_keys_under(redis_url, prefix))
        raise KeyboardInterrupt  # Ctrl-C with chunks in Redis

    with _deleted_after(redis_url, prefix):
        monkeypatch.setattr(bench_remote, "_count_bad", interrupted_while_reading)
        with pytest.raises(KeyboardInterrupt):
            run_remote_bench([SIZE], redis_url=redis_url, prefix=prefix, **SMALL)
        assert seen_keys  # the interrupt came with keys written
        assert _keys_under(redis_url, prefix) == []

        monkeypatch.setattr(bench_remote, "_count_bad", real_count_bad)
        real_peer_agent = bench_remote._peer_agent
        pids: list[int] = []

        @contextlib.contextmanager
        def peer_then_interrupt(*args: Any) -> Iterator[Any]:
            with real_peer_agent(*args) as peer:
                pids.append(peer.pid)
                assert pid_alive(peer.pid)
                yield peer
                raise AssertionError("the bench should have been interrupted")

        def interrupted_pull(*args: Any) -> Any:
            raise KeyboardInterrupt  # Ctrl-C with the agent up

        monkeypatch.setattr(bench_remote, "_peer_agent", peer_then_interrupt)
        monkeypatch.setattr(bench_remote, "_pull", interrupted_pull)
        with pytest.raises(KeyboardInterrupt):
            run_remote_bench([SIZE], redis_url=redis_url, prefix=prefix, **SMALL)
        assert pids and not pid_alive(pids[0])
        assert _keys_under(redis_url, prefix) == []


def _kvctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    return subprocess.run(
        [sys.executable, "-m", "kvctl", "bench", "remote", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_the_command_prints_json(redis_url: str) -> None:
    prefix = _prefix()
    with _deleted_after(redis_url, prefix):
        out = _kvctl(*SMALL_ARGS, "--redis-url", redis_url, "--prefix", prefix, "--json")
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)  # progress went to stderr
        assert r["benchmark"] == "remote" and r["pool"]["sizes"][0]["chunk_bytes"] == SIZE
        assert r["pool"]["sizes"][0]["mismatches"] == 0
        assert [x["mismatches"] for x in r["peer_pull"]["runs"]] == [0, 0]
        assert "peer pull" in out.stderr
        assert not pid_alive(r["peer_pull"]["peer_pid"])
        assert _keys_under(redis_url, prefix) == []


def test_the_password_is_not_printed() -> None:
    # a wrong password on a closed port: the error names the server without the secret
    out = _kvctl("--redis-url", f"redis://:hunter2@127.0.0.1:{closed_port()}/0", "--json")
    assert out.returncode == 2
    assert "not reachable" in out.stderr and "***" in out.stderr
    assert "hunter2" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "0"], "positive chunk size"),
        (["--redis-url", "redis://127.0.0.1:{port}/0"], "not reachable"),
        (["--redis-url", "http://127.0.0.1/0"], "unsupported scheme"),
        (["--rtts-ms", "1,x"], "not a number"),
        (["--repeats", "0"], "repeats"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    out = _kvctl(*[a.format(port=closed_port()) for a in args], "--json")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_parse_rtts_ms() -> None:
    assert parse_rtts_ms("0, 1,5") == [0.0, 0.001, 0.005]
    for bad in ("", ",", "-1", "nan", "inf", "1,a"):
        with pytest.raises(InvalidArgument):
            parse_rtts_ms(bad)
