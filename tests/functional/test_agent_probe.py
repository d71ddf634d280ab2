"""Link probes between two real agents (POST /v1/probe, the PROBE op), GET /v1/gpus and the
started_s that collectors use to notice agent restarts."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.client import DataClient, RequestError
from kvctl.nvml import NvmlReader
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    MAX_PROBE_BYTES,
    PROBE_PIECE_BYTES,
    REPLY_BIT,
    ErrorCode,
    MetaReader,
    MetaWriter,
    Op,
    error_meta,
    pack_header,
    parse_error,
    probe_meta,
)

from .agents import Agent, closed_port, running_agent
from .waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the agent's shm path is Linux")

SMALL = ("--cpu", "4MiB", "--disk", "0")
TOKEN_B = "b-probe-s3cret-7f3a"
SIZE = (2 << 20) + 12345  # not a multiple of the 1 MiB filler piece


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    # shared by the module's tests (agents take a second each to start and stop): tests count
    # requests as differences, never from zero
    tmp = tmp_path_factory.mktemp("pair")
    with running_agent(tmp / "a", *SMALL) as a, running_agent(tmp / "b", *SMALL) as b:
        yield a, b


def _requests(agent: Agent, op: str) -> float:
    """kvctl_dataplane_requests_total for ``op`` (ok outcome) from the agent's /metrics."""
    text = agent.control().metrics_text()
    pattern = rf'kvctl_dataplane_requests_total{{[^}}]*op="{op}"[^}}]*outcome="ok"[^}}]*}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def _settled(agent: Agent, op: str, want: float) -> float:
    """``_requests`` once it reaches ``want`` (or after a bounded wait): the agent counts a
    request after its reply is sent, so the prober can finish before the last one is counted."""
    with contextlib.suppress(AssertionError):
        wait_until(f"{want} {op} requests counted", lambda: _requests(agent, op) >= want, 10.0)
    return _requests(agent, op)


