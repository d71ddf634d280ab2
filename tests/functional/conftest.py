"""Fixtures the functional tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def stand_ins() -> Iterator[tuple[Any, Any]]:
    """Two loopback stand-in agents (n1, n2) answering what a test sets, NaN and Infinity
    included (``StandIn`` of the impossible-values tests)."""
    from tests.functional.test_collector_impossible_values import StandIn

    a, b = StandIn("n1"), StandIn("n2")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
