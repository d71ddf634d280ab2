"""`kvctl status --json`: a node whose figures were not read (down, or refusing the token) and
a DC with no node up report their counts as null, not 0 lookups, the way their ratios are."""

from __future__ import annotations

from kvctl.fleet.status import DcStatus, NodeStatus
from kvctl.ratios import RATIO_NAMES, HitCounts

COUNTS = ("lookups", "hits", "reuse_hits", "sharing_hits")


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
