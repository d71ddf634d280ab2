"""kvctl.router.inventory.InventoryReloader: rereading the fleet's inventory while the router
runs."""

from __future__ import annotations

import math
import time

import pytest

from kvctl.cli.router import unknown_nodes_line
from kvctl.errors import InvalidArgument
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.router.inventory import InventoryReloader
from kvctl.router.topology import Topology
from tests.unit.test_router_service import fleet, make_router, stored

KEYS = [bytes([i]) * 16 for i in range(1, 5)]


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


def _forgetting(index: EmbeddedIndex) -> InventoryReloader:
    """A reloader of ``fleet()`` (a1, a2, b1, b2) that drops the index's other nodes."""
    return InventoryReloader(
        _read, make_router(index), Followers(index, {}), source="test", forget_unknown=True
    )


def test_a_node_forgotten_again_at_a_later_reread_counts_once() -> None:
    """y's engine entries (y#vllm) written after y was dropped are dropped at the next reread:
    forgotten_nodes counted y twice ('2 nodes' in `kvctl router status` for one that left)
    and last_forgotten named it twice (found by a review)."""
    index = EmbeddedIndex()
    index.apply("a1", stored([KEYS[0]]))
    index.apply("y", stored(KEYS[1:3]))
    reloader = _forgetting(index)
    assert reloader.reload()
    assert set(index.nodes()) == {"a1"}
    index.apply("y#vllm", stored([KEYS[3]]))  # an engine feed's, written after the drop
    assert reloader.reload()
    assert set(index.nodes()) == {"a1"}
    status = reloader.status()
    assert (status["forgotten_nodes"], status["forgotten_entries"]) == (1, 3)
    assert status["last_forgotten"] == ["y", "y#vllm"]


def test_a_node_written_again_after_it_was_dropped_is_kept_and_said_to_be() -> None:
    """A router of the version before claims (it writes none) follows y: each reread dropped
    y, its follower resynced it, the next reread dropped it again (y's entries flapping for
    every router, forgotten_nodes growing by one a reread, the status saying y is 'dropped at
    the next reread'). A node written again after this router dropped it is followed by
    something: it is kept, and the status says why (found by a review)."""
    index = EmbeddedIndex()
    index.apply("a1", stored([KEYS[0]]))
    index.apply("y", stored(KEYS[1:3]))
    reloader = _forgetting(index)
    assert reloader.reload()
    assert set(index.nodes()) == {"a1"}
    for _ in range(2):
        index.replace("y", stored(KEYS[1:3]))  # the older router's follower resyncs it
        assert reloader.reload()
        assert index.nodes() == {"a1": 1, "y": 2}
    status = reloader.status()
    assert (status["forgotten_nodes"], status["forgotten_entries"]) == (1, 2)
    assert status["last_forgotten"] == ["y"]
    assert "written again after this router dropped it" in status["forget_note"]
    line = unknown_nodes_line(make_router(index).unknown_index_nodes(index.nodes()), status)
    assert "not dropped: 1 of them written again" in line
    assert line.endswith(
        "`kvctl router forget NODE` drops them (one still followed is written back)"
    )


def test_a_reread_that_fails_where_nobody_expected_leaves_the_rereads_running() -> None:
    """The index's nodes are listed, and the claims read, outside the reread's own error
    handling: anything but IndexUnavailable out of them (a ValueError from a count no index
    wrote, before 'malformed count' said it) ended the reloader's thread, and with it every
    reread, SIGHUP's too, while the status went on naming the last good read."""
    import threading

    class Flaky(EmbeddedIndex):
        fails = 1

        def nodes(self) -> dict[str, int]:
            if self.fails:
                self.fails -= 1
                raise ValueError("invalid literal for int() with base 10: b'many'")
            return super().nodes()

    index = Flaky()
    reloader = _forgetting(index)
    reloader.interval_s = 0.0  # reread when asked only
    reread = threading.Semaphore(0)
    read = reloader._read
    assert read is not None

    def counted() -> tuple[Topology, dict[str, str]]:
        reread.release()
        return read()

    reloader._read = counted
    reloader.start()  # the start's pass: listing the index's nodes fails
    try:
        deadline_s = time.monotonic() + 10
        while index.fails:  # (the start's pass under way)
            assert time.monotonic() < deadline_s
            time.sleep(0.01)
        reloader.request()
        assert reread.acquire(timeout=10)  # a reread after the failed pass
    finally:
        reloader.stop()