# --- POST /v1/probe ----------------------------------------------------------------------------
def test_probe_from_one_agent_to_another(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    target = b.state.data_tcp
    assert target is not None
    pings, probes = _requests(b, "ping"), _requests(b, "probe")
    with a.control() as ctl:
        out = ctl.probe(target, pings=7, size_bytes=SIZE)
    assert out["target"] == target
    assert out["ok"] is True, out["error"]
    assert out["error"] is None
    assert out["loss_ratio"] == 0.0
    assert 0 < out["rtt_min_s"] <= out["rtt_s"] < 1.0
    assert out["upload_bytes_per_s"] > 0 and out["download_bytes_per_s"] > 0
    assert out["bandwidth_bytes_per_s"] == min(
        out["upload_bytes_per_s"], out["download_bytes_per_s"]
    )
    assert out["probe_bytes"] == SIZE
    # A has no link configured to B: the network alone
    assert (out["rtt_basis"], out["emulated_delay_s"]) == ("measured", None)
    # the pings and both transfers really reached B: one PROBE up, one down
    assert _settled(b, "ping", pings + 7) - pings == 7
    assert _settled(b, "probe", probes + 2) - probes == 2


def test_probe_with_zero_bytes_measures_latency_only(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    pings, probes = _requests(b, "ping"), _requests(b, "probe")
    r = httpx.post(a.state.control_url + "/v1/probe", json={"target": b.state.data_tcp, "bytes": 0})
    assert r.status_code == 200
    out = r.json()
    assert out["ok"] is True and out["rtt_s"] > 0 and out["loss_ratio"] == 0.0
    assert out["probe_bytes"] == 0
    assert out["bandwidth_bytes_per_s"] is None and out["upload_bytes_per_s"] is None
    assert _settled(b, "ping", pings + 5) - pings == 5  # the default
    assert _requests(b, "probe") - probes == 0


def test_a_probe_over_an_emulated_link_includes_its_delay(tmp_path: Path) -> None:
    """B pulls from peer A over a link emulating distance (``--link a:delay_ms=5``): B's probe
    of A, by A's name or by its address, waits the same 5 ms each round trip and says so."""
    with running_agent(tmp_path / "a", *SMALL) as a:
        target = a.state.data_tcp
        assert target is not None
        port = target.rpartition(":")[2]
        link = ("--peer", f"a={target}", "--link", "a:delay_ms=5")
        with running_agent(tmp_path / "b", *SMALL, *link) as b, b.control() as ctl:
            pings = _requests(a, "ping")
            # by name: the fleet may spell the host otherwise than B's configuration does
            by_name = ctl.probe(f"localhost:{port}", name="a", pings=3, size_bytes=SIZE)
            by_address = ctl.probe(target, pings=3, size_bytes=0)
            own = b.state.data_tcp
            assert own is not None
            unconfigured = ctl.probe(own, name="b", pings=3, size_bytes=0)
            assert _settled(a, "ping", pings + 6) - pings == 6  # the delayed pings reached A
            # the operator's view: the basis next to the figure, and in --json
            cli = ["agent", "probe", "--url", b.state.control_url, "--pings", "2"]
            shown = CliRunner().invoke(
                app, [*cli, target, "--target-name", "a"], env={"COLUMNS": "160"}
            )
            as_json = CliRunner().invoke(app, [*cli, own, "--bytes", "0", "--json"])
            failed = CliRunner().invoke(app, [*cli, f"127.0.0.1:{closed_port()}", "--bytes", "0"])
    for out in (by_name, by_address):
        assert out["ok"] is True, out["error"]
        assert (out["rtt_basis"], out["emulated_delay_s"]) == ("emulated", 0.005)
        assert out["rtt_min_s"] >= 0.005 and out["rtt_s"] >= 0.005
    assert by_name["bandwidth_bytes_per_s"] > 0
    assert unconfigured["ok"] is True, unconfigured["error"]
    assert (unconfigured["rtt_basis"], unconfigured["emulated_delay_s"]) == ("measured", None)
    assert shown.exit_code == 0, shown.output
    assert "probe of a" in shown.output and "(emulated +5.00 ms)" in shown.output
    assert as_json.exit_code == 0, as_json.output
    own_probe = json.loads(as_json.output)
    assert own_probe["ok"] is True
    assert (own_probe["rtt_basis"], own_probe["emulated_delay_s"]) == ("measured", None)
    assert failed.exit_code == 1 and "probe failed" in failed.output


def test_probe_of_a_closed_port_is_ok_false_naming_the_address(pair: tuple[Agent, Agent]) -> None:
    a, _ = pair
    target = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    r = httpx.post(a.state.control_url + "/v1/probe", json={"target": target, "pings": 3})
    assert r.status_code == 200
    out = r.json()
    assert out["ok"] is False
    assert out["loss_ratio"] == 1.0
    assert target in out["error"]
    assert out["rtt_s"] is None and out["rtt_min_s"] is None
    assert out["bandwidth_bytes_per_s"] is None
    assert time.monotonic() - started < 10  # a refused connect does not wait out timeouts


def test_probe_with_and_without_the_targets_token(tmp_path: Path) -> None:
    # A has a token of its own, the same as B's: A must not send it unless the caller does
    with (
        running_agent(tmp_path / "a", *SMALL, token=TOKEN_B) as a,
        running_agent(tmp_path / "b", *SMALL, token=TOKEN_B) as b,
    ):
        target = b.state.data_tcp
        assert target is not None
        with a.control() as ctl:
            refused = ctl.probe(target, pings=2, size_bytes=1000)
            assert refused["ok"] is False
            assert "auth" in refused["error"].lower()
            assert target in refused["error"]
            assert refused["loss_ratio"] == 1.0

            wrong = ctl.probe(target, token="wrong-token", pings=2, size_bytes=1000)
            assert wrong["ok"] is False and "auth" in wrong["error"].lower()

            good = ctl.probe(target, token=TOKEN_B, pings=2, size_bytes=1000)
            assert good["ok"] is True, good["error"]
            assert good["loss_ratio"] == 0.0 and good["bandwidth_bytes_per_s"] > 0

            # a 422 echoes the body it refused: never with the token in it
            r = httpx.post(
                a.state.control_url + "/v1/probe",
                json={"token": TOKEN_B, "pings": 0},
                headers={"Authorization": f"Bearer {TOKEN_B}"},
            )
            assert r.status_code == 422
            assert {tuple(e["loc"]) for e in r.json()["detail"]} >= {
                ("body", "target"),
                ("body", "pings"),
            }
            assert TOKEN_B not in r.text
            r = httpx.post(
                a.state.control_url + "/v1/probe",
                json={"target": target, "token": 12345678},
                headers={"Authorization": f"Bearer {TOKEN_B}"},
            )
            assert r.status_code == 422 and "12345678" not in r.text
        for out in (refused, wrong, good):
            assert TOKEN_B not in str(out)
        assert "wrong-token" not in str(wrong)
        assert _settled(b, "probe", 2) == 2  # only the authenticated probe got through
        assert "probe of " + target in a.log()  # the probes were logged...
        assert TOKEN_B not in a.log() and "wrong-token" not in a.log()  # ...without tokens


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"bytes": MAX_PROBE_BYTES + 1}, "bytes", str(MAX_PROBE_BYTES)),
        ({"bytes": -1}, "bytes", "greater than or equal to 0"),
        ({"pings": 0}, "pings", "greater than or equal to 1"),
        ({"pings": 101}, "pings", "less than or equal to 100"),
        ({"timeout_s": 0}, "timeout_s", "greater than 0"),
        ({"target": "no-port-here"}, "target", "HOST:PORT"),
        ({"target": "/run/kvctl/agent.sock"}, "target", "TCP address"),
        ({"target": "127.0.0.1:99999"}, "target", "HOST:PORT"),
    ],
)
def test_bad_probe_requests_are_422_naming_the_field(
    pair: tuple[Agent, Agent], body: dict[str, object], field: str, words: str
) -> None:
    a, b = pair
    req = {"target": b.state.data_tcp, **body}
    pings = _requests(b, "ping")
    r = httpx.post(a.state.control_url + "/v1/probe", json=req)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert [e["loc"] for e in detail] == [["body", field]]
    assert words in detail[0]["msg"]
    assert _requests(b, "ping") == pings  # refused before anything was sent


