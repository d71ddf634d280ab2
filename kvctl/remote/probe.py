"""Link probes to another agent: RTT and loss by PING, bandwidth by a bounded PROBE upload and
download through the target's data plane (through the SDK, like every other talk to a peer).
The agent's control API serves them as ``POST /v1/probe``."""

from __future__ import annotations

import statistics

from kvctl.client import AgentError, AgentUnreachable, AuthError, DataClient
from kvctl.wire.reports import LinkProbe

#: a probe stops pinging after this many lost in a row: the link is down, and more tries would
#: only hold the request (and a threadpool thread) for another timeout each
_PROBE_MAX_LOST_IN_A_ROW = 3
#: what a probe's target can make the SDK raise (it may be anything listening on a port, so
#: malformed HELLO replies too): reported in the probe's error, never a 500
_TARGET_ERRORS = (AgentError, OSError, ValueError, KeyError, TypeError)


def _connect_error(target: str, exc: Exception) -> str:
    if isinstance(exc, AuthError):
        return f"auth failed at {target}: {exc} (give the target's token)"
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


def probe_link(
    target: str, *, token: str, pings: int, size_bytes: int, timeout_s: float
) -> LinkProbe:
    """Ping ``target``'s data plane ``pings`` times, then time one upload and one download of
    ``size_bytes``. Never raises for the target's sake: failures go in ``error``. Worst case
    about (2 * pings + 4) * timeout_s, though a dead link ends the pings early."""
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
    }
    client: DataClient | None = None

    def connected() -> DataClient:
        nonlocal client
        if client is None or client.closed:
            # token "" rather than None: None would fall back to KVCTL_TOKEN, i.e. send this
            # agent's own token to whatever host the caller named
            client = DataClient.connect(target, token=token, timeout_s=timeout_s, use_shm=False)
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
                rtts_s.append(connected().ping())
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
                up_s = connected().probe(upload_bytes=size_bytes)
                down_s = connected().probe(download_bytes=size_bytes)
            except _TARGET_ERRORS as exc:
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
