"""The control API's failed accepts in the log: CPython's event loop logs a traceback for each
accept that fails for want of descriptors (thousands a second), and the agent's filter on the
``asyncio`` logger lets one line an interval through, saying what happened. And the warning
when the open-files limit is below what the connection caps need."""

from __future__ import annotations

import logging

import pytest

from kvctl.agent.daemon import descriptors_needed, warn_if_few_descriptors
from kvctl.http_serving import AcceptErrorThrottle, throttle_accept_errors


def _accept_failure() -> logging.LogRecord:
    """The record asyncio's default exception handler logs for a failed accept."""
    exc = OSError(24, "Too many open files")
    return logging.LogRecord(
        "asyncio",
        logging.ERROR,
        __file__,
        1,
        "socket.accept() out of system resource\nsocket: <asyncio.TransportSocket fd=3>",
        (),
        (OSError, exc, None),
    )


def test_one_line_an_interval_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("kvctl.http_serving.time.monotonic", lambda: now[0])
    throttle = AcceptErrorThrottle(interval_s=60.0)
    first = _accept_failure()
    assert throttle.filter(first)
    assert first.exc_info is None
    assert first.getMessage().startswith("control API: accept failed ([Errno 24] Too many")
    assert "more since" not in first.getMessage()
    assert [throttle.filter(_accept_failure()) for _ in range(2047)] == [False] * 2047
    now[0] += 61
    later = _accept_failure()
    assert throttle.filter(later)
    assert "2047 more since the last line" in later.getMessage()


def test_other_asyncio_records_pass_untouched() -> None:
    throttle = AcceptErrorThrottle()
    message = "Task was destroyed but it is pending!"
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), None)
    assert throttle.filter(record) and record.getMessage() == message


def test_the_filter_is_put_on_the_asyncio_logger_once() -> None:
    logger = logging.getLogger("asyncio")
    before = list(logger.filters)
    try:
        throttle_accept_errors()
        throttle_accept_errors()
        added = [f for f in logger.filters if isinstance(f, AcceptErrorThrottle)]
        assert len(added) == 1
    finally:
        logger.filters[:] = before


@pytest.mark.parametrize(("soft", "warned"), [(1024, True), (65536, False)])
def test_a_descriptor_limit_under_the_connection_caps_is_warned_of(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int, warned: bool
) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _what: (soft, 1 << 20))
    caplog.set_level(logging.WARNING, logger="kvctl.agent")
    warn_if_few_descriptors(1024)
    lines = [r.getMessage() for r in caplog.records if "open-files limit" in r.getMessage()]
    assert len(lines) == warned, lines
    if warned:
        assert f"({soft})" in lines[0] and str(descriptors_needed(1024)) in lines[0]
