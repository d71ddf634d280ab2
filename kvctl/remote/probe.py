"""Link probes to another agent: RTT and loss by PING, bandwidth by a bounded PROBE upload and
download through the target's data plane (through the SDK, like every other talk to a peer).
The agent's control API serves them as ``POST /v1/probe``.

Emulated distance: when the probed node is the far end of one of this agent's configured links
with an emulated delay (``--link NAME:delay_ms=N``), every ping and transfer of the probe waits
that link's own ``EmulatedDelay`` first, as each of the agent's fetches over the link does, and
the report says ``rtt_basis: "emulated"``: the figure then matches what the agent's transfers
see, and nobody takes it for the network's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from functools import partial

from kvctl.client import AgentError, AgentTimeout, AgentUnreachable, AuthError, DataClient
from kvctl.remote.agent_source import AgentSource, cut_client
from kvctl.remote.federation import PEER_TIER, Source
from kvctl.remote.links import EmulatedDelay
from kvctl.remote.pool import PullWatch, probe_too_slow, pull_deadline_s
from kvctl.store.errors import TierUnavailable
from kvctl.wire.address import TcpAddress, parse_address
from kvctl.wire.protocol import FrameError
from kvctl.wire.reports import LinkProbe

#: a probe stops pinging after this many lost in a row: the link is down, and more tries would
#: only hold the request (and a threadpool thread) for another timeout each
_PROBE_MAX_LOST_IN_A_ROW = 3
#: what a probe's target can make the SDK raise (it may be anything listening on a port, so
#: malformed HELLO replies too, and replies whose metadata breaks the protocol): reported in
#: the probe's error, never a 500
_TARGET_ERRORS = (AgentError, OSError, ValueError, KeyError, TypeError, FrameError)
#: cuts a probe's transfer at its deadline (its socket shut down): one thread for every probe
#: of this process, asleep when none runs
_WATCH = PullWatch("link probes")


def _connect_error(target: str, exc: Exception) -> str:
    if isinstance(exc, AuthError):
        return f"auth failed at {target}: {exc} (give the target's token)"
    if isinstance(exc, AgentTimeout):  # it was reached: it answered too slowly, or never
        return f"{target}: {exc}"
    cause = exc.__cause__
    if isinstance(exc, AgentUnreachable) and isinstance(cause, OSError):
        return f"cannot reach {target}: {cause.strerror or cause}"
    return f"cannot reach {target}: {exc}"


def _bytes_per_s(size_bytes: int, elapsed_s: float, rtt_min_s: float) -> float:
    """Bandwidth of a transfer timed as one round trip: the fastest ping's RTT is taken off,
    so that on a long link a small probe does not measure mostly latency."""
    transfer_s = elapsed_s
    if elapsed_s > rtt_min_s:
        transfer_s = elapsed_s - rtt_min_s
    return size_bytes / max(transfer_s, 1e-9)


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a data-plane TCP address, ``kvctl://`` or not; None for anything else."""
    try:
        where = parse_address(address.removeprefix("kvctl://").rstrip("/"))
    except ValueError:
        return None
    if not isinstance(where, TcpAddress):
        return None
    return where.host.lower(), where.port


def emulated_source(sources: Iterable[Source], *, target: str, name: str | None) -> Source | None:
    """The configured link a probe of ``target`` (the node the fleet calls ``name``) travels,
    when that link has an emulated delay; None when the probe is of the network alone.

    A peer matches by name first (the configured address may spell the host another way than
    the fleet does), then the pool or a peer by address (host compared as spelled, case aside).
    A matching link without a delay means measured: there is nothing to emulate on it."""
    sources = list(sources)
    matched = None
    if name:
        matched = next((s for s in sources if s.tier == PEER_TIER and s.name == name), None)
    if matched is None:
        endpoint = _tcp_endpoint(target)
        if endpoint is not None:
            matched = next(
                (
                    s
                    for s in sources
                    if isinstance(s.backend, AgentSource)
                    and _tcp_endpoint(s.backend.address) == endpoint
                ),
                None,
            )
    if matched is None or matched.delay.delay_s <= 0:
        return None
    return matched


