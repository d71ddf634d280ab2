"""Fetch or recompute over a real agent's own tiers: a slow disk is recomputed while the cpu prefix
is taken (and only the taken chunks count as hits), engine-reported prefill samples make the
basis measured and, with attention, make a long chain's disk chunks worth reading; bad RATES
frames are refused and the connection stays usable."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.settings import DEFAULT_MODELS
from kvctl.client import DataClient, RequestError
from kvctl.store.keys import Namespace, keys_for, parents_of
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    MAX_RATE_SAMPLES,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
)
from tests.functional.agents import Agent, payload, running_agent

NS = Namespace(DEFAULT_MODELS[0].id, DEFAULT_MODELS[0].layout)
TOKENS = 256  # the agent's chunk size
CHUNK_BYTES = 4096
#: 4 KiB at 100 kB/s: 41 ms a chunk from disk, against ~8 ms to prefill 256 tokens (modeled:
#: llama-3.1-8b on an h100)
SLOW_DISK_BYTES_PER_S = 1e5


def chain(n: int, seed: int) -> list[bytes]:
    return keys_for([seed * 1_000_003 + i for i in range(TOKENS * n)], NS, TOKENS)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\ndisk_read_bytes_per_second = {SLOW_DISK_BYTES_PER_S}\n")
    with running_agent(
        tmp_path / "a", "--config", str(config), "--cpu", "8MiB", "--disk", "64MiB"
    ) as a:
        yield a


def put_cpu_then_disk(agent: Agent, n_cpu: int, n_disk: int, seed: int) -> list[bytes]:
    keys = chain(n_cpu + n_disk, seed)
    with agent.data() as d:
        outs = d.put_many(
            [(k, payload(k, CHUNK_BYTES)) for k in keys],
            tenant="t",
            parents=parents_of(keys),
            tokens=TOKENS,
        )
        assert {o.status for o in outs} == {"stored"}
        if n_disk:
            agent.control().move([k.hex() for k in keys[n_cpu:]], "disk")
        assert d.exists(keys, tenant="t") == ["cpu"] * n_cpu + ["disk"] * n_disk
    return keys


def plan_events(agent: Agent) -> list[dict[str, Any]]:
    events = agent.control().events(after=0)["events"]
    return [e for e in events if e["type"] == "fetch_plan"]


def test_a_slow_disk_is_recomputed_and_the_cpu_prefix_taken(agent: Agent) -> None:
    keys = put_cpu_then_disk(agent, 3, 5, seed=1)
    before = agent.control().stats()["stats"]
    with agent.data() as d:
        res = d.lookup(keys, tenant="t")
    assert res.matched_chunks == 3 and res.matched_tokens == 3 * TOKENS
    assert list(res.locations) == ["cpu"] * 3 + ["disk"] * 5  # found, but not worth reading
    stats = agent.control().stats()
    after = stats["stats"]
    # hits only for the chunks the plan took
    assert after["hit_chunks"] - before["hit_chunks"] == 3
    assert after["tiers"]["disk"]["hits"] == before["tiers"]["disk"]["hits"]
    plans = stats["fetch_plans"]["plans"]
    assert plans["fetched_by_tier"] == {"cpu": 3}
    assert plans["recomputed_by_tier"] == {"disk": {"slower-than-recompute": 5}}
    assert plans["saved_s"] > 0
    # the decision, its reason and its inputs, in the event stream
    (event,) = plan_events(agent)
    assert event["reason"] == "fetch" and event["fetch"] == 3 and event["recompute"] == 5
    disk = event["links"]["disk"]
    assert disk["source"] == "configured" and disk["bandwidth_bytes_per_s"] == SLOW_DISK_BYTES_PER_S
    assert event["prefill"]["basis"].startswith("modeled: llama-3.1-8b on h100")
    assert event["prefill"]["kind"] == "modeled" and event["device"]["source"] == "unreported"
    metrics = agent.control().metrics_text()
    assert 'kvctl_plan_recomputed_chunks_total{reason="slower-than-recompute",tier="disk"} 5.0' in (
        metrics
    )
    assert 'kvctl_plan_fetched_chunks_total{tier="cpu"} 3.0' in metrics
    assert "kvctl_plan_saved_seconds_total" in metrics
    # /v1/remote answers the plans without remote tiers too
    remote = agent.control().remote()
    assert remote["configured"] is False and remote["plans"]["lookups"] == 1


def test_measured_prefill_with_attention_makes_a_long_chains_disk_chunks_worth_reading(
    agent: Agent,
) -> None:
    keys = put_cpu_then_disk(agent, 0, 16, seed=2)
    with agent.data() as d:
        # modeled (linear) prefill: 16 x 8 ms < 16 x 41 ms of disk reads
        assert d.lookup(keys, tenant="t").matched_chunks == 0
        # the engine measures its prefill: 30 us a token plus attention over the context
        alpha, beta = 3e-5, 1e-7
        samples = [
            (n, a, n * (alpha + beta * (2 * a + n) / 2))
            for n, a in ((256, 0), (1024, 0), (512, 2048), (256, 8192), (2048, 4096))
        ]
        reply = d.report_rates(samples, model=NS.model_id)
        assert reply["kept"] == len(samples) and str(reply["basis"]).startswith("measured")
        assert reply["tokens_per_s"] == pytest.approx(1 / alpha, rel=1e-3)
        assert reply["beta_s_per_token2"] == pytest.approx(beta, rel=1e-3)
        # 4,096 tokens now cost 0.96 s to prefill against 0.66 s of disk reads
        res = d.lookup(keys, tenant="t")
        assert res.matched_chunks == 16
        # the first chunks alone are still not worth it
        assert d.lookup(keys[:2], tenant="t").matched_chunks == 0
    event = plan_events(agent)[1]
    assert event["prefill"]["kind"] == "measured" and event["prefill"]["inputs"]["samples"] == 5
    rates = agent.control().stats()["fetch_plans"]["engine_rates"]
    assert rates["prefill_samples"] == 5 and rates["models"] == {NS.model_id: 1}


def test_a_buggy_engine_or_a_small_model_does_not_set_the_big_models_prefill(
    agent: Agent,
) -> None:
    keys = put_cpu_then_disk(agent, 0, 16, seed=4)
    alpha, beta = 3e-5, 1e-7  # as above: 16 disk chunks are worth reading at this prefill
    shapes = ((256, 0), (1024, 0), (512, 2048), (256, 8192), (2048, 4096))

    def timed(scale: float) -> list[tuple[int, int, float]]:
        return [(n, a, scale * n * (alpha + beta * (2 * a + n) / 2)) for n, a in shapes]

    with agent.data() as d:
        d.report_rates(timed(1.0), model=NS.model_id)
        assert d.lookup(keys, tenant="t").matched_chunks == 16
        # an engine of the same model with a unit bug: every sample ~1e-9 s, rejected
        d.report_rates([(n, a, 1e-9) for n, a in shapes], model=NS.model_id)
        assert d.lookup(keys, tenant="t").matched_chunks == 16
        # a small model on the same agent, 1,000x faster: its own fit, not this model's
        d.report_rates(timed(1e-3), model="tiny-model")
        d.report_rates([], host_to_device_bytes_per_s=5e10, model=NS.model_id)
        assert d.lookup(keys, tenant="t").matched_chunks == 16
    rates = agent.control().stats()["fetch_plans"]["engine_rates"]
    assert rates["prefill_samples_rejected"] == 5 and rates["prefill_model"] == NS.model_id
    assert rates["prefill_samples_in_window"] == 5
    assert rates["prefill_fit"]["alpha_s_per_token"] == pytest.approx(alpha, rel=1e-3)
    tiny = rates["by_model"]["tiny-model"]["prefill_fit"]
    assert tiny["alpha_s_per_token"] == pytest.approx(alpha * 1e-3, rel=1e-3)


def test_an_engine_reported_host_to_device_copy_is_weighed(agent: Agent) -> None:
    keys = put_cpu_then_disk(agent, 4, 0, seed=3)
    with agent.data() as d:
        assert d.lookup(keys, tenant="t").matched_chunks == 4
        d.report_rates([], host_to_device_bytes_per_s=1e4)  # 0.4 s a chunk: absurdly slow
        assert d.lookup(keys, tenant="t").matched_chunks == 0
        d.report_rates([], host_to_device_bytes_per_s=5e10)
        assert d.lookup(keys, tenant="t").matched_chunks == 4
    device = agent.control().stats()["fetch_plans"]["device"]
    assert device["source"] == "engine" and 1e4 < device["bandwidth_bytes_per_s"] <= 5e10


@pytest.mark.parametrize(
    ("samples", "device", "words"),
    [
        ([(256, 0, math.nan)], None, "seconds"),
        ([(256, 0, -0.5)], None, "seconds"),
        ([(256, 0, math.inf)], None, "seconds"),
        ([(0, 0, 0.1)], None, "computed_tokens"),
        ([(1 << 40, 0, 0.1)], None, "computed_tokens"),
        ([(256, 1 << 62, 0.1)], None, "cached_tokens"),
        ([(256, 0, 1e9)], None, "seconds"),
        ([], math.nan, "host_to_device"),
        ([], -5.0, "host_to_device"),
        ([], 1e30, "host_to_device"),
    ],
)
def test_bad_rates_are_refused_cleanly(
    agent: Agent, samples: list[tuple[int, int, float]], device: float | None, words: str
) -> None:
    with agent.data() as d:
        with pytest.raises(RequestError) as err:
            d.report_rates([(256, 0, 0.01), *samples], host_to_device_bytes_per_s=device)
        assert err.value.code == ErrorCode.BAD_REQUEST and words in str(err.value)
        assert d.ping() >= 0  # the connection stays usable
        # nothing of a refused frame is kept, not even its good sample
        assert agent.control().stats()["fetch_plans"]["engine_rates"]["prefill_samples"] == 0


def _raw_call(agent: Agent, meta: bytes) -> tuple[int, bytes]:
    import socket

    address = agent.state.data_tcp
    assert address is not None
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(pack_header(Op.RATES, 7, len(meta)) + meta)
        head = b""
        while len(head) < HEADER_BYTES:
            head += s.recv(HEADER_BYTES - len(head))
        _, _, op, rid, meta_len, _ = HEADER.unpack(head)
        body = b""
        while len(body) < meta_len:
            body += s.recv(meta_len - len(body))
        # still framed: a PING after the refusal is answered
        s.sendall(pack_header(Op.PING, 8, 0))
        pong = s.recv(HEADER_BYTES)
        assert HEADER.unpack(pong)[2] == Op.PING | 0x80
    assert rid == 7
    return op, body


def test_malformed_rates_frames_get_an_error_frame(agent: Agent) -> None:
    too_many = MetaWriter().text("m").f64(0.0).u32(MAX_RATE_SAMPLES + 1).build()
    truncated = MetaWriter().text("m").f64(0.0).u32(2).build() + struct.pack("<QQd", 256, 0, 0.1)
    trailing = MetaWriter().text("m").f64(0.0).u32(0).build() + b"x"
    for meta, words in (
        (too_many, "limit"),
        (truncated, "truncated"),
        (trailing, "unexpected"),
    ):
        op, body = _raw_call(agent, meta)
        assert op == Op.ERROR
        code, message = parse_error(body)
        assert code == ErrorCode.BAD_REQUEST and words in message


def test_a_client_cannot_encode_negative_token_counts(agent: Agent) -> None:
    with agent.data() as d, pytest.raises(ValueError):
        DataClient.report_rates(d, [(-1, 0, 0.1)])
