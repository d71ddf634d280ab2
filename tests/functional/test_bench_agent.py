"""`kvctl bench agent` for real, small: a real agent, the raw-socket reference process, the
miss-path store. The JSON's shape and internal consistency, the reference moving the right
bytes, the CLI. No assertion on speed."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from kvctl.bench.agent import (
    IPERF3_MAX_BLOCK_BYTES,
    RawStreams,
    iperf3_loopback,
    raw_reference,
    render_agent_bench,
    run_agent_bench,
)
from kvctl.cli.main import app

SIZES = [1 << 20, 2 << 20]
BYTES = 8 << 20
PAIRS = (
    ("shm_get", "memcpy", "shm_get_vs_memcpy_ratio"),
    ("shm_put", "memcpy_put", "shm_put_vs_memcpy_ratio"),
    ("tcp_get", "socket", "tcp_get_vs_socket_ratio"),
    ("tcp_put", "socket_put", "tcp_put_vs_socket_ratio"),
    ("miss_store_shm", "miss_store_memcpy", "miss_store_shm_vs_memcpy_ratio"),
    ("miss_store_tcp", "miss_store_memcpy", "miss_store_tcp_vs_memcpy_ratio"),
)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_agent_bench(
        SIZES, bytes_per_size=BYTES, repeats=3, lookup_seconds=0.3, demotion_seconds=0.3
    )


def test_every_figure_sits_beside_its_reference(result: dict[str, Any]) -> None:
    assert result["benchmark"] == "agent" and result["repeats"] == 3
    assert [row["chunk_bytes"] for row in result["results"]] == SIZES
    for row in result["results"]:
        n = BYTES // row["chunk_bytes"]
        assert row["chunks_per_sample"] == n
        samples = row["samples_seconds"]
        for fig, ref, ratio in PAIRS:
            rate, ref_rate = row[f"{fig}_bytes_per_second"], row[f"{ref}_bytes_per_second"]
            assert rate > 0 and ref_rate > 0
            assert math.isclose(row[ratio], rate / ref_rate)
            assert len(samples[fig]) == 3 and len(samples[ref]) >= 3
            # an odd count of samples: the median rate is the bytes over the median time
            assert math.isclose(rate, n * row["chunk_bytes"] / statistics.median(samples[fig]))
        # the reference of the miss path is timed once per sample of each transport
        assert len(samples["miss_store_memcpy"]) == 6
        for transport in ("shm", "tcp"):
            store_s = row[f"miss_store_{transport}_seconds"]
            assert store_s == statistics.median(samples[f"miss_store_{transport}"])
            assert math.isclose(row[f"miss_store_{transport}_bytes_per_second"], BYTES / store_s)
        assert row["miss_store_memcpy_seconds"] == statistics.median(samples["miss_store_memcpy"])
    json.dumps(result, allow_nan=False)


def test_the_notes_say_what_the_references_are(result: dict[str, Any]) -> None:
    notes = " ".join(result["notes"])
    assert "sendmsg" in notes and "recv_exactly" in notes and "memfd" in notes
    assert "put_many" in notes
    iperf3 = result["iperf3"]
    if "skipped" in iperf3:
        assert isinstance(iperf3["skipped"], str) and iperf3["skipped"]
    else:
        assert iperf3["bytes_per_second"] > 0 and iperf3["streams"] == 1
        assert iperf3["block_bytes"] == min(max(SIZES), IPERF3_MAX_BLOCK_BYTES)


def test_the_table_for_people(result: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_agent_bench(result))
    text = console.export_text()
    assert "miss store (shm)" in text and "miss store (tcp)" in text and "socket_put" in text


def test_raw_streams_read_each_span_on_its_own_connection_into_its_place() -> None:
    size = 1 << 20
    with raw_reference(3 * size) as raw:
        streams = RawStreams(raw, 3)
        try:
            assert len({c.sock.getsockname() for c in streams.clients}) == 3
            sink = np.zeros(3 * size + 10, dtype=np.uint8)
            seconds = streams.get_seconds([(0, size), (2 * size, 3 * size)], memoryview(sink))
            assert seconds > 0
            # the spans landed where they were asked to, and nothing else was written
            assert (sink[:size] == 1).all() and (sink[2 * size : 3 * size] == 1).all()
            assert not sink[size : 2 * size].any() and not sink[3 * size :].any()
            with pytest.raises(ValueError, match="4 spans for 3 connections"):
                streams.get_seconds([(0, 1)] * 4, memoryview(sink))
            raw.get_into(0, memoryview(sink)[:16])  # the first connection is still in step
        finally:
            streams.close()


def test_the_raw_reference_moves_the_bytes_asked_for() -> None:
    size = 1 << 20
    with raw_reference(4 * size) as raw:
        for offset in (0, 3 * size, 4 * size - 100):
            out = np.zeros(min(size, 4 * size - offset), dtype=np.uint8)
            raw.get_into(offset, memoryview(out))
            assert (out == 1).all()  # the arena is written with ones, every byte of it
        raw.put(memoryview(np.full(size, 7, dtype=np.uint8)))
        raw.put(memoryview(bytes(3)))  # the stream stays in step after puts of any length
        out = np.zeros(16, dtype=np.uint8)
        raw.get_into(0, memoryview(out))
        assert (out == 1).all()


def test_iperf3_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert iperf3_loopback(1 << 20, 1 << 20) == {"skipped": "iperf3 is not installed"}


def test_cli_json() -> None:
    out = CliRunner().invoke(
        app,
        [
            "bench", "agent", "--sizes", "1MiB", "--bytes-per-size", "4MiB", "--repeats", "1",
            "--lookup-seconds", "0.2", "--json",
        ],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    [row] = r["results"]
    assert row["chunks_per_sample"] == 4 and row["miss_store_shm_seconds"] > 0
    assert "iperf3" in r


@pytest.mark.parametrize(
    ("section", "writer", "moves"),
    [
        ("reads_under_demotion", "put", "demotions_to_disk"),
        ("reads_under_promotion", "lease", "promotions_to_cpu"),
        ("reads_under_read_promotion", "get", "promotions_to_cpu"),
    ],
)
def test_reads_beside_a_writer_that_moves_chunks(
    result: dict[str, Any], section: str, writer: str, moves: str
) -> None:
    under = result[section]
    assert under["writer"] == writer
    assert under["reads_quiet"] > 0 and under["reads_busy"] > 0
    assert under[f"writer_{writer}s_per_second"] > 0
    assert under[moves] > 0  # the writer did move chunks between the tiers
    for phase in ("quiet", "busy"):
        assert 0 < under[f"read_p50_seconds_{phase}"] <= under[f"read_p99_seconds_{phase}"]


def test_lookups_beside_an_operator_flush_and_resize(result: dict[str, Any]) -> None:
    bulk = result["lookups_under_bulk"]
    assert bulk["demotions_to_disk"] >= bulk["cpu_tier_chunks"]  # the flush demoted every chunk
    for phase in ("quiet", "flush", "resize"):
        p = bulk[phase]
        assert p["seconds"] > 0 and p["lookups"] > 0
        assert 0 < p["lookup_p50_seconds"] <= p["lookup_p99_seconds"] <= p["lookup_max_seconds"]


def test_a_leased_lookup_beside_a_plain_one(result: dict[str, Any]) -> None:
    assert result["lookup_lease_chunks"] == 64
    assert result["lookup_p50_seconds"] > 0
    assert result["lookup_lease_p50_seconds"] > 0
