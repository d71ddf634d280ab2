"""A PUT's chunk claiming more tokens than its bytes can hold is refused (BAD), as a pool's or
a peer's chunk is (``RemoteTiers._token_bound``): every hit on it counted its claim as prefill
saved, so one 1 KiB chunk claiming 4,294,967,295 tokens made each lookup that matched it report
as many tokens matched, and the agent's hit counters (and the energy and GPU time a dashboard
derives from them) grow by as much per lookup (found by review, hostile clients)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.wire.protocol import Op, Status, put_item, put_meta

from .agents import key, metric, payload, running_agent
from .dataplane_hostile_agents import RawConn

CHUNK_TOKENS = 256  # the agent's default


@pytest.mark.parametrize(
    ("size", "tokens", "status"),
    [
        (1024, 2**32 - 1, Status.BAD),
        (1024, 1024 // 2, Status.OK),  # two bytes a token: the least any KV layout takes
        (1024, 1024 // 2 + 1, Status.BAD),
        (64, CHUNK_TOKENS, Status.OK),  # chunk_tokens, whatever its bytes (a test's chunks)
        (64, CHUNK_TOKENS + 1, Status.BAD),
    ],
)
def test_a_put_claiming_more_tokens_than_its_bytes_hold_is_refused(
    tmp_path: Path, size: int, tokens: int, status: Status
) -> None:
    with running_agent(tmp_path / "a") as agent:
        k = key(size + tokens, 41)
        conn = RawConn(agent, "tcp")
        conn.hello()
        meta = put_meta("t", [put_item(k, size, tokens=tokens)])
        op, _rid, reply, _payload = conn.call(Op.PUT, meta, payload(k, size))
        assert op == Op.PUT | 0x80 and reply[4] == status, (reply, tokens)
        conn.sock.close()
        with agent.data() as c:
            found = c.lookup([k], tenant="t")
        if status == Status.OK:
            assert (found.matched_chunks, found.matched_tokens) == (1, tokens)
        else:
            assert (found.matched_chunks, found.matched_tokens) == (0, 0)
            assert metric(agent, "kvctl_dataplane_requests_total", op="put", outcome="ok") == 1
