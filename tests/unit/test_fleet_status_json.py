"""`kvctl status --json`: a node whose figures were not read (down, or refusing the token) and
a DC with no node up report their counts as null, not 0 lookups, the way their ratios are; the
reads gone and each tier's reuse/sharing, per node and summed per DC."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvctl.db.inventory import NodeInfo
from kvctl.fleet.status import DcStatus, NodeStatus, node_status
from kvctl.ratios import RATIO_NAMES, HitCounts

COUNTS = ("lookups", "hits", "reuse_hits", "sharing_hits")
#: the read figures, by the names `kvctl status --window --json` gives them
READS = ("read_chunks", "read_missing_chunks", "read_missing_ratio")


def test_unread_nodes_and_dcs_without_a_node_up_have_null_counts() -> None:
    up = NodeStatus("a", "fra", "http://a", True, counts=HitCounts(10, 4, 3, 1))
    down = NodeStatus("b", "ams", "http://b", False, "connection refused")
    refused = NodeStatus("c", "ams", "http://c", True, "401", auth_refused=True)
    assert up.as_dict()["lookups"] == 10 and up.as_dict()["hit_ratio"] == 0.4
    for n in (down, refused):
        doc = n.as_dict()
        assert all(doc[k] is None for k in (*COUNTS, *RATIO_NAMES)), n.node
    fra, ams = DcStatus("fra"), DcStatus("ams")
    fra.add(up)
    ams.add(down)
    assert fra.as_dict()["lookups"] == 10
    assert all(ams.as_dict()[k] is None for k in (*COUNTS, *RATIO_NAMES))
    assert ams.as_dict()["nodes"] == 1 and ams.as_dict()["up"] == 0


def _stats(
    lookups: int, tiers: dict[str, tuple[float, float, float]], reads: dict[str, Any] | None
) -> dict[str, Any]:
    """/v1/stats with ``tiers``: name -> (hits, reuse hits, sharing hits); the node's own
    counts are their sums; ``reads``: its dataplane counts (None: an older agent's, none)."""
    hits, reuse, sharing = (sum(t[i] for t in tiers.values()) for i in range(3))
    counter = dict.fromkeys(("hit_tokens", "promotions", "demotions", "bytes_read"), 0)
    return {
        "stats": {
            "lookup_chunks": lookups,
            "lookup_tokens": 0,
            "hit_chunks": hits,
            "hit_tokens": 0,
            "reuse_hits": reuse,
            "sharing_hits": sharing,
            "drops": 0,
            "tiers": {
                name: {**counter, "bytes_written": 0, "hits": h, "reuse_hits": r, "sharing_hits": s}
                for name, (h, r, s) in tiers.items()
            },
        },
        "usage": {"cpu": {"used_bytes": 1, "capacity_bytes": 4, "pinned_bytes": 0, "chunks": 1}},
        "started_s": 1.0,
        **({} if reads is None else {"dataplane": reads}),
    }


def _node(name: str, stats: dict[str, Any]) -> NodeStatus:
    return node_status(NodeInfo(1, name, "fra", f"http://{name}", "", None), stats, 2_000)


def test_reads_gone_and_tier_splits_per_node_and_summed_per_dc() -> None:
    a = _node(
        "a",
        _stats(
            10,
            {"cpu": (4, 3, 1), "remote": (2, 0, 2)},
            {"read_chunks": 6, "read_missing_chunks": 2},
        ),
    )
    # the pool's tier reports hits and no usage: its occupancy null, its split there
    doc = a.as_dict()
    assert [doc[k] for k in READS] == [6, 2, pytest.approx(1 / 3)]
    assert doc["tiers"]["remote"]["occupancy_ratio"] is None
    assert doc["tiers"]["remote"]["sharing_hit_ratio"] == pytest.approx(0.2)
    assert doc["tiers"]["cpu"]["occupancy_ratio"] == 0.25
    assert (doc["tiers"]["cpu"]["reuse_hit_ratio"], doc["tiers"]["cpu"]["sharing_hit_ratio"]) == (
        pytest.approx(0.3),
        pytest.approx(0.1),
    )
    # an idle agent reports 0 reads: their share unknown, not 0%; an older agent none at all
    idle = _node("b", _stats(10, {"cpu": (0, 0, 0)}, {"read_chunks": 0, "read_missing_chunks": 0}))
    assert [idle.as_dict()[k] for k in READS] == [0, 0, None]
    old = _node("c", _stats(20, {"cpu": (10, 10, 0)}, None))
    assert [old.as_dict()[k] for k in READS] == [None, None, None]
    # its cpu tier's sharing hits answered NaN: that ratio unknown for the node and its DC,
    # never a DC's sum short by one node's hits; its other counts stand
    odd_nan = _stats(10, {"cpu": (2, 2, math.nan)}, {"read_chunks": 4, "read_missing_chunks": 0})
    odd_nan["stats"]["sharing_hits"] = 0
    odd = _node("d", odd_nan)
    assert odd.rejected == {"stats.tiers.cpu.sharing_hits": "not finite"}
    assert odd.as_dict()["tiers"]["cpu"]["sharing_hit_ratio"] is None
    fra = DcStatus("fra")
    for n in (a, idle, old):
        fra.add(n)
    dc = fra.as_dict()
    # reads over the nodes that report them (a and idle): 6 of which 2 gone
    assert [dc[k] for k in READS] == [6, 2, pytest.approx(1 / 3)]
    # each tier's hits over the DC's lookups (40), nodes without the tier counting 0 hits
    assert dc["tiers"]["cpu"]["hits"] == 14 and dc["tiers"]["cpu"]["reuse_hits"] == 13
    assert dc["tiers"]["cpu"]["reuse_hit_ratio"] == pytest.approx(13 / 40)
    assert dc["tiers"]["remote"]["sharing_hit_ratio"] == pytest.approx(2 / 40)
    fra.add(odd)
    dc = fra.as_dict()
    assert [dc[k] for k in READS] == [10, 2, pytest.approx(0.2)]
    assert dc["tiers"]["cpu"]["sharing_hit_ratio"] is None
    assert dc["tiers"]["cpu"]["reuse_hit_ratio"] == pytest.approx(15 / 50)
    # a DC with no node read: null, never 0 reads
    ams = DcStatus("ams")
    ams.add(NodeStatus("e", "ams", "http://e", False, "connection refused"))
    assert [ams.as_dict()[k] for k in READS] == [None, None, None]


def test_a_tier_that_could_not_be_read_leaves_its_dcs_tier_split_unknown() -> None:
    """A node whose agent answered a tier that could not be read (not an object: its hits
    unknown, and which tier they were in may not be known either) is counted in its DC's hit
    ratio; the DC's per-tier split would be short by that tier's hits and no longer add up to
    it, so it is unknown (null), never a number. The node's readable tiers stand."""
    odd_stats = _stats(10, {"cpu": (4, 3, 1), "remote": (2, 0, 2)}, None)
    odd_stats["stats"]["tiers"]["remote"] = "not a tier"
    odd = _node("a", odd_stats)
    assert odd.rejected == {"stats.tiers.remote": "not an object"}
    assert odd.as_dict()["tiers"]["cpu"]["reuse_hit_ratio"] == pytest.approx(0.3)
    fra = DcStatus("fra")
    fra.add(odd)
    fra.add(_node("b", _stats(10, {"cpu": (0, 0, 0), "remote": (5, 0, 5)}, None)))
    dc = fra.as_dict()
    assert dc["hit_ratio"] == pytest.approx(11 / 20)
    for tier in ("cpu", "remote"):
        split = dc["tiers"][tier]
        assert all(split[k] is None for k in (*COUNTS[1:], *RATIO_NAMES)), (tier, split)
        assert fra.tier_hit_counts(tier).hit_ratio is None
