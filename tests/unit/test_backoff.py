"""The backoff the followers and the vLLM event feed share: a failed try waits first_s, each
further one twice as long up to max_s, a success resets it; a failure of something else than
the action (a cheap check before it) waits the current length again without growing it."""

from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.backoff import Backoff


def test_waits_double_up_to_the_max_and_a_success_resets_them() -> None:
    now = [100.0]
    backoff = Backoff(1.0, 30.0, lambda: now[0])
    assert backoff.due() and backoff.retry_in_s() is None
    assert [backoff.failed() for _ in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.failures == 7 and backoff.retry_at_s == 130.0
    now[0] = 129.5
    assert not backoff.due() and backoff.retry_in_s() == 0.5
    now[0] = 130.0
    assert backoff.due() and backoff.retry_in_s() == 0.0
    backoff.succeeded()
    assert backoff.due() and backoff.failures == 0 and backoff.retry_in_s() is None
    assert backoff.failed() == 1.0


def test_a_failure_that_does_not_lengthen_waits_the_current_wait_again() -> None:
    now = [0.0]
    backoff = Backoff(1.0, 30.0, lambda: now[0])
    assert backoff.failed(lengthen=False) == 1.0  # at least first_s
    assert backoff.failures == 0
    assert backoff.failed() == 2.0  # a failed try after it doubles from there
    now[0] = 10.0
    assert backoff.failed(lengthen=False) == 2.0 and backoff.retry_at_s == 12.0
    assert backoff.failures == 1


@pytest.mark.parametrize(
    ("first_s", "max_s"), [(0, 1), (-1, 1), (2, 1), (1, float("inf")), (float("nan"), 1), (True, 2)]
)
def test_bad_waits_are_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(InvalidArgument):
        Backoff(first_s, max_s)
