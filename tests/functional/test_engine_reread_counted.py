"""An engine's read counts each chunk it reuses once. Its leases (``hold`` in ``read_chunks``'
slices, the lookup's lease in ``CachedLM``) count every chunk they find as served (per-chunk
``hit_count`` on /v1/keys, the eviction policy's access); a chunk they could not be copied
from (here: pinned on disk, so not leasable in the arena) ends the leased run, and the engine
reads the rest again over the socket. That re-read counted again every chunk from the blocked
one on: hit_count [1, 1, 2, 2, 2, 2] for six chunks with the third pinned. Now the chunks its
leases counted are read with ``get_into(counted=True)`` (GET_COUNTED) and only those no lease
of the request counted (a later slice's) as an ordinary read: [1] * 6. The /v1/stats hit
counters are counted at lookup and are not moved by the read."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvctl.engines import kvload  # noqa: E402
from kvctl.engines.kvformat import ChunkFormat  # noqa: E402
from kvctl.store.keys import KVLayout  # noqa: E402
from tests.functional.agents import key, payload, running_agent  # noqa: E402
from tests.functional.test_get_counted import _hit_counters, _hit_counts  # noqa: E402
from tests.unit.cuda_marks import needs_cuda  # noqa: E402

# 2 layers x K/V x 2 heads x 64 dims x float32 = 2 KiB a token: 32 tokens are one 64 KiB chunk
FORMAT = ChunkFormat(KVLayout(2, 2, 64, "float32"), 32)
CHUNK_BYTES = 64 << 10
CHUNKS = 6
PINNED = 2  # the third chunk: on disk, not leasable in the arena


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize(
    ("slice_chunks", "from_arena"), [(CHUNKS, 5), (2, 3)], ids=["one-slice", "slices-of-2"]
)
def test_read_chunks_counts_each_chunk_once_past_a_chunk_it_could_not_lease(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    slice_chunks: int,
    from_arena: int,
    device: str,
) -> None:
    """One slice: the hold counted every chunk; the pinned one is read uncounted over the
    socket, those after it copied from the hold's leases (5 chunks from the arena in all).
    Slices of two: the pinned chunk's slice ([2, 3]) likewise, and the later slice ([4, 5]),
    which no hold of the read counted, is read as an ordinary read, counted once."""
    assert FORMAT.chunk_bytes == CHUNK_BYTES
    monkeypatch.setattr(kvload, "MIN_PULL_SLICE_BYTES", slice_chunks * CHUNK_BYTES)
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "64MiB") as agent:
        keys = [key(i, 95) for i in range(CHUNKS)]
        control = agent.control()
        loader = kvload.KVLoader(FORMAT, torch.device(device))
        kv = loader.alloc(CHUNKS)
        with agent.data("unix") as client:
            assert client.shm and client.takes_get_counted
            client.put_many([(k, payload(k, CHUNK_BYTES)) for k in keys])
            assert control.pin([keys[PINNED]], tier="disk")["done"] == 1
            assert _hit_counts(control, keys) == [0] * CHUNKS
            before = _hit_counters(control)
            assert kvload.read_chunks(client, keys, "", loader, kv) == (CHUNKS, "lease")
            # before: [1, 1, 2, 2, 2, 2] (one slice), [1, 1, 2, 2, 1, 1] (slices of two)
            assert _hit_counts(control, keys) == [1] * CHUNKS
            assert _hit_counters(control) == before
            assert loader.last_copy is not None
            assert loader.last_copy[0] == from_arena * CHUNK_BYTES  # copied in place
        t = FORMAT.chunk_tokens
        host = kv.cpu()
        for i, k in enumerate(keys):
            want = torch.frombuffer(bytearray(payload(k, CHUNK_BYTES)), dtype=torch.int32)
            got = host[:, :, 0, :, i * t : (i + 1) * t, :].contiguous().view(torch.int32)
            assert torch.equal(got.flatten(), want), f"chunk {i}"
        loader.close()


def test_a_prefill_through_the_leased_lookup_counts_each_reused_chunk_once(
    tmp_path: Path,
) -> None:
    """``CachedLM``'s lookup leases the matched prefix (counting it); the pinned chunk ends
    the copy from the arena and the rest is read again over the socket, uncounted. The lookup
    counts its hits in /v1/stats once, as before."""
    pytest.importorskip("transformers")
    from kvctl.engines.hf import CachedLM
    from kvctl.engines.models import build_model

    chunk_tokens = 64
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {chunk_tokens}\n")
    g = torch.Generator().manual_seed(41)
    ids = [int(x) for x in torch.randint(0, 32000, (chunk_tokens * CHUNKS + 5,), generator=g)]
    model = build_model("tiny-llama", seed=9)
    with (
        running_agent(
            tmp_path / "a", "--config", str(config), "--cpu", "64MiB", "--disk", "64MiB"
        ) as agent,
        agent.data("unix") as client,
    ):
        control = agent.control()
        writer = CachedLM(model, client, chunked_prefill=True)
        want = writer.prefill(ids)
        writer.close()
        reader = CachedLM(model, client, store=False, chunked_prefill=True)
        try:
            keys = reader.chunk_keys(ids)[:CHUNKS]
            assert _hit_counts(control, keys) == [0] * CHUNKS
            assert control.pin([keys[PINNED]], tier="disk")["done"] == 1
            before = control.stats()["stats"]
            got = reader.prefill(ids)
            assert (got.reused_chunks, got.fetch_path) == (CHUNKS, "lease")
            assert torch.equal(got.logits, want.logits)
            # before: [1, 1, 2, 2, 2, 2]
            assert _hit_counts(control, keys) == [1] * CHUNKS
            # all but the pinned chunk copied from the lookup's leases
            assert got.timings["copy_bytes"] == (CHUNKS - 1) * reader.format.chunk_bytes
            after = control.stats()["stats"]
            # the lookup's hits, once
            assert after["hit_chunks"] - before["hit_chunks"] == CHUNKS
            assert after["reuse_hits"] - before["reuse_hits"] == CHUNKS
        finally:
            reader.close()