# --- targets that misbehave -------------------------------------------------------------------
@contextlib.contextmanager
def _fake_target(serve: Callable[[socket.socket, int], None]) -> Iterator[str]:
    """A TCP listener that runs ``serve(conn, conn_number)`` for each connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            n += 1
            threading.Thread(target=_serve_quietly, args=(serve, conn, n), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _serve_quietly(
    serve: Callable[[socket.socket, int], None], conn: socket.socket, n: int
) -> None:
    with conn, contextlib.suppress(OSError):
        serve(conn, n)


def _agent_that_answers_pings(
    answer: Callable[[int], bool],
) -> Callable[[socket.socket, int], None]:
    """Answers HELLO, and the i-th PING of a connection only when ``answer(i)``; a PING it does
    not answer stalls the connection until the client gives up and closes it."""

    def serve(conn: socket.socket, _n: int) -> None:
        pings = 0
        while True:
            _, _, op, rid, meta_len, _ = HEADER.unpack(_recv(conn, HEADER_BYTES))
            _recv(conn, meta_len)
            if op == Op.HELLO:
                meta = json.dumps({"tiers": ["cpu"]}).encode()
            else:
                pings += 1
                if not answer(pings):
                    while conn.recv(1 << 16):  # stall: wait for the client to hang up
                        pass
                    return
                meta = b""
            conn.sendall(pack_header(op | REPLY_BIT, rid, len(meta)) + meta)

    return serve


def test_a_lost_ping_counts_and_the_next_one_reconnects(pair: tuple[Agent, Agent]) -> None:
    a, _ = pair
    # every connection answers its first PING and stalls on its second
    with _fake_target(_agent_that_answers_pings(lambda i: i == 1)) as target:
        r = httpx.post(
            a.state.control_url + "/v1/probe",
            json={"target": target, "pings": 6, "bytes": 0, "timeout_s": 0.3},
            timeout=30,
        )
    out = r.json()
    assert r.status_code == 200
    assert out["loss_ratio"] == 0.5  # answered, lost, answered (new connection), lost, ...
    assert out["ok"] is True and out["rtt_s"] > 0


def test_a_dead_link_ends_the_pings_early(pair: tuple[Agent, Agent]) -> None:
    a, _ = pair
    with _fake_target(_agent_that_answers_pings(lambda _i: False)) as target:
        started = time.monotonic()
        out = a.control().probe(target, pings=50, size_bytes=0, timeout_s=0.3)
        took_s = time.monotonic() - started
    assert out["ok"] is False and out["loss_ratio"] == 1.0
    assert "50 pings" in out["error"] and target in out["error"]
    assert took_s < 5  # three timeouts in a row, not fifty


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "bad magic"),
        # a kvctl-looking header announcing 4 GiB of metadata: refused, never allocated
        (pack_header(Op.HELLO | REPLY_BIT, 1, 0xFFFF_FFF0), "metadata of"),
    ],
    ids=["http-server", "huge-metadata"],
)
def test_a_peer_that_is_not_an_agent(pair: tuple[Agent, Agent], reply: bytes, words: str) -> None:
    a, _ = pair

    def serve(conn: socket.socket, _n: int) -> None:
        conn.sendall(reply)
        while conn.recv(1 << 16):
            pass

    with _fake_target(serve) as target:
        out = a.control().probe(target, pings=2, size_bytes=0, timeout_s=1.0)
    assert out["ok"] is False and out["loss_ratio"] == 1.0
    assert target in out["error"]
    assert "does not speak the kvctl data plane" in out["error"] and words in out["error"]
    assert a.control().health()["status"] == "ok"


# --- the PROBE op ------------------------------------------------------------------------------
def test_dataclient_probe_sizes_and_limits(pair: tuple[Agent, Agent]) -> None:
    _, b = pair
    with b.data("tcp") as c:
        for up, down in [(0, 0), (SIZE, 0), (0, SIZE), (1, 3), (MAX_PROBE_BYTES, MAX_PROBE_BYTES)]:
            assert c.probe(upload_bytes=up, download_bytes=down) > 0
        # refused by the SDK before anything is sent: the connection goes on
        with pytest.raises(ValueError, match="upload_bytes"):
            c.probe(upload_bytes=MAX_PROBE_BYTES + 1)
        with pytest.raises(ValueError, match="download_bytes"):
            c.probe(download_bytes=-1)
        assert c.ping() > 0 and not c.closed
        # an oversized probe that reaches the agent is TOO_LARGE, and (like every TOO_LARGE)
        # ends the connection
        with pytest.raises(RequestError) as exc:
            c._call(Op.PROBE, MetaWriter().u64(MAX_PROBE_BYTES + 1).build())
        assert exc.value.code == ErrorCode.TOO_LARGE
        assert c.closed
    with b.data("unix", use_shm=False) as c:  # the Unix socket serves probes too
        assert c.probe(upload_bytes=SIZE, download_bytes=SIZE) > 0
    # every uploaded byte was read by the agent, every asked-for byte sent
    metrics = b.control().metrics_text()
    moved = {
        d: float(v)
        for d, v in re.findall(
            r'kvctl_dataplane_bytes_total{direction="(in|out)",transport="tcp"} (\S+)', metrics
        )
    }
    assert moved["in"] >= SIZE + 1 + MAX_PROBE_BYTES
    assert moved["out"] >= SIZE + 3 + MAX_PROBE_BYTES


def test_kept_connections_hold_no_probe_buffers_of_their_own(pair: tuple[Agent, Agent]) -> None:
    """A connection made 1 MiB of filler and 1 MiB of scratch on its first probe and kept them
    while open: an agent keeps up to 4 read connections per pool or peer, so its memory went up
    2 MiB a step as each did its first link probe (a soak's tracemalloc: client.py at 2, 4,
    then 5 MiB). The buffers are the process's, made once; probes at once still move every
    byte."""
    _, b = pair
    clients = [b.data("tcp") for _ in range(8)]
    first = _requests(b, "probe")
    try:
        assert clients[0].probe(upload_bytes=SIZE, download_bytes=SIZE) > 0
        tracemalloc.start()
        try:
            for c in clients:
                assert c.probe(upload_bytes=SIZE, download_bytes=SIZE) > 0
            kept_bytes, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # before: the 7 others kept 2 MiB each (14 MiB)
        assert kept_bytes < PROBE_PIECE_BYTES
        # settled: the last of those is counted after its reply is sent, so it could land in
        # the count below (a CI run read 9 probes of 8)
        before = _settled(b, "probe", first + 1 + len(clients))
        with ThreadPoolExecutor(len(clients)) as pool:
            rtts = list(pool.map(lambda c: c.probe(SIZE, SIZE), clients))
        assert all(rtt > 0 for rtt in rtts) and not any(c.closed for c in clients)
        assert _settled(b, "probe", before + len(clients)) - before == len(clients)
    finally:
        for c in clients:
            c.close()


def _tcp(agent: Agent) -> socket.socket:
    assert agent.state.data_tcp is not None
    host, port = agent.state.data_tcp.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += part
    return buf


def _reply(s: socket.socket) -> tuple[int, int, bytes, int]:
    _, _, op, rid, meta_len, payload_len = HEADER.unpack(_recv(s, HEADER_BYTES))
    return op, rid, _recv(s, meta_len), payload_len


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_probe_frames_on_the_wire(pair: tuple[Agent, Agent]) -> None:
    _, b = pair
    with _tcp(b) as s:
        # upload 7 bytes, ask for 5: the reply says 7 arrived and carries 5 zero bytes
        meta = probe_meta(5)
        s.sendall(pack_header(Op.PROBE, 1, len(meta), 7) + meta + b"garbage")
        op, rid, reply, n = _reply(s)
        assert (op, rid, n) == (Op.PROBE | REPLY_BIT, 1, 5)
        assert MetaReader(reply).u64() == 7
        assert _recv(s, 5) == bytes(5)
        # malformed metadata with a payload: BAD_REQUEST, the payload skipped, still in step
        s.sendall(pack_header(Op.PROBE, 2, 3, 100) + b"\x01\x02\x03" + bytes(100))
        op, rid, reply, _ = _reply(s)
        assert (op, rid, parse_error(reply)[0]) == (Op.ERROR, 2, ErrorCode.BAD_REQUEST)
        s.sendall(pack_header(Op.PING, 3, 0))
        assert _reply(s)[:2] == (Op.PING | REPLY_BIT, 3)
    # an oversized upload: TOO_LARGE at once (its bytes are never read), connection closed
    with _tcp(b) as s:
        meta = probe_meta(0)
        s.sendall(pack_header(Op.PROBE, 4, len(meta), MAX_PROBE_BYTES + 1) + meta)
        op, rid, reply, _ = _reply(s)
        code, message = parse_error(reply)
        assert (op, code) == (Op.ERROR, ErrorCode.TOO_LARGE)
        assert str(MAX_PROBE_BYTES) in message
        assert _closed(s)
    with DataClient.connect(b.state.data_tcp) as c:  # type: ignore[arg-type]
        assert c.probe(1, 1) > 0  # the agent is unharmed


def test_probe_needs_hello_when_the_agent_has_a_token(tmp_path: Path) -> None:
    with running_agent(tmp_path / "b", *SMALL, token=TOKEN_B) as b, _tcp(b) as s:
        meta = probe_meta(10)
        s.sendall(pack_header(Op.PROBE, 1, len(meta)) + meta)
        op, _, reply, n = _reply(s)
        assert (op, parse_error(reply)[0], n) == (Op.ERROR, ErrorCode.UNAUTHORIZED, 0)
        assert _closed(s)


# --- GET /v1/gpus and started_s ---------------------------------------------------------------
def test_gpus_reports_nvml_as_this_host_sees_it(pair: tuple[Agent, Agent]) -> None:
    a, _ = pair
    with NvmlReader() as reader:
        here = reader.status()
    with a.control() as ctl:
        out = ctl.gpus()
        again = ctl.gpus()  # the reader is opened once (or its failed open retried), not broken
    nvml = out["nvml"]
    assert set(nvml) == {
        "available",
        "driver_version",
        "nvml_version",
        "device_count",
        "error",
        "hint",
    }
    assert nvml["available"] is here.available
    assert nvml["device_count"] == here.device_count == len(out["gpus"])
    assert again["nvml"] == nvml
    if not here.available:  # this CI machine: no GPU, no driver
        assert nvml["error"] and nvml["hint"]
        assert out["gpus"] == []
    else:
        assert [g["index"] for g in out["gpus"]] == list(range(here.device_count))


def test_stats_carry_the_agents_start_time(pair: tuple[Agent, Agent]) -> None:
    a, b = pair
    with a.control() as ctl:
        stats, info = ctl.stats(), ctl.info()
    assert stats["started_s"] == info["started_s"]
    assert 0 < time.time() - stats["started_s"] < 600
    with b.control() as ctl:
        assert ctl.stats()["started_s"] == ctl.info()["started_s"] != stats["started_s"]


def test_a_targets_error_text_cannot_forge_lines_in_the_agents_log(
    pair: tuple[Agent, Agent],
) -> None:
    """A probed target answers HELLO with an error whose text holds newlines and an escape
    sequence: the agent logs it on one line, escaped. Before, the text after each newline
    stood in agent.log as a record of its own (a forged CRITICAL line)."""
    a, _ = pair
    forged = "2030-01-01 00:00:00,000 CRITICAL kvctl.agent: FORGED by the target"
    message = f"refused\n{forged}\r\n\x1b[2Khidden"
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                head = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
                _magic, _version, _op, rid, meta_len, payload_len = HEADER.unpack(head)
                conn.recv(meta_len + payload_len, socket.MSG_WAITALL)
                meta = error_meta(ErrorCode.BAD_REQUEST, message)
                conn.sendall(pack_header(Op.ERROR, rid, len(meta)) + meta)

        target = threading.Thread(target=answer, daemon=True)
        target.start()
        with a.control() as ctl:
            out = ctl.probe(f"127.0.0.1:{listener.getsockname()[1]}", pings=1, timeout_s=5)
        target.join(10)
    assert out["ok"] is False and "FORGED" in (out["error"] or "")
    wait_until("the probe logged", lambda: "FORGED" in a.log(), 10.0)
    lines = a.log().splitlines()
    assert not [line for line in lines if line.startswith("2030-")]
    (logged,) = [line for line in lines if "FORGED" in line]
    assert "probe of 127.0.0.1:" in logged and "refused\\n2030-01-01" in logged
    assert "\x1b" not in logged and "\\x1b[2Khidden" in logged


def test_probes_of_a_stalling_target_leave_the_other_endpoints_their_threads(
    pair: tuple[Agent, Agent],
) -> None:
    """A target that answers HELLO and then holds every PING: 48 probes at once. At most a few
    run at a time, on threads of their own, and /v1/stats answers meanwhile. Before, each
    probe took one of the threads every other endpoint is served on: the 40th held them all,
    and /v1/stats (and /metrics, so Prometheus's `up`) waited until the probes timed out."""
    a, _ = pair
    release = threading.Event()
    lock = threading.Lock()
    held = [0, 0]  # pings held now, most held at once

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
                if len(head) < HEADER_BYTES:
                    return
                _magic, _version, op, rid, meta_len, payload_len = HEADER.unpack(head)
                conn.recv(meta_len + payload_len, socket.MSG_WAITALL)
                meta = b""
                if op == Op.HELLO:
                    meta = json.dumps(
                        {"tiers": ["cpu"], "chunk_tokens": 256, "max_chunk_bytes": 1 << 20}
                    ).encode()
                elif op == Op.PING:
                    with lock:
                        held[0] += 1
                        held[1] = max(held)
                    release.wait(60)
                    with lock:
                        held[0] -= 1
                conn.sendall(pack_header(op | REPLY_BIT, rid, len(meta)) + meta)

    def accept(listener: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()

    probes = 48
    outs: list[dict[str, object]] = []
    with socket.create_server(("127.0.0.1", 0), backlog=probes) as listener:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
        target = f"127.0.0.1:{listener.getsockname()[1]}"

        def probe() -> None:
            with a.control() as ctl:
                outs.append(dict(ctl.probe(target, pings=1, size_bytes=0, timeout_s=30)))

        threads = [threading.Thread(target=probe, daemon=True) for _ in range(probes)]
        try:
            for t in threads:
                t.start()
            wait_until("probes holding pings", lambda: held[0] >= 8, 30.0)
            # a thread free for it: answered long before a probe's 30 s timeout
            stats = httpx.get(f"{a.state.control_url}/v1/stats", timeout=15.0)
            assert stats.status_code == 200
        finally:
            release.set()
            for t in threads:
                t.join(90)
    assert len(outs) == probes and all(o["ok"] for o in outs), outs
    assert held[1] <= 8  # the probes ran a few at a time


def test_a_target_answering_a_transfer_with_truncated_metadata_is_a_failed_probe(
    pair: tuple[Agent, Agent],
) -> None:
    """A target that answers HELLO and PING, then a PROBE transfer with no metadata: the probe
    fails naming it. Before, the protocol error escaped the probe: HTTP 500."""
    a, _ = pair
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                while head := conn.recv(HEADER_BYTES, socket.MSG_WAITALL):
                    _magic, _version, op, rid, meta_len, payload_len = HEADER.unpack(head)
                    conn.recv(meta_len + payload_len, socket.MSG_WAITALL)
                    meta = b""
                    if op == Op.HELLO:
                        meta = json.dumps({"tiers": ["cpu"], "chunk_tokens": 256}).encode()
                    conn.sendall(pack_header(op | REPLY_BIT, rid, len(meta)) + meta)

        served = threading.Thread(target=answer, daemon=True)
        served.start()
        with a.control() as ctl:
            out = ctl.probe(f"127.0.0.1:{listener.getsockname()[1]}", pings=2, timeout_s=5)
    assert out["ok"] is False and out["rtt_s"] is not None
    assert "bandwidth probe of 127.0.0.1:" in (out["error"] or "")
    assert "metadata is truncated" in (out["error"] or "")


@pytest.mark.parametrize(
    "hello",
    [
        b'{"version": "9"}',
        b"\xff\xfe",
        b'{"tiers": "cpu"}',
        # JSON nested deeper than the parser recurses: its RecursionError was a 500
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["no-tiers", "not-utf8", "tiers-not-a-list", "nested-too-deep"],
)
def test_a_target_whose_hello_names_no_tiers_is_said_to_be_no_agent(
    pair: tuple[Agent, Agent], hello: bytes
) -> None:
    """Before, the SDK's bare KeyError or decode error made the probe's error "'tiers'", and
    JSON nested too deep for the parser made the probe a 500."""
    a, _ = pair
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                head = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
                _magic, _version, op, rid, meta_len, payload_len = HEADER.unpack(head)
                conn.recv(meta_len + payload_len, socket.MSG_WAITALL)
                conn.sendall(pack_header(op | REPLY_BIT, rid, len(hello)) + hello)

        served = threading.Thread(target=answer, daemon=True)
        served.start()
        with a.control() as ctl:
            out = ctl.probe(f"127.0.0.1:{listener.getsockname()[1]}", pings=1, timeout_s=5)
    assert out["ok"] is False
    assert "the HELLO reply names no tiers: not a kvctl agent's data plane" in (out["error"] or "")