def test_an_index_holding_no_entry_of_the_inventorys_nodes_says_they_may_hold_none_yet() -> None:
    """The inventory's nodes resynced into the index, holding no chunk yet (a new fleet's
    agents), beside a node of the fleet before: nothing is dropped (the index lists nodes with
    entries only, so it looks like another fleet's), and the note said only 'another fleet's
    index?', which it is not (found by a review)."""
    index = EmbeddedIndex()
    for node in ("a1", "a2", "b1", "b2"):
        index.replace(node, [])  # followed, empty
    index.apply("y", stored(KEYS[:2]))
    reloader = _forgetting(index)
    assert reloader.reload()
    assert index.nodes() == {"y": 2}
    note = reloader.status()["forget_note"]
    assert "the inventory's nodes hold no chunk yet?" in note and "none dropped" in note
    assert "only of 1 other node (" in note


def test_an_index_holding_no_entry_of_a_one_node_inventory_says_1_node_not_1_nodes() -> None:
    """0ca7f60 wrote 'only of 1 other node', but the inventory's own count kept its 's':
    a one-node inventory's note said 'the inventory's 1 nodes'."""
    from kvctl.router.topology import Node

    one = Topology.build([Node("a1", "fra")], {})
    index = EmbeddedIndex()
    index.apply("y", stored(KEYS[:2]))
    reloader = InventoryReloader(
        lambda: (one, {}),
        make_router(index, one),
        Followers(index, {}),
        source="test",
        forget_unknown=True,
    )
    assert reloader.reload()
    note = reloader.status()["forget_note"]
    assert "the index holds no entry of the inventory's 1 node, only of 1 other node (" in note


class _Claiming(EmbeddedIndex):
    """An index with claims (``ClaimingIndex``) whose ages the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.ages: dict[str, float] = {}

    def claim(self, claimant: str, nodes: object) -> None:
        pass

    def claims(self, *, excluding: str = "") -> dict[str, float]:
        return dict(self.ages)


def test_a_node_kept_as_written_again_goes_once_a_router_claimed_it_and_stopped() -> None:
    """y, kept as written again after its drop (a router before claims followed it), is
    then followed by a router that claims it (the old one upgraded); once that router stops
    (y removed from the fleet) its claim goes stale: y is dropped then, not kept for good."""
    index = _Claiming()
    index.apply("a1", stored([KEYS[0]]))
    index.apply("y", stored(KEYS[1:3]))
    reloader = _forgetting(index)
    assert reloader.reload()
    index.replace("y", stored(KEYS[1:3]))  # the router before claims resyncs it
    assert reloader.reload() and "y" in index.nodes()
    index.ages = {"y": 1.0}  # upgraded: it claims y
    assert reloader.reload() and "y" in index.nodes()
    index.ages = {"y": 600.0}  # it stopped 10 minutes ago
    assert reloader.reload()
    assert set(index.nodes()) == {"a1"}
    assert reloader.status()["forgotten_nodes"] == 1


def test_a_node_back_in_the_inventory_and_gone_again_is_dropped_not_kept() -> None:
    """z, dropped at start (it left while no router ran), joins the fleet again, is followed,
    then leaves again: its entries are no longer 'written again after this router dropped
    it' (its own follower wrote them, while the inventory named it). They were kept as such
    (0e3f8ba remembered the first drop for good): the status said a router of the version
    before claims follows z, and when the follower's own drop of z failed (the index
    blinked), z's entries stayed in the index for good where the next reread dropped them
    (found by a review)."""
    from kvctl.index.remote import IndexUnavailable
    from kvctl.router.topology import DcLink, Node

    class Blinking(EmbeddedIndex):
        failing_drops = 0

        def drop(self, node: str) -> int:
            if self.failing_drops:
                self.failing_drops -= 1
                raise IndexUnavailable("the index blinked")
            return super().drop(node)

    with_z = Topology.build([*fleet().nodes.values(), Node("z", "fra")],
                            {("fra", "ams"): DcLink.fiber(80.0)})  # fmt: skip
    inventory: tuple[Topology, dict[str, str]] = (fleet(), {})
    index = Blinking()
    index.apply("a1", stored([KEYS[0]]))
    index.apply("z", stored(KEYS[1:3]))
    reloader = InventoryReloader(
        lambda: inventory, make_router(index), Followers(index, {}), source="test",
        forget_unknown=True,
    )  # fmt: skip
    assert reloader.reload()  # at start: z left while no router ran
    assert set(index.nodes()) == {"a1"}
    for failing_drops in (0, 1):
        inventory = (with_z, {"z": "http://127.0.0.1:9"})  # z joins again, followed
        assert reloader.reload()
        index.replace("z", stored(KEYS[1:3]))  # its follower's resync
        inventory = (fleet(), {})  # and z leaves again
        index.failing_drops = failing_drops  # the follower's own drop of z fails
        assert reloader.reload()
        assert "written again" not in reloader.status()["forget_note"]
        assert reloader.reload()
        assert set(index.nodes()) == {"a1"}