def probe_link(
    target: str,
    *,
    token: str,
    pings: int,
    size_bytes: int,
    timeout_s: float,
    delay: EmulatedDelay | None = None,
) -> LinkProbe:
    """Ping ``target``'s data plane ``pings`` times, then time one upload and one download of
    ``size_bytes``. Never raises for the target's sake: failures go in ``error``. Worst case
    about (2 * pings + 4) * timeout_s plus twice ``size_bytes`` at ``PULL_FLOOR_BYTES_PER_S``
    (each transfer is cut at ``timeout_s`` plus its bytes at that rate: a link that trickles
    is a failed probe, not one that holds its caller for as long as it trickles), though a dead
    link ends the pings early.

    ``delay``: the emulated delay of the configured link to ``target`` (see
    ``emulated_source``), waited for real before each ping and transfer, inside its timing;
    the worst case grows by (pings + 2) of them."""
    emulated = delay is not None and delay.delay_s > 0
    result: LinkProbe = {
        "target": target,
        "ok": False,
        "rtt_s": None,
        "rtt_min_s": None,
        "loss_ratio": 1.0,
        "upload_bytes_per_s": None,
        "download_bytes_per_s": None,
        "bandwidth_bytes_per_s": None,
        "probe_bytes": size_bytes,
        "error": None,
        "rtt_basis": "emulated" if emulated else "measured",
        "emulated_delay_s": delay.delay_s if delay is not None and emulated else None,
    }
    client: DataClient | None = None

    def with_delay(timed: Callable[[], float]) -> float:
        """``timed()``'s seconds plus the emulated wait just before it, as waited (the link's
        ``Source.call`` waits inside the span it times, too)."""
        if delay is None or not emulated:
            return timed()
        started = time.perf_counter()
        delay.wait()
        return time.perf_counter() - started + timed()

    def transfer(what: str, **nbytes: int) -> float:
        """One PROBE transfer's seconds (emulated delay included), cut at its deadline."""
        c = connected()
        wait_s = delay.delay_s if delay is not None and emulated else 0.0
        deadline_s = pull_deadline_s(size_bytes, timeout_s) + wait_s
        with _WATCH.watching(partial(cut_client, c), deadline_s) as cut:
            try:
                elapsed_s = with_delay(partial(c.probe, **nbytes))
            except _TARGET_ERRORS as exc:
                if not cut.cut:
                    raise
                took_s = time.monotonic() - cut.started_s
                raise probe_too_slow(target, what, took_s, deadline_s) from exc
        if cut.cut:  # done just as it was cut: its socket is shut, the next one reconnects
            c.close()
        return elapsed_s

    def connected() -> DataClient:
        nonlocal client
        if client is None or client.closed:
            # token "" rather than None: None would fall back to KVCTL_TOKEN, i.e. send this
            # agent's own token to whatever host the caller named
            # its HELLO bounded in all, as each ping is: a target trickling its answers (each
            # byte within the socket's timeout) held the probe, and its request's thread, for
            # as long as it trickled
            client = DataClient.connect(
                target, token=token, timeout_s=timeout_s, use_shm=False, hello_timeout_s=timeout_s
            )
        return client

    rtts_s: list[float] = []
    lost = 0
    try:
        try:
            connected()
        except _TARGET_ERRORS as exc:
            result["error"] = _connect_error(target, exc)
            return result
        last_error = ""
        lost_in_a_row = 0
        for i in range(pings):
            try:
                c = connected()  # a reconnect is not part of the round trip

                def ping(c: DataClient = c) -> float:
                    with c.timeout(timeout_s):
                        return c.ping()

                rtts_s.append(with_delay(ping))
                lost_in_a_row = 0
            except _TARGET_ERRORS as exc:
                # a timed-out ping leaves the stream out of step, so the client has closed;
                # the next ping reconnects
                lost += 1
                lost_in_a_row += 1
                last_error = f"ping {i + 1}: {_connect_error(target, exc)}"
                if isinstance(exc, AuthError) or lost_in_a_row >= _PROBE_MAX_LOST_IN_A_ROW:
                    lost += pings - i - 1  # the rest would be lost too: count, don't wait
                    break
        result["loss_ratio"] = lost / pings
        if not rtts_s:
            result["error"] = f"all {pings} pings to {target} were lost ({last_error})"
            return result
        rtt_min_s = min(rtts_s)
        result["rtt_s"] = statistics.median(rtts_s)
        result["rtt_min_s"] = rtt_min_s
        if size_bytes:
            try:
                up_s = transfer(f"upload of {size_bytes} bytes", upload_bytes=size_bytes)
                down_s = transfer(f"download of {size_bytes} bytes", download_bytes=size_bytes)
            except (*_TARGET_ERRORS, TierUnavailable) as exc:
                result["error"] = f"bandwidth probe of {target} failed: {exc}"
                return result
            up = _bytes_per_s(size_bytes, up_s, rtt_min_s)
            down = _bytes_per_s(size_bytes, down_s, rtt_min_s)
            result["upload_bytes_per_s"] = up
            result["download_bytes_per_s"] = down
            result["bandwidth_bytes_per_s"] = min(up, down)
        result["ok"] = True
        return result
    finally:
        if client is not None:
            client.close()
