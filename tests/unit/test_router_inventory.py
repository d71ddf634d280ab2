"""kvctl.router.inventory.InventoryReloader: rereading the fleet's inventory while the router
runs."""

from __future__ import annotations

import math

import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.router.inventory import InventoryReloader
from kvctl.router.topology import Topology
from tests.unit.test_router_service import fleet, make_router


def _read() -> tuple[Topology, dict[str, str]]:
    return fleet(), {}


@pytest.mark.parametrize("interval_s", [math.inf, 1e300, math.nan, -1.0])
def test_an_interval_the_reloaders_thread_cannot_wait_is_refused(interval_s: float) -> None:
    # `--reload-s inf` (typer's min=0 lets it through) was taken: the reloader's thread then
    # died at its first wait (OverflowError: timestamp out of range), and with it the rereads
    # SIGHUP asks for, while the status went on saying "reload_s: inf"
    index = EmbeddedIndex()
    with pytest.raises(InvalidArgument, match="reload interval"):
        InventoryReloader(
            _read, make_router(index), Followers(index, {}), source="test", interval_s=interval_s
        )
