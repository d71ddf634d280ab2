"""Reused KV is right: a transformers Llama prefilled with chunks from a real agent gives the same
logits and greedy tokens as a full prefill, and the agent counts exactly the chunks reused.

Tolerances: chunk-aligned (chunked) prefill is compared bit for bit (fp32 and bf16). A one-pass
prefill is compared with ``FP32_ATOL`` / ``BF16_ATOL``: there a chunk's KV differs from a longer
prefill's in the last bits (sums over masked rows group differently), seen at <= 8e-7 (fp32) and
one bf16 step (7.8e-3) on these models.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvctl.engines.hf import CachedLM  # noqa: E402
from kvctl.engines.models import build_model  # noqa: E402
from kvctl.errors import InvalidArgument  # noqa: E402
from tests.functional.agents import Agent, running_agent  # noqa: E402
from tests.functional.hung import (  # noqa: E402
    HANG_GUARD_S,
    SOCKET_TIMEOUT_S,
    guarded,
    stopped,
)
from tests.functional.waiting import wait_until  # noqa: E402
from tests.unit.cuda_marks import needs_cuda  # noqa: E402

CHUNK = 64
FP32_ATOL = 1e-5
BF16_ATOL = 3e-2
VOCAB = 32000


def _config(tmp_path: Path, isolated: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "agent.toml"
    tenants = ", ".join(f'"{t}"' for t in isolated)
    path.write_text(f"[agent]\nchunk_tokens = {CHUNK}\nisolated_tenants = [{tenants}]\n")
    return path


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)]


def _prompts() -> list[tuple[str, list[int]]]:
    """Prompts sharing prefixes (a system prompt, then documents) across two tenants."""
    system = _tokens(200, 1)
    doc = _tokens(150, 2)
    return [
        ("alice", system + _tokens(40, 3)),
        ("bob", system + _tokens(90, 4)),  # shares alice's first 3 chunks
        ("bob", system + doc + _tokens(30, 5)),
        ("alice", system + doc + _tokens(70, 6)),  # shares bob's 5 chunks
        ("alice", system + doc + _tokens(70, 6)),  # the same prompt again: its own chunks
        ("bob", _tokens(CHUNK * 2, 7)),  # exactly two chunks: the last token is computed
        ("bob", [*_tokens(CHUNK * 2, 7), 5]),
        ("alice", [9]),  # shorter than a chunk
    ]


def _expected(owners: dict[tuple[int, ...], str], tenant: str, ids: list[int]) -> tuple[int, int]:
    """Reuse and sharing hits the agent must count: the leading stored chunks, by owner."""
    reuse = sharing = 0
    for j in range((len(ids) - 1) // CHUNK):
        owner = owners.get(tuple(ids[: (j + 1) * CHUNK]))
        if owner is None:
            break
        reuse += owner == tenant
        sharing += owner != tenant
    for j in range(len(ids) // CHUNK):
        owners.setdefault(tuple(ids[: (j + 1) * CHUNK]), tenant)
    return reuse, sharing


def _hits(agent: Agent) -> tuple[int, int]:
    stats = agent.control().stats()["stats"]
    return int(stats["reuse_hits"]), int(stats["sharing_hits"])


@pytest.mark.parametrize(
    ("dtype", "layerwise"), [("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_cache_assisted_prefill_equals_full_prefill_bit_for_bit(
    tmp_path: Path, dtype: str, layerwise: bool
) -> None:
    model = build_model("tiny-llama", dtype=getattr(torch, dtype))
    baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
    owners: dict[tuple[int, ...], str] = {}
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        lm = CachedLM(model, client, chunked_prefill=True, layerwise=layerwise)
        assert lm.chunk_tokens == CHUNK  # taken from the agent
        reused_total = 0
        for tenant, ids in _prompts():
            before = _hits(agent)
            got = lm.prefill(ids, tenant=tenant)
            assert got.fetch_path in ("", "lease")  # same host: straight from the arena
            lm.flush()  # the next prompt expects this one's chunks stored
            want = baseline.prefill(ids)
            reuse, sharing = _expected(owners, tenant, ids)
            assert got.reused_chunks == reuse + sharing
            assert got.reused_tokens == got.reused_chunks * CHUNK < len(ids)
            after = _hits(agent)
            assert (after[0] - before[0], after[1] - before[1]) == (reuse, sharing)
            assert torch.equal(got.logits, want.logits), (tenant, len(ids))
            assert got.next_token == want.next_token
            # the whole cache after the prompt is the full prefill's, bit for bit
            for mine, ref in zip(got.cache.layers, want.cache.layers, strict=True):
                assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
            reused_total += got.reused_chunks
        # the scenario really exercises both kinds of hit
        assert _hits(agent)[0] > 0 and _hits(agent)[1] > 0 and reused_total >= 15
        assert lm.layerwise_redos == 0
        # greedy decoding continues identically from the reused cache
        tenant, ids = _prompts()[3]
        assert lm.generate(ids, 4, tenant="carol") == baseline.generate(ids, 4)


@pytest.mark.parametrize(("dtype", "atol"), [("float32", FP32_ATOL), ("bfloat16", BF16_ATOL)])
def test_one_pass_prefill_matches_within_the_stated_tolerance(
    tmp_path: Path, dtype: str, atol: float
) -> None:
    model = build_model("tiny-llama", dtype=getattr(torch, dtype), seed=3)
    baseline = CachedLM(model, None, chunk_tokens=CHUNK)
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("tcp") as client,
    ):
        lm = CachedLM(model, client)
        reused = 0
        for tenant, ids in _prompts():
            got = lm.prefill(ids, tenant=tenant)
            assert got.fetch_path in ("", "socket")
            assert "copy_seconds" not in got.timings  # nothing came out of a shared arena
            lm.flush()
            want = baseline.prefill(ids)
            assert torch.allclose(got.logits, want.logits, rtol=0, atol=atol)
            assert got.next_token == want.next_token
            reused += got.reused_chunks
        assert reused >= 15
        _, ids = _prompts()[2]
        assert lm.generate(ids, 4, tenant="alice") == baseline.generate(ids, 4)


@contextlib.contextmanager
def _layerwise_engine(
    tmp_path: Path, model: Any, ids: list[int], config: Path | None = None
) -> Iterator[tuple[Agent, CachedLM]]:
    """A ``layerwise`` engine on a real agent (unix socket) that has stored ``ids``' chunks."""
    with (
        running_agent(tmp_path, "--config", str(config or _config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        lm = CachedLM(model, client, chunked_prefill=True, layerwise=True)
        assert lm.prefill(ids).stored_chunks == (len(ids) - 1) // CHUNK
        lm.flush()
        yield agent, lm


def _hooked(model: Any) -> int:
    return sum(len(layer._forward_pre_hooks) for layer in model.model.layers)


def test_layerwise_copies_run_under_the_forward_pass_one_layer_ahead(tmp_path: Path) -> None:
    """With ``layerwise``, a reused prefix's layer is copied just before that layer runs: when
    layer l's attention starts, its KV is in the buffer and the next layer's is not (CPU:
    copies on demand). The hooks are the request's only."""
    model = build_model("tiny-llama", seed=15)
    ids = _tokens(CHUNK * 3 + 5, 19)
    seen: list[tuple[bool, bool]] = []  # per layer: (its KV landed, the next one's landed)
    with _layerwise_engine(tmp_path, model, ids) as (_agent, lm):
        layers = model.model.layers
        buffer = lm.loader.alloc(3, reuse=True)

        def watch(index: int) -> Any:
            def hook(_module: Any, _args: Any) -> None:
                landed = [bool(torch.count_nonzero(buffer[i])) for i in (index, index + 1)]
                seen.append((landed[0], landed[1]))

            return hook

        buffer.zero_()  # what the previous request left there
        handles = [
            layer.self_attn.register_forward_pre_hook(watch(i))
            for i, layer in enumerate(layers[:-1])
        ]
        try:
            got = lm.prefill(ids)
        finally:
            for h in handles:
                h.remove()
        assert got.reused_chunks == 3 and got.timings["copy_seconds"] > 0
        assert got.timings["layerwise"] == 1.0  # the copies are not in fetch_seconds
        assert seen == [(True, False)] * (len(layers) - 1)
        assert _hooked(model) == 0  # none left behind on the (shared) model
        baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
        assert torch.equal(got.logits, baseline.prefill(ids).logits)


def test_a_lease_that_runs_out_under_a_layerwise_copy_costs_a_second_prefill(
    tmp_path: Path,
) -> None:
    """A lease checked once the copies end, not before the forward pass: one that ran out
    while the layers were copied makes the engine prefill again (the bytes read after it ran
    out may be another chunk's); the answer is still right and the first try's time is in
    the time to first token."""
    import time

    model = build_model("tiny-llama", seed=21)
    ids = _tokens(CHUNK * 3 + 5, 23)
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {CHUNK}\nlease_seconds = 0.3\n")
    with _layerwise_engine(tmp_path, model, ids, config) as (agent, lm):
        before = agent.control().stats()["stats"]
        stalls = [0.6]  # the first forward pass stalls past the lease after layer 0's copy

        def stall(_module: Any, _args: Any) -> None:
            if stalls:
                time.sleep(stalls.pop())

        handle = model.model.layers[0].self_attn.register_forward_pre_hook(stall)
        try:
            got = lm.prefill(ids)
        finally:
            handle.remove()
        assert lm.layerwise_redos == 1
        assert got.reused_chunks == 3  # the second try's leases held
        # one request, one lookup: the redo reads again without being counted again
        after = agent.control().stats()["stats"]
        assert after["lookups"] - before["lookups"] == 1
        assert after["hit_chunks"] - before["hit_chunks"] == 3
        assert got.timings["redo_seconds"] >= 0.6 and got.lookup_seconds >= 0.6
        assert got.ttft_seconds >= 0.6
        baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
        assert torch.equal(got.logits, baseline.prefill(ids).logits)


def test_a_layerwise_request_that_fails_mid_forward_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    """An error in the forward pass with layers still to copy: its leases are released, no
    hook stays on the model, and the next request reuses the prefix as usual."""
    model = build_model("tiny-llama", seed=27)
    ids = _tokens(CHUNK * 3 + 5, 29)
    with _layerwise_engine(tmp_path, model, ids) as (agent, lm):

        def broken(_module: Any, _args: Any) -> None:
            raise RuntimeError("out of memory (test)")

        handle = model.model.layers[1].self_attn.register_forward_pre_hook(broken)
        try:
            with pytest.raises(RuntimeError, match="out of memory"):
                lm.prefill(ids)
        finally:
            handle.remove()
        assert _hooked(model) == 0
        wait_until("leases released", lambda: agent.control().stats()["leases"] == 0, 5.0)
        again = lm.prefill(ids)
        assert again.reused_chunks == 3 and lm.layerwise_redos == 0
        baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
        assert torch.equal(again.logits, baseline.prefill(ids).logits)


def test_layerwise_needs_decoder_layers_it_can_find() -> None:
    model = build_model("tiny-llama", seed=1)
    inner = model.model
    del inner.layers  # not where the engine looks for them any more
    with pytest.raises(InvalidArgument, match=r"decoder layers at model\.model\.layers"):
        CachedLM(model, None, chunk_tokens=CHUNK, layerwise=True)


def test_isolated_tenants_reuse_nothing_across_each_other(tmp_path: Path) -> None:
    model = build_model("tiny-llama", seed=5)
    baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
    config = _config(tmp_path, isolated=("acme", "globex"))
    ids = _tokens(CHUNK * 4 + 10, 11)
    with (
        running_agent(tmp_path, "--config", str(config)) as agent,
        agent.data("unix") as client,
    ):
        lm = CachedLM(model, client, chunked_prefill=True)
        assert lm.namespace("acme").root != lm.namespace("globex").root
        assert lm.namespace("acme").root != lm.namespace("shared-tenant").root
        first = lm.prefill(ids, tenant="acme")
        assert (first.reused_chunks, first.stored_chunks) == (0, 4)
        # globex sends the very same prompt: nothing of acme's is reused
        other = lm.prefill(ids, tenant="globex")
        assert other.reused_chunks == 0 and other.stored_chunks == 4
        # a shared tenant gets nothing of either
        assert lm.prefill(ids, tenant="initech").reused_chunks == 0
        # each isolated tenant reuses its own chunks, and those are right
        for tenant in ("acme", "globex"):
            again = lm.prefill(ids, tenant=tenant)
            assert again.reused_chunks == 4
            assert torch.equal(again.logits, baseline.prefill(ids).logits)
        assert _hits(agent) == (8, 0)


def test_an_agent_that_dies_costs_reuse_not_the_answer(tmp_path: Path) -> None:
    model = build_model("tiny-llama", seed=7)
    baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
    ids = _tokens(CHUNK * 3 + 5, 13)
    want = baseline.prefill(ids).logits
    with running_agent(tmp_path / "a", "--config", str(_config(tmp_path))) as agent:
        client = agent.data("tcp")
        lm = CachedLM(model, client, chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        agent.kill9()
        got = lm.prefill(ids)
        assert (got.reused_chunks, got.stored_chunks) == (0, 0)
        assert torch.equal(got.logits, want)
        # a tenant never seen before needs the agent for its policy: still an answer
        assert torch.equal(lm.prefill(ids, tenant="newcomer").logits, want)
        client.close()
    # the agent is back (empty): a new connection, and reuse resumes
    with (
        running_agent(tmp_path / "b", "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        lm.client = client
        assert lm.prefill(ids).stored_chunks == 3
        again = lm.prefill(ids)
        assert again.reused_chunks == 3 and torch.equal(again.logits, want)


def test_reuse_resumes_by_itself_once_the_agent_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent dies and is restarted on the same data dir: the engine connects again by
    itself (a review's engine reused nothing until someone set a new client by hand)."""
    from kvctl.engines import hf

    monkeypatch.setattr(hf, "RECONNECT_INTERVAL_SECONDS", 0.0)
    model = build_model("tiny-llama", seed=7)
    ids = _tokens(CHUNK * 3 + 5, 17)
    data_dir = tmp_path / "a"
    with running_agent(data_dir, "--config", str(_config(tmp_path))) as agent:
        lm = CachedLM(model, agent.data("unix"), chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        agent.kill9()
        assert lm.prefill(ids).reused_chunks == 0  # the connection is lost here
    with running_agent(data_dir, "--config", str(_config(tmp_path))):
        lm.prefill(ids)  # connects again; the new agent's memory is empty: stores again
        assert lm.flush(30)
        again = lm.prefill(ids)
        assert again.reused_chunks == 3
    lm.close()


class _Clock:
    """The engine's monotonic clock, moved by the test: when a try to reach the agent is due is
    then the test's to say, whatever the machine's speed (the tries' own cost is real time)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _engine_clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    from kvctl.engines import hf

    clock = _Clock()
    monkeypatch.setattr(
        hf, "time", SimpleNamespace(monotonic=clock, perf_counter=time.perf_counter)
    )
    return clock


def _tries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("still unreachable" in r.getMessage() for r in caplog.records)


def test_a_hung_agent_is_tried_less_and_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While the agent hangs (each try waits out its HELLO) each failed try doubles the wait
    before the next: a hung agent costs requests a try a minute at most, not one every
    interval."""
    import logging

    from kvctl.engines import hf

    monkeypatch.setattr(hf, "RECONNECT_HELLO_SECONDS", 1.0)  # past REFUSED_TRY_SECONDS
    clock = _engine_clock(monkeypatch)
    model = build_model("tiny-llama", seed=7)
    with running_agent(tmp_path / "a", "--config", str(_config(tmp_path))) as agent:
        client = agent.data("unix")
        lm = CachedLM(model, client, chunked_prefill=True)
        with stopped(agent), caplog.at_level(logging.INFO, logger=hf.log.name):
            client.close()  # the connection lost
            for _ in range(10):
                assert lm.client is not None and lm.client.closed
                clock.now_s += hf.RECONNECT_INTERVAL_SECONDS
        # tries at 0, 1, 3 and 7 intervals (every interval it would be 10)
        assert _tries(caplog) == 4
        lm.close()


def test_a_stopped_agent_is_tried_every_interval_so_reuse_resumes_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent stopped for an upgrade refuses each try at once (no socket): trying it costs a
    request nothing, so it is tried every RECONNECT_INTERVAL_SECONDS however long it stays away,
    and reuse resumes within one interval of its restart. A review's fleet: an agent away
    9.6 s, its engine's waits doubling at each refused try (2, 4, 8 s, up to a minute), reused
    nothing for 4.9 s (63 requests) after the agent was back."""
    import logging

    from kvctl.engines import hf

    clock = _engine_clock(monkeypatch)
    model = build_model("tiny-llama", seed=7)
    ids = _tokens(CHUNK * 3 + 5, 23)
    data_dir = tmp_path / "a"
    with running_agent(data_dir, "--config", str(_config(tmp_path))) as agent:
        lm = CachedLM(model, agent.data("unix"), chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        assert lm.flush(30)
    # stopped cleanly: requests prefill in full, the engine tries the agent every interval
    with caplog.at_level(logging.INFO, logger=hf.log.name):
        for _ in range(6):
            clock.now_s += hf.RECONNECT_INTERVAL_SECONDS
            assert lm.prefill(ids).reused_chunks == 0
    assert _tries(caplog) == 6  # one a request (doubling waits: 3)
    with running_agent(data_dir, "--config", str(_config(tmp_path))):
        clock.now_s += hf.RECONNECT_INTERVAL_SECONDS
        lm.prefill(ids)  # connects again at once
        assert lm.client is not None and not lm.client.closed
        assert lm.flush(30)
        assert lm.prefill(ids).reused_chunks == 3
    lm.close()


def test_requests_while_the_agent_is_away_do_not_call_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the connection is lost, until a try to reach the agent again succeeds, requests
    prefill in full without calling it: the loss is one warning and one failure, not a warning
    and a failure (and a writer's warning) per request. A review's engine, 20 requests a
    second through a 10 s restart, logged two warnings a request and counted each request in
    ``agent_failures`` (111 of 116)."""
    import logging

    _engine_clock(monkeypatch)  # not moved: after the first, no try is due
    model = build_model("tiny-llama", seed=7)
    ids = _tokens(CHUNK * 3 + 5, 31)
    want = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True).prefill(ids).logits
    with running_agent(tmp_path / "a", "--config", str(_config(tmp_path))) as agent:
        lm = CachedLM(model, agent.data("unix"), chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        assert lm.flush(30)
    with caplog.at_level(logging.INFO):
        for _ in range(10):
            got = lm.prefill(ids)
            assert got.reused_chunks == 0 and torch.equal(got.logits, want)
        assert lm.flush(30)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "lookup" in warned[0], warned  # the first request's, lost
    assert lm.agent_failures == 1
    assert _tries(caplog) == 1
    lm.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_hung_agent_costs_one_request_a_short_deadline_then_reuse_resumes(
    tmp_path: Path,
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An agent alive and accepting but answering nothing (SIGSTOP) costs the next request its
    calls' deadline, not the connection's socket timeout (set to 10 minutes here: only the
    engine's own deadline can end the wait): the request recomputes the right answer, the
    failure is counted, the connection dropped; once the agent answers again the engine
    connects by itself and reuses its chunks."""
    import logging

    from kvctl.engines import hf

    monkeypatch.setattr(hf, "RECONNECT_INTERVAL_SECONDS", 0.1)
    model = build_model("tiny-llama", seed=7)
    ids = _tokens(CHUNK * 3 + 5, 29)
    want = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True).prefill(ids).logits
    with running_agent(tmp_path / "a", "--config", str(_config(tmp_path))) as agent:
        client = agent.data(transport, timeout_s=SOCKET_TIMEOUT_S)
        lm = CachedLM(model, client, chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        with stopped(agent), caplog.at_level(logging.WARNING, logger=hf.log.name):
            got = guarded(lambda: lm.prefill(ids))
            assert (got.reused_chunks, lm.agent_failures) == (0, 1)
            assert torch.equal(got.logits, want)
            assert client.closed  # dropped: the engine connects again later, with backoff
            assert any("did not answer" in r.getMessage() for r in caplog.records)
        deadline_s = time.monotonic() + HANG_GUARD_S
        again = lm.prefill(ids)
        while again.reused_chunks == 0 and time.monotonic() < deadline_s:
            time.sleep(0.05)  # the reconnect's backoff
            again = lm.prefill(ids)
        assert again.reused_chunks == 3 and torch.equal(again.logits, want)
        assert lm.client is not client and lm.client is not None and not lm.client.closed
        lm.close()


def test_chunks_the_agent_holds_are_not_stored_again(tmp_path: Path) -> None:
    model = build_model("tiny-llama", seed=9)
    ids = _tokens(CHUNK * 3, 17)  # ends on a chunk boundary: the last chunk is never reused
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("tcp") as client,
    ):
        lm = CachedLM(model, client)
        first = lm.prefill(ids)
        assert (first.reused_chunks, first.stored_chunks) == (0, 3)
        second = lm.prefill(ids)
        assert (second.reused_chunks, second.stored_chunks, second.stored_bytes) == (2, 0, 0)
        puts = agent.control().stats()["stats"]["tiers"]["cpu"]["puts"]
        assert puts == 3


@contextlib.contextmanager
def _reader_of_a_cached_prompt(tmp_path: Path, ids: list[int]) -> Iterator[tuple[Agent, CachedLM]]:
    """An agent holding ``ids``' chunks (stored by one engine), and another engine on the same
    Unix connection that stores nothing (so no later call of its own carries a release)."""
    model = build_model("tiny-llama", seed=9)
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        writer = CachedLM(model, client)
        writer.prefill(ids)
        writer.close()
        reader = CachedLM(model, client, store=False)
        try:
            yield agent, reader
        finally:
            # its loader's tensor over the arena goes now: a test's monkeypatch of the loader
            # leaves it in a reference cycle (the bound method it puts back), which would keep
            # the arena mapped until the garbage collector's next full pass
            reader.close()


def test_a_reusing_request_releases_its_leases_once_its_first_token_is_out(
    tmp_path: Path,
) -> None:
    """The lookup leases what the request reuses; the release is sent after the first token
    (not in the time to it), with nothing else on the connection to carry it."""
    ids = _tokens(CHUNK * 3 + 5, 18)
    with _reader_of_a_cached_prompt(tmp_path, ids) as (agent, reader):
        got = reader.prefill(ids)
        assert (got.reused_chunks, got.fetch_path) == (3, "lease")
        assert got.timings["copy_bytes"] == got.fetched_bytes  # every chunk copied from the arena
        assert 0 < got.timings["copy_seconds"] <= got.fetch_seconds
        wait_until("leases released", lambda: agent.control().stats()["leases"] == 0, 5.0)


def test_a_request_that_fails_after_its_lookup_releases_its_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: an error other than the agent's between the lookup and the first token
    (here the copy out of the arena) left the leases held until the client's next call."""
    ids = _tokens(CHUNK * 3 + 5, 19)
    with _reader_of_a_cached_prompt(tmp_path, ids) as (agent, reader):

        def broken(*_args: object, **_kw: object) -> None:
            raise RuntimeError("out of memory (test)")

        monkeypatch.setattr(reader.loader, "load", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            reader.prefill(ids)
        wait_until("leases released", lambda: agent.control().stats()["leases"] == 0, 5.0)


def test_bad_prompts_and_oversized_chunks_are_refused_clearly(tmp_path: Path) -> None:
    model = build_model("tiny-llama")
    with pytest.raises(InvalidArgument, match="at least one token"):
        CachedLM(model, None).prefill([])
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\nmax_chunk_bytes = 65536\n")
    with (
        running_agent(tmp_path, "--config", str(path)) as agent,
        agent.data("tcp") as client,
        pytest.raises(InvalidArgument, match="max_chunk_bytes"),
    ):
        CachedLM(model, client)


def test_the_engine_reports_its_measured_prefill_rate_to_the_agent(tmp_path: Path) -> None:
    """The agent's fetch-or-recompute plan uses what this engine measured (sent by the writer,
    off the request path), not a model of it."""
    model = build_model("tiny-llama", seed=11)
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        before = agent.control().stats()["fetch_plans"]["prefill"]
        assert not before["basis"].startswith("measured")
        lm = CachedLM(model, client)
        for seed in range(3):
            lm.prefill(_tokens(CHUNK * 3 + 7, 20 + seed))
        lm.prefill(_tokens(CHUNK * 3 + 7, 20))  # a reuse: a sample over a cached prefix
        assert lm.flush(30)
        after = agent.control().stats()["fetch_plans"]["prefill"]
        assert after["basis"].startswith("measured"), after
        lm.close()


@needs_cuda
def test_on_cuda_new_chunks_are_copied_into_a_registered_staging_segment(tmp_path: Path) -> None:
    model = build_model("tiny-llama", dtype=torch.bfloat16).to("cuda")
    baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
    ids = _tokens(CHUNK * 3 + 5, 11)
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
    ):
        lm = CachedLM(model, client, chunked_prefill=True)
        assert lm.prefill(ids).stored_chunks == 3
        # the writer's staging segment is registered with CUDA while the writer has it
        assert lm._staging_reg is not None and lm.staging_register_failures == 0
        again = lm.prefill(ids)
        assert again.reused_chunks == 3
        assert torch.equal(again.logits, baseline.prefill(ids).logits)  # bit for bit
        lm.close()
        assert lm._staging_reg is None  # unregistered before the segment was unmapped


@needs_cuda
def test_on_cuda_layerwise_copies_give_the_same_answer_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers' copies run on the side stream under the forward pass, each layer's compute
    waiting on its event only (no device-wide sync before the forward pass: it would wait for
    every copy): the answer and the whole cache are a full prefill's."""
    model = build_model("tiny-llama", dtype=torch.bfloat16).to("cuda")
    baseline = CachedLM(model, None, chunk_tokens=CHUNK, chunked_prefill=True)
    ids = _tokens(CHUNK * 6 + 5, 25)
    with _layerwise_engine(tmp_path, model, ids) as (_agent, lm):
        monkeypatch.setattr(lm, "_sync", lambda: pytest.fail("synced before the forward pass"))
        want = baseline.prefill(ids)
        for _ in range(3):
            again = lm.prefill(ids)
            assert again.reused_chunks == 6 and again.timings["copy_seconds"] > 0
            assert torch.equal(again.logits, want.logits)
            for mine, ref in zip(again.cache.layers, want.cache.layers, strict=True):
                assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
        assert lm.layerwise_redos == 0
        lm.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_the_arena_is_mapped_when_the_engine_starts_not_in_its_first_request(
    tmp_path: Path, device: str
) -> None:
    """Registering the arena with CUDA pins all of it (seconds for a few GiB): an engine pays it
    when it connects, and its first reuse maps and registers nothing more."""
    model = build_model("tiny-llama", seed=5).to(device)
    ids = _tokens(CHUNK * 3 + 5, 12)
    with (
        running_agent(tmp_path, "--config", str(_config(tmp_path))) as agent,
        agent.data("unix") as client,
        agent.data("tcp") as remote,
    ):
        writer = CachedLM(model, remote)
        assert writer.arena_attach_seconds is None  # no shared memory over TCP
        writer.prefill(ids)
        assert writer.flush(30)
        lm = CachedLM(model, client)
        assert lm.arena_attach_seconds is not None and lm.arena_attach_seconds >= 0
        (arena,) = [buf for buf, _, _ in lm.loader._registered.values()]
        registered = lm.loader._registered[id(arena)][1]
        assert lm.loader.register_failures == 0
        assert lm.prefill(ids).reused_chunks == 3
        # the first reuse read through the mapping made at start
        assert lm.loader._registered[id(arena)][1] is registered
        assert len(lm.loader._registered) == 1
        lm.close()
        writer.close()
