"""An engine's reads keep a deadline sized to their bytes: a multi-chunk read is not cut off by
the short deadline of calls that move nothing (an earlier bug cut control calls off during
multi-GiB moves). Here the short deadline is a millisecond and the floor rate 16 MiB/s, so only
the bytes' share of the deadline lets 64 MiB through, over the socket and through leases."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvctl.engines import deadlines  # noqa: E402
from kvctl.engines.kvformat import ChunkFormat  # noqa: E402
from kvctl.engines.kvload import KVLoader, read_chunks  # noqa: E402
from kvctl.store.keys import KVLayout  # noqa: E402
from tests.functional.agents import key, payload, running_agent  # noqa: E402

#: 4 MiB chunks: 4 layers x K,V x 2 heads x 1024 tokens x 64 dims x 4 bytes
FORMAT = ChunkFormat(KVLayout(4, 2, 64, "float32"), 1024)
CHUNKS = 16


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_large_read_gets_a_deadline_sized_to_its_bytes(
    tmp_path: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deadlines, "MOVE_BYTES_PER_SECOND", 16 << 20)  # 64 MiB: 4 s
    size = FORMAT.chunk_bytes
    keys = [key(i, 31) for i in range(CHUNKS)]
    with running_agent(tmp_path, "--cpu", "256MiB") as agent, agent.data(transport) as client:
        outcomes = client.put_many([(k, payload(k, size)) for k in keys], tenant="t")
        assert [o.status for o in outcomes] == ["stored"] * CHUNKS
        loader = KVLoader(FORMAT, torch.device("cpu"))
        kv = loader.alloc(CHUNKS)
        got, path = read_chunks(client, keys, "t", loader, kv, answer_s=0.001)
        assert (got, path) == (CHUNKS, "socket" if transport == "tcp" else "lease")
        assert not client.closed
        loader.close()
