"""A hostile or broken peer answering a real agent's pulls with chunks it cannot keep: larger
than the agent takes (its ``max_chunk_bytes``) whatever the peer's HELLO claims, or many
chunks the agent must drop (isolated to another tenant). The agent must refuse or drop them
without allocating what they claim: before, each claimed chunk was allocated as a buffer of
its own and held until the whole reply was read, so a peer claiming a 256 MiB chunk made a
4 MiB-chunk agent commit 256 MiB, and one answering 48 chunks it had to drop made it hold
all 48 at once. The peer here trickles the rest of its reply while the agent's resident
memory is sampled."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvctl.wire.protocol import (
    FETCH_ITEM,
    FETCH_PAYLOAD,
    FLAG_ISOLATED,
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    pack_header,
)
from tests.functional.agents import running_agent
from tests.functional.hung import loopback_server
from tests.functional.raw_sockets import recv_exactly

MIB = 1 << 20
#: the agent's own limit on a chunk
MAX_CHUNK_BYTES = 4 * MIB
#: what a probe is told each chunk is: small, so the pull asks for all of them
PROBE_CHUNK_BYTES = 64 << 10
#: how long the peer trickles the rest of a reply (a hang guard for the sampling, not a
#: timing claim: with the fix the agent hangs up before the first trickled byte)
TRICKLE_S = 4.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Pulls:
    """What the hostile peer saw of the agent's pulls (FETCHes with the payload)."""

    pid: int = 0
    #: the agent's largest resident size sampled while a pull's reply was trickled
    peak_rss_bytes: int = 0
    pulls: int = 0
    #: pulls the agent hung up on before the trickle ran out
    cut_by_agent: int = 0


@contextlib.contextmanager
def hostile_peer(
    item_bytes: int, owner: str | None, *, sent_whole: int = 0
) -> Iterator[tuple[str, Pulls]]:
    """A loopback data plane that answers HELLO claiming to take any chunk, probes with
    ``PROBE_CHUNK_BYTES`` chunks of the asking tenant, and pulls with ``item_bytes`` chunks
    owned by ``owner`` (None: the asking tenant; else isolated to ``owner``): the first
    ``sent_whole`` chunks sent whole at once, then the rest of the reply a few bytes at a
    time for ``TRICKLE_S`` (or until the agent hangs up) while the agent's resident memory
    is sampled."""
    stop = threading.Event()
    seen = Pulls()

    def reply(conn: socket.socket, op: int, rid: int, meta: bytes, payload_len: int = 0) -> None:
        conn.sendall(pack_header(op | REPLY_BIT, rid, len(meta), payload_len) + meta)

    def trickle(conn: socket.socket) -> bool:
        """True when the agent hung up before the trickle ran out."""
        end_s = time.monotonic() + TRICKLE_S
        while time.monotonic() < end_s:
            with contextlib.suppress(OSError):
                seen.peak_rss_bytes = max(seen.peak_rss_bytes, rss_bytes(seen.pid))
            try:
                conn.sendall(b"x" * 64)
            except OSError:
                return True
            time.sleep(0.05)
        return False

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            while not stop.is_set():
                _, _, op, rid, meta_len, payload_len = HEADER.unpack(
                    recv_exactly(conn, HEADER_BYTES)
                )
                meta = recv_exactly(conn, meta_len + payload_len)[:meta_len]
                if op == Op.HELLO:
                    info = {"tiers": ["cpu"], "max_chunk_bytes": 1 << 40, "version": "evil"}
                    reply(conn, op, rid, json.dumps(info).encode())
                    continue
                if op == Op.PING:
                    reply(conn, op, rid, b"")
                    continue
                if op != Op.FETCH:
                    return  # (a bandwidth probe: the link is overridden, none is needed)
                r = MetaReader(meta)
                tenant, flags, keys = r.text(), r.u8(), r.keys()
                pull = bool(flags & FETCH_PAYLOAD)
                size = item_bytes if pull else PROBE_CHUNK_BYTES
                isolated_to = owner if pull and owner is not None else None
                w = MetaWriter().u32(len(keys))
                for _ in keys:
                    w.raw(
                        FETCH_ITEM.pack(
                            Status.OK,
                            size,
                            16,
                            35,
                            FLAG_ISOLATED if isolated_to else 0,
                            bytes(16),
                            0.0,
                        )
                    ).text(isolated_to or tenant)
                reply(conn, op, rid, w.build(), size * len(keys) if pull else 0)
                if not pull:
                    continue
                seen.pulls += 1
                for _ in range(min(sent_whole, len(keys))):
                    conn.sendall(bytes(size))
                seen.cut_by_agent += trickle(conn)
                return

    with loopback_server(serve, stop, "hostile-peer") as address:
        yield address, seen


def _pull_through_agent(tmp_path: Path, address: str, seen: Pulls, n_keys: int) -> dict:  # type: ignore[type-arg]
    """A real agent with the hostile peer: a lookup (which probes it) then a read of the
    chain (which pulls it); returns the agent's ``/v1/remote`` peer entry."""
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nmax_chunk = "{MAX_CHUNK_BYTES // MIB}MiB"\n')
    args = ["--config", str(config), "--disk", "0", "--cpu", "64MiB"]
    args += ["--peer", f"evil={address}", "--link", "evil:override=fetch"]
    with running_agent(tmp_path / "a", *args) as agent:
        seen.pid = agent.proc.pid
        keys = [bytes([i + 1]) * 16 for i in range(n_keys)]
        with agent.data() as d:
            res = d.lookup(keys, tenant="t1")
            seen.peak_rss_bytes = before = rss_bytes(agent.proc.pid)
            got = d.get_many(keys, tenant="t1")
        assert res.matched_chunks == n_keys  # the probe's small chunks were worth fetching
        assert got == [None] * n_keys  # nothing it could not keep was kept or served
        assert seen.pulls >= 1
        # never near what the peer claimed: at most a chunk or two of the agent's own size
        grew_mib = (seen.peak_rss_bytes - before) / MIB
        assert grew_mib < 32, f"the agent grew by {grew_mib:.0f} MiB on a hostile peer's reply"
        peer = agent.control().remote()["peers"][0]
        assert agent.proc.poll() is None
        return peer  # type: ignore[no-any-return]


def test_a_chunk_larger_than_the_agent_takes_is_refused_before_it_is_read(
    tmp_path: Path,
) -> None:
    """The peer claims to take chunks of any size and answers a pull with a 256 MiB chunk."""
    with hostile_peer(256 * MIB, None) as (address, seen):
        peer = _pull_through_agent(tmp_path, address, seen, 1)
    assert seen.cut_by_agent == seen.pulls  # refused at the reply's head, not read on
    assert f"larger than this side's {MAX_CHUNK_BYTES}-byte chunks" in peer["last_error"]


def test_chunks_the_agent_drops_are_never_all_held_at_once(tmp_path: Path) -> None:
    """The peer answers a pull of 48 chunks with chunks of the agent's largest size, each
    isolated to another tenant: the agent drops each (counted corrupt) as it lands."""
    n = 48
    with hostile_peer(MAX_CHUNK_BYTES, "mallory", sent_whole=n - 1) as (address, seen):
        peer = _pull_through_agent(tmp_path, address, seen, n)
    assert peer["corrupt"] == n - 1
